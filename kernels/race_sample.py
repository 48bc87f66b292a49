"""The exponential race (Gumbel-max trick): one token per row, `argmax_t p_t / E_t` with `E_t ~ Exp(1)`.

The noise is a pure function of (the row's seed, the row's position, the token id): the kernel derives each `E_t` from
that counter where it uses it (no `[rows, vocab]` noise in memory), and `race_sample_ref` computes the same numbers
bit for bit on a CPU. Keyed by a sample's seed and the position of the token in its completion, the noise makes a
sampled token a function of the distribution at that position and nothing else: not the batch, the slot, K or the
proposer. A draft equal to the race's token at its position is exactly the token plain decoding would emit.

The uniform `u_t` takes 53 bits of a SplitMix64-style hash (int64 arithmetic, wrapping multiplies and masked
shifts: the same bits in Triton, numpy and torch); `E_t = -ln(u_t)` uses a logarithm written with IEEE basic
operations only (exponent from the bits, then a series for the mantissa), so the interpreter's numpy and torch's CPU
kernels round it identically (their own `log` differ in the last bit for ~0.1% of inputs). A GPU compile would contract
the series' multiply-adds into FMAs (one rounding where the reference has two): kernels that use the noise are launched
with `enable_fp_fusion=False`, and every other operation on the way to a score (int64 arithmetic, float64 add, multiply
and divide, comparisons) is correctly rounded on the GPU as on a CPU: the compiled kernel is the reference bit for bit.

The reference avoids most of the work: `-ln(u) >= 1 - u`, so `p / (1 - u)` bounds a token's score from above, and the
bound needs only the top 23 of the 53 bits, which the hash's last round leaves as they are (it changes bits 32..0 of
the 64). It takes the bounds in float32 from those bits (a lower bound of `1 - u`, so still an upper bound of the
score), scores the token of the largest bound exactly, and a row in which no other token's bound reaches that score
(less a slack far above the float32 and logarithm errors) is done; any other row is hashed in full and scored
exactly, with the kernel's logarithm. The winner is the kernel's, always.
"""

import sys

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import PROB_DTYPES, block_size_for, check_kernel_device, check_tensor

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # as int64: multiplies wrap
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_BITS53 = (1 << 53) - 1
_BOUND_SLACK = 1.0 - 2.0**-16  # the share of a winner's score another token's float32 bound must reach to contest it
_ONE_HIGH_BITS = 0x3F80000000000000  # float32 1.0 in the high 32 bits of an int64
_TOP23_BELOW_ONE = 0x007FFFFFFFFFFFFF  # the 23 mantissa bits and the 32 below them
_ARGMAX_BLOCK = 32  # the reference's first argmax: the block of the largest maximum, then the largest in that block
_LN2 = 0.6931471805599453
_SQRT2 = 1.4142135623730951
# 1 / (2k + 1), k = 10..1: ln(m) = 2 s (1 + s^2 / 3 + s^4 / 5 + ...), s = (m - 1) / (m + 1), |s| < 0.172
_SERIES = tuple(1.0 / (2 * k + 1) for k in range(10, 0, -1))
_ELEMENTS_PER_CHUNK = 1 << 18  # the reference's rows x vocab per pass: its temporaries stay in cache


# ---- Triton ----------------------------------------------------------------------------------------------------


@triton.jit
def _mix64(z):
    # SplitMix64's finaliser on int64: multiplies wrap, right shifts are masked to act as logical ones
    z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685  # 0x94D049BB133111EB
    return z ^ ((z >> 31) & 0x1FFFFFFFF)


@triton.jit
def _log(x):
    # ln(x) for positive normal float64 x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln x = e ln 2 + ln m
    bits = x.to(tl.int64, bitcast=True)
    exponent = ((bits >> 52) & 0x7FF) - 1023
    mantissa = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).to(tl.float64, bitcast=True)  # in [1, 2)
    high = mantissa >= tl.full((), 1.4142135623730951, tl.float64)
    mantissa = tl.where(high, mantissa * tl.full((), 0.5, tl.float64), mantissa)
    exponent = tl.where(high, exponent + 1, exponent)
    one = tl.full((), 1.0, tl.float64)
    s = (mantissa - one) / (mantissa + one)
    s2 = s * s
    series = tl.full((), 1.0 / 21.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 19.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 17.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 15.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 13.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 11.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 9.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 7.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 5.0, tl.float64)
    series = series * s2 + tl.full((), 1.0 / 3.0, tl.float64)
    series = series * s2 + one
    log_m = tl.full((), 2.0, tl.float64) * s * series
    return exponent.to(tl.float64) * tl.full((), 0.6931471805599453, tl.float64) + log_m


@triton.jit
def _neg_log(u):
    # -ln(u) for float64 u in (0, 1)
    return -_log(u)


@triton.jit
def _race_uniforms(key, cols):
    # float64 in (0, 1): the uniform of each token id `cols` under the row's `key`, from 53 bits of its hash
    bits = (_mix64(key + cols.to(tl.int64) * -7046029254386353131) >> 11) & 0x1FFFFFFFFFFFFF
    return (bits.to(tl.float64) + tl.full((), 0.5, tl.float64)) * tl.full((), 2.0**-53, tl.float64)


@triton.jit
def _race_key(seed, position):
    return _mix64(seed ^ _mix64(position + -7046029254386353131))  # + 0x9E3779B97F4A7C15


# Row r: keys from (seed_r, position_r); token t's uniform from (keys, t); score p_t / E_t; the blocked argmax keeps
# the lowest index among equal scores (as torch.argmax does). A token with p_t = 0 scores 0 and never beats one with
# p_t > 0.
@triton.jit
def _race_sample_kernel(
    probs_ptr,  # [num_rows, vocab_size] float32/float64
    seeds_ptr,  # [num_rows] int64
    positions_ptr,  # [num_rows] int64
    token_ids_ptr,  # [num_rows] int64, out
    vocab_size,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    key = _race_key(seed, position)
    row_ptr = probs_ptr + row.to(tl.int64) * vocab_size
    best_score = tl.full((), -1.0, tl.float64)
    best_index = tl.full((), 0, tl.int64)
    for block_start in range(0, vocab_size, BLOCK_SIZE):
        cols = block_start + tl.arange(0, BLOCK_SIZE)
        in_vocab = cols < vocab_size
        p = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float64)
        score = tl.where(in_vocab, p / _neg_log(_race_uniforms(key, cols)), -1.0)
        block_max = tl.max(score, axis=0)
        block_index = tl.min(tl.where(score == block_max, cols, vocab_size), axis=0)
        better = block_max > best_score
        best_score = tl.where(better, block_max, best_score)
        best_index = tl.where(better, block_index.to(tl.int64), best_index)
    tl.store(token_ids_ptr + row, best_index)


def race_sample(
    probs: Tensor,  # [num_rows, vocab_size] float32/float64
    seeds: Tensor,  # [num_rows] int64
    positions: Tensor,  # [num_rows] int64
) -> Tensor:
    """Draw one token per row by the exponential race over `probs`, with noise keyed by (seed, position, token).

    Args:
        probs: `[num_rows, vocab_size]` float32/float64, each row a distribution (processed: temperature, top-k,
            top-p; zeros are never drawn).
        seeds: `[num_rows]` int64, 62-bit: the sample's seed.
        positions: `[num_rows]` int64 in [0, 2^32): the position of the drawn token in its completion.

    Returns:
        `[num_rows]` int64 token ids.
    """
    num_rows, vocab_size = _check_inputs(probs, seeds, positions)
    check_kernel_device(_race_sample_kernel, probs.device, "race_sample")
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows:
        _race_sample_kernel[(num_rows,)](
            probs,
            seeds,
            positions,
            token_ids,
            vocab_size,
            BLOCK_SIZE=block_size_for(vocab_size),
            enable_fp_fusion=False,  # a fused multiply-add rounds once where the reference rounds twice
        )
    return token_ids


# ---- pure torch --------------------------------------------------------------------------------------------------


def _mix_rounds_ref(z: Tensor, shifted: Tensor, rounds: range) -> Tensor:
    """Rounds `rounds` (of 0, 1, 2) of the kernel's `_mix64`, in place on `z`, with `shifted` as scratch (the
    reference's time is mostly these passes over memory)."""
    for i in rounds:
        shift, mask, multiplier = _MIX_ROUNDS[i]
        z ^= torch.bitwise_right_shift(z, shift, out=shifted).bitwise_and_(mask)
        if multiplier is not None:
            z *= multiplier
    return z


_MIX_ROUNDS = ((30, 0x3FFFFFFFF, _MIX1), (27, 0x1FFFFFFFFF, _MIX2), (31, 0x1FFFFFFFF, None))


def _mix64_ref(z: Tensor) -> Tensor:
    """The kernel's `_mix64`, in place on `z` (every caller's own temporary)."""
    return _mix_rounds_ref(z, torch.empty_like(z), range(3))


def _row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    return _mix64_ref(seeds ^ _mix64_ref(positions + _GOLDEN))


def _bits(keys: Tensor, token_ids: Tensor) -> Tensor:
    """`[rows, tokens]` int64: the 53 random bits of each (row key, token)."""
    return _finished_bits(_mix64_ref(keys[:, None] + token_ids * _GOLDEN))


def _finished_bits(mixed: Tensor) -> Tensor:
    """The 53 random bits of fully mixed hashes, in place."""
    return mixed.bitwise_right_shift_(11).bitwise_and_(_BITS53)


def _uniforms_of(bits: Tensor) -> Tensor:
    """float64 in (0, 1): the uniform `(bits + 1/2) 2^-53` of each value of `_bits`."""
    return bits.to(torch.float64).add_(0.5).mul_(2.0**-53)


def _uniforms(keys: Tensor, token_ids: Tensor) -> Tensor:
    """`[rows, tokens]` float64 in (0, 1): the race's uniform of each (row key, token)."""
    return _uniforms_of(_bits(keys, token_ids))


def _log_ref(x: Tensor) -> Tensor:
    """ln(x) of positive normal float64 `x`, with the kernel's operations in the kernel's order."""
    bits = x.view(torch.int64)
    exponent = ((bits >> 52) & 0x7FF) - 1023
    mantissa = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).view(torch.float64)
    high = mantissa >= _SQRT2
    mantissa = torch.where(high, mantissa * 0.5, mantissa)
    exponent = torch.where(high, exponent + 1, exponent)
    s = (mantissa - 1.0) / (mantissa + 1.0)
    s2 = s * s
    series = torch.full_like(s, _SERIES[0])
    for coefficient in _SERIES[1:]:
        series = series * s2 + coefficient
    series = series * s2 + 1.0
    log_m = 2.0 * s * series
    return exponent.to(torch.float64) * _LN2 + log_m


def _neg_log_ref(u: Tensor) -> Tensor:
    """-ln(u), float64, with the kernel's operations in the kernel's order."""
    return -_log_ref(u)


def race_exponentials_ref(
    seeds: Tensor,  # [num_rows] int64
    positions: Tensor,  # [num_rows] int64
    token_ids: Tensor,  # [num_tokens] or [num_rows, num_tokens] int64
) -> Tensor:
    """`[num_rows, num_tokens]` float64: the race's Exp(1) noise of each row at each of `token_ids` (the same tokens
    for every row, or each row's own)."""
    return _neg_log_ref(_uniforms(_row_keys(seeds, positions), token_ids))


def race_sample_ref(
    probs: Tensor,  # [num_rows, vocab_size] float32/float64
    seeds: Tensor,  # [num_rows] int64
    positions: Tensor,  # [num_rows] int64
) -> Tensor:
    """Pure-torch `race_sample`: same arguments and output, runs on any device (rows in chunks of about 2^18
    elements, exact scores only where the bound of the module docstring cannot rule a token out)."""
    num_rows, vocab_size = _check_inputs(probs, seeds, positions)
    device = probs.device
    token_offsets = torch.arange(vocab_size, device=device) * _GOLDEN
    keys = _row_keys(seeds, positions)
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    padded = -(-vocab_size // _ARGMAX_BLOCK) * _ARGMAX_BLOCK
    rows_per_chunk = max(1, _ELEMENTS_PER_CHUNK // max(vocab_size, 1))
    for start in range(0, num_rows, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        p = probs[rows].detach()  # [n, vocab] (a token id has no gradient)
        n = p.shape[0]
        mixed = keys[rows, None] + token_offsets  # [n, vocab] int64: the hashes, two rounds of three mixed below
        scratch = torch.empty_like(mixed)
        _mix_rounds_ref(mixed, scratch, range(2))
        bound = torch.zeros(n, padded, dtype=torch.float32, device=device)  # padding bounds 0: never the first
        torch.div(p, _room(mixed, scratch), out=bound[:, :vocab_size])
        first = _first_argmax(bound)  # [n]
        first_mixed = _mix_rounds_ref(
            mixed.gather(1, first[:, None]), torch.empty(n, 1, dtype=torch.int64, device=device), range(2, 3)
        )
        # the first's score, to within an ulp or two (an uncontested row needs it only against the slack)
        best = p.gather(1, first[:, None]).to(torch.float64) / -torch.log(_uniforms_of(_finished_bits(first_mixed)))
        threshold = (best[:, 0] * _BOUND_SLACK).to(torch.float32)
        contested = torch.nonzero(bound.scatter_(1, first[:, None], 0.0).amax(dim=1) >= threshold)[:, 0]
        if len(contested):  # another token may beat the first (or tie it with a lower id): every exact score
            full = _mix_rounds_ref(
                mixed[contested], torch.empty(len(contested), vocab_size, dtype=torch.int64, device=device), range(2, 3)
            )
            noise = _neg_log_ref(_uniforms_of(_finished_bits(full)))
            first[contested] = (p[contested].to(torch.float64) / noise).argmax(dim=1)  # the first maximum
        out[rows] = first
    return out


def _room(mixed: Tensor, scratch: Tensor) -> Tensor:
    """`[n, vocab]` float32 lower bounds of `1 - u`, within 2^-23 of it, from hashes two rounds into mixing (the last
    round leaves bits 63..33 as they are). Bits 63..41, the uniform's top 23, become the mantissa of a float32
    `F = 1 + top 2^-23` in each high word: `1 - u >= (2^23 - 1 - top) 2^-23 = (2 - 2^-23) - F`, exactly, and
    `1 - u >= 2^-54` (an all-ones top gives 0)."""
    high = torch.bitwise_right_shift(mixed, 9, out=scratch).bitwise_and_(_TOP23_BELOW_ONE).bitwise_or_(_ONE_HIGH_BITS)
    return torch.sub(2.0 - 2.0**-23, high.view(torch.float32)[:, 1 if _LITTLE_ENDIAN else 0 :: 2]).clamp_min_(2.0**-54)


_LITTLE_ENDIAN = sys.byteorder == "little"  # which int32 of an int64 holds its high bits


def _first_argmax(values: Tensor) -> Tensor:
    """`[n]` the index of each row's first maximum of `values [n, k * _ARGMAX_BLOCK]`: the first block holding the
    row's maximum, then the first maximum in it (torch's argmax over a long row is several times its amax)."""
    n, width = values.shape
    blocks = values.view(n, width // _ARGMAX_BLOCK, _ARGMAX_BLOCK)
    block = blocks.amax(dim=2).argmax(dim=1)
    return block * _ARGMAX_BLOCK + blocks[torch.arange(n, device=values.device), block].argmax(dim=1)


def _check_inputs(probs: Tensor, seeds: Tensor, positions: Tensor) -> tuple[int, int]:
    """Host-side checks (no device sync); return (num_rows, vocab_size)."""
    if not isinstance(probs, Tensor):
        raise TypeError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    check_tensor(probs, "probs", 2, PROB_DTYPES, probs.device, "probs")
    num_rows = probs.shape[0]
    for name, tensor in (("seeds", seeds), ("positions", positions)):
        check_tensor(tensor, name, 1, (torch.int64,), probs.device, "probs")
        if tensor.shape[0] != num_rows:
            raise ValueError(f"{name} has {tensor.shape[0]} entries, expected one per row of probs ({num_rows})")
    return num_rows, probs.shape[1]
