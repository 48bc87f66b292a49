"""The rollout loop a trainer calls every step: prompts in, a scored `RolloutBatch` out.

rollout = Rollout(model, tokenizer, rewards=["arithmetic"], sampling=SamplingParams(n=8, max_new_tokens=256))
for step, rows in enumerate(prompt_batches):
    batch = rollout(rows, seed=step)   # same Generator, same model object: updated weights are used
    tensors = batch.to_padded()
    advantages = batch.advantages()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from rollout.batch import SAMPLE_FIELDS, RolloutBatch
from rollout.engine.generator import Generator
from rollout.engine.requests import check_prompts, integer_indices
from rollout.engine.sampling import Completion, SamplingParams
from rollout.phases import PhaseLabeler, summarize
from rollout.prompts import PromptFormatter, prompt_kind
from rollout.rewards import (
    RESERVED_REWARD_KWARGS,
    RewardError,
    RewardFn,
    WeightedReward,
    build_rewards,
    check_reward_columns,
    mean_reward,
    score,
)
from specdec.config import SpecConfig


def _reward_terms(rewards) -> list[tuple]:
    """`Rollout`'s rewards as (reward, weight) pairs: one given bare, a list of rewards or pairs, a dict of rewards to
    weights, or None."""
    if isinstance(rewards, str) or callable(rewards):  # one reward given bare, not in a list
        rewards = [rewards]
    if isinstance(rewards, Mapping):
        return list(rewards.items())
    terms = []
    for i, term in enumerate([] if rewards is None else rewards):
        if isinstance(term, tuple) and len(term) != 2:
            raise ValueError(f"rewards[{i}] ({term!r}) must be a reward or a (reward, weight) pair")
        terms.append(term if isinstance(term, tuple) else (term, 1.0))
    return terms


# on_step(step, num_finished_samples, num_total_samples); `step` is a step-trace dict with its phase labelled
StepCallback = Callable[[dict, int, int], None]


class Rollout:
    """Samples, scores and packages rollouts with one `Generator` that lives as long as this object.

    Args:
        model: the policy model; the generator runs this very object, so in-place weight updates take effect on
            the next call without copying.
        tokenizer: its tokenizer (formats prompts, decodes completions, gives the pad id).
        rewards: reward terms, each a built-in name, a "module:function" path, a callable, or a
            `(any of those, weight)` pair (or a dict of them to their weights); the batch's reward is their weighted
            sum. See `rollout.rewards` for the reward function signature. None (or empty): no scoring, `batch.reward`
            is None (a trainer that scores rewards itself sets it, then calls `batch.advantages()`).
        sampling: sampling settings (n samples per prompt, temperature, max_new_tokens, seed, ...).
        spec: speculative decoding settings; None decodes without drafts.
        max_batch_size: generator slots (sequences decoded at once).
        max_seq_len: prompt + completion tokens a sequence may hold.
        prompt_column, template, chat_template, system_prompt: prompt formatting (see `PromptFormatter`).
        tail_fraction: decode steps whose batch is below this fraction of the peak decode batch are `tail`.
        non_finite_rewards_as_null: False: a NaN or infinite reward stops the call, naming the reward and the
            prompt; True: the sample's reward is None, its advantage 0, and the summary counts it in
            `num_null_rewards`.
        kv_layout: the generator's KV layout: "auto" (paged on a GPU, slots on a CPU), "paged" or "slots" (see
            `Generator`).
        cuda_graphs: "auto" (on with the paged layout on a GPU), True or False: decode steps replay CUDA graphs.
        async_scheduling: "auto" (on a GPU), True or False: the host one step ahead of the device where a step
            drafts nothing (see `Generator`); the same samples either way.
        compile_forward: the CUDA graphs capture the decoder compiled by `torch.compile` (see `Generator`).
        threads: torch's CPU threads for this process (`torch.set_num_threads`), set before the generator is built;
            None leaves torch's setting. On a small CPU one thread is often the fastest: torch's default (one per
            core) slows many times over when another process holds a core. No effect on what is sampled.
    """

    def __init__(
        self,
        model,
        tokenizer,
        rewards: Sequence[str | RewardFn | tuple[str | RewardFn, float]] | Mapping | None = ("arithmetic",),
        *,
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        prompt_column: str = "prompt",
        template: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        tail_fraction: float = 0.25,
        non_finite_rewards_as_null: bool = False,
        kv_layout: str = "auto",
        cuda_graphs: bool | str = "auto",
        async_scheduling: bool | str = "auto",
        compile_forward: bool = False,
        threads: int | None = None,
    ):
        if threads is not None:
            if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
                raise ValueError(f"threads ({threads!r}) must be an integer >= 1, or None to keep torch's setting")
            torch.set_num_threads(threads)
        self.non_finite_rewards_as_null = bool(non_finite_rewards_as_null)
        if not callable(tokenizer) or not hasattr(tokenizer, "pad_token_id"):
            raise TypeError(
                f"tokenizer must be the model's transformers tokenizer (AutoTokenizer.from_pretrained(...), or "
                f"rollout.models.zoo.load_model's second value), got {type(tokenizer).__name__}"
            )
        if sampling is not None and not isinstance(sampling, SamplingParams):
            kind = type(sampling).__name__
            raise TypeError(f"sampling must be a SamplingParams, e.g. SamplingParams(n=4), got {kind}")
        self.tokenizer = tokenizer
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.rewards: list[WeightedReward] = build_rewards(_reward_terms(rewards))
        self.prompt_column = prompt_column
        self.formatter = PromptFormatter(tokenizer, prompt_column, template, chat_template, system_prompt)
        self._chat_formatter = None
        self._chat_args = (tokenizer, prompt_column, None, True, system_prompt)
        PhaseLabeler(tail_fraction)  # checks the value now rather than on the first call
        self.tail_fraction = tail_fraction
        self.generator = Generator(
            model,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            spec=spec,
            kv_layout=kv_layout,
            cuda_graphs=cuda_graphs,
            async_scheduling=async_scheduling,
            compile_forward=compile_forward,
        )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = pad if pad is not None else 0

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a Rollout cannot be pickled or copied: its generator holds the model's KV caches and its steps' state; "
            "send its results (RolloutBatch, which pickles) to another process, and build a Rollout there"
        )

    def __call__(
        self,
        data,
        seed: int | None = None,
        on_step: StepCallback | None = None,
        *,
        n: int | None = None,
        on_group: Callable[[RolloutBatch], None] | None = None,
        group_indices: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """Sample `n` completions for every prompt of `data` and score them.

        Args:
            data: a `datasets.Dataset`, a pandas DataFrame or a list of dicts, each with the prompt column; or a list
                of prompts, each a string, a list of chat messages (`{"role", "content"}` dicts, formatted with the
                tokenizer's chat template) or a list of token ids (used as they are).
            seed: overrides `sampling.seed` for this call (pass the training step for fresh samples every step);
                the same seed and inputs give the same completions.
            on_step: called after every generator step with (step dict, finished samples, total samples).
            n: completions per prompt for this call; None uses `sampling.n`.
            on_group: called with each prompt's scored samples (a `RolloutBatch` of one group, no steps) as soon as
                its last sample finishes: stream them to disk here, and what was written survives a later failure.
                Callbacks and rewards run in the caller's inference and grad modes (not the generator's inference
                mode), with the policy in eval mode.
            group_indices: each prompt's group index (default 0, 1, ...); it also seeds the prompt's samples, so a
                resumed run that passes the remaining prompts with their original indices draws the same samples.
        Returns:
            the `RolloutBatch`, prompt-major, with the step trace and the per-phase summary.
        """
        for name, callback in (("on_step", on_step), ("on_group", on_group)):
            if callback is not None and not callable(callback):
                raise TypeError(f"{name} must be a function or None, got {type(callback).__name__}")
        self.sampling.check()  # (a field may have been set since: rollout.sampling.temperature = ...)
        rows, prompts, prompt_ids = self._prompts(data)
        indices = list(range(len(rows))) if group_indices is None else integer_indices(group_indices, "group_indices")
        if len(indices) != len(rows):
            raise ValueError(f"group_indices holds {len(indices)} values for {len(rows)} prompts: give one each")
        if len(set(indices)) != len(indices):  # two prompts in one group would share their advantages' baseline
            repeated = next(i for i in indices if indices.count(i) > 1)
            raise ValueError(f"group_indices holds {repeated} more than once: give each prompt a group of its own")
        self._check_reward_columns(rows)
        params = self.sampling if seed is None else replace(self.sampling, seed=seed)
        if n is not None:
            params = replace(params, n=n)
        groups: dict[int, RolloutBatch] = {}

        def finish_group(outs: list[Completion]) -> None:
            local = outs[0].prompt_index
            groups[local] = self._score_group(rows[local], prompts[local], prompt_ids[local], indices[local], outs)
            if on_group is not None:
                on_group(groups[local])

        steps = self._generate(prompt_ids, params, on_step, finish_group, indices)
        batch = concat_groups([groups[i] for i in range(len(rows))], self.pad_token_id)
        summary = summarize(steps)
        reward = batch.reward
        summary["reward_mean"] = mean_reward(reward) if reward else None
        summary["reward_terms"] = {name: mean_reward(v) for name, v in batch.reward_terms.items()}
        summary["num_null_rewards"] = sum(r is None for r in reward) if reward else 0
        summary["wall_seconds"] = steps[-1]["elapsed"] if steps else 0.0
        summary["num_samples"] = len(batch)
        batch.steps, batch.summary = steps, summary
        return batch

    def _score_group(self, row: dict, prompt: str, prompt_ids: list[int], index: int, outs) -> RolloutBatch:
        """One prompt's samples, decoded and scored."""
        completions = self.tokenizer.batch_decode([o.token_ids for o in outs], skip_special_tokens=True)
        reward, terms = None, {}
        if self.rewards:
            columns = {name: [row[name]] * len(outs) for name in row if name not in RESERVED_REWARD_KWARGS}
            columns["prompts"] = [prompt] * len(outs)
            columns["completion_ids"] = [o.token_ids for o in outs]
            columns["finish_reasons"] = [o.finish_reason for o in outs]
            try:
                reward, terms = score(self.rewards, completions, columns, self.non_finite_rewards_as_null)
            except RewardError as err:  # it names the reward and what it raised or returned: add the prompt
                raise RewardError(f"prompt {index}: {err}") from err.__cause__
        return RolloutBatch(
            group_index=[index] * len(outs),
            sample_index=[o.sample_index for o in outs],
            prompt=[prompt] * len(outs),
            completion=completions,
            prompt_ids=[list(prompt_ids) for _ in outs],  # a list each: a trainer editing one edited them all
            completion_ids=[o.token_ids for o in outs],
            logprobs=[o.logprobs for o in outs],
            finish_reason=[o.finish_reason for o in outs],
            reward=reward,
            reward_terms=terms,
            pad_token_id=self.pad_token_id,
        )

    def _check_reward_columns(self, rows: list[dict]) -> None:
        """Before any generation: every reward's required keyword arguments must be columns the loop passes, in every
        row (a data set's rows share its columns; a list of dicts may not)."""
        first = rows[0].keys()
        check_reward_columns(self.rewards, list(first))
        for i, row in enumerate(rows[1:], start=1):
            if row.keys() != first:
                check_reward_columns(self.rewards, list(row), where=f"row {i} of the data")

    def _prompts(self, data) -> tuple[list[dict], list[str], list[list[int]]]:
        """(rows, prompt texts, prompt ids) of the call's data: dataset rows, or bare prompts as rows of one column."""
        refused = ValueError(
            f"data must be a list of prompts or rows (or a datasets.Dataset, or a pandas DataFrame), got one "
            f"{type(data).__name__}"
        )
        if isinstance(data, (str, Mapping)):
            if isinstance(data, Mapping) and "input_ids" in data:  # a BatchEncoding iterates its keys: two prompts
                raise ValueError(
                    "data is a tokenizer's encoding (input_ids, ...): pass a list of prompts, e.g. its texts, or "
                    "its input_ids as a list of token-id lists without padding"
                )
            raise refused
        if hasattr(data, "iterrows") and hasattr(data, "to_dict"):  # a pandas DataFrame iterates its column names
            data = data.to_dict("records")
        try:
            items = list(data)
        except TypeError:  # not iterable (None, a number)
            raise refused from None
        if not items:
            raise ValueError("data is empty: pass at least one prompt or one row with a prompt column")
        kinds = {prompt_kind(item) for item in items}
        if len(kinds) > 1:
            raise ValueError(f"data mixes kinds of prompt ({', '.join(sorted(kinds))}): pass one kind per call")
        kind = kinds.pop()
        if kind == "row":
            rows = [dict(item) for item in items]
            prompts, prompt_ids = self.formatter(rows)  # (every row's prompt column checked first)
        elif kind == "token ids":  # checked before decoding: -1 or 2**32 failed in the tokenizer's OverflowError
            prompt_ids = check_prompts(items, self.generator.vocab_size, self.generator.max_seq_len)
            prompts = self.tokenizer.batch_decode(prompt_ids)
            rows = [{} for _ in items]
        else:  # text or chat messages: what the prompt column of a row would hold
            rows = [{self.prompt_column: item} for item in items]
            formatter = self.formatter if kind == "text" else self.chat_formatter
            prompts, prompt_ids = formatter(rows)
        if kind != "token ids":
            for i, (text, ids) in enumerate(zip(prompts, prompt_ids)):
                if not ids:  # an empty text, where the tokenizer adds no BOS
                    raise ValueError(
                        f"prompt {i} ({text!r:.40}) has no tokens: every prompt needs some text (this tokenizer adds "
                        "no BOS token to an empty one)"
                    )
        return rows, prompts, prompt_ids

    @property
    def chat_formatter(self) -> PromptFormatter:
        """Formats chat messages passed as prompts (built on first use: it needs the tokenizer's chat template)."""
        if self._chat_formatter is None:
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise ValueError(
                    "data holds chat messages but the tokenizer has no chat template: pass the prompts as text or "
                    "token ids, or use a tokenizer with a chat template"
                )
            self._chat_formatter = PromptFormatter(*self._chat_args)
        return self._chat_formatter

    def _generate(self, prompt_ids, params, on_step, on_group, indices) -> list[dict]:
        """Run the generator; return its steps as dicts with their phase (prefill / bulk / tail) and `elapsed`
        (seconds from the start of the call to the end of the step)."""
        labeler = PhaseLabeler(self.tail_fraction)
        steps: list[dict] = []
        start = time.perf_counter()

        def record_step(record, num_finished: int, num_total: int) -> None:
            step = record.to_dict()
            step["phase"] = labeler.label(step["kind"], step["batch_size"])
            step["elapsed"] = time.perf_counter() - start
            steps.append(step)
            if on_step is not None:
                on_step(step, num_finished, num_total)

        self.generator.generate(prompt_ids, params, on_step=record_step, on_group=on_group, seed_indices=indices)
        return steps


def concat_groups(groups: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """The groups' samples in one batch, in the order given."""
    fields = {name: [v for g in groups for v in getattr(g, name)] for name in SAMPLE_FIELDS if name != "reward"}
    scored = bool(groups) and groups[0].reward is not None
    terms = {
        name: [v for g in groups for v in g.reward_terms[name]] for name in (groups[0].reward_terms if groups else {})
    }
    reward = [v for g in groups for v in g.reward] if scored else None
    return RolloutBatch(**fields, reward=reward, reward_terms=terms, pad_token_id=pad_token_id)
