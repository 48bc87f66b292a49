"""Rejection sampling of linear-chain drafts (Leviathan et al. 2023): lossless w.r.t. the target.

Layout as in `greedy_verify`. Probabilities come in already processed (temperature, top-k, top-p).
All randomness comes in as float64 uniforms, so the kernel and `rejection_sample_ref` return the same
tokens for the same uniforms.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import (
    PLACEHOLDER_TOKEN_ID,
    PROB_DTYPES,
    block_size_for,
    check_draft_layout,
    check_kernel_device,
    check_target_rows,
    check_tensor,
    draft_row_ranges,
    empty_outputs,
    padded_drafts,
)
from rollout_kernels._triton_common import _chain_row, _inverse_cdf, _weights_total, inverse_cdf_ref


@triton.jit
def _sampling_weights(
    cols,  # [BLOCK_SIZE] int32 token ids of this block
    target_row_ptr,  # [vocab_size] p at the sampled position
    draft_row_ptr,  # [vocab_size] q at the sampled position, read below q_limit only
    vocab_size,
    q_limit,  # vocab_size to subtract q, 0 to sample from p
    excluded_token,  # without draft probs: the rejected draft, removed from p (-1 for none)
    HAS_DRAFT_PROBS: tl.constexpr,
):
    # Limits rather than `mask & flag`: the interpreter turns a block & scalar bool into int8.
    p = tl.load(target_row_ptr + cols, mask=cols < vocab_size, other=0.0).to(tl.float64)
    if HAS_DRAFT_PROBS:
        q = tl.load(draft_row_ptr + cols, mask=cols < q_limit, other=0.0).to(tl.float64)
        return tl.maximum(p - q, 0.0)
    else:
        # q is one-hot at the draft: max(p - q, 0) is p with the draft removed.
        return tl.where(cols == excluded_token, 0.0, p)


# Row with drafts x_j ~ q_j and target distributions p_j (j = 0..K, p_K for the bonus token):
#   accept x_j iff u_j * q_j(x_j) < p_j(x_j)   (u_j < min(1, p/q) without a division; q = 1 without
#   draft_probs, and q(x) = 0 accepts iff p(x) > 0); stop at the first rejection n, or n = K.
#   Then sample the token at position n from w = max(p_n - q_n, 0) (p_K at the bonus position; p_n
#   again when w is all zero) by inverse CDF: the first t with w_t > 0 and cumsum(w)_t > v * sum(w),
#   accumulated in float64 block by block (running total + in-block cumsum), like the reference.
@triton.jit
def _rejection_sample_kernel(
    draft_token_ids_ptr,  # [total_drafts] int64
    cu_num_draft_tokens_ptr,  # [num_rows] int64
    draft_probs_ptr,  # [total_drafts, vocab_size], unused without HAS_DRAFT_PROBS
    target_probs_ptr,  # [total_drafts + num_rows, vocab_size]
    accept_uniforms_ptr,  # [total_drafts] float64
    sample_uniforms_ptr,  # [num_rows] float64
    output_token_ids_ptr,  # [num_rows, max_num_draft_tokens + 1] int64, pre-filled with -1
    num_emitted_ptr,  # [num_rows] int64
    vocab_size,
    max_num_draft_tokens,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row, draft_start, num_drafts, target_start, out_ptr = _chain_row(
        cu_num_draft_tokens_ptr, output_token_ids_ptr, max_num_draft_tokens
    )
    pos = draft_start * 0  # int64: accepted drafts so far
    accepting = pos < num_drafts
    while accepting:
        draft = tl.load(draft_token_ids_ptr + draft_start + pos)
        # An out-of-vocabulary draft reads p = 0 (rejected) instead of out of bounds.
        valid = (draft >= 0) & (draft < vocab_size)
        p = tl.load(target_probs_ptr + (target_start + pos) * vocab_size + draft, mask=valid, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + (draft_start + pos) * vocab_size + draft, mask=valid, other=0.0)
        else:
            q = tl.full((), 1.0, tl.float64)
        u = tl.load(accept_uniforms_ptr + draft_start + pos)
        accepted = u * q.to(tl.float64) < p.to(tl.float64)
        tl.store(out_ptr + pos, draft, mask=accepted)
        pos += accepted.to(tl.int64)
        accepting = accepted & (pos < num_drafts)

    # One sample at position pos: the recovered token after a rejection, else the bonus token.
    residual = pos < num_drafts
    q_limit = tl.where(residual, vocab_size, 0)
    excluded_token = tl.load(draft_token_ids_ptr + draft_start + pos, mask=residual, other=-1)
    target_row_ptr = target_probs_ptr + (target_start + pos) * vocab_size
    draft_row_ptr = draft_probs_ptr + (draft_start + pos) * vocab_size
    weights_args = (target_row_ptr, draft_row_ptr, vocab_size, q_limit, excluded_token)
    total, last_nonzero = _weights_total(_sampling_weights, weights_args, HAS_DRAFT_PROBS, vocab_size, BLOCK_SIZE)
    if residual & (total == 0):  # p == q: fall back to p
        q_limit = q_limit * 0
        excluded_token = excluded_token * 0 - 1
        weights_args = (target_row_ptr, draft_row_ptr, vocab_size, q_limit, excluded_token)
        total, last_nonzero = _weights_total(_sampling_weights, weights_args, HAS_DRAFT_PROBS, vocab_size, BLOCK_SIZE)
    threshold = tl.load(sample_uniforms_ptr + row) * total
    token = _inverse_cdf(
        _sampling_weights, weights_args, HAS_DRAFT_PROBS, vocab_size, threshold, last_nonzero, BLOCK_SIZE
    )
    tl.store(out_ptr + pos, token)
    tl.store(num_emitted_ptr + row, pos + 1)


def rejection_sample(
    draft_token_ids: Tensor,  # [total_drafts] int64
    cu_num_draft_tokens: Tensor,  # [num_rows] int64
    draft_probs: Tensor | None,  # [total_drafts, vocab_size] float32/float64, None for n-gram drafts
    target_probs: Tensor,  # [total_drafts + num_rows, vocab_size] float32/float64
    accept_uniforms: Tensor,  # [total_drafts] float64
    sample_uniforms: Tensor,  # [num_rows] float64
    max_num_draft_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Verify drafts by rejection sampling so that emitted tokens follow the target distribution.

    Args:
        draft_token_ids: `[total_drafts]` int64, all rows' drafts concatenated.
        cu_num_draft_tokens: `[num_rows]` int64, inclusive cumulative sum of per-row draft counts.
        draft_probs: `[total_drafts, vocab_size]` float32/float64 draft distributions q, or None
            when the drafts have none (n-gram: q is one-hot at the draft).
        target_probs: `[total_drafts + num_rows, vocab_size]` float32/float64 target
            distributions p; row i's rows start at `cu[i-1] + i`, the last one for the bonus token.
        accept_uniforms: `[total_drafts]` float64 in [0, 1), one per draft (float64: float32
            uniforms can be exactly 0).
        sample_uniforms: `[num_rows]` float64 in [0, 1), one per row for its recovered or bonus token.
        max_num_draft_tokens: at least every row's draft count (a host int: no device sync).

    Returns:
        output_token_ids: `[num_rows, max_num_draft_tokens + 1]` int64: accepted drafts, then the
            recovered or bonus token, then -1.
        num_emitted: `[num_rows]` int64, accepted drafts + 1.
    """
    num_rows, vocab_size = _check_inputs(
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        accept_uniforms,
        sample_uniforms,
        max_num_draft_tokens,
    )
    check_kernel_device(_rejection_sample_kernel, draft_token_ids.device, "rejection_sample")
    output_token_ids, num_emitted = empty_outputs(num_rows, max_num_draft_tokens, draft_token_ids.device)
    if num_rows == 0:
        return output_token_ids, num_emitted
    _rejection_sample_kernel[(num_rows,)](
        draft_token_ids,
        cu_num_draft_tokens,
        target_probs if draft_probs is None else draft_probs,  # a placeholder pointer when None
        target_probs,
        accept_uniforms,
        sample_uniforms,
        output_token_ids,
        num_emitted,
        vocab_size,
        max_num_draft_tokens,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_SIZE=block_size_for(vocab_size),
    )
    return output_token_ids, num_emitted


def rejection_sample_ref(
    draft_token_ids: Tensor,  # [total_drafts] int64
    cu_num_draft_tokens: Tensor,  # [num_rows] int64
    draft_probs: Tensor | None,  # [total_drafts, vocab_size], None for n-gram drafts
    target_probs: Tensor,  # [total_drafts + num_rows, vocab_size]
    accept_uniforms: Tensor,  # [total_drafts] float64
    sample_uniforms: Tensor,  # [num_rows] float64
    max_num_draft_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Pure-torch `rejection_sample`: same arguments and outputs, runs on any device."""
    num_rows, vocab_size = _check_inputs(
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        accept_uniforms,
        sample_uniforms,
        max_num_draft_tokens,
    )
    draft_start, num_drafts = draft_row_ranges(draft_token_ids, cu_num_draft_tokens, max_num_draft_tokens)
    if not bool(((draft_token_ids >= 0) & (draft_token_ids < vocab_size)).all()):
        raise ValueError(f"draft_token_ids must lie in [0, vocab_size = {vocab_size})")
    device = draft_token_ids.device
    rows = torch.arange(num_rows, device=device)
    target_start = draft_start + rows  # [num_rows]

    # Accept test per draft, laid out like the drafts as [num_rows, max + 1] (False past each row's drafts).
    drafts, draft_row, draft_pos = padded_drafts(draft_token_ids, draft_start, num_drafts, max_num_draft_tokens)
    p = target_probs[target_start[draft_row] + draft_pos, draft_token_ids].double()
    q = 1.0 if draft_probs is None else draft_probs.gather(1, draft_token_ids[:, None]).squeeze(1).double()
    accepted = torch.zeros(drafts.shape, dtype=torch.bool, device=device)
    accepted[draft_row, draft_pos] = accept_uniforms * q < p
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_rows]

    # One sample per row at position num_accepted: from the residual after a rejection, else the bonus p.
    p = target_probs[target_start + num_accepted].double()  # [num_rows, vocab_size]
    weights = p.clone()
    residual_rows = (num_accepted < num_drafts).nonzero().squeeze(1)
    rejected = draft_start[residual_rows] + num_accepted[residual_rows]  # index into the drafts
    if draft_probs is None:  # q is one-hot at the draft: max(p - q, 0) is p with the draft removed
        weights[residual_rows, draft_token_ids[rejected]] = 0.0
    else:
        weights[residual_rows] = (p[residual_rows] - draft_probs[rejected].double()).clamp_min(0.0)
    tokens = inverse_cdf_ref(weights, p, sample_uniforms)  # p where the residual is all zero (p == q)

    positions = torch.arange(max_num_draft_tokens + 1, device=device)
    output_token_ids = torch.where(positions < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    output_token_ids[rows, num_accepted] = tokens
    return output_token_ids, num_accepted + 1


def _check_inputs(
    draft_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    accept_uniforms: Tensor,
    sample_uniforms: Tensor,
    max_num_draft_tokens: int,
) -> tuple[int, int]:
    """Host-side checks (no device sync); return (num_rows, vocab_size)."""
    num_rows = check_draft_layout(draft_token_ids, cu_num_draft_tokens, max_num_draft_tokens)
    vocab_size = check_target_rows(target_probs, "target_probs", draft_token_ids, num_rows, PROB_DTYPES)
    total_drafts = draft_token_ids.shape[0]
    device = draft_token_ids.device
    if draft_probs is not None:
        check_tensor(draft_probs, "draft_probs", 2, PROB_DTYPES, device)
        if tuple(draft_probs.shape) != (total_drafts, vocab_size):
            raise ValueError(
                f"draft_probs has shape {tuple(draft_probs.shape)}, expected (total_drafts, vocab_size) = "
                f"({total_drafts}, {vocab_size}) to match draft_token_ids and target_probs"
            )
    for name, uniforms, expected in (
        ("accept_uniforms", accept_uniforms, total_drafts),
        ("sample_uniforms", sample_uniforms, num_rows),
    ):
        check_tensor(uniforms, name, 1, (torch.float64,), device)
        if uniforms.shape[0] != expected:
            raise ValueError(f"{name} has {uniforms.shape[0]} entries, expected {expected}")
    return num_rows, vocab_size
