"""RolloutBatch: what a PPO/GRPO trainer takes from one rollout, as lists, padded tensors or a `datasets.Dataset`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# the per-sample fields, in the order `to_dataset` writes them
SAMPLE_FIELDS = (
    "group_index",
    "sample_index",
    "prompt",
    "completion",
    "prompt_ids",
    "completion_ids",
    "logprobs",
    "finish_reason",
    "reward",
)


def group_advantages(rewards: Tensor, group_index: Tensor, eps: float = 1e-4, scale: bool = True) -> Tensor:
    """GRPO advantages: `(r - mean of its group) / (std of its group + eps)`.

    Args:
        rewards: `[num_samples]` rewards.
        group_index: `[num_samples]` the group (prompt) of each sample.
        eps: keeps groups whose rewards are all equal finite (their advantages are 0).
        scale: False leaves out the division by the std (Dr. GRPO's variant).
    Returns:
        `[num_samples]` float advantages. The std is the population std (ddof 0), so a group of one has advantage 0.
    """
    rewards = rewards.to(torch.float64)
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, rewards) / count
    centred = rewards - mean[inverse]
    if not scale:
        return centred
    var = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centred**2) / count
    return centred / (var.sqrt()[inverse] + eps)


@dataclass
class RolloutBatch:
    """One rollout: `len(prompts) * n` samples, prompt-major (all samples of group 0 first).

    Every per-sample list has one entry per sample. `logprobs[i][t]` is the behaviour log-probability of
    `completion_ids[i][t]` (under the sampling distribution after temperature / top-k / top-p), so
    `len(logprobs[i]) == len(completion_ids[i])`. A completion that stopped on EOS ends with the EOS id.
    """

    group_index: list[int]  # the prompt each sample came from (its GRPO group)
    sample_index: list[int]  # the sample's index within its group, 0..n-1
    prompt: list[str]  # the formatted prompt text
    completion: list[str]  # the decoded completion (special tokens skipped)
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reason: list[str]  # "stop" (EOS or a stop id) | "length" (hit max_new_tokens)
    reward: list[float]  # the weighted sum of the reward terms
    reward_terms: dict[str, list[float]] = field(default_factory=dict)  # each term's unweighted rewards
    pad_token_id: int = 0  # what `to_padded` pads ids with
    steps: list[dict] = field(default_factory=list)  # the step trace, phases relabelled, with `elapsed`
    summary: dict = field(default_factory=dict)  # `rollout.phases.summarize(steps)`

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def truncated(self) -> list[bool]:
        """True where the completion hit the length cap instead of stopping."""
        return [reason == "length" for reason in self.finish_reason]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)

    def advantages(self, eps: float = 1e-4, scale: bool = True) -> Tensor:
        """`[num_samples]` GRPO group-normalised advantages of `reward` (see `group_advantages`)."""
        return group_advantages(torch.tensor(self.reward), torch.tensor(self.group_index), eps, scale)

    def to_padded(self, pad_token_id: int | None = None) -> dict[str, Tensor]:
        """Padded tensors, TRL's layout: prompts padded on the LEFT, completions on the RIGHT, so that
        `cat([prompt_ids, completion_ids], dim=1)` holds each sample's tokens contiguously.

        Returns:
            prompt_ids `[N, P]` long, padded with `pad_token_id`; prompt_mask `[N, P]` long, 1 = token, 0 = pad;
            completion_ids `[N, C]` long, padded with `pad_token_id`; completion_mask `[N, C]` long, 1 = token;
            logprobs `[N, C]` float32, 0.0 at padding; rewards `[N]` float32; advantages `[N]` float32;
            group_index `[N]` long; truncated `[N]` bool. P and C are the longest prompt and completion.
        """
        pad = self.pad_token_id if pad_token_id is None else pad_token_id
        num = len(self)
        prompt_width = max((len(p) for p in self.prompt_ids), default=0)
        width = max((len(c) for c in self.completion_ids), default=0)
        prompt_ids = torch.full((num, prompt_width), pad, dtype=torch.long)
        prompt_mask = torch.zeros(num, prompt_width, dtype=torch.long)
        completion_ids = torch.full((num, width), pad, dtype=torch.long)
        completion_mask = torch.zeros(num, width, dtype=torch.long)
        logprobs = torch.zeros(num, width, dtype=torch.float32)
        for i, (prompt, ids, lps) in enumerate(zip(self.prompt_ids, self.completion_ids, self.logprobs)):
            if prompt:
                prompt_ids[i, prompt_width - len(prompt) :] = torch.tensor(prompt)
                prompt_mask[i, prompt_width - len(prompt) :] = 1
            completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            completion_mask[i, : len(ids)] = 1
            logprobs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "logprobs": logprobs,
            "rewards": torch.tensor(self.reward, dtype=torch.float32),
            "advantages": self.advantages().to(torch.float32),
            "group_index": torch.tensor(self.group_index, dtype=torch.long),
            "truncated": torch.tensor(self.truncated, dtype=torch.bool),
        }

    def to_dataset(self):
        """A `datasets.Dataset`, one row per sample: the `SAMPLE_FIELDS`, `truncated`, `advantage` and one
        `reward_<term>` column per reward term. `RolloutBatch.from_dataset` reads it back."""
        import datasets

        columns = {name: getattr(self, name) for name in SAMPLE_FIELDS}
        columns["truncated"] = self.truncated
        columns["advantage"] = self.advantages().tolist()
        for name, values in self.reward_terms.items():
            columns[f"reward_{name}"] = values
        return datasets.Dataset.from_dict(columns)

    @classmethod
    def from_dataset(cls, dataset, pad_token_id: int = 0) -> RolloutBatch:
        """The batch back from `to_dataset`'s output (without the step trace and summary)."""
        missing = [name for name in SAMPLE_FIELDS if name not in dataset.column_names]
        if missing:
            raise ValueError(f"dataset lacks the RolloutBatch columns {missing}; it has {dataset.column_names}")
        terms = {c[len("reward_") :]: dataset[c] for c in dataset.column_names if c.startswith("reward_")}
        return cls(**{name: dataset[name] for name in SAMPLE_FIELDS}, reward_terms=terms, pad_token_id=pad_token_id)

    def records(self) -> list[dict]:
        """One dict per sample, the `rollouts.jsonl` line format (`prompt_index` is the group index)."""
        rows = []
        for i in range(len(self)):
            row = {
                "prompt_index": self.group_index[i],
                "sample_index": self.sample_index[i],
                "prompt": self.prompt[i],
                "completion": self.completion[i],
                "completion_ids": self.completion_ids[i],
                "logprobs": self.logprobs[i],
                "finish_reason": self.finish_reason[i],
                "truncated": self.finish_reason[i] == "length",
                "reward": self.reward[i],
            }
            row.update({f"reward_{name}": values[i] for name, values in self.reward_terms.items()})
            rows.append(row)
        return rows
