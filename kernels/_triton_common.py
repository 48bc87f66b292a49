"""Per-row passes shared by the kernels: row setup, the blocked argmax and the inverse-CDF sample, with the
pure-torch twin of the sample (`inverse_cdf_ref`) that the references use.

The sampling passes take the row's weights as a `@triton.jit` function, called once per vocabulary block as
`weights_fn(cols, *weights_args, WEIGHTS_CONST)`, so the chain and tree samplers share one float64 sum order.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import block_size_for


def compute_dtype_for(dtype: torch.dtype) -> tl.dtype:
    """The kernels compare logits in float64 when given float64, else in float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit
def _chain_row(
    cu_num_draft_tokens_ptr,  # [num_rows] int64
    output_token_ids_ptr,  # [num_rows, max_num_draft_tokens + 1] int64
    max_num_draft_tokens,
):
    # This program's row: (row, draft_start, num_drafts, target_start, out_ptr), each int64 but row.
    row = tl.program_id(0)
    draft_start = tl.load(cu_num_draft_tokens_ptr + row - 1, mask=row > 0, other=0)
    # Clamped so that a row with more drafts than promised cannot write past its output row.
    num_drafts = tl.minimum(tl.load(cu_num_draft_tokens_ptr + row) - draft_start, max_num_draft_tokens)
    out_ptr = output_token_ids_ptr + row.to(tl.int64) * (max_num_draft_tokens + 1)
    return row, draft_start, num_drafts, draft_start + row, out_ptr


@triton.jit
def _tree_row(
    cu_num_nodes_ptr,  # [num_rows] int64
    output_token_ids_ptr,  # [num_rows, max_depth + 1] int64
    accepted_nodes_ptr,  # [num_rows, max_depth] int64
    max_depth,
):
    # This program's row: (row, node_start, num_row_nodes, out_ptr, accepted_ptr), each int64 but row.
    row = tl.program_id(0)
    node_start = tl.load(cu_num_nodes_ptr + row - 1, mask=row > 0, other=0)
    num_row_nodes = tl.load(cu_num_nodes_ptr + row) - node_start
    out_ptr = output_token_ids_ptr + row.to(tl.int64) * (max_depth + 1)
    accepted_ptr = accepted_nodes_ptr + row.to(tl.int64) * max_depth
    return row, node_start, num_row_nodes, out_ptr, accepted_ptr


# Blocked argmax of one row: each block's maximum and its lowest index, kept when strictly greater than the best so
# far, so ties go to the lowest index and a row of -inf gives 0, as torch.argmax does. Returns an int64 index.
@triton.jit
def _row_argmax(
    row_ptr,  # [vocab_size]
    vocab_size,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    best_value = tl.full((), float("-inf"), COMPUTE_DTYPE)
    best_index = tl.full((), 0, tl.int64)
    for block_start in range(0, vocab_size, BLOCK_SIZE):
        cols = block_start + tl.arange(0, BLOCK_SIZE)
        in_vocab = cols < vocab_size
        logits = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf")).to(COMPUTE_DTYPE)
        block_max = tl.max(logits, axis=0)
        block_index = tl.min(tl.where((logits == block_max) & in_vocab, cols, vocab_size), axis=0)
        better = block_max > best_value
        best_value = tl.where(better, block_max, best_value)
        best_index = tl.where(better, block_index.to(tl.int64), best_index)
    return best_index


@triton.jit
def _weights_total(
    weights_fn: tl.constexpr,  # @triton.jit (cols, *weights_args, WEIGHTS_CONST) -> [BLOCK_SIZE] float64, >= 0
    weights_args,  # tuple of tensors and scalars
    WEIGHTS_CONST: tl.constexpr,  # weights_fn's last argument (constexpr: a tuple would not keep it one)
    vocab_size,
    BLOCK_SIZE: tl.constexpr,
):
    # (float64 total, last token with weight or -1). A block's total is the last entry of its cumsum, so the search
    # pass reaches exactly this total.
    total = tl.full((), 0.0, tl.float64)
    last_nonzero = -1
    for block_start in range(0, vocab_size, BLOCK_SIZE):
        cols = block_start + tl.arange(0, BLOCK_SIZE)
        weights = weights_fn(cols, *weights_args, WEIGHTS_CONST)
        total += tl.max(tl.cumsum(weights, axis=0), axis=0)
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(weights > 0, cols, -1), axis=0))
    return total, last_nonzero


# Inverse CDF: the first t with w_t > 0 and cumsum(w)_t > threshold (= v * total), accumulated in float64 block by
# block (running total + in-block cumsum), like `inverse_cdf_ref`. Returns an int64 token.
@triton.jit
def _inverse_cdf(
    weights_fn: tl.constexpr,  # as in `_weights_total`
    weights_args,
    WEIGHTS_CONST: tl.constexpr,
    vocab_size,
    threshold,  # float64 v * total
    last_nonzero,  # from `_weights_total`
    BLOCK_SIZE: tl.constexpr,
):
    token = -1
    running = tl.full((), 0.0, tl.float64)
    block_start = 0
    while (token < 0) & (block_start < vocab_size):
        cols = block_start + tl.arange(0, BLOCK_SIZE)
        weights = weights_fn(cols, *weights_args, WEIGHTS_CONST)
        cdf = tl.cumsum(weights, axis=0)
        # Zero-weight tokens are skipped: a zero-probability (or removed) token is never returned.
        hit = (running + cdf > threshold) & (weights > 0)
        first = tl.min(tl.where(hit, cols, vocab_size), axis=0)
        token = tl.where(first < vocab_size, first, -1)
        running += tl.max(cdf, axis=0)
        block_start += BLOCK_SIZE
    # v * total rounded up to total: take the last token with weight (0 for an all-zero row).
    token = tl.where(token < 0, tl.maximum(last_nonzero, 0), token)
    return token.to(tl.int64)


def inverse_cdf_ref(
    weights: Tensor,  # [num_rows, vocab_size] float64, >= 0
    p: Tensor,  # [num_rows, vocab_size] float64, sampled instead where a row of weights is all zero
    uniforms: Tensor,  # [num_rows] float64 in [0, 1)
) -> Tensor:  # [num_rows] int64
    """Per row, the first t with weights[t] > 0 and cdf[t] > u * total, summed block by block like the kernels."""
    weights = torch.where(weights.any(dim=1, keepdim=True), weights, p)  # all zero (p == q, or rounding): use p
    num_rows, vocab_size = weights.shape
    block_size = block_size_for(vocab_size)
    num_blocks = triton.cdiv(vocab_size, block_size)
    padded = F.pad(weights, (0, num_blocks * block_size - vocab_size))
    block_cdf = padded.view(num_rows, num_blocks, block_size).cumsum(dim=2)
    # Sequential cumsum of block totals: running_{b+1} = running_b + total_b, as the kernel adds them.
    running = block_cdf[:, :, -1].cumsum(dim=1)  # [num_rows, num_blocks]
    exclusive = torch.cat([running.new_zeros(num_rows, 1), running[:, :-1]], dim=1)
    cdf = (exclusive[:, :, None] + block_cdf).view(num_rows, num_blocks * block_size)[:, :vocab_size]
    nonzero = weights > 0
    hit = (cdf > (uniforms * running[:, -1])[:, None]) & nonzero
    token_ids = torch.arange(vocab_size, device=weights.device)
    # u * total rounded up to total: the last token with weight (0 for an all-zero row).
    last_nonzero = torch.where(nonzero, token_ids, 0).amax(dim=1)
    return torch.where(hit.any(dim=1), hit.long().argmax(dim=1), last_nonzero)  # argmax: first maximum
