"""Attention in torch over a paged cache's blocks gathered row by row, under a boolean mask of the keys each query
sees: `paged_attention_ref`'s body, and the engine's attention where there is no Triton (a CPU)."""

import torch
from torch import Tensor


def visible_keys(
    cache_lens: Tensor,
    query_start: Tensor,
    num_queries: Tensor,
    kv_len: int,
    S: int,
    sliding_window: int | None = None,
    depths: Tensor | None = None,
    ancestors: Tensor | None = None,
) -> Tensor:
    """`[rows, S, kv_len]` bool: which cache positions the query in each column sees (padding columns: none)."""
    device = cache_lens.device
    column = torch.arange(S, device=device)
    index = column[None, :] - query_start[:, None]  # [rows, S] query index in its row
    q_valid = (index >= 0) & (index < num_queries[:, None])
    key = torch.arange(kv_len, device=device)
    j = key[None, :] - cache_lens[:, None]  # [rows, kv_len] new-token index of each key
    new = (j >= 0) & (j < num_queries[:, None])
    committed = j < 0
    if ancestors is None:
        sees = (j[:, None, :] <= index[:, :, None]) & new[:, None, :]
        q_depth, k_depth = index, j
    else:
        i = index.clamp(0, S - 1)
        sees = ancestors.gather(1, i[:, :, None].expand(-1, -1, S))  # [rows, S(query column), S(new index)]
        sees = sees.gather(2, j.clamp(0, S - 1)[:, None, :].expand(-1, S, -1)) & new[:, None, :]
        q_depth = depths.gather(1, i)
        k_depth = depths.gather(1, j.clamp(0, S - 1))
    mask = committed[:, None, :] | sees
    if sliding_window is not None:
        q_pos = cache_lens[:, None] + q_depth
        k_pos = torch.where(new, cache_lens[:, None] + k_depth, key[None, :])
        mask = mask & (q_pos[:, :, None] - k_pos[:, None, :] < sliding_window)
    return mask & q_valid[:, :, None]


def attend_gathered(
    query: Tensor,  # [rows, heads, S, head_dim]
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,  # [rows, max_blocks]
    mask: Tensor,  # [rows, S, max_blocks * block_size] bool
    scale: float,
) -> Tensor:
    """Attention over each row's blocks gathered in table order, under `mask`; `[rows, S, heads, head_dim]`, zeros
    where a query sees no key."""
    rows, num_heads, S, head_dim = query.shape
    num_kv_heads = k_pool.shape[2]
    # [rows, max_blocks, block_size, kv_heads, D] -> [rows, kv_heads, keys, D]
    keys = k_pool[block_tables].flatten(1, 2).transpose(1, 2)
    values = v_pool[block_tables].flatten(1, 2).transpose(1, 2)
    if num_heads != num_kv_heads:
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
    sees_any = mask.any(-1)  # [rows, S]
    safe = mask | ~sees_any[:, :, None]  # a query that sees nothing attends to everything, then is zeroed
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=safe[:, None], scale=scale)
    return out.transpose(1, 2).masked_fill(~sees_any[:, :, None, None], 0.0)
