"""Top-k / top-p as a threshold on the logits, found without sorting the vocabulary.

Row r keeps the first `n` tokens of its vocabulary ordered by (logit descending, id ascending), and the launcher returns
that set as `race_logits` takes it: `keep_min` (the n-th token's logit, float64) and `keep_last` (the id of the n-th
token), token t kept iff `x_t > keep_min` or (`x_t == keep_min` and `t <= keep_last`).

    n = min(K, the smallest prefix whose mass reaches top_p * (the mass of the first K))

with K = top_k where 0 < top_k < V, else V. The mass of a token is a fixed-point weight, an integer held in a float64:

    q_t = floor(e(z_t) 2^S + 1/2),   z_t = (x_t - max x) / T,   S = 53 - bit_length(V)

where `e` is exp written with basic operations only (z = r - k ln 2 in float64, then e^r by a degree-7 series in
float32: within 3e-7 of exp). Every q_t is an integer, at most 2^S, and V 2^S < 2^53: every sum of weights is exact in
float64, in any order. The kernel (blocks, pivot sums) and the reference (torch.topk, cumulative sums) add them
in different orders and still agree bit for bit; `e` needs no library exp, whose last bit differs between devices. A
prefix reaches top_p when its mass is at least `ceil(top_p * Q_K)` (a float64 product). Greedy rows (T = 0) and rows
without a filter keep everything: `(-inf, V)`. A row whose weights are all 0 (no finite maximum) keeps its first token.

The kernel, one program per row, never sorts: it finds the K-th largest logit, then the top-p cut, each by a search
over the logits' order-preserving integer keys (float32 bits for 16/32-bit logits, float64 bits for float64), 16
pivots a pass over the vocabulary (4 bits of the key a pass: about 8 passes for 32-bit keys), counting the tokens and
summing the weights at or above each pivot; a last pass finds the id of the n-th token among those equal to its logit.
The reference selects candidates with `torch.topk` (the top K, or for top-p alone a growing number) and cuts their
cumulative weights.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import check_kernel_device, check_logits, check_tensor

_NUM_PIVOTS = 16  # keys tried per pass of the kernel's search (a power of two: the step is a shift)
_BLOCK_SIZE = 512  # vocabulary entries per block of the kernel's loops (x 16 pivots per search step)
_ELEMENTS_PER_CHUNK = 1 << 22  # the reference's rows x vocab per pass
_FIRST_CANDIDATES = 256  # the reference's first topk for a top-p-only row, 8 times more each round it falls short
_WEIGHT_CHUNK = 1 << 16  # the reference's elements per pass of the weight polynomial: its temporaries stay in cache


def _f32(value: float) -> float:
    """`value` rounded to float32: the kernel and the reference use the same float32 constants."""
    return torch.tensor(value, dtype=torch.float32).item()


_EXP_FLOOR = -40.0  # below this z the weight rounds to 0 for every S (2^-52 > e^-40 * 2^0.5)
_INV_LN2 = 1.4426950408889634
_LN2_HIGH = 6.93147180369123816490e-01  # ln 2 in two parts (fdlibm's): k * _LN2_HIGH is exact for |k| < 2^20
_LN2_LOW = 1.90821492927058770002e-10
_SERIES = tuple(_f32(1.0 / math.factorial(i)) for i in range(7, -1, -1))  # e^r = sum r^i / i!, |r| <= ln 2 / 2
# the kernel reads globals only as constexprs (Triton refuses a plain tuple there)
_S0, _S1, _S2, _S3, _S4, _S5, _S6, _S7 = (tl.constexpr(c) for c in _SERIES)


def fixed_point_bits(vocab_size: int) -> int:
    """S: the weights' fixed-point bits, as many as keep a whole row's total below 2^53 (exact in float64)."""
    return 53 - max(vocab_size, 1).bit_length()


# ---- Triton ----------------------------------------------------------------------------------------------------


@triton.jit
def _weights(
    x,  # [BLOCK] float64 logits
    row_max,  # float64
    divisor,  # float64 temperature
    scale_exponent,  # int S
):
    # q = floor(e(z) 2^S + 1/2), z = (x - max) / T; e(z) = 2^-k e^r, z = r - k ln 2 (float64), e^r for |r| <= ln 2 / 2
    # by a float32 series
    z = (x - row_max) / divisor
    live = z >= -40.0  # _EXP_FLOOR; NaN (no finite maximum) is not live
    z = tl.where(live, z, 0.0)
    # float64 constants spelled out: a bare float literal would be rounded to float32
    k = (0.5 - z * tl.full((), 1.4426950408889634, tl.float64)).to(tl.int32)  # _INV_LN2
    k_float = k.to(tl.float64)
    r = z + k_float * tl.full((), 6.93147180369123816490e-01, tl.float64)  # _LN2_HIGH
    r = (r + k_float * tl.full((), 1.90821492927058770002e-10, tl.float64)).to(tl.float32)  # _LN2_LOW
    series = tl.full((), _S0, tl.float32)
    series = series * r + tl.full((), _S1, tl.float32)
    series = series * r + tl.full((), _S2, tl.float32)
    series = series * r + tl.full((), _S3, tl.float32)
    series = series * r + tl.full((), _S4, tl.float32)
    series = series * r + tl.full((), _S5, tl.float32)
    series = series * r + tl.full((), _S6, tl.float32)
    series = series * r + tl.full((), _S7, tl.float32)
    power = ((scale_exponent - k + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^(S - k), exact
    q = (series.to(tl.float64) * power + 0.5).to(tl.int64).to(tl.float64)
    return tl.where(live, q, 0.0)


@triton.jit
def _keys(x, KEY64: tl.constexpr):
    # Order-preserving int64 keys of the logits (float64 bits, or float32 bits for narrower logits); -0 is +0.
    if KEY64:
        bits = tl.where(x == 0, 0.0, x).to(tl.int64, bitcast=True)
        return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)
    else:
        bits = tl.where(x == 0, 0.0, x.to(tl.float32)).to(tl.int32, bitcast=True)
        return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _value(key, KEY64: tl.constexpr):
    # The float64 logit of a key (the inverse of `_keys`).
    if KEY64:
        return (key ^ ((key >> 63) & 0x7FFFFFFFFFFFFFFF)).to(tl.float64, bitcast=True)
    else:
        key32 = key.to(tl.int32)
        return (key32 ^ ((key32 >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True).to(tl.float64)


# The largest key v with f(v) >= target, where f(v) is the number (BY_MASS false) or the weight (true) of the tokens
# whose key is >= v, given f(lo) >= target > f(hi); each pass tries 16 keys between lo and hi. Returns
# (v, count and weight of the tokens above v).
@triton.jit
def _search(
    row_ptr,  # [vocab_size]
    vocab_size,
    lo,  # int64
    hi,  # int64
    target,  # float64
    row_max,  # float64
    divisor,  # float64
    scale_exponent,
    BY_MASS: tl.constexpr,
    KEY64: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    slots = tl.arange(0, NUM_PIVOTS).to(tl.int64)
    count_above = tl.full((), 0, tl.int64)
    mass_above = tl.full((), 0.0, tl.float64)
    while lo < hi - 1:
        # step ~ (hi - lo) / 16 without forming hi - lo, which can pass 2^63 for float64 keys
        step = ((hi >> 1) - (lo >> 1)) >> 3
        middle = lo + step * (NUM_PIVOTS // 2)
        pivots = tl.where(step > 0, middle + (slots - (NUM_PIVOTS // 2 - 1)) * step, lo + 1 + slots)
        valid = (pivots > lo) & (pivots < hi)
        counts = tl.zeros((NUM_PIVOTS,), tl.int64)
        masses = tl.zeros((NUM_PIVOTS,), tl.float64)
        for block_start in range(0, vocab_size, BLOCK_SIZE):
            cols = block_start + tl.arange(0, BLOCK_SIZE)
            in_vocab = cols < vocab_size
            x = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float64)
            at_or_above = (_keys(x, KEY64)[:, None] >= pivots[None, :]) & in_vocab[:, None]
            counts += tl.sum(at_or_above.to(tl.int64), axis=0)
            if BY_MASS:
                q = _weights(x, row_max, divisor, scale_exponent)
                masses += tl.sum(tl.where(at_or_above, q[:, None], 0.0), axis=0)
        if BY_MASS:
            reached = valid & (masses >= target)
        else:
            reached = valid & (counts.to(tl.float64) >= target)
        short = valid & ~reached
        lo = tl.max(tl.where(reached, pivots, lo), axis=0)
        new_hi = tl.min(tl.where(short, pivots, hi), axis=0)
        at_new_hi = short & (pivots == new_hi)
        count_above = tl.where(new_hi < hi, tl.sum(tl.where(at_new_hi, counts, 0), axis=0), count_above)
        mass_above = tl.where(new_hi < hi, tl.sum(tl.where(at_new_hi, masses, 0.0), axis=0), mass_above)
        hi = new_hi
    return lo, count_above, mass_above


@triton.jit
def _keep_threshold_kernel(
    logits_ptr,  # [num_logit_rows, logits_stride] any float, the vocabulary contiguous
    logit_rows_ptr,  # [num_rows] int64
    temperatures_ptr,  # [num_rows] float32/float64, 0 = greedy
    top_k_ptr,  # [num_rows] int64
    top_p_ptr,  # [num_rows] float32/float64
    keep_min_ptr,  # [num_rows] float64, out
    keep_last_ptr,  # [num_rows] int64, out
    logits_stride,
    vocab_size,
    scale_exponent,
    KEY64: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + tl.load(logit_rows_ptr + row) * logits_stride
    temperature = tl.load(temperatures_ptr + row).to(tl.float64)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row).to(tl.float64)
    num_kept = tl.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)  # K
    has_top_p = top_p < 1.0
    keep_min = tl.full((), float("-inf"), tl.float64)
    keep_last = tl.full((), 0, tl.int64) + vocab_size
    if (temperature != 0.0) & ((num_kept < vocab_size) | has_top_p):
        key_min = tl.full((), 0x7FFFFFFFFFFFFFFF, tl.int64)
        key_max = tl.full((), -0x7FFFFFFFFFFFFFFF, tl.int64)
        for block_start in range(0, vocab_size, BLOCK_SIZE):
            cols = block_start + tl.arange(0, BLOCK_SIZE)
            in_vocab = cols < vocab_size
            keys = _keys(tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float64), KEY64)
            key_min = tl.minimum(key_min, tl.min(tl.where(in_vocab, keys, 0x7FFFFFFFFFFFFFFF), axis=0))
            key_max = tl.maximum(key_max, tl.max(tl.where(in_vocab, keys, -0x7FFFFFFFFFFFFFFF), axis=0))
        row_max = _value(key_max, KEY64)
        # top-k: the K-th largest key, and the count and weight of the tokens above it
        cut = key_min
        count_above = tl.full((), 0, tl.int64)
        mass_above = tl.full((), 0.0, tl.float64)
        if num_kept < vocab_size:
            cut, count_above, mass_above = _search(
                row_ptr, vocab_size, key_min, key_max + 1, num_kept.to(tl.float64), row_max, temperature,
                scale_exponent, False, KEY64, BLOCK_SIZE, NUM_PIVOTS,
            )  # fmt: skip
        num_cut = num_kept  # n
        if has_top_p:
            # Q_K: the weight of the first K tokens, those above the K-th key and enough of those equal to it
            total = tl.full((), 0.0, tl.float64)
            num_above = tl.full((), 0, tl.int64)
            for block_start in range(0, vocab_size, BLOCK_SIZE):
                cols = block_start + tl.arange(0, BLOCK_SIZE)
                in_vocab = cols < vocab_size
                x = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float64)
                above = in_vocab & (_keys(x, KEY64) > cut)
                total += tl.sum(tl.where(above, _weights(x, row_max, temperature, scale_exponent), 0.0), axis=0)
                num_above += tl.sum(above.to(tl.int64), axis=0)
            cut_weight = _weights(_value(cut, KEY64), row_max, temperature, scale_exponent)
            total += (num_kept - num_above).to(tl.float64) * cut_weight
            product = top_p * total
            target = product.to(tl.int64).to(tl.float64)  # ceil(top_p Q_K), at least 1 unless Q_K is 0
            target = tl.where(target < product, target + 1.0, target)
            target = tl.where(total > 0.0, tl.maximum(target, 1.0), 0.0)
            cut = key_max
            count_above = tl.full((), 0, tl.int64)
            mass_above = tl.full((), 0.0, tl.float64)
            num_cut = tl.full((), 1, tl.int64)
            if target > 0.0:
                cut, count_above, mass_above = _search(
                    row_ptr, vocab_size, key_min, key_max + 1, target, row_max, temperature, scale_exponent, True,
                    KEY64, BLOCK_SIZE, NUM_PIVOTS,
                )  # fmt: skip
                # an integer of its own: Triton keeps a variable's type across an if
                cut_units = _weights(_value(cut, KEY64), row_max, temperature, scale_exponent).to(tl.int64)
                missing = target.to(tl.int64) - mass_above.to(tl.int64)  # > 0, taken from tokens equal to the cut
                num_cut = count_above + (missing + cut_units - 1) // cut_units
            num_cut = tl.minimum(num_cut, num_kept)
        # the n-th token: the (n - count above)-th of the tokens whose key is the cut, by id
        rank = num_cut - count_above
        seen = tl.full((), 0, tl.int64)
        keep_last = tl.full((), -1, tl.int64)
        for block_start in range(0, vocab_size, BLOCK_SIZE):
            cols = block_start + tl.arange(0, BLOCK_SIZE)
            in_vocab = cols < vocab_size
            keys = _keys(tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float64), KEY64)
            equal = (in_vocab & (keys == cut)).to(tl.int64)
            hit = (equal > 0) & (tl.cumsum(equal, axis=0) + seen == rank)
            keep_last = tl.maximum(keep_last, tl.max(tl.where(hit, cols, -1), axis=0).to(tl.int64))
            seen += tl.sum(equal, axis=0)
        keep_min = _value(cut, KEY64)
    tl.store(keep_min_ptr + row, keep_min)
    tl.store(keep_last_ptr + row, keep_last)


def keep_threshold(
    logits: Tensor,  # [num_logit_rows, vocab_size] float16/bfloat16/float32/float64
    logit_rows: Tensor,  # [num_rows] int64
    temperatures: Tensor,  # [num_rows] float32/float64
    top_k: Tensor,  # [num_rows] int64
    top_p: Tensor,  # [num_rows] float32/float64
) -> tuple[Tensor, Tensor]:
    """The tokens top-k / top-p keep in each row of `logits[logit_rows]`, as a threshold (see the module docstring).

    Args:
        logits: `[num_logit_rows, vocab_size]` the model's logits (rows may be strided, the vocabulary contiguous).
        logit_rows: `[num_rows]` int64, the row of `logits` each row reads.
        temperatures: `[num_rows]` float, 0 for a greedy row (keeps everything).
        top_k: `[num_rows]` int64, 0 (or >= vocab_size) for no top-k.
        top_p: `[num_rows]` float, 1 for no top-p.

    Returns:
        `([num_rows] float64 keep_min, [num_rows] int64 keep_last)`: token t is kept iff `x_t > keep_min` or
        (`x_t == keep_min` and `t <= keep_last`); `(-inf, vocab_size)` for a row that keeps everything. A row
        holding NaN logits has no defined kept set (the kernel and the reference may disagree on it).
    """
    num_rows, vocab_size = _check_inputs(logits, logit_rows, temperatures, top_k, top_p)
    check_kernel_device(_keep_threshold_kernel, logits.device, "keep_threshold")
    keep_min = torch.empty(num_rows, dtype=torch.float64, device=logits.device)
    keep_last = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if not num_rows:
        return keep_min, keep_last
    _keep_threshold_kernel[(num_rows,)](
        logits,
        logit_rows,
        temperatures,
        top_k,
        top_p,
        keep_min,
        keep_last,
        logits.stride(0),
        vocab_size,
        fixed_point_bits(vocab_size),
        KEY64=logits.dtype == torch.float64,
        BLOCK_SIZE=min(triton.next_power_of_2(vocab_size), _BLOCK_SIZE),
        NUM_PIVOTS=_NUM_PIVOTS,
        enable_fp_fusion=False,  # the weights' multiply-adds round as the reference's do
    )
    return keep_min, keep_last


# ---- torch reference -------------------------------------------------------------------------------------------


def weights_ref(
    x: Tensor,  # [..., n] float64 logits
    row_max: Tensor,  # [..., 1] float64
    divisor: Tensor,  # [..., 1] float64
    scale_exponent: int,
) -> Tensor:  # [..., n] float64 integers
    """The fixed-point weights q of the module docstring, operation for operation as the kernel computes them."""
    z = (x - row_max) / divisor
    live = z >= _EXP_FLOOR
    z = torch.where(live, z, 0.0)
    k = (0.5 - z * _INV_LN2).to(torch.int32)
    k_float = k.to(torch.float64)
    r = (z + k_float * _LN2_HIGH).add_(k_float * _LN2_LOW).to(torch.float32)
    series = torch.full_like(r, _SERIES[0])
    for coefficient in _SERIES[1:]:
        series.mul_(r).add_(coefficient)
    power = ((scale_exponent + 1023 - k).to(torch.int64) << 52).view(torch.float64)
    q = (series.to(torch.float64).mul_(power).add_(0.5)).to(torch.int64).to(torch.float64)
    return q.masked_fill_(~live, 0.0)


def _total_weights(x: Tensor, row_max: Tensor, divisor: Tensor, scale_exponent: int) -> Tensor:
    """`[rows]` float64 sum of every token's weight, a few rows at a time (exact: the sum of integers below 2^53)."""
    rows_per_pass = max(1, _WEIGHT_CHUNK // max(x.shape[1], 1))
    totals = []
    for start in range(0, x.shape[0], rows_per_pass):
        part = slice(start, start + rows_per_pass)
        totals.append(weights_ref(x[part].to(torch.float64), row_max[part], divisor[part], scale_exponent).sum(dim=1))
    return torch.cat(totals)


def _kept_counts(
    x: Tensor,  # [rows, vocab_size] any float
    divisor: Tensor,  # [rows] float64, > 0
    num_kept: Tensor,  # [rows] int64, K in [1, vocab_size]
    top_p: Tensor,  # [rows] float64
) -> tuple[Tensor, Tensor]:
    """`([rows] int64 n, [rows] float64 the n-th largest logit)`: the kept prefix of each row, from candidates that
    torch.topk selects (the top K; for a top-p-only row a number that grows until the cut falls inside)."""
    rows, vocab_size = x.shape
    scale_exponent = fixed_point_bits(vocab_size)
    row_max = x.amax(dim=1, keepdim=True).to(torch.float64)
    has_top_p = top_p < 1.0
    top_p_only = has_top_p & (num_kept == vocab_size)
    totals = torch.zeros(rows, dtype=torch.float64, device=x.device)
    if bool(top_p_only.any()):
        only = torch.nonzero(top_p_only)[:, 0]
        totals[only] = _total_weights(x[only], row_max[only], divisor[only, None], scale_exponent)
    num_cut = torch.empty(rows, dtype=torch.int64, device=x.device)
    cut_value = torch.empty(rows, dtype=torch.float64, device=x.device)
    pending = torch.arange(rows, device=x.device)
    limited = num_kept < vocab_size
    num_candidates = int(num_kept[limited].max()) if bool(limited.any()) else 0
    num_candidates = min(vocab_size, max(num_candidates, _FIRST_CANDIDATES))
    while len(pending):
        values = x[pending].topk(num_candidates, dim=1).values.to(torch.float64)  # [m, c] descending
        keep = num_kept[pending]
        in_top_k = torch.arange(num_candidates, device=x.device)[None, :] < keep[:, None]
        weights = weights_ref(values, row_max[pending], divisor[pending, None], scale_exponent)
        cumulative = weights.masked_fill_(~in_top_k, 0.0).cumsum(dim=1)  # exact: integers below 2^53
        total = torch.where(top_p_only[pending], totals[pending], cumulative[:, -1])
        product = top_p[pending] * total
        target = torch.where(total > 0, product.ceil().clamp_min(1.0), 0.0)  # ceil(top_p Q_K)
        reached = (cumulative < target[:, None]).sum(dim=1) + 1  # the first prefix at or above the target
        count = torch.where(has_top_p[pending], torch.minimum(reached, keep), keep)
        done = ~has_top_p[pending] | (count <= num_candidates) | (num_candidates == vocab_size)
        count = count.clamp_max(num_candidates)
        finished = pending[done]
        num_cut[finished] = count[done]
        cut_value[finished] = values[done].gather(1, count[done, None] - 1)[:, 0]
        pending = pending[~done]
        num_candidates = min(vocab_size, num_candidates * 8)
    return num_cut, cut_value


def keep_threshold_ref(
    logits: Tensor,  # [num_logit_rows, vocab_size] float16/bfloat16/float32/float64
    logit_rows: Tensor,  # [num_rows] int64
    temperatures: Tensor,  # [num_rows] float32/float64
    top_k: Tensor,  # [num_rows] int64
    top_p: Tensor,  # [num_rows] float32/float64
    elements_per_chunk: int = _ELEMENTS_PER_CHUNK,
) -> tuple[Tensor, Tensor]:
    """`keep_threshold` in torch, a chunk of rows (`elements_per_chunk` rows x vocab) at a time: the same outputs bit
    for bit, found with torch.topk instead of the kernel's search."""
    num_rows, vocab_size = _check_inputs(logits, logit_rows, temperatures, top_k, top_p)
    device = logits.device
    keep_min = torch.full((num_rows,), float("-inf"), dtype=torch.float64, device=device)
    keep_last = torch.full((num_rows,), vocab_size, dtype=torch.int64, device=device)
    num_kept = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    top_p = top_p.to(torch.float64)
    filtered = torch.nonzero((temperatures != 0) & ((num_kept < vocab_size) | (top_p < 1.0)))[:, 0]
    token_ids = torch.arange(vocab_size, device=device)
    per_chunk = max(1, elements_per_chunk // max(vocab_size, 1))
    for start in range(0, len(filtered), per_chunk):
        rows = filtered[start : start + per_chunk]
        x = logits.detach()[logit_rows[rows]]  # [m, vocab]: compared with float64 cuts, exactly
        num_cut, cut_value = _kept_counts(x, temperatures[rows].to(torch.float64), num_kept[rows], top_p[rows])
        # the n-th token: the (n - count above)-th of those equal to the cut, by id
        rank = num_cut - (x > cut_value[:, None]).sum(dim=1)
        equal = x == cut_value[:, None]
        nth = equal & (equal.cumsum(dim=1) == rank[:, None])
        keep_last[rows] = torch.where(nth, token_ids, -1).amax(dim=1)
        keep_min[rows] = torch.where(cut_value == 0, 0.0, cut_value)  # -0 is +0, as the kernel's keys
    return keep_min, keep_last


def _check_inputs(
    logits: Tensor, logit_rows: Tensor, temperatures: Tensor, top_k: Tensor, top_p: Tensor
) -> tuple[int, int]:
    """Host-side checks (no device sync); return (num_rows, vocab_size)."""
    check_logits(logits)
    if logits.shape[1] == 0 or logits.shape[1] >= 2**52:
        raise ValueError(f"logits has vocab_size {logits.shape[1]}, expected 1 to 2^52 - 1")
    num_rows = logit_rows.shape[0] if isinstance(logit_rows, Tensor) else 0
    floats = (torch.float32, torch.float64)
    named = [("logit_rows", logit_rows, (torch.int64,)), ("temperatures", temperatures, floats)]
    named += [("top_k", top_k, (torch.int64,)), ("top_p", top_p, floats)]
    for name, tensor, dtypes in named:
        check_tensor(tensor, name, 1, dtypes, logits.device, "logits")
        if tensor.shape[0] != num_rows:
            raise ValueError(f"{name} has {tensor.shape[0]} entries, expected one per row ({num_rows})")
    return num_rows, logits.shape[1]
