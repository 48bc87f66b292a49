"""RolloutBatch: what a PPO/GRPO trainer takes from one rollout, as lists, padded tensors or a `datasets.Dataset`."""

from __future__ import annotations

import math
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


def group_advantages(
    rewards: Tensor, group_index: Tensor, eps: float = 1e-4, scale: bool = True, std: str = "population"
) -> Tensor:
    """GRPO advantages: `(r - mean of its group) / (std of its group + eps)`, over the finite rewards of each group;
    a sample whose reward is non-finite (missing) gets advantage 0 and does not count in its group's mean and std.

    Args:
        rewards: `[num_samples]` rewards.
        group_index: `[num_samples]` the group (prompt) of each sample.
        eps: keeps groups whose rewards are all equal finite (their advantages are 0).
        scale: False leaves out the division by the std (Dr. GRPO's variant).
        std: "population" (ddof 0) or "sample" (ddof 1, Bessel-corrected: what TRL's GRPOTrainer uses). A group of
            one sample has advantage 0 either way.
    Returns:
        `[num_samples]` float64 advantages.
    """
    if std not in ("population", "sample"):
        raise ValueError(f"std ({std!r}) must be 'population' (ddof 0) or 'sample' (ddof 1, as TRL computes it)")
    rewards = rewards.to(torch.float64)
    valid = rewards.isfinite()
    rewards = torch.where(valid, rewards, 0.0)
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, valid.to(torch.float64))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, rewards) / count.clamp(min=1)
    # a group whose finite rewards are all equal has no deviation: exactly 0 (its mean, rounded, may differ from
    # them in the last bit, which a std as small would blow up to +-1 at eps 0)
    inf = float("inf")
    high = torch.full((num_groups,), -inf, dtype=torch.float64)
    high = high.scatter_reduce(0, inverse, torch.where(valid, rewards, -inf), "amax")
    low = torch.full((num_groups,), inf, dtype=torch.float64)
    low = low.scatter_reduce(0, inverse, torch.where(valid, rewards, inf), "amin")
    spread = (high > low)[inverse]
    centred = torch.where(valid & spread, rewards - mean[inverse], 0.0)
    if not scale:
        return centred
    ddof = 0 if std == "population" else 1
    squares = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centred**2)
    var = squares / (count - ddof).clamp(min=1)
    return torch.where(centred == 0, 0.0, centred / (var.sqrt()[inverse] + eps))  # no deviation: 0, even at eps 0


@dataclass(repr=False)  # (the default repr wrote every token, log-prob and step: megabytes for one rollout)
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
    # the weighted sum of the reward terms; None when the rollout scored nothing; an entry is None where a reward was
    # non-finite and the Rollout records such samples as null (`non_finite_rewards_as_null=True`)
    reward: list[float | None] | None
    reward_terms: dict[str, list[float | None]] = field(default_factory=dict)  # each term's unweighted rewards
    pad_token_id: int = 0  # what `to_padded` pads ids with
    steps: list[dict] = field(default_factory=list)  # the step trace, each with its phase and `elapsed`
    summary: dict = field(default_factory=dict)  # `rollout.phases.summarize(steps)`

    def __len__(self) -> int:
        return len(self.completion_ids)

    def __repr__(self) -> str:
        groups = len(set(self.group_index))
        scored = [r for r in self.reward or () if r is not None and math.isfinite(r)]
        reward = f", reward mean {sum(scored) / len(scored):.4g}" if scored else ""
        return (
            f"RolloutBatch({len(self)} samples of {groups} prompts, {self.num_tokens} completion tokens{reward}, "
            f"{len(self.steps)} steps)"
        )

    def _check_aligned(self) -> None:
        """Refuse per-sample lists out of step with `completion_ids` (a trainer's edit): zipped, they were cut to the
        shortest without a word, and a log-prob list shorter than its completion padded with 0.0 (probability 1)."""
        num = len(self)
        for name in ("group_index", "prompt_ids", "logprobs", "finish_reason"):
            if len(getattr(self, name)) != num:
                raise ValueError(
                    f"batch.{name} holds {len(getattr(self, name))} entries for {num} samples (completion_ids): give "
                    "one per sample"
                )
        for i, (ids, lps) in enumerate(zip(self.completion_ids, self.logprobs)):
            if len(lps) != len(ids):
                raise ValueError(
                    f"batch.logprobs[{i}] holds {len(lps)} values for {len(ids)} completion tokens: give one per token"
                )

    @property
    def truncated(self) -> list[bool]:
        """True where the completion hit the length cap instead of stopping."""
        return [reason == "length" for reason in self.finish_reason]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)

    def advantages(self, eps: float = 1e-4, scale: bool = True, std: str = "population") -> Tensor:
        """`[num_samples]` GRPO group-normalised advantages of `reward` (see `group_advantages`); 0 where it is None."""
        if self.reward is None:
            raise ValueError(
                "this batch has no rewards (its Rollout was built with rewards=None): set batch.reward to one float "
                "per sample first, or call rollout.batch.group_advantages with your rewards"
            )
        if len(self.reward) != len(self):
            raise ValueError(f"batch.reward holds {len(self.reward)} values for {len(self)} samples: give one each")
        rewards = torch.tensor([math.nan if r is None else r for r in self.reward], dtype=torch.float64)
        return group_advantages(rewards, torch.tensor(self.group_index), eps, scale, std)

    def to_padded(self, pad_token_id: int | None = None, std: str = "population") -> dict[str, Tensor]:
        """Padded tensors, TRL's layout: prompts padded on the LEFT, completions on the RIGHT, so that
        `cat([prompt_ids, completion_ids], dim=1)` holds each sample's tokens contiguously. A forward over them
        reproduces `logprobs` where each token sits at its own position: a model with learned positions (GPT-2's)
        needs `position_ids` counted from the first unmasked token (`mask.cumsum(1) - 1`, clamped at 0); rotary
        attention of a static rope type sees only relative positions, which the left padding does not change.

        Returns:
            prompt_ids `[N, P]` long, padded with `pad_token_id`; prompt_mask `[N, P]` long, 1 = token, 0 = pad;
            completion_ids `[N, C]` long, padded with `pad_token_id`; completion_mask `[N, C]` long, 1 = token;
            logprobs `[N, C]` float32, 0.0 at padding; group_index `[N]` long; truncated `[N]` bool; and when the
            batch has rewards, rewards `[N]` float32 (0.0 where a reward is None, or NaN or infinite as a trainer may
            set it), reward_mask `[N]` bool (False there) and advantages `[N]` float32 (`advantages(std=std)`:
            "sample" for TRL's Bessel-corrected std; 0.0 where a reward is missing so). P and C are the longest
            prompt and completion.
        """
        self._check_aligned()
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
        tensors = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "logprobs": logprobs,
            "group_index": torch.tensor(self.group_index, dtype=torch.long),
            "truncated": torch.tensor(self.truncated, dtype=torch.bool),
        }
        if self.reward is not None:
            # a reward the advantages leave out (None, or a NaN or infinite one a trainer set) is masked, and 0 here
            scored = [r is not None and math.isfinite(r) for r in self.reward]
            tensors["rewards"] = torch.tensor(
                [r if ok else 0.0 for r, ok in zip(self.reward, scored)], dtype=torch.float32
            )
            tensors["reward_mask"] = torch.tensor(scored, dtype=torch.bool)
            tensors["advantages"] = self.advantages(std=std).to(torch.float32)
        return tensors

    def to_dataset(self):
        """A `datasets.Dataset`, one row per sample: the `SAMPLE_FIELDS`, `truncated`, `advantage` and one
        `reward_<term>` column per reward term. `RolloutBatch.from_dataset` reads it back."""
        import datasets

        columns = {name: getattr(self, name) for name in SAMPLE_FIELDS}
        columns["truncated"] = self.truncated
        if self.reward is None:
            columns["reward"] = [None] * len(self)
        else:
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
        # plain lists (datasets 4+ hands back a lazy Column, which neither JSON nor item assignment takes)
        terms = {c[len("reward_") :]: list(dataset[c]) for c in dataset.column_names if c.startswith("reward_")}
        fields = {name: list(dataset[name]) for name in SAMPLE_FIELDS}
        if "advantage" not in dataset.column_names and all(r is None for r in fields["reward"]):
            fields["reward"] = None  # not scored (a scored batch, even one whose every reward is null, has advantages)
        return cls(**fields, reward_terms=terms, pad_token_id=pad_token_id)

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
                "reward": self.reward[i] if self.reward is not None else None,
            }
            row.update({f"reward_{name}": values[i] for name, values in self.reward_terms.items()})
            rows.append(row)
        return rows
