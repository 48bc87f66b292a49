"""Paged attention: each row's new tokens attend over the row's blocks of a paged KV cache, without a mask tensor.

One layer's cache is a pool of fixed-size blocks, `[num_blocks, block_size, num_kv_heads, head_dim]`. A row's block
table lists its blocks in order, so the row's cache position p lives at slot `table[p // block_size] * block_size + p %
block_size`. A step feeds row r `num_queries[r]` new tokens, columns `[query_start[r], query_start[r] + num_queries[r])`
of a padded `[rows, S]` block, after its `cache_lens[r]` committed ones: new token j goes to cache position
`cache_lens[r] + j` (`rollout_kernels.store_kv` writes it there first), and query i sees the row's committed keys and
the new tokens it descends from: j <= i for a causal chain, or `ancestors[r, i, j]` for a token tree. Position ids (for
a sliding window: a key is visible iff `query position - key position < window`) are the cache position for committed
keys and `cache_lens[r] + depths[r, j]` for new token j (depth j for a chain). `depths` and `ancestors` are indexed by
new-token index (query i is column `query_start[r] + i`). Padding queries return zeros.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from rollout_kernels._layout import check_kernel_device
from rollout_kernels.store_kv import check_pools


# Flash attention over a row's blocks: per query block, running max m, sum l and output acc over key blocks (one
# cache block each): acc = acc * exp(m_old - m_new) + exp(s - m_new) @ v; out = acc / l. A masked score is -inf.
# A program serves one row and one KV head: its query block stacks the row's queries of every query head sharing
# that KV head (index m = group member * S + query), so each key and value is read once per KV head, not once per
# query head (a decode step's 4 query heads per KV head of a Llama-3-style model fill 4 of its 16 lanes).
@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [rows, heads, S, head_dim], contiguous last dim
    k_pool_ptr,  # [num_blocks, BLOCK_N, num_kv_heads, head_dim] contiguous
    v_pool_ptr,
    block_tables_ptr,  # [rows, max_blocks] int64
    cache_lens_ptr,  # [rows] int64
    query_start_ptr,  # [rows] int64
    num_queries_ptr,  # [rows] int64
    depths_ptr,  # [rows, S] int64 (HAS_TREE)
    ancestors_ptr,  # [rows, S, S] int8 (HAS_TREE)
    out_ptr,  # [rows, S, heads, head_dim] contiguous
    stride_qb,
    stride_qh,
    stride_qs,
    stride_bt,
    scale,
    window,
    S,
    num_heads,
    num_kv_heads,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    cache_len = tl.load(cache_lens_ptr + row)
    first = tl.load(query_start_ptr + row)
    num_queries = tl.load(num_queries_ptr + row)
    group = num_heads // num_kv_heads
    offs_m = m_start + tl.arange(0, BLOCK_M)  # group member * S + query
    query = offs_m % S  # query index among the row's new tokens
    head = kv_head * group + offs_m // S
    offs_d = tl.arange(0, BLOCK_D)
    q_valid = (query < num_queries) & (offs_m < group * S)
    d_valid = offs_d < head_dim
    q_offsets = row * stride_qb + head[:, None] * stride_qh + (first + query)[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_valid[:, None] & d_valid[None, :], other=0.0)
    acc_dtype = tl.float64 if q.dtype == tl.float64 else tl.float32
    if UPCAST:
        q = q.to(acc_dtype)
    if HAS_TREE:
        q_depth = tl.load(depths_ptr + row * S + query, mask=q_valid, other=0)
    else:
        q_depth = query
    q_pos = cache_len + q_depth
    m_i = tl.full((BLOCK_M,), float("-inf"), acc_dtype)
    l_i = tl.zeros((BLOCK_M,), acc_dtype)
    acc = tl.zeros((BLOCK_M, BLOCK_D), acc_dtype)
    kv_len = cache_len + num_queries
    # a query block that holds no query reads no key (limit 0)
    kv_limit = tl.where(tl.max(q_valid.to(tl.int32), axis=0) > 0, kv_len, 0)
    for start in range(0, kv_limit, BLOCK_N):
        block = tl.load(block_tables_ptr + row * stride_bt + start // BLOCK_N)
        offs_n = start + tl.arange(0, BLOCK_N)  # cache positions
        k_valid = offs_n < kv_len
        kv_offsets = ((block * BLOCK_N + tl.arange(0, BLOCK_N)) * num_kv_heads + kv_head)[:, None] * head_dim
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_pool_ptr + kv_offsets + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_pool_ptr + kv_offsets + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(acc_dtype)
            v = v.to(acc_dtype)
        if USE_DOT:  # 16-bit inputs on tensor cores, float32 exactly (ieee), accumulated in float32
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
        else:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        committed = offs_n < cache_len
        new = offs_n >= cache_len
        j = offs_n - cache_len
        if HAS_TREE:
            tree_mask = q_valid[:, None] & (new & k_valid)[None, :]
            sees = tl.load(ancestors_ptr + (row * S + query[:, None]) * S + j[None, :], mask=tree_mask, other=0) != 0
            k_depth = tl.load(depths_ptr + row * S + j, mask=new & k_valid, other=0)
        else:
            sees = j[None, :] <= query[:, None]
            k_depth = j
        visible = q_valid[:, None] & k_valid[None, :] & (committed[None, :] | sees)
        if HAS_WINDOW:
            k_pos = tl.where(new, cache_len + k_depth, offs_n)
            visible = visible & ((q_pos[:, None] - k_pos[None, :]) < window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: no nan from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offsets = ((row * S + first + query) * num_heads + head)[:, None] * head_dim + offs_d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None] & d_valid[None, :])


def paged_attention(
    query: Tensor,  # [rows, heads, S, head_dim]
    k_pool: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pool: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [rows, max_blocks] int64
    cache_lens: Tensor,  # [rows] int64
    query_start: Tensor,  # [rows] int64
    num_queries: Tensor,  # [rows] int64
    scale: float,
    sliding_window: int | None = None,
    depths: Tensor | None = None,  # [rows, S] int64
    ancestors: Tensor | None = None,  # [rows, S, S] bool
    block_m: int | None = None,
) -> Tensor:
    """Attention of each row's new tokens over its paged cache (their own keys stored already); see the module
    docstring for what a query sees. Returns `[rows, S, heads, head_dim]` (zeros at padding queries), the layout
    transformers' attention functions return.

    Args:
        query: after rotary embedding; only the last dimension must be contiguous.
        block_tables: each row's blocks, covering at least `cache_lens + num_queries` positions.
        depths, ancestors: a token tree (both or neither): node j's depth below the row's first new token and which
            new tokens query i sees (itself included).
        block_m: queries per program, counting each query head sharing a KV head (None: the group's queries
            rounded up to a power of two, 16 to 64).
    """
    _check_attention(query, k_pool, v_pool, block_tables, cache_lens, query_start, num_queries, depths, ancestors)
    check_kernel_device(_paged_attention_kernel, query.device, "paged_attention")
    rows, num_heads, S, head_dim = query.shape
    out = torch.zeros(rows, S, num_heads, head_dim, dtype=query.dtype, device=query.device)  # padding stays 0
    if rows * S == 0:
        return out
    has_tree = ancestors is not None
    dummy = cache_lens
    block_d = max(triton.next_power_of_2(head_dim), 16)
    num_kv_heads = k_pool.shape[2]
    if block_m is None:
        block_m = min(max(triton.next_power_of_2(num_heads // num_kv_heads * S), 16), 64)
    grid = (rows, num_kv_heads, triton.cdiv(num_heads // num_kv_heads * S, block_m))
    # tl.dot needs 16 x 16 tiles and takes no float64 on a GPU: the reduction form serves the rest
    use_dot = query.dtype != torch.float64 and k_pool.shape[1] >= 16 and block_m >= 16
    upcast = use_dot and query.dtype != torch.float32 and isinstance(_paged_attention_kernel, InterpretedFunction)
    _paged_attention_kernel[grid](
        query,
        k_pool,
        v_pool,
        block_tables,
        cache_lens,
        query_start,
        num_queries,
        depths.contiguous() if has_tree else dummy,
        ancestors.to(torch.int8).contiguous() if has_tree else dummy,
        out,
        *query.stride()[:3],
        block_tables.stride(0),
        float(scale),
        sliding_window or 0,
        S,
        num_heads,
        k_pool.shape[2],
        head_dim,
        BLOCK_M=block_m,
        BLOCK_N=k_pool.shape[1],
        BLOCK_D=block_d,
        HAS_TREE=has_tree,
        HAS_WINDOW=sliding_window is not None,
        USE_DOT=use_dot,
        IEEE=query.dtype == torch.float32 or upcast,
        # the interpreter's tl.dot gets 16-bit floats wrong: there, they are computed in float32
        UPCAST=not use_dot or upcast,
    )
    return out


def paged_attention_ref(
    query: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    cache_lens: Tensor,
    query_start: Tensor,
    num_queries: Tensor,
    scale: float,
    sliding_window: int | None = None,
    depths: Tensor | None = None,
    ancestors: Tensor | None = None,
) -> Tensor:
    """`paged_attention` in torch: each row's blocks gathered into one key sequence, a boolean mask, sdpa."""
    _check_attention(query, k_pool, v_pool, block_tables, cache_lens, query_start, num_queries, depths, ancestors)
    rows, num_heads, S, head_dim = query.shape
    out = torch.zeros(rows, S, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if rows * S == 0:
        return out
    kv_len = block_tables.shape[1] * k_pool.shape[1]
    mask = visible_keys(cache_lens, query_start, num_queries, kv_len, S, sliding_window, depths, ancestors)
    return attend_gathered(query, k_pool, v_pool, block_tables, mask, scale)


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


def _check_attention(query, k_pool, v_pool, block_tables, cache_lens, query_start, num_queries, depths, ancestors):
    check_pools(k_pool, v_pool)
    if query.dim() != 4 or query.shape[3] != k_pool.shape[3] or query.stride(3) != 1:
        raise ValueError(f"query must be [rows, heads, S, head_dim={k_pool.shape[3]}] with a contiguous last dim")
    if query.shape[1] % k_pool.shape[2]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of the cache's ({k_pool.shape[2]})")
    if query.dtype != k_pool.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the pool's {k_pool.dtype}")
    rows = query.shape[0]
    for name, t in (("cache_lens", cache_lens), ("query_start", query_start), ("num_queries", num_queries)):
        if t.shape != (rows,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 [rows={rows}] tensor, got {t.dtype} {tuple(t.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != rows or block_tables.dtype != torch.int64:
        raise ValueError(f"block_tables must be int64 [rows={rows}, max_blocks], got {block_tables.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables needs a contiguous last dimension")
    if (depths is None) != (ancestors is None):
        raise ValueError("depths and ancestors come together (a token tree) or not at all (a chain)")
    S = query.shape[2]
    if ancestors is not None and (ancestors.shape != (rows, S, S) or depths.shape != (rows, S)):
        raise ValueError(f"a tree needs depths [rows, S] and ancestors [rows, S, S], S = {S}")
