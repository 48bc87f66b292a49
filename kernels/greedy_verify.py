"""Greedy verification of linear-chain drafts: accept while the draft equals the target argmax.

Flattened layout (vLLM's), shared with `rejection_sample`: row i owns drafts `[cu[i-1], cu[i])` of
`draft_token_ids` (cu[-1] = 0) and K_i + 1 target rows starting at `cu[i-1] + i`: one per draft,
then one for the bonus token.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

# The kernels loop over the vocabulary in blocks of at most this many tokens.
MAX_BLOCK_SIZE = 1024

# Fills each output row after its emitted tokens (vLLM's placeholder).
PLACEHOLDER_TOKEN_ID = -1

LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Greedy rule for a row with drafts d_0..d_{K-1} and target rows t_0..t_K:
#   n = first j with d_j != argmax(t_j), or K; emit d_0..d_{n-1} then argmax(t_n).
# As d_j == argmax(t_j) for j < n, the emitted tokens are argmax(t_j) for j = 0..n.
# Ties go to the lowest index (torch.argmax's first occurrence): a later block wins only with a
# strictly larger maximum, and inside a block the smallest index holding the maximum is taken.
@triton.jit
def _greedy_verify_kernel(
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    cu_num_draft_tokens_ptr,  # [num_rows] int64
    target_logits_ptr,  # [num_draft_tokens + num_rows, vocab_size]
    output_token_ids_ptr,  # [num_rows, max_num_draft_tokens + 1] int64, pre-filled with -1
    num_emitted_ptr,  # [num_rows] int64
    vocab_size,
    max_num_draft_tokens,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    draft_start = tl.load(cu_num_draft_tokens_ptr + row - 1, mask=row > 0, other=0)
    # Clamped so that a row with more drafts than promised cannot write past its output row.
    num_drafts = tl.minimum(tl.load(cu_num_draft_tokens_ptr + row) - draft_start, max_num_draft_tokens)
    target_start = draft_start + row
    out_ptr = output_token_ids_ptr + row.to(tl.int64) * (max_num_draft_tokens + 1)
    offsets = tl.arange(0, BLOCK_SIZE)

    pos = draft_start * 0  # int64 position in the row
    accepting = pos == 0
    while accepting:
        row_ptr = target_logits_ptr + (target_start + pos) * vocab_size
        best_value = tl.full((), float("-inf"), COMPUTE_DTYPE)
        best_index = pos * 0  # a row of -inf gives 0, as torch.argmax does
        for block_start in range(0, vocab_size, BLOCK_SIZE):
            cols = block_start + offsets
            in_vocab = cols < vocab_size
            logits = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf")).to(COMPUTE_DTYPE)
            block_max = tl.max(logits, axis=0)
            block_index = tl.min(tl.where((logits == block_max) & in_vocab, cols, vocab_size), axis=0)
            better = block_max > best_value
            best_value = tl.where(better, block_max, best_value)
            best_index = tl.where(better, block_index.to(tl.int64), best_index)
        tl.store(out_ptr + pos, best_index)
        draft = tl.load(draft_token_ids_ptr + draft_start + pos, mask=pos < num_drafts, other=-1)
        accepting = (pos < num_drafts) & (draft == best_index)
        pos += 1
    tl.store(num_emitted_ptr + row, pos)


def greedy_verify(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: Tensor,  # [num_rows] int64
    target_logits: Tensor,  # [num_draft_tokens + num_rows, vocab_size]
    max_num_draft_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Accept drafts while each equals the target argmax; emit the argmax at the first mismatch.

    Args:
        draft_token_ids: `[num_draft_tokens]` int64, all rows' drafts concatenated.
        cu_num_draft_tokens: `[num_rows]` int64, inclusive cumulative sum of per-row draft counts.
        target_logits: `[num_draft_tokens + num_rows, vocab_size]` float16, bfloat16, float32 or
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
        COMPUTE_DTYPE=tl.float64 if target_logits.dtype == torch.float64 else tl.float32,
        BLOCK_SIZE=block_size_for(vocab_size),
    )
    return output_token_ids, num_emitted


def greedy_verify_ref(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: Tensor,  # [num_rows] int64
    target_logits: Tensor,  # [num_draft_tokens + num_rows, vocab_size]
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


# ---------------------------------------------------------------------------------------------
# Helpers shared with rejection_sample.py (and the tree-verification ops to come).


def block_size_for(vocab_size: int) -> int:
    """Vocabulary block size of the kernels; references that mirror their sum order use it too."""
    return min(triton.next_power_of_2(vocab_size), MAX_BLOCK_SIZE)


def empty_outputs(num_rows: int, max_num_draft_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """`output_token_ids` `[num_rows, max + 1]` filled with -1 and an uninitialised `num_emitted` `[num_rows]`."""
    output_token_ids = torch.full(
        (num_rows, max_num_draft_tokens + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    return output_token_ids, torch.empty(num_rows, dtype=torch.int64, device=device)


def check_kernel_device(kernel: object, device: torch.device, op_name: str) -> None:
    """`@triton.jit` picks the interpreter at import time, so CPU tensors need TRITON_INTERPRET=1 set before."""
    if device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"{op_name} got CPU tensors but its Triton kernel was built for a GPU: set TRITON_INTERPRET=1 "
            f"before `kernels` is first imported, or call {op_name}_ref"
        )


def check_tensor(tensor: object, name: str, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    """Raise ValueError/TypeError unless `tensor` is a contiguous tensor of `ndim` dims, a dtype in `dtypes`."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected one of: {allowed}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(tensor.shape)}) must be contiguous: call .contiguous() first")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} like draft_token_ids")


def check_draft_layout(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, max_num_draft_tokens: int) -> int:
    """Check the flattened draft arguments; return num_rows. Only host-side checks: no device sync."""
    if not isinstance(draft_token_ids, Tensor):
        raise TypeError(f"draft_token_ids must be a torch.Tensor, got {type(draft_token_ids).__name__}")
    device = draft_token_ids.device
    check_tensor(draft_token_ids, "draft_token_ids", 1, (torch.int64,), device)
    check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", 1, (torch.int64,), device)
    if isinstance(max_num_draft_tokens, bool) or not isinstance(max_num_draft_tokens, int):
        raise TypeError(f"max_num_draft_tokens must be a python int, got {type(max_num_draft_tokens).__name__}")
    if max_num_draft_tokens < 0:
        raise ValueError(f"max_num_draft_tokens must be >= 0, got {max_num_draft_tokens}")
    return cu_num_draft_tokens.shape[0]


def check_target_rows(
    target: Tensor, name: str, draft_token_ids: Tensor, num_rows: int, dtypes: tuple[torch.dtype, ...]
) -> int:
    """Check a `[num_draft_tokens + num_rows, vocab_size]` target tensor; return vocab_size."""
    check_tensor(target, name, 2, dtypes, draft_token_ids.device)
    num_target_rows = draft_token_ids.shape[0] + num_rows
    if target.shape[0] != num_target_rows:
        raise ValueError(
            f"{name} has {target.shape[0]} rows, expected num_draft_tokens + num_rows = "
            f"{draft_token_ids.shape[0]} + {num_rows} = {num_target_rows} (each row's drafts plus a bonus row)"
        )
    if target.shape[1] == 0:
        raise ValueError(f"{name} has vocab_size 0 (shape {tuple(target.shape)}), expected at least 1")
    return target.shape[1]


def draft_row_ranges(
    draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, max_num_draft_tokens: int
) -> tuple[Tensor, Tensor]:
    """Per-row `(draft_start, num_drafts)`, each `[num_rows]`, after the checks that need a device sync.

    References only: the kernels trust `cu_num_draft_tokens` (and clamp rows to max_num_draft_tokens).
    """
    num_draft_tokens = draft_token_ids.shape[0]
    num_rows = cu_num_draft_tokens.shape[0]
    draft_start = torch.cat([cu_num_draft_tokens.new_zeros(1), cu_num_draft_tokens[:-1]])[:num_rows]
    num_drafts = cu_num_draft_tokens - draft_start
    if num_rows == 0:
        return draft_start, num_drafts
    if int(cu_num_draft_tokens[-1]) != num_draft_tokens:
        raise ValueError(
            f"cu_num_draft_tokens[-1] is {int(cu_num_draft_tokens[-1])}, expected "
            f"len(draft_token_ids) = {num_draft_tokens}"
        )
    if bool((num_drafts < 0).any()):
        raise ValueError(f"cu_num_draft_tokens must be non-decreasing, got {cu_num_draft_tokens.tolist()}")
    if int(num_drafts.max()) > max_num_draft_tokens:
        raise ValueError(
            f"a row has {int(num_drafts.max())} drafts, more than max_num_draft_tokens ({max_num_draft_tokens})"
        )
    return draft_start, num_drafts


def padded_drafts(
    draft_token_ids: Tensor,  # [num_draft_tokens]
    draft_start: Tensor,  # [num_rows]
    num_drafts: Tensor,  # [num_rows]
    max_num_draft_tokens: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Drafts as `[num_rows, max + 1]` with -1 after each row's drafts, and each draft's (row, position)."""
    num_rows = draft_start.shape[0]
    device = draft_token_ids.device
    draft_row = torch.repeat_interleave(torch.arange(num_rows, device=device), num_drafts)  # [num_draft_tokens]
    draft_pos = torch.arange(draft_token_ids.shape[0], device=device) - draft_start[draft_row]
    drafts = torch.full((num_rows, max_num_draft_tokens + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    drafts[draft_row, draft_pos] = draft_token_ids
    return drafts, draft_row, draft_pos
