"""The rollout loop a trainer calls every step: prompts in, a scored `RolloutBatch` out.

rollout = Rollout(model, tokenizer, rewards=["arithmetic"], sampling=SamplingParams(n=8, max_new_tokens=256))
for step, rows in enumerate(prompt_batches):
    batch = rollout(rows, seed=step)   # same Generator, same model object: updated weights are used
    tensors = batch.to_padded()
    advantages = batch.advantages()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from rollout.batch import RolloutBatch
from rollout.generator import Generator
from rollout.phases import PhaseLabeler, summarize
from rollout.prompts import PromptFormatter, check_prompt_column, prompt_kind
from rollout.rewards import RewardFn, WeightedReward, build_rewards, score
from rollout.sampling import SamplingParams
from specdec.config import SpecConfig

# on_step(step, num_finished_samples, num_total_samples); `step` is a step-trace dict with phase relabelled
StepCallback = Callable[[dict, int, int], None]
# the keyword arguments the loop itself passes to reward functions; dataset columns of these names are not passed
RESERVED_REWARD_KWARGS = ("prompts", "completion_ids", "finish_reasons")


class Rollout:
    """Samples, scores and packages rollouts with one `Generator` that lives as long as this object.

    Args:
        model: the policy model; the generator runs this very object, so in-place weight updates take effect on
            the next call without copying.
        tokenizer: its tokenizer (formats prompts, decodes completions, gives the pad id).
        rewards: reward terms, each a built-in name, a "module:function" path, a callable, or a
            `(any of those, weight)` pair; the batch's reward is their weighted sum. See `rollout.rewards` for the
            reward function signature. None (or empty): no scoring, `batch.reward` is None (a trainer that scores
            rewards itself sets it, then calls `batch.advantages()`).
        sampling: sampling settings (n samples per prompt, temperature, max_new_tokens, seed, ...).
        spec: speculative decoding settings; None decodes without drafts.
        max_batch_size: generator slots (sequences decoded at once).
        max_seq_len: prompt + completion tokens a sequence may hold.
        prompt_column, template, chat_template, system_prompt: prompt formatting (see `PromptFormatter`).
        tail_fraction: decode steps whose batch is below this fraction of the peak decode batch are `tail`.
    """

    def __init__(
        self,
        model,
        tokenizer,
        rewards: Sequence[str | RewardFn | tuple[str | RewardFn, float]] | None = ("arithmetic",),
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
    ):
        self.tokenizer = tokenizer
        self.sampling = sampling if sampling is not None else SamplingParams()
        if isinstance(rewards, str) or callable(rewards):  # one reward given bare, not in a list
            rewards = [rewards]
        rewards = [] if rewards is None else list(rewards)
        self.rewards: list[WeightedReward] = build_rewards([r if isinstance(r, tuple) else (r, 1.0) for r in rewards])
        self.prompt_column = prompt_column
        self.formatter = PromptFormatter(tokenizer, prompt_column, template, chat_template, system_prompt)
        self._chat_formatter = None
        self._chat_args = (tokenizer, prompt_column, None, True, system_prompt)
        PhaseLabeler(tail_fraction)  # checks the value now rather than on the first call
        self.tail_fraction = tail_fraction
        self.generator = Generator(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len, spec=spec)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = pad if pad is not None else 0

    def __call__(
        self, data, seed: int | None = None, on_step: StepCallback | None = None, *, n: int | None = None
    ) -> RolloutBatch:
        """Sample `n` completions for every prompt of `data` and score them.

        Args:
            data: a `datasets.Dataset` or a list of dicts, each with the prompt column; or a list of prompts, each
                a string, a list of chat messages (`{"role", "content"}` dicts, formatted with the tokenizer's chat
                template) or a list of token ids (used as they are).
            seed: overrides `sampling.seed` for this call (pass the training step for fresh samples every step);
                the same seed and inputs give the same completions.
            on_step: called after every generator step with (step dict, finished samples, total samples).
            n: completions per prompt for this call; None uses `sampling.n`.
        Returns:
            the `RolloutBatch`, prompt-major, with the step trace and the per-phase summary.
        """
        rows, prompts, prompt_ids = self._prompts(data)
        params = self.sampling if seed is None else replace(self.sampling, seed=seed)
        if n is not None:
            params = replace(params, n=n)
        outs, steps = self._generate(prompt_ids, params, on_step)
        completions = self.tokenizer.batch_decode([o.token_ids for o in outs], skip_special_tokens=True)
        summary = summarize(steps)
        reward, terms = None, {}
        if self.rewards:
            columns = {
                name: [rows[o.prompt_index][name] for o in outs]
                for name in rows[0]
                if name not in RESERVED_REWARD_KWARGS
            }
            columns["prompts"] = [prompts[o.prompt_index] for o in outs]
            columns["completion_ids"] = [o.token_ids for o in outs]
            columns["finish_reasons"] = [o.finish_reason for o in outs]
            reward, terms = score(self.rewards, completions, columns)
        summary["reward_mean"] = sum(reward) / len(reward) if reward else None
        summary["reward_terms"] = {name: sum(v) / len(v) for name, v in terms.items()}
        summary["wall_seconds"] = steps[-1]["elapsed"] if steps else 0.0
        summary["num_samples"] = len(outs)
        return RolloutBatch(
            group_index=[o.prompt_index for o in outs],
            sample_index=[o.sample_index for o in outs],
            prompt=[prompts[o.prompt_index] for o in outs],
            completion=completions,
            prompt_ids=[prompt_ids[o.prompt_index] for o in outs],
            completion_ids=[o.token_ids for o in outs],
            logprobs=[o.logprobs for o in outs],
            finish_reason=[o.finish_reason for o in outs],
            reward=reward,
            reward_terms=terms,
            pad_token_id=self.pad_token_id,
            steps=steps,
            summary=summary,
        )

    def _prompts(self, data) -> tuple[list[dict], list[str], list[list[int]]]:
        """(rows, prompt texts, prompt ids) of the call's data: dataset rows, or bare prompts as rows of one column."""
        if isinstance(data, (str, dict)):
            raise ValueError(
                f"data must be a list of prompts or rows (or a datasets.Dataset), got one {type(data).__name__}"
            )
        items = list(data)
        if not items:
            raise ValueError("data is empty: pass at least one prompt or one row with a prompt column")
        kinds = {prompt_kind(item) for item in items}
        if len(kinds) > 1:
            raise ValueError(f"data mixes kinds of prompt ({', '.join(sorted(kinds))}): pass one kind per call")
        kind = kinds.pop()
        if kind == "row":
            rows = [dict(item) for item in items]
            check_prompt_column(list(rows[0]), self.prompt_column)
            prompts, prompt_ids = self.formatter(rows)
        elif kind == "token ids":
            prompt_ids = [[int(t) for t in item] for item in items]
            prompts = self.tokenizer.batch_decode(prompt_ids)
            rows = [{} for _ in items]
        else:  # text or chat messages: what the prompt column of a row would hold
            rows = [{self.prompt_column: item} for item in items]
            formatter = self.formatter if kind == "text" else self.chat_formatter
            prompts, prompt_ids = formatter(rows)
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

    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams, on_step: StepCallback | None):
        """Run the generator; return its completions and its steps as dicts with the phase relabelled and `elapsed`
        (seconds from the start of the call to the end of the step)."""
        labeler = PhaseLabeler(self.tail_fraction)
        steps: list[dict] = []
        start = time.perf_counter()

        def record_step(record, num_finished: int, num_total: int) -> None:
            step = record.to_dict()
            step["phase"] = labeler.label(step["phase"], step["batch_size"])
            step["elapsed"] = time.perf_counter() - start
            steps.append(step)
            if on_step is not None:
                on_step(step, num_finished, num_total)

        outs = self.generator.generate(prompt_ids, params, on_step=record_step)
        return outs, steps
