"""Times real decode steps for a K policy's calibration, through the generator's public calls only.

Rows hold random periodic prompts, and a row whose proposer drafts fewer than the K asked (a suffix proposer drafts at
most as many tokens as it matched of the response, which is one token here) is filled up to K, so every width is
really timed: each timed step is a full decode step (drafting, the verification
forward, the verifier, the commit) of the first B rows at a forced K, after which the rows are restored, so the same
rows serve every (B, K). A few distinct prompts fan out to all slots (samples of one prompt share its prefill), so a
long context costs a few prompts' prefill. Random text says nothing about real drafts: only times are measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import Protocol

import torch

from rollout.engine.policy_mode import eval_mode
from rollout.engine.sampling import SamplingParams
from specdec.auto_policy import AutoPolicy, StepObservation
from specdec.policies import ForcedPolicy
from specdec.proposers.calibration import FillingProposers


class Engine(Protocol):
    """The generator calls a StepTimer makes."""

    model: torch.nn.Module
    max_batch_size: int
    max_seq_len: int
    vocab_size: int
    last_trace: list
    policy: object  # the K policy
    proposers: object  # the proposers (a `ProposerSet`)

    def add_requests(self, prompt_ids, params, seed_indices=None) -> list: ...
    def step(self): ...
    def snapshot(self) -> list: ...
    def restore(self, rows: list, keep_others: bool = False) -> None: ...
    def abort(self) -> None: ...


class StepTimer:
    """A context manager over a generator (no garbage collection inside it: a full collection pauses the process
    for 0.1-0.4 s and would land inside a timed step); on exit the generator holds no rows and no trace.

    Args:
        engine: the generator.
        num_speculative_tokens: the largest K that will be timed (rows keep room for K drafts and the bonus).
        num_prompts: distinct prompts fanned out to the slots.
        max_context: the longest context to time (default: what the generator holds).
    """

    def __init__(
        self, engine: Engine, num_speculative_tokens: int, num_prompts: int = 4, max_context: int | None = None
    ):
        self.engine = engine
        self.max_batch_size = engine.max_batch_size
        self.num_speculative_tokens = num_speculative_tokens
        # the longest context whose rows can take K drafts and a bonus token without reaching the length cap (or, in a
        # paged pool smaller than every slot at full length, without running out of blocks), and no longer than
        # `max_context` (the rollout's longest request: timing longer contexts would only take memory)
        longest = min(engine.max_seq_len, getattr(engine, "max_uniform_context", engine.max_seq_len))
        self.max_context = max(1, min(longest, max_context or longest) - num_speculative_tokens - 3)
        self.num_prompts = min(num_prompts, engine.max_batch_size)
        self.noise = torch.Generator().manual_seed(0)
        self.rows: list = []

    def __enter__(self) -> StepTimer:
        self._collecting = gc.isenabled()
        gc.disable()
        self._modes = [torch.inference_mode(), eval_mode(self.engine.model)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        if self._collecting:
            gc.enable()
        self.engine.abort()
        self.engine.last_trace = []

    def fill(self, context: int) -> None:
        """Fill every slot with a row of `context` tokens of period 4, whose pending token continues the period."""
        e = self.engine
        pattern = torch.randint(0, e.vocab_size, (self.num_prompts, 4), generator=self.noise)
        prompts = pattern.repeat(1, context // 4 + 1)[:, :context].tolist()
        per_prompt = [
            e.max_batch_size // self.num_prompts + (i < e.max_batch_size % self.num_prompts)
            for i in range(self.num_prompts)
        ]
        # the first token, a full-width step (K drafts and the bonus) and one more: a timed step never brings a row to
        # its length cap (a finished row would be released, the rows behind it moved, and the snapshot no longer fit)
        room = self.num_speculative_tokens + 3
        params = [
            SamplingParams(n=n, temperature=1.0, max_new_tokens=room, seed=0, ignore_eos=True) for n in per_prompt
        ]
        e.add_requests(prompts, params)
        e.step()  # the prefill admits every row
        # the first sampled token is random: continue the period instead, so that a lookup matches from the first
        # step (it is pending, not in the KV cache: nothing else changes)
        rows = e.snapshot()
        self.rows = [dataclasses.replace(r, pending=int(pattern[r.sequence.prompt_index, context % 4])) for r in rows]
        assert len(self.rows) == e.max_batch_size, f"expected every slot filled, got {len(self.rows)}"

    def time_step(self, num_rows: int, num_draft_tokens: int, with_models: bool | None = None) -> StepObservation:
        """One decode step of the first `num_rows` rows at K = `num_draft_tokens`, every row fed K drafts (a proposer
        that finds fewer in random text is filled up); the rows are restored first. `with_models`: as
        `FillingProposers`' (a cascade's model-running proposers in, out, or by its own rule)."""
        self.engine.restore(self.rows[:num_rows], keep_others=True)  # the rows after them: for a longer prefix
        with forced_steps(self.engine, num_draft_tokens, with_models) as forced:
            self.engine.step()
        return forced.observation


WARM_UP_MAX_CONTEXT = 1024  # the auto policy's warm-up times contexts up to this many tokens


def warm_up(engine) -> float:
    """Let the engine's K policy measure what it needs (auto: step times, as vLLM profiles; static and table nothing);
    returns the seconds it took. The rows it timed are gone after it and the proposers have forgotten them."""
    policy, cache = engine.policy, engine.runner.cache
    if isinstance(policy, AutoPolicy) and engine.max_uniform_context < engine.max_width + 4:
        per_slot = cache.max_blocks // engine.max_batch_size
        if cache.max_blocks >= engine.max_batch_size * -(-engine.runner.num_positions // cache.block_size):
            # the pool holds every slot at full length: the rows are what is short, not the pool
            raise ValueError(
                f"max_seq_len ({engine.max_seq_len}) is too short for the auto policy's warm-up on the paged layout "
                f"({per_slot} blocks of {cache.block_size} tokens a slot): it fills every slot at once, each with "
                f"room for a full-width step beside 2 blocks a step may take; raise max_seq_len to at least "
                f"{_shortest_warm_up_length(engine.max_seq_len, engine.max_width, cache.block_size)} (whole blocks: "
                f"at another K, another length), use kv_layout='slots', or give a static K or a table"
            )
        raise ValueError(
            f"kv_pool_blocks ({cache.max_blocks}) holds {per_slot} blocks of {cache.block_size} tokens per slot: the "
            f"auto policy's warm-up fills every slot at once and needs more; raise kv_pool_blocks, lower "
            f"max_batch_size, or give a static K or a table"
        )
    start = time.perf_counter()
    # contexts up to a cap: a longer one would fill every slot to it for a few steps (memory follows the rollout,
    # not the cap); the step-time table extends longer contexts along the two longest timed
    with StepTimer(engine, engine.spec.num_speculative_tokens, max_context=WARM_UP_MAX_CONTEXT) as timer:
        policy.calibrate(timer)
    engine.proposers.reset()  # the calibration's random rows are no drafting material
    return time.perf_counter() - start


def _shortest_warm_up_length(max_seq_len: int, max_width: int, block_size: int) -> int:
    """The shortest max_seq_len above `max_seq_len` whose paged pool, planned at every slot's blocks, leaves the auto
    policy's warm-up a uniform context of `max_width + 4` tokens (`Scheduler.max_uniform_context`, with whole blocks of
    `block_size` and the 2 a step may take kept aside)."""
    length = max_seq_len + 1
    while True:
        blocks = -(-(length + max_width) // block_size) - 2
        if min(length, blocks * block_size - max_width) >= max_width + 4:
            return length
        length += 1


@contextlib.contextmanager
def forced_steps(engine: Engine, num_draft_tokens: int, with_models: bool | None = None):
    """Within the block, the engine's decode steps run at K = `num_draft_tokens` with every row fed the drafts asked of
    it (`FillingProposers`; `with_models` as there), and teach neither the K policy nor the proposers anything: the
    `ForcedPolicy` yielded keeps the last step's observation. The output stays exact."""
    policy, proposers = engine.policy, engine.proposers
    forced = ForcedPolicy(num_draft_tokens)
    engine.policy, engine.proposers = forced, FillingProposers(proposers, with_models)
    try:
        yield forced
    finally:
        engine.policy, engine.proposers = policy, proposers
