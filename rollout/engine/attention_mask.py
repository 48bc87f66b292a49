"""4D attention masks for a forward over slot rows: committed prefix + a block of new tokens with ancestor structure.

One builder serves left-padded prefill, chain verification (ancestors = causal) and token trees (ancestors = the
tree's ancestor-or-self relation), and builds a sliding window into the mask, because transformers hands a user
4D mask to every layer unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MaskSettings:
    """How a model on the slot cache takes its masks and its cache: one mask for every layer (with the model-wide
    sliding window) or one per layer type (each with its window); bool masks for sdpa, additive ones for eager
    attention; the forward keyword that takes the cache."""

    layer_windows: dict[str, int | None] | None  # per layer type its window; None: one mask for all layers
    uniform_window: int | None  # the window of the one mask (a model-wide window, Mistral's)
    additive_dtype: torch.dtype | None  # eager attention: additive masks of this dtype (None: bool, for sdpa)
    cache_keyword: str  # "past_key_values" or "cache_params"

    def build(self, prefix_lengths, write_positions, valid, positions, kv_len: int, ancestors) -> Tensor | dict:
        """The mask the model takes (`build_attention_mask`'s, per layer type where the model has several)."""
        masks = {}
        windows = self.layer_windows if self.layer_windows is not None else {None: self.uniform_window}
        for layer_type, window in windows.items():
            mask = build_attention_mask(prefix_lengths, write_positions, valid, positions, kv_len, ancestors, window)
            masks[layer_type] = mask if self.additive_dtype is None else to_additive(mask, self.additive_dtype)
        return masks if self.layer_windows is not None else masks[None]


def build_attention_mask(
    prefix_lengths: Tensor,  # [rows] committed tokens visible to every valid query
    write_positions: Tensor,  # [rows, S] slot position each block token is written at
    valid: Tensor,  # [rows, S] bool, False for padding tokens
    positions: Tensor,  # [rows, S] position id of each block token
    kv_len: int,
    ancestors: Tensor | None = None,  # [rows, S, S] bool: query s sees block token t; None = causal chain
    sliding_window: int | None = None,
) -> Tensor:
    """Return a bool mask `[rows, 1, S, kv_len]` (True = attend).

    A valid query sees the prefix keys `j < prefix_length` and the block tokens it descends from (itself included);
    with a sliding window, only keys whose position is within `sliding_window` of its own. A padding query sees key 0
    only: every query row needs one visible key, or softmax returns NaN. A chain (`ancestors` None) must be written
    right after its prefix, valid tokens at `prefix_length`, `prefix_length + 1`, ... (as decode and prefill write).
    """
    num_rows, num_block = write_positions.shape
    device = write_positions.device
    if ancestors is None and sliding_window is None:
        # a chain sits right after its prefix (decode) or starts at 0 (prefill): a query sees every key up to its own
        # slot, a padding query (its slot taken as 0) key 0. Row q of `stairs` is kv_len - q ones then zeros (a view
        # sliding over one [ones, zeros] vector): gathering rows costs a copy, where comparing every key costs ~15x
        last_key = torch.where(valid, write_positions, 0)
        ones_then_zeros = torch.arange(2 * kv_len, device=device) < kv_len
        stairs = ones_then_zeros.as_strided((kv_len, kv_len), (1, 1))  # [q, key]: key < kv_len - q
        mask = stairs.index_select(0, (kv_len - 1 - last_key).reshape(-1))
        return mask.view(num_rows, 1, num_block, kv_len)
    key_index = torch.arange(kv_len, device=device)
    padding_query = key_index == 0  # [kv_len]
    if ancestors is None:
        ancestors = torch.ones(num_block, num_block, dtype=torch.bool, device=device).tril().expand(num_rows, -1, -1)
    ancestors = ancestors & valid[:, None, :] & valid[:, :, None]
    prefix = key_index[None, None, :] < prefix_lengths[:, None, None]  # [rows, 1, kv_len]
    if sliding_window is not None:
        # transformers' convention: key visible iff q_pos - k_pos < window (prefix keys sit at their own position)
        prefix = prefix & (positions[:, :, None] - key_index[None, None, :] < sliding_window)
        ancestors = ancestors & (positions[:, :, None] - positions[:, None, :] < sliding_window)
    # scatter each query's visible block tokens to their key columns; add, then test > 0, so that the padding
    # tokens (pointed at column 0 with weight 0) cannot overwrite a real entry
    columns = torch.where(valid, write_positions, 0)[:, None, :].expand(-1, num_block, -1)
    block = torch.zeros(num_rows, num_block, kv_len, dtype=torch.int32, device=device)
    block.scatter_add_(2, columns, ancestors.to(torch.int32))
    mask = (block > 0) | prefix
    return torch.where(valid[:, :, None], mask, padding_query)[:, None]


def to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask -> additive float mask (0 / finfo.min): eager attention adds the mask to the scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
