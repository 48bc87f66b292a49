"""Paged attention: each row's new tokens attend over the row's blocks of a paged KV cache, without a mask tensor.

One layer's cache is a pool of fixed-size blocks (pages), `[num_blocks, block_size, num_kv_heads, head_dim]`. A row's
block table lists its blocks in order, so the row's cache position p lives at slot `table[p // block_size] * block_size
+ p % block_size`. A step feeds row r `num_queries[r]` new tokens, columns `[query_start[r], query_start[r] +
num_queries[r])` of a padded `[rows, S]` block, after its `cache_lens[r]` committed ones: new token j goes to cache
position `cache_lens[r] + j` (`rollout_kernels.store_kv` writes it there first), and query i sees the row's committed
keys and the new tokens it descends from: j <= i for a causal chain, or `ancestors[r, i, j]` for a token tree. Position
ids (for a sliding window: a key is visible iff `query position - key position < window`) are the cache position for
committed keys and `cache_lens[r] + depths[r, j]` for new token j (depth j for a chain). `depths` and `ancestors` are
indexed by new-token index (query i is column `query_start[r] + i`). Padding queries return zeros.

The kernel reads keys in tiles of `block_n` positions gathered through the block table (a tile spans several pages),
only over the range a query block may see (up to its last query for a chain; from its first query's window on), and
may split that range across programs (`rollout_kernels.attention_splits`).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

try:  # (not exported by triton.runtime: guarded, so that a Triton that moves it still imports the engine)
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - no such Triton tested
    InterpretedFunction = type("InterpretedFunction", (), {})  # nothing is one: kernels taken as compiled

from rollout_kernels._layout import check_kernel_device
from rollout_kernels.attention_splits import choose_num_splits, merge_splits, num_sms_of
from rollout_kernels.paged_mask import attend_gathered, visible_keys
from rollout_kernels.store_kv import check_pools


# Flash attention over a row's keys: per query block, running max m, sum l and output acc over key tiles:
# acc = acc * exp(m_old - m_new) + exp(s - m_new) @ v; out = acc / l. A masked score is -inf. A program serves one row,
# one KV head, one query block and one split of the block's key tiles: its query block stacks the row's queries of
# every query head sharing that KV head (index m = query * group + group member), so each key and value is read once
# per KV head, not once per query head. With several splits each program writes its own softmax (acc / l and
# m + log l) for `merge_splits`.
@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [rows, heads, S, head_dim], contiguous last dim
    k_pool_ptr,  # [num_blocks, PAGE_SIZE, num_kv_heads, head_dim] contiguous
    v_pool_ptr,
    block_tables_ptr,  # [rows, max_blocks] int64
    cache_lens_ptr,  # [rows] int64
    query_start_ptr,  # [rows] int64
    num_queries_ptr,  # [rows] int64
    depths_ptr,  # [rows, S] int64 (HAS_TREE)
    ancestors_ptr,  # [rows, S, S] int8 (HAS_TREE)
    out_ptr,  # [rows, S, heads, head_dim] contiguous, or with SPLIT [rows, S, heads, num_splits, head_dim]
    lse_ptr,  # [rows, S, heads, num_splits] (SPLIT)
    stride_qb,
    stride_qh,
    stride_qs,
    stride_bt,
    scale,  # float32: the softmax scale rounded to float32 (Triton passes a Python float as one)
    scale_rest,  # float32: what that rounding left out, added back where the scores are float64
    window,
    S,
    num_heads,
    num_kv_heads,
    head_dim,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    m_start = (tl.program_id(2) // num_splits) * BLOCK_M
    split = tl.program_id(2) % num_splits
    cache_len = tl.load(cache_lens_ptr + row)
    first = tl.load(query_start_ptr + row)
    num_queries = tl.load(num_queries_ptr + row)
    group = num_heads // num_kv_heads
    offs_m = m_start + tl.arange(0, BLOCK_M)  # query * group + group member
    query = offs_m // group  # query index among the row's new tokens
    head = kv_head * group + offs_m % group
    offs_d = tl.arange(0, BLOCK_D)
    q_valid = query < num_queries
    d_valid = offs_d < head_dim
    q_offsets = row * stride_qb + head[:, None] * stride_qh + (first + query)[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_valid[:, None] & d_valid[None, :], other=0.0)
    acc_dtype = tl.float64 if q.dtype == tl.float64 else tl.float32
    if UPCAST:
        q = q.to(acc_dtype)
    if acc_dtype == tl.float64:  # the scale to about 48 bits, not float32's 24
        scale = tl.cast(scale, tl.float64) + tl.cast(scale_rest, tl.float64)
    if HAS_TREE:
        q_depth = tl.load(depths_ptr + row * S + query, mask=q_valid, other=0)
    else:
        q_depth = query
    q_pos = cache_len + q_depth
    kv_len = cache_len + num_queries
    # the keys this query block may see, [lo, hi): none without a query; a chain's up to its last query; a tree's
    # new keys all (its order is free); with a window from its first query's, but a tree's new keys are at their
    # depth, not their index
    if HAS_TREE:
        hi = kv_len
    else:
        hi = cache_len + tl.max(tl.where(q_valid, query + 1, 0), axis=0)
    hi = tl.where(tl.max(q_valid.to(tl.int32), axis=0) > 0, hi, 0)
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.min(tl.where(q_valid, q_pos, kv_len), axis=0) - window + 1
        if HAS_TREE:
            lo = tl.minimum(lo, cache_len)
        lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
    num_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    m_i = tl.full((BLOCK_M,), float("-inf"), acc_dtype)
    l_i = tl.zeros((BLOCK_M,), acc_dtype)
    acc = tl.zeros((BLOCK_M, BLOCK_D), acc_dtype)
    for tile in range(tile_start, tile_end):
        offs_n = lo + tile * BLOCK_N + tl.arange(0, BLOCK_N)  # cache positions
        k_valid = offs_n < hi
        # a tile spans pages: each key's block through the table
        block = tl.load(block_tables_ptr + row * stride_bt + offs_n // PAGE_SIZE, mask=k_valid, other=0)
        slot = block * PAGE_SIZE + offs_n % PAGE_SIZE
        kv_offsets = (slot * num_kv_heads + kv_head)[:, None] * head_dim + offs_d[None, :]
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_pool_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_pool_ptr + kv_offsets, mask=kv_mask, other=0.0)
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
    cell = (row * S + first + query) * num_heads + head  # [BLOCK_M] (column, head) of each query
    if SPLIT:  # every split writes its cells, one that saw no key lse = -inf and zeros
        cell = cell * num_splits + split
        lse = m_i + tl.log(tl.where(l_i > 0, l_i, 1.0))
        tl.store(lse_ptr + cell, tl.where(l_i > 0, lse, float("-inf")), mask=q_valid)
    out_offsets = cell[:, None] * head_dim + offs_d[None, :]
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
    block_n: int | None = None,
    num_splits: int | None = None,
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
        block_n: keys per tile, a power of two >= 16, independent of the page size (None: 64; 16 in float64,
            which takes no tensor cores).
        num_splits: programs that share each row's keys (None: chosen from the shapes and the SM count, so that a
            captured graph replays the same choice; 1 off CUDA). A split left without keys costs one empty program.
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
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[1]
    group = num_heads // num_kv_heads
    if block_m is None:
        block_m = min(max(triton.next_power_of_2(group * S), 16), 64)
    if block_n is None:
        block_n = 16 if query.dtype == torch.float64 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n ({block_n}) must be a power of two >= 16")
    num_query_blocks = triton.cdiv(group * S, block_m)
    if num_splits is None:
        num_key_tiles = triton.cdiv(block_tables.shape[1] * page_size, block_n)
        num_splits = choose_num_splits(rows * num_kv_heads * num_query_blocks, num_key_tiles, num_sms_of(query.device))
    if num_splits < 1:
        raise ValueError(f"num_splits ({num_splits}) must be at least 1")
    # tl.dot needs 16 x 16 tiles and takes no float64 on a GPU: the reduction form serves the rest
    use_dot = query.dtype != torch.float64 and block_m >= 16
    upcast = use_dot and query.dtype != torch.float32 and isinstance(_paged_attention_kernel, InterpretedFunction)
    partial_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    if num_splits > 1:  # allocated here, so inside a graph's capture from its pool; only query cells are written
        target = torch.empty(rows, S, num_heads, num_splits, head_dim, dtype=partial_dtype, device=query.device)
        lse = torch.empty(rows, S, num_heads, num_splits, dtype=partial_dtype, device=query.device)
    else:
        target, lse = out, dummy
    grid = (rows, num_kv_heads, num_query_blocks * num_splits)
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
        target,
        lse,
        *query.stride()[:3],
        block_tables.stride(0),
        *_float32_parts(scale),
        sliding_window or 0,
        S,
        num_heads,
        num_kv_heads,
        head_dim,
        num_splits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        BLOCK_D=block_d,
        HAS_TREE=has_tree,
        HAS_WINDOW=sliding_window is not None,
        USE_DOT=use_dot,
        IEEE=query.dtype == torch.float32 or upcast,
        # the interpreter's tl.dot gets 16-bit floats wrong: there, they are computed in float32
        UPCAST=not use_dot or upcast,
        SPLIT=num_splits > 1,
    )
    if num_splits > 1:
        merge_splits(target, lse, query_start, num_queries, out)
    return out


def _float32_parts(value: float) -> tuple[float, float]:
    """`value` as float32 `(high, rest)`: high + rest is `value` to about 48 bits (a kernel's float arguments are
    float32)."""
    high = torch.tensor(value, dtype=torch.float32).item()
    return high, torch.tensor(value - high, dtype=torch.float32).item()


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
