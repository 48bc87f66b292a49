"""The exponential race read straight from logits: every race of a verification step in one launch, with the drawn
token's log-probability.

Race r reads row `logit_rows[r]` of the logits (any float dtype, the model's own output: no gathered, cast or
normalised copy) and draws

    token = argmax_t  x_t / T - ln E_t   over the kept tokens,   E_t = -ln u_t   (`race_sample`'s noise)

the race `argmax_t p_t / E_t` in log space: `ln p_t = x_t / T - lse` and the row's constant `lse` moves no argmax. A
token's score is a function of its own logit, T and its noise only, so the vocabulary splits over many programs per race
with nothing to rescale between them; a second stage keeps the largest score (the lowest token id on ties, as
`torch.argmax`) and turns the online log-sum-exp of each split into the token's log-probability
`(x_t / T - M) - ln sum_t e^(x_t / T - M)` (M: the row's largest x_t / T; subtracted first, so that a large x / T at a
small T never rounds the logarithm away, as `x_t / T - (M + ln sum)` did).

Exact where it matters: the score takes float64 (`x` widened exactly, an IEEE division by T, the noise's series
logarithm twice, a subtraction; launched with `enable_fp_fusion=False`), so the kernel and `race_logits_ref` draw the
same tokens bit for bit on a CPU and a GPU. The log-sum-exp, which only the reported log-probability uses, runs in
float32 (float64 for float64 logits) with whatever rounding the device has.

Greedy races (T = 0) take the argmax of the logits, with the plain log-softmax's log-probability. Top-k / top-p come
in as a threshold per race: token t is kept iff `x_t > keep_min` or (`x_t == keep_min` and `t <= keep_last`), which any
prefix of the vocabulary sorted by (logit descending, id ascending) is (`specdec.processing.keep_thresholds`).

A race over a row holding a NaN logit (a policy whose weights or activations are no longer finite) draws token 0 with
log-probability NaN, in the kernel and the reference alike: the caller refuses it (the generator, when it reads a
step's results).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import block_size_for, check_kernel_device, check_logits, check_tensor
from rollout_kernels.race_sample import (
    _ARGMAX_BLOCK,
    _GOLDEN,
    _finished_bits,
    _first_argmax,
    _log,
    _log_ref,
    _mix_rounds_ref,
    _neg_log,
    _neg_log_ref,
    _race_key,
    _race_uniforms,
    _room,
    _row_keys,
    _uniforms_of,
)

_MAX_SPLITS = 64  # programs per race at most (the second stage reads them as one block)
_SPLIT_SIZE = 8192  # vocabulary entries per program by default (a multiple of every block size)
_ELEMENTS_PER_CHUNK = 1 << 18  # the reference's races x vocab per pass
# The logarithm of the reference's float32 bound of a score may be off by (|score| + |top| + 80) 2^-21 at most (x/T,
# its difference to the row's top logit and the exponential in float32); twice that keeps a token in the running.
_BOUND_SLACK = 2.0**-20
_BOUND_SLACK_OFFSET = 80.0


# Stage 1, program (r, s): the tokens of split s of race r. Writes the split's best score (float64, -inf where nothing
# is kept, NaN where a logit of the split is) and its lowest token among equal scores, and the split's log-sum-exp as
# (maximum, sum of exp(x/T - maximum)) over its kept tokens.
@triton.jit
def _race_logits_split_kernel(
    logits_ptr,  # [num_logit_rows, logits_stride] any float, the vocabulary contiguous
    logit_rows_ptr,  # [num_races] int64
    temperatures_ptr,  # [num_races] float32/float64, 0 = greedy
    seeds_ptr,  # [num_races] int64
    positions_ptr,  # [num_races] int64
    keep_min_ptr,  # [num_races] float64 (HAS_FILTER)
    keep_last_ptr,  # [num_races] int64 (HAS_FILTER)
    split_scores_ptr,  # [num_races, num_splits] float64, out
    split_tokens_ptr,  # [num_races, num_splits] int64, out
    split_max_ptr,  # [num_races, num_splits] COMPUTE_DTYPE, out
    split_sum_ptr,  # [num_races, num_splits] COMPUTE_DTYPE, out
    logits_stride,
    vocab_size,
    num_splits,
    split_size,
    HAS_FILTER: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    race = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + tl.load(logit_rows_ptr + race) * logits_stride
    temperature = tl.load(temperatures_ptr + race).to(tl.float64)
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    divisor_c = divisor.to(COMPUTE_DTYPE)
    key = _race_key(tl.load(seeds_ptr + race), tl.load(positions_ptr + race))
    if HAS_FILTER:
        keep_min = tl.load(keep_min_ptr + race)
        keep_last = tl.load(keep_last_ptr + race)
    split_start = split * split_size
    split_end = tl.minimum(split_start + split_size, vocab_size)
    best_score = tl.full((), float("-inf"), tl.float64)
    best_token = split_start.to(tl.int64)
    running_max = tl.full((), float("-inf"), COMPUTE_DTYPE)
    running_sum = tl.full((), 0.0, COMPUTE_DTYPE)
    num_nan = tl.full((), 0, tl.int32)
    for block_start in range(split_start, split_end, BLOCK_SIZE):
        cols = block_start + tl.arange(0, BLOCK_SIZE)
        in_split = cols < split_end
        x = tl.load(row_ptr + cols, mask=in_split, other=float("-inf"))
        x64 = x.to(tl.float64)
        num_nan += tl.sum((x64 != x64).to(tl.int32), axis=0)
        kept = in_split
        if HAS_FILTER:
            kept = kept & ((x64 > keep_min) | ((x64 == keep_min) & (cols <= keep_last)))
        log_noise = _log(_neg_log(_race_uniforms(key, cols)))
        score = x64 / divisor - tl.where(greedy, 0.0, log_noise)
        score = tl.where(kept, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_token = tl.min(tl.where(in_split & (score == block_best), cols, vocab_size), axis=0)
        better = block_best > best_score
        best_score = tl.where(better, block_best, best_score)
        best_token = tl.where(better, block_token.to(tl.int64), best_token)
        # online log-sum-exp of x / T over the kept tokens (a kept logit of -inf adds nothing)
        scaled = tl.where(kept, x.to(COMPUTE_DTYPE) / divisor_c, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scaled, axis=0))
        rescale = tl.where(running_max > float("-inf"), tl.exp(running_max - new_max), 0.0)
        shifted = tl.where(scaled > float("-inf"), scaled - new_max, float("-inf"))
        running_sum = running_sum * rescale + tl.sum(tl.exp(shifted), axis=0)
        running_max = new_max
    out = race.to(tl.int64) * num_splits + split
    tl.store(split_scores_ptr + out, tl.where(num_nan > 0, float("nan"), best_score))
    tl.store(split_tokens_ptr + out, best_token)
    tl.store(split_max_ptr + out, running_max)
    tl.store(split_sum_ptr + out, running_sum)


# Stage 2, program r: the best split (the lowest token among equal scores: splits hold disjoint id ranges), then
# the token's log-probability (x_t / T - M) - ln(sum_s sum_s e^(max_s - M)).
@triton.jit
def _race_logits_combine_kernel(
    logits_ptr,  # [num_logit_rows, logits_stride]
    logit_rows_ptr,  # [num_races] int64
    temperatures_ptr,  # [num_races]
    split_scores_ptr,  # [num_races, num_splits] float64
    split_tokens_ptr,  # [num_races, num_splits] int64
    split_max_ptr,  # [num_races, num_splits] COMPUTE_DTYPE
    split_sum_ptr,  # [num_races, num_splits] COMPUTE_DTYPE
    token_ids_ptr,  # [num_races] int64, out
    logprobs_ptr,  # [num_races] float64, out
    logits_stride,
    vocab_size,
    num_splits,
    COMPUTE_DTYPE: tl.constexpr,
    SPLITS_BLOCK: tl.constexpr,
):
    race = tl.program_id(0)
    splits = tl.arange(0, SPLITS_BLOCK)
    valid = splits < num_splits
    at = race.to(tl.int64) * num_splits + splits
    scores = tl.load(split_scores_ptr + at, mask=valid, other=float("-inf"))
    tokens = tl.load(split_tokens_ptr + at, mask=valid, other=vocab_size)
    nan_row = tl.sum((scores != scores).to(tl.int32), axis=0) > 0  # a NaN logit: token 0, log-probability NaN
    best = tl.max(scores, axis=0)
    token = tl.min(tl.where(valid & (scores == best), tokens, vocab_size), axis=0)
    token = tl.where(nan_row, 0, token)
    maxima = tl.load(split_max_ptr + at, mask=valid, other=float("-inf"))
    sums = tl.load(split_sum_ptr + at, mask=valid, other=0.0)
    top = tl.max(maxima, axis=0)
    total = tl.sum(tl.where(maxima > float("-inf"), sums * tl.exp(maxima - top), 0.0), axis=0)
    log_total = tl.log(total)
    temperature = tl.load(temperatures_ptr + race).to(COMPUTE_DTYPE)
    divisor = tl.where(temperature == 0.0, 1.0, temperature)
    x = tl.load(logits_ptr + tl.load(logit_rows_ptr + race) * logits_stride + token).to(COMPUTE_DTYPE)
    tl.store(token_ids_ptr + race, token)
    # x / T - M first: both as stage 1 computed them, so the drawn top token's difference is exactly 0
    logprob = ((x / divisor - top) - log_total).to(tl.float64)
    tl.store(logprobs_ptr + race, tl.where(nan_row, float("nan"), logprob))


def race_logits(
    logits: Tensor,  # [num_logit_rows, vocab_size] float16/bfloat16/float32/float64
    logit_rows: Tensor,  # [num_races] int64
    temperatures: Tensor,  # [num_races] float32/float64
    seeds: Tensor,  # [num_races] int64
    positions: Tensor,  # [num_races] int64
    keep_min: Tensor | None = None,  # [num_races] float64
    keep_last: Tensor | None = None,  # [num_races] int64
    split_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Draw one token per race by the exponential race over `logits[logit_rows]` / temperature, keyed by (seed,
    position, token), and return it with its log-probability, in one pass over the logits.

    Args:
        logits: `[num_logit_rows, vocab_size]` the model's logits (rows may be strided, the vocabulary contiguous).
        logit_rows: `[num_races]` int64, the row each race reads.
        temperatures: `[num_races]` float, 0 for a greedy race (the argmax).
        seeds: `[num_races]` int64, 62-bit: the sample's seed.
        positions: `[num_races]` int64 in [0, 2^32): the position of the drawn token in its completion.
        keep_min, keep_last: `[num_races]` float64 / int64, both or neither: race r keeps token t iff
            `x_t > keep_min[r]` or (`x_t == keep_min[r]` and `t <= keep_last[r]`); None keeps every token.
        split_size: vocabulary entries per program (None: 8192, fewer programs where that would pass 64 a race).

    Returns:
        `([num_races] int64 token ids, [num_races] float64 log-probabilities under the kept, tempered distribution)`.
    """
    num_races, vocab_size = _check_inputs(logits, logit_rows, temperatures, seeds, positions, keep_min, keep_last)
    check_kernel_device(_race_logits_split_kernel, logits.device, "race_logits")
    device = logits.device
    token_ids = torch.empty(num_races, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_races, dtype=torch.float64, device=device)
    if not num_races:
        return token_ids, logprobs
    block_size = block_size_for(vocab_size)
    split_size = max(split_size or _SPLIT_SIZE, triton.cdiv(vocab_size, _MAX_SPLITS))
    split_size = triton.cdiv(split_size, block_size) * block_size
    num_splits = triton.cdiv(vocab_size, split_size)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    compute_tl = tl.float64 if compute == torch.float64 else tl.float32
    split_scores = torch.empty(num_races, num_splits, dtype=torch.float64, device=device)
    split_tokens = torch.empty(num_races, num_splits, dtype=torch.int64, device=device)
    split_max = torch.empty(num_races, num_splits, dtype=compute, device=device)
    split_sum = torch.empty(num_races, num_splits, dtype=compute, device=device)
    has_filter = keep_min is not None
    _race_logits_split_kernel[(num_races, num_splits)](
        logits,
        logit_rows,
        temperatures,
        seeds,
        positions,
        keep_min if has_filter else split_scores,  # placeholder pointers when there is no filter
        keep_last if has_filter else split_tokens,
        split_scores,
        split_tokens,
        split_max,
        split_sum,
        logits.stride(0),
        vocab_size,
        num_splits,
        split_size,
        HAS_FILTER=has_filter,
        COMPUTE_DTYPE=compute_tl,
        BLOCK_SIZE=block_size,
        enable_fp_fusion=False,  # the score's multiply-adds round as the reference's do
    )
    _race_logits_combine_kernel[(num_races,)](
        logits,
        logit_rows,
        temperatures,
        split_scores,
        split_tokens,
        split_max,
        split_sum,
        token_ids,
        logprobs,
        logits.stride(0),
        vocab_size,
        num_splits,
        COMPUTE_DTYPE=compute_tl,
        SPLITS_BLOCK=triton.next_power_of_2(num_splits),
    )
    return token_ids, logprobs


@triton.jit
def _race_log_noise_kernel(
    seeds_ptr,  # [num_races] int64
    positions_ptr,  # [num_races] int64
    log_noise_ptr,  # [num_races, vocab_size] float64, out
    vocab_size,
    BLOCK_SIZE: tl.constexpr,
):
    race = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    key = _race_key(tl.load(seeds_ptr + race), tl.load(positions_ptr + race))
    log_noise = _log(_neg_log(_race_uniforms(key, cols)))
    tl.store(log_noise_ptr + race.to(tl.int64) * vocab_size + cols, log_noise, mask=cols < vocab_size)


def race_log_noise(
    seeds: Tensor,  # [num_races] int64
    positions: Tensor,  # [num_races] int64
    vocab_size: int,
) -> Tensor:
    """`[num_races, vocab_size]` float64 `ln E_t` of every token, as `race_logits` computes it (for tests and
    inspection: the race itself never stores it)."""
    check_tensor(seeds, "seeds", 1, (torch.int64,), seeds.device, "seeds")
    check_tensor(positions, "positions", 1, (torch.int64,), seeds.device, "seeds")
    check_kernel_device(_race_log_noise_kernel, seeds.device, "race_log_noise")
    log_noise = torch.empty(len(seeds), vocab_size, dtype=torch.float64, device=seeds.device)
    if len(seeds) and vocab_size:
        block_size = block_size_for(vocab_size)
        _race_log_noise_kernel[(len(seeds), triton.cdiv(vocab_size, block_size))](
            seeds, positions, log_noise, vocab_size, BLOCK_SIZE=block_size, enable_fp_fusion=False
        )
    return log_noise


# ---- pure torch --------------------------------------------------------------------------------------------------


def race_log_noise_ref(
    seeds: Tensor,  # [num_races] int64
    positions: Tensor,  # [num_races] int64
    token_ids: Tensor,  # [num_tokens] or [num_races, num_tokens] int64
) -> Tensor:
    """`[num_races, num_tokens]` float64 `ln E_t`: what a sampled race subtracts from `x_t / T`, bit for bit."""
    mixed = _row_keys(seeds, positions)[:, None] + token_ids * _GOLDEN
    finished = _finished_bits(_mix_rounds_ref(mixed, torch.empty_like(mixed), range(3)))
    return _log_ref(_neg_log_ref(_uniforms_of(finished)))


def race_logits_ref(
    logits: Tensor,  # [num_logit_rows, vocab_size]
    logit_rows: Tensor,  # [num_races] int64
    temperatures: Tensor,  # [num_races]
    seeds: Tensor,  # [num_races] int64
    positions: Tensor,  # [num_races] int64
    keep_min: Tensor | None = None,  # [num_races] float64
    keep_last: Tensor | None = None,  # [num_races] int64
    split_size: int | None = None,  # unused: the reference does not split
) -> tuple[Tensor, Tensor]:
    """Pure-torch `race_logits`: the same tokens, log-probabilities to rounding, on any device. Races in chunks of
    about 2^18 elements; a sampled race scores exactly its token of largest float32 bound `e^(x/T - top) / (1 - u)`
    (`-ln u >= 1 - u`, the bound from `race_sample`'s `_room`; `top` the row's largest x/T, the exponentials shared
    with the log-sum-exp) and the tokens whose bound comes within the slack of that score (most rows: that token
    alone), and no other."""
    num_races, vocab_size = _check_inputs(logits, logit_rows, temperatures, seeds, positions, keep_min, keep_last)
    device = logits.device
    token_ids = torch.empty(num_races, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_races, dtype=torch.float64, device=device)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    vocab = torch.arange(vocab_size, device=device)
    token_offsets = vocab * _GOLDEN
    keys = _row_keys(seeds, positions)
    padded = -(-vocab_size // _ARGMAX_BLOCK) * _ARGMAX_BLOCK
    per_chunk = max(1, _ELEMENTS_PER_CHUNK // max(vocab_size, 1))
    for start in range(0, num_races, per_chunk):
        races = slice(start, start + per_chunk)
        x = logits.detach()[logit_rows[races]]  # [n, vocab]
        n = x.shape[0]
        nan_rows = x.isnan().any(dim=1)  # drawn as token 0 with log-probability NaN (below): raced as zeros meanwhile
        if nan_rows.any():
            x = x.masked_fill(nan_rows[:, None], 0.0)
        temperature = temperatures[races].to(torch.float64)
        greedy = temperature == 0
        divisor = torch.where(greedy, 1.0, temperature)  # [n] float64
        kept = None
        if keep_min is not None:
            x64 = x.to(torch.float64)
            at_min = (x64 == keep_min[races, None]) & (vocab <= keep_last[races, None])
            kept = (x64 > keep_min[races, None]) | at_min
        scaled = x.to(compute) / divisor.to(compute)[:, None]
        if kept is not None:
            scaled = scaled.masked_fill(~kept, float("-inf"))
        top = scaled.amax(dim=1)
        top = torch.where(top > float("-inf"), top, 0.0)  # a row of -inf: any finite shift
        shifted = torch.exp(scaled - top[:, None])  # [n, vocab] p_t e^(lse - top), 0 where cut
        log_total = shifted.sum(dim=1).log()  # [n] lse - top
        # the bounds, shifted: e^(x/T - top) / room >= e^(x/T - ln E - top), room from the hash two rounds into mixing
        mixed = keys[races, None] + token_offsets
        scratch = torch.empty_like(mixed)
        _mix_rounds_ref(mixed, scratch, range(2))
        bound = torch.zeros(n, padded, dtype=torch.float32, device=device)  # padding 0: never above the first
        torch.div(shifted.to(torch.float32), _room(mixed, scratch), out=bound[:, :vocab_size])
        first = _first_argmax(bound)  # [n]
        first_mixed = _mix_rounds_ref(
            mixed.gather(1, first[:, None]), torch.empty(n, 1, dtype=torch.int64, device=device), range(2, 3)
        )
        first_noise = _log_ref(_neg_log_ref(_uniforms_of(_finished_bits(first_mixed))))[:, 0]
        best = x.gather(1, first[:, None])[:, 0].to(torch.float64) / divisor - first_noise
        slack = (best.abs() + top.abs() + _BOUND_SLACK_OFFSET) * _BOUND_SLACK
        threshold = torch.exp(best - top - slack).to(torch.float32)
        bound.scatter_(1, first[:, None], 0.0)
        contested = torch.nonzero(~greedy & ~(bound.amax(dim=1) < threshold))[:, 0]
        if len(contested):  # another token's bound reaches the first's score, less the slack: score the contenders
            contenders = bound[contested, :vocab_size] >= threshold[contested, None]
            contenders &= bound[contested, :vocab_size] > 0  # never a token top-k / top-p cut
            contenders.scatter_(1, first[contested, None], True)
            local, cols = torch.nonzero(contenders, as_tuple=True)
            rows = contested[local]
            mixed_rows_cols = _mix_rounds_ref(mixed[rows, cols], torch.empty_like(rows), range(2, 3))
            score = x[rows, cols].to(torch.float64) / divisor[rows]
            score -= _log_ref(_neg_log_ref(_uniforms_of(_finished_bits(mixed_rows_cols))))
            # the largest exact score wins, the lowest id among equal ones
            row_best = torch.full((n,), float("-inf"), dtype=torch.float64, device=device)
            row_best.scatter_reduce_(0, rows, score, "amax")
            winners = torch.full_like(first, vocab_size).scatter_reduce_(
                0, rows, torch.where(score == row_best[rows], cols, vocab_size), "amin"
            )
            first[contested] = winners[contested]
        greedy_rows = torch.nonzero(greedy)[:, 0]
        if len(greedy_rows):  # T = 0: the argmax of the logits (a greedy race has no filter)
            first[greedy_rows] = x[greedy_rows].argmax(dim=1)
        drawn = scaled.gather(1, first[:, None])[:, 0]
        token_ids[races] = first.masked_fill(nan_rows, 0)
        logprobs[races] = ((drawn - top) - log_total).to(torch.float64).masked_fill(nan_rows, float("nan"))
    return token_ids, logprobs


def _check_inputs(
    logits: Tensor,
    logit_rows: Tensor,
    temperatures: Tensor,
    seeds: Tensor,
    positions: Tensor,
    keep_min: Tensor | None,
    keep_last: Tensor | None,
) -> tuple[int, int]:
    """Host-side checks (no device sync); return (num_races, vocab_size)."""
    check_logits(logits)
    num_races = logit_rows.shape[0] if isinstance(logit_rows, Tensor) else 0
    if (keep_min is None) != (keep_last is None):
        raise ValueError("keep_min and keep_last come together: give both or neither")
    named = [("logit_rows", logit_rows, (torch.int64,)), ("temperatures", temperatures, (torch.float32, torch.float64))]
    named += [("seeds", seeds, (torch.int64,)), ("positions", positions, (torch.int64,))]
    if keep_min is not None:
        named += [("keep_min", keep_min, (torch.float64,)), ("keep_last", keep_last, (torch.int64,))]
    for name, tensor, dtypes in named:
        check_tensor(tensor, name, 1, dtypes, logits.device, "logits")
        if tensor.shape[0] != num_races:
            raise ValueError(f"{name} has {tensor.shape[0]} entries, expected one per race ({num_races})")
    return num_races, logits.shape[1]
