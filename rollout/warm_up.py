"""Warm-up profile for the `auto` K policy: time real decode steps before the first rollout.

Each profiled step is a full decode step (drafting, the verification forward, the verifier, the commit) of B rows at
a forced K, so the step-time model starts from what a step really costs on this machine, host work included. Rows
hold random periodic prompts (an n-gram lookup finds matches in them and drafts the full K); after every step they are
rolled back (lengths lowered, proposer state restored), so the same rows serve every (B, K) pair. B runs over powers of
four up to the slot count, K over 0, 1, K/2 and K (every K at the second largest B: a width's cost is not a straight
line in the width), each at a short context and at the longest the generator allows:
rows attend over the longest row's cache, and on this project's CPU a plain step of 1024 rows costs 2x more at the
~290-token context of the benchmark's first steps than at 32 tokens (172 ms against 88), while a K = 8 step costs only
1.6x more (939 ms against 575); a profile at one short context prices wide steps too high. A few distinct prompts fan
out to all slots (samples of one prompt share its prefill), so the long context costs a few prompts' prefill. Acceptance
is not learned here: random text says nothing about the real drafts.
"""

from __future__ import annotations

import copy
import gc
from collections import deque
from typing import TYPE_CHECKING

import torch

from rollout.model_runner import eval_mode
from rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from rollout.generator import Generator
    from rollout.sequence import Sequence
    from specdec.auto_policy import AutoPolicy


def warm_up(gen: Generator, policy: AutoPolicy, short_context: int = 32, num_prompts: int = 4) -> None:
    # no garbage collection inside a profiled step: a full collection pauses the process for 0.1-0.4 s (measured:
    # single warm-up steps 1.6-2.4x slower than in two other warm-ups), and the rollbacks copy state for every row
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode(), eval_mode(gen.model):
            _profile(gen, policy, short_context, num_prompts)
    finally:
        if collecting:
            gc.enable()
    gen.last_trace = []


def _profile(gen: Generator, policy: AutoPolicy, short_context: int, num_prompts: int) -> None:
    max_k = policy.num_speculative_tokens
    longest = max(1, gen.max_seq_len - max_k - 2)
    sizes = sorted({min(4**i, gen.max_batch_size) for i in range(gen.max_batch_size.bit_length())})
    ks = sorted({0, 1, max_k // 2, max_k})
    noise = torch.Generator().manual_seed(0)
    for index, context in enumerate(sorted({min(short_context, longest), longest}, reverse=True)):
        active = _admit_periodic(gen, context, num_prompts, noise)
        if index == 0:
            # a first pass, not kept: first calls pay one-off costs that would make the first profiled steps look
            # slow: every width once (kernel compilation on a GPU), and the largest step (the process's heap grows
            # to it; measured: the first warm-up in a process timed its 1024-row steps 1.2-1.4x slower)
            for k in ks:
                _step_and_roll_back(gen, active[:1], k)
            _step_and_roll_back(gen, active, max_k)
            policy.time_model.clear_profile()
        for batch_size in sizes:
            for k in ks:
                _step_and_roll_back(gen, active[:batch_size], k)
        # every other width at one batch size (a quarter of the slots or so): widths are not a straight line
        for k in sorted(set(range(max_k + 1)) - set(ks)):
            _step_and_roll_back(gen, active[: sizes[-2] if len(sizes) > 1 else sizes[-1]], k)


def _admit_periodic(gen: Generator, prompt_len: int, num_prompts: int, noise: torch.Generator) -> list[Sequence]:
    """Fill every slot with samples of `num_prompts` random prompts of period 4 and `prompt_len` tokens: an n-gram
    lookup finds matches in them and drafts the full K, so every width is really timed."""
    pattern = torch.randint(0, gen.vocab_size, (num_prompts, 4), generator=noise)
    prompts = pattern.repeat(1, prompt_len // 4 + 1)[:, :prompt_len].tolist()
    params = SamplingParams(
        n=-(-gen.max_batch_size // num_prompts), temperature=1.0, max_new_tokens=gen.max_seq_len, seed=0
    )
    sequences = gen._make_sequences(prompts, [params] * num_prompts)[: gen.max_batch_size]
    active: list[Sequence] = []
    gen._admit(deque(sequences), active)
    for row, seq in enumerate(active):  # the first sampled token is random: continue the period instead, so the
        seq.token_ids[0] = seq.prompt[prompt_len % 4]  # n-gram lookup matches from the first step (it is pending,
        gen.history[row, prompt_len] = seq.token_ids[0]  # not yet in the KV cache: nothing else to fix)
    return active


def _step_and_roll_back(gen: Generator, rows: list[Sequence], k: int) -> None:
    """One decode step of `rows` at K = `k` (timed and reported to the policy), then the rows as they were."""
    saved = [(len(s.token_ids), s.cache_len, copy.deepcopy(s.proposer_state)) for s in rows]
    gen._decode_step(rows, force_k=k)
    for seq, (num_generated, cache_len, state) in zip(rows, saved):
        del seq.token_ids[num_generated:], seq.logprobs[num_generated:]
        seq.cache_len, seq.proposer_state, seq.finish_reason = cache_len, state, None
