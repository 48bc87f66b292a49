"""Greedy verification of linear-chain drafts: accept while the draft equals the target argmax.

Flattened layout (vLLM's), shared with `rejection_sample`: row i owns drafts `[cu[i-1], cu[i])` of
`draft_token_ids` (cu[-1] = 0) and K_i + 1 target rows starting at `cu[i-1] + i`: one per draft,
then one for the bonus token.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import (
    LOGIT_DTYPES,
    PLACEHOLDER_TOKEN_ID,
    block_size_for,
    check_draft_layout,
    check_kernel_device,
    check_target_rows,
    draft_row_ranges,
    empty_outputs,
    padded_drafts,
)
from rollout_kernels._triton_common import _chain_row, _row_argmax, compute_dtype_for


# Greedy rule for a row with drafts d_0..d_{K-1} and target rows t_0..t_K:
#   n = first j with d_j != argmax(t_j), or K; emit d_0..d_{n-1} then argmax(t_n).
# As d_j == argmax(t_j) for j < n, the emitted tokens are argmax(t_j) for j = 0..n.
# Ties go to the lowest index (torch.argmax's first occurrence): see `_row_argmax`.
@triton.jit
def _greedy_verify_kernel(
    draft_token_ids_ptr,  # [total_drafts] int64
    cu_num_draft_tokens_ptr,  # [num_rows] int64
    target_logits_ptr,  # [total_drafts + num_rows, vocab_size]
    output_token_ids_ptr,  # [num_rows, max_num_draft_tokens + 1] int64, pre-filled with -1
    num_emitted_ptr,  # [num_rows] int64
    vocab_size,
    max_num_draft_tokens,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row, draft_start, num_drafts, target_start, out_ptr = _chain_row(
        cu_num_draft_tokens_ptr, output_token_ids_ptr, max_num_draft_tokens
    )
    pos = draft_start * 0  # int64 position in the row
    accepting = pos == 0
    while accepting:
        best_index = _row_argmax(
            target_logits_ptr + (target_start + pos) * vocab_size, vocab_size, COMPUTE_DTYPE, BLOCK_SIZE
        )
        tl.store(out_ptr + pos, best_index)
        draft = tl.load(draft_token_ids_ptr + draft_start + pos, mask=pos < num_drafts, other=-1)
        accepting = (pos < num_drafts) & (draft == best_index)
        pos += 1
    tl.store(num_emitted_ptr + row, pos)


def greedy_verify(
    draft_token_ids: Tensor,  # [total_drafts] int64
    cu_num_draft_tokens: Tensor,  # [num_rows] int64
    target_logits: Tensor,  # [total_drafts + num_rows, vocab_size]
    max_num_draft_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Accept drafts while each equals the target argmax; emit the argmax at the first mismatch.

    Args:
        draft_token_ids: `[total_drafts]` int64, all rows' drafts concatenated.
        cu_num_draft_tokens: `[num_rows]` int64, inclusive cumulative sum of per-row draft counts.
        target_logits: `[total_drafts + num_rows, vocab_size]` float16, bfloat16, float32 or
            float64; row i's target rows start at `cu[i-1] + i`, the last one gives the bonus token.
        max_num_draft_tokens: at least every row's draft count (a host int: no device sync).

    Returns:
        output_token_ids: `[num_rows, max_num_draft_tokens + 1]` int64: accepted drafts, then the
            recovered or bonus token, then -1.
        num_emitted: `[num_rows]` int64, accepted drafts + 1.
    """
    num_rows = check_draft_layout(draft_token_ids, cu_num_draft_tokens, max_num_draft_tokens)
    vocab_size = check_target_rows(target_logits, "target_logits", draft_token_ids, num_rows, LOGIT_DTYPES)
    check_kernel_device(_greedy_verify_kernel, draft_token_ids.device, "greedy_verify")
    output_token_ids, num_emitted = empty_outputs(num_rows, max_num_draft_tokens, draft_token_ids.device)
    if num_rows == 0:
        return output_token_ids, num_emitted
    _greedy_verify_kernel[(num_rows,)](
        draft_token_ids,
        cu_num_draft_tokens,
        target_logits,
        output_token_ids,
        num_emitted,
        vocab_size,
        max_num_draft_tokens,
        COMPUTE_DTYPE=compute_dtype_for(target_logits.dtype),
        BLOCK_SIZE=block_size_for(vocab_size),
    )
    return output_token_ids, num_emitted


def greedy_verify_ref(
    draft_token_ids: Tensor,  # [total_drafts] int64
    cu_num_draft_tokens: Tensor,  # [num_rows] int64
    target_logits: Tensor,  # [total_drafts + num_rows, vocab_size]
    max_num_draft_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Pure-torch `greedy_verify`: same arguments and outputs, runs on any device."""
    num_rows = check_draft_layout(draft_token_ids, cu_num_draft_tokens, max_num_draft_tokens)
    check_target_rows(target_logits, "target_logits", draft_token_ids, num_rows, LOGIT_DTYPES)
    draft_start, num_drafts = draft_row_ranges(draft_token_ids, cu_num_draft_tokens, max_num_draft_tokens)
    drafts, _, _ = padded_drafts(draft_token_ids, draft_start, num_drafts, max_num_draft_tokens)
    # Position j of row i is checked by target row draft_start[i] + i + j.
    positions = torch.arange(max_num_draft_tokens + 1, device=draft_token_ids.device)
    target_start = draft_start + torch.arange(num_rows, device=draft_token_ids.device)
    target_index = (target_start[:, None] + positions).clamp(max=target_logits.shape[0] - 1)
    target_argmax = target_logits.argmax(dim=-1)[target_index]  # [num_rows, max + 1]
    accepted = drafts == target_argmax  # the -1 padding never matches
    num_emitted = accepted.long().cumprod(dim=1).sum(dim=1) + 1
    emitted = positions < num_emitted[:, None]
    return torch.where(emitted, target_argmax, PLACEHOLDER_TOKEN_ID), num_emitted
