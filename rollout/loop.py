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
from rollout.prompts import PromptFormatter, check_prompt_column
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
            reward function signature.
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
        rewards: Sequence[str | RewardFn | tuple[str | RewardFn, float]] = ("arithmetic",),
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
        self.rewards: list[WeightedReward] = build_rewards([r if isinstance(r, tuple) else (r, 1.0) for r in rewards])
        self.prompt_column = prompt_column
        self.formatter = PromptFormatter(tokenizer, prompt_column, template, chat_template, system_prompt)
        PhaseLabeler(tail_fraction)  # checks the value now rather than on the first call
        self.tail_fraction = tail_fraction
        self.generator = Generator(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len, spec=spec)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = pad if pad is not None else 0

    def __call__(self, data, seed: int | None = None, on_step: StepCallback | None = None) -> RolloutBatch:
        """Sample `sampling.n` completions for every row of `data` and score them.

        Args:
            data: a `datasets.Dataset` or a list of dicts, each with the prompt column.
            seed: overrides `sampling.seed` for this call (pass the training step for fresh samples every step).
            on_step: called after every generator step with (step dict, finished samples, total samples).
        Returns:
            the `RolloutBatch`, prompt-major, with the step trace and the per-phase summary.
        """
        rows = [dict(row) for row in data]
        if not rows:
            raise ValueError("data is empty: pass at least one row with a prompt column")
        check_prompt_column(list(rows[0]), self.prompt_column)
        prompts, prompt_ids = self.formatter(rows)
        params = self.sampling if seed is None else replace(self.sampling, seed=seed)
        outs, steps = self._generate(prompt_ids, params, on_step)
        completions = self.tokenizer.batch_decode([o.token_ids for o in outs], skip_special_tokens=True)
        columns = {
            name: [rows[o.prompt_index][name] for o in outs] for name in rows[0] if name not in RESERVED_REWARD_KWARGS
        }
        columns["prompts"] = [prompts[o.prompt_index] for o in outs]
        columns["completion_ids"] = [o.token_ids for o in outs]
        columns["finish_reasons"] = [o.finish_reason for o in outs]
        reward, terms = score(self.rewards, completions, columns)
        summary = summarize(steps)
        summary["reward_mean"] = sum(reward) / len(reward)
        summary["reward_terms"] = {name: sum(v) / len(v) for name, v in terms.items()}
        summary["wall_seconds"] = steps[-1]["elapsed"] if steps else 0.0
        summary["num_samples"] = len(outs)
        return RolloutBatch(
            group_index=[o.prompt_index for o in outs],
            sample_index=[o.sample_index for o in outs],
            prompt=columns["prompts"],
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
