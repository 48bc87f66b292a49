"""Split-key attention (flash-decoding): how many programs share a row's keys, and the pass that merges what they
computed.

When rows x KV heads x query blocks leave most of the GPU idle (a tail of a few long rows), `paged_attention` splits
each row's keys into `num_splits` ranges, one program each. A program writes, per query and head, the softmax over its
range only: the normalised output `o_s` and the log-sum-exp `lse_s` of its scores (-inf when it saw no key).
`merge_splits` combines them into the softmax over all keys.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import check_kernel_device

# Splits are sized so that about this many programs run per SM.
PROGRAMS_PER_SM = 2
# The most splits a row's keys are cut into (the merge pass holds them all at once).
MAX_SPLITS = 32


def choose_num_splits(num_programs: int, num_key_tiles: int, num_sms: int | None) -> int:
    """Splits per row so that `num_programs` (rows x KV heads x query blocks) times the splits reach about
    `PROGRAMS_PER_SM` programs per SM; 1 when they already do, or without an SM count (a CPU). Never more than the
    key tiles of the longest row the launch can hold (`num_key_tiles`) nor `MAX_SPLITS`. Host integers only: the
    choice is the same at every replay of a captured graph."""
    target = PROGRAMS_PER_SM * (num_sms or 0)
    if num_programs <= 0 or num_programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, num_programs), num_key_tiles, MAX_SPLITS))


def num_sms_of(device: torch.device) -> int | None:
    """The device's SM count (a cached host query), None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


# out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M), M = max_s lse_s: the softmax over the union of the splits'
# keys, since split s holds exp(lse_s) = its sum of exp(scores) and o_s its output normalised by that sum.
@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [rows, S, heads, num_splits, head_dim] contiguous, float32 or float64
    partial_lse_ptr,  # [rows, S, heads, num_splits] contiguous, the dtype of partial_out
    query_start_ptr,  # [rows] int64
    num_queries_ptr,  # [rows] int64
    out_ptr,  # [rows, S, heads, head_dim] contiguous
    S,
    num_heads,
    head_dim,
    num_splits,
    BLOCK_H: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    cell = tl.program_id(0).to(tl.int64)  # row * S + column
    row = cell // S
    column = cell % S
    first = tl.load(query_start_ptr + row)
    num_queries = tl.load(num_queries_ptr + row)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (column >= first) & (column < first + num_queries)  # padding columns: nothing read or written
    h_valid = offs_h < tl.where(valid, num_heads, 0)  # (a vector from a scalar bool: the interpreter mistypes it)
    d_valid = offs_d < head_dim
    lse_index = (cell * num_heads + offs_h)[:, None] * num_splits + offs_s[None, :]  # [BLOCK_H, BLOCK_SPLITS]
    lse_mask = h_valid[:, None] & (offs_s < num_splits)[None, :]
    lse = tl.load(partial_lse_ptr + lse_index, mask=lse_mask, other=float("-inf"))
    top = tl.max(lse, axis=1)
    weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)[:, None])  # a split that saw nothing weighs 0
    total = tl.sum(weights, axis=1)
    part_mask = lse_mask[:, :, None] & d_valid[None, None, :]
    part = tl.load(partial_out_ptr + lse_index[:, :, None] * head_dim + offs_d[None, None, :], mask=part_mask, other=0)
    out = tl.sum(weights[:, :, None] * part, axis=1) / tl.where(total > 0, total, 1.0)[:, None]
    out_offsets = (cell * num_heads + offs_h)[:, None] * head_dim + offs_d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & d_valid[None, :])


def merge_splits(
    partial_out: Tensor,  # [rows, S, heads, num_splits, head_dim] float32 or float64
    partial_lse: Tensor,  # [rows, S, heads, num_splits]
    query_start: Tensor,  # [rows] int64
    num_queries: Tensor,  # [rows] int64
    out: Tensor,  # [rows, S, heads, head_dim] written at the rows' query columns only
) -> Tensor:
    """Merge the splits' partial softmaxes into `out` (in place, at query columns; padding columns keep what they
    hold; the partials there are never read) and return it."""
    rows, S, num_heads, num_splits, head_dim = partial_out.shape
    assert partial_lse.shape == partial_out.shape[:4], f"expected lse {partial_out.shape[:4]}, got {partial_lse.shape}"
    assert out.shape == (rows, S, num_heads, head_dim) and out.is_contiguous(), f"bad out {tuple(out.shape)}"
    assert partial_out.is_contiguous() and partial_lse.is_contiguous(), "partials must be contiguous"
    check_kernel_device(_merge_splits_kernel, out.device, "merge_splits")
    if rows * S == 0:
        return out
    block_splits = triton.next_power_of_2(num_splits)
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 8192 // (block_splits * block_d)))
    grid = (rows * S, triton.cdiv(num_heads, block_h))
    _merge_splits_kernel[grid](
        partial_out,
        partial_lse,
        query_start,
        num_queries,
        out,
        S,
        num_heads,
        head_dim,
        num_splits,
        BLOCK_H=block_h,
        BLOCK_SPLITS=block_splits,
        BLOCK_D=block_d,
    )
    return out


def merge_splits_ref(partial_out: Tensor, partial_lse: Tensor) -> Tensor:
    """`merge_splits` in torch at every column: `[rows, S, heads, head_dim]` in the partials' dtype (zeros where no
    split saw a key)."""
    top = partial_lse.amax(-1, keepdim=True)
    weights = torch.exp(partial_lse - torch.where(top == float("-inf"), 0.0, top))  # [rows, S, heads, num_splits]
    total = weights.sum(-1, keepdim=True)
    return (weights[..., None] * partial_out).sum(-2) / torch.where(total > 0, total, 1.0)
