"""Paged KV kernels against their torch references and against attention written out row by row: chains of new
tokens after a cached prefix (decode, verification), left-padded prefills, token trees, sliding windows, grouped
heads, odd head sizes, blocks scattered through the pool in any order."""

import random

import pytest
import torch

from rollout_kernels import paged_attention, paged_attention_ref, store_kv_, store_kv_ref_

torch.set_num_threads(1)

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def random_tree(num_nodes: int, rng: random.Random) -> tuple[list[int], list[list[bool]]]:
    """(depths, ancestors) of a random tree whose node 0 is the root and whose parents precede their children."""
    parents = [-1] + [rng.randrange(0, j) for j in range(1, num_nodes)]
    depths, ancestors = [], []
    for j, parent in enumerate(parents):
        depths.append(0 if parent < 0 else depths[parent] + 1)
        row = list(ancestors[parent]) if parent >= 0 else [False] * num_nodes
        row[j] = True
        ancestors.append(row)
    return depths, ancestors


def make_case(
    rng: random.Random,
    num_rows: int,
    S: int,
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    prefill: bool = False,
    tree: bool = False,
):
    """Random rows: committed keys and new tokens placed in a pool through shuffled block tables."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    cache_lens = [0 if prefill else rng.randrange(0, 40) for _ in range(num_rows)]
    num_queries = [rng.randrange(0 if r == 0 else 1, S + 1) for r in range(num_rows)]  # row 0 may have none
    query_start = [S - n if prefill else 0 for n in num_queries]
    lengths = [c + n for c, n in zip(cache_lens, num_queries)]
    max_blocks = max(-(-length // block_size) for length in lengths) + 1
    num_blocks = num_rows * max_blocks + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables = torch.tensor(order[: num_rows * max_blocks]).view(num_rows, max_blocks)
    k_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(num_rows, S, num_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)  # a view, as HF
    depths = ancestors = None
    if tree:
        depths = torch.zeros(num_rows, S, dtype=torch.long)
        ancestors = torch.zeros(num_rows, S, S, dtype=torch.bool)
        for r, n in enumerate(num_queries):
            if n:
                d, a = random_tree(n, rng)
                depths[r, :n] = torch.tensor(d)
                ancestors[r, :n, :n] = torch.tensor(a)
    longs = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return dict(
        query=query,
        k_pool=k_pool,
        v_pool=v_pool,
        block_tables=tables,
        cache_lens=longs(cache_lens),
        query_start=longs(query_start),
        num_queries=longs(num_queries),
        depths=depths,
        ancestors=ancestors,
    )


def written_out(case: dict, scale: float, window: int | None) -> torch.Tensor:
    """Attention by its definition, one query at a time, in float64."""
    q, tables = case["query"].double(), case["block_tables"]
    k_pool, v_pool = case["k_pool"].double(), case["v_pool"].double()
    rows, num_heads, S, D = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    out = torch.zeros(rows, S, num_heads, D, dtype=torch.float64)
    for r in range(rows):
        cache_len, first, n = (int(case[k][r]) for k in ("cache_lens", "query_start", "num_queries"))

        def depth(j: int, r: int = r) -> int:
            return int(case["depths"][r, j]) if case["depths"] is not None else j

        def slot(p: int, r: int = r) -> tuple[int, int]:
            return int(tables[r, p // block_size]), p % block_size

        for i in range(n):
            visible = []
            for p in range(cache_len + n):
                j = p - cache_len
                if j < 0:
                    seen, key_pos = True, p
                else:
                    seen = bool(case["ancestors"][r, i, j]) if case["ancestors"] is not None else j <= i
                    key_pos = cache_len + depth(j)
                if seen and (window is None or cache_len + depth(i) - key_pos < window):
                    visible.append(p)
            keys = torch.stack([k_pool[slot(p)] for p in visible])  # [keys, kv_heads, D]
            values = torch.stack([v_pool[slot(p)] for p in visible])
            for h in range(num_heads):
                kv = h // (num_heads // num_kv_heads)
                weights = torch.softmax(keys[:, kv] @ q[r, h, first + i] * scale, dim=0)
                out[r, first + i, h] = weights @ values[:, kv]
    return out


CASES = [
    # name, rows, S, (heads, kv heads), head_dim, block size, prefill, tree, window
    ("decode", 5, 1, (4, 2), 16, 4, False, False, None),
    ("verify", 6, 5, (4, 4), 16, 16, False, False, None),
    ("verify-gqa-odd-dim", 4, 4, (6, 2), 24, 8, False, False, None),
    ("prefill-left-padded", 4, 11, (4, 2), 32, 4, True, False, None),
    ("tree", 5, 6, (4, 2), 16, 4, False, True, None),
    ("window", 5, 4, (4, 2), 16, 4, False, False, 5),
    ("tree-window", 4, 6, (2, 1), 16, 16, False, True, 4),
    ("prefill-window", 3, 13, (2, 2), 16, 4, True, False, 6),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_attention_is_attention_by_its_definition(case, dtype):
    name, rows, S, heads, head_dim, block_size, prefill, tree, window = case
    inputs = make_case(random.Random(name), rows, S, heads, head_dim, block_size, dtype, prefill, tree)
    scale = head_dim**-0.5
    expected = written_out(inputs, scale, window)
    for op in (paged_attention_ref, paged_attention):
        out = op(**inputs, scale=scale, sliding_window=window)
        assert out.shape == (rows, S, heads[0], head_dim) and out.dtype == dtype
        assert torch.allclose(out.double(), expected, atol=TOLERANCE[dtype], rtol=0), (op.__name__, name)


def test_paged_attention_in_bfloat16_and_with_large_query_blocks():
    inputs = make_case(random.Random(7), 3, 20, (4, 2), 32, 16, torch.bfloat16, prefill=True)
    expected = written_out(inputs, 0.2, None)
    for out in (paged_attention_ref(**inputs, scale=0.2), paged_attention(**inputs, scale=0.2, block_m=32)):
        assert (out.double() - expected).abs().max() < TOLERANCE[torch.bfloat16]


def test_padding_queries_are_zero_and_a_row_without_queries_reads_nothing():
    inputs = make_case(random.Random(3), 4, 5, (2, 2), 16, 4, torch.float64, prefill=True)
    inputs["num_queries"][0] = 0
    inputs["query_start"][0] = 5
    for op in (paged_attention_ref, paged_attention):
        out = op(**inputs, scale=0.25)
        for r in range(4):
            first = int(inputs["query_start"][r])
            assert not out[r, :first].any()
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_each_token_at_its_slot_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(0)
    rows, heads, S, head_dim, num_blocks, block_size = 3, 2, 4, 24, 6, 4
    key = torch.randn(rows, S, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)  # a view, as HF passes it
    value = torch.randn(rows, S, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: rows * S].view(rows, S)
    slots[1, 2:] = -1
    pools = []
    for op in (store_kv_ref_, store_kv_):
        k_pool = torch.zeros(num_blocks, block_size, heads, head_dim, dtype=dtype)
        v_pool = torch.zeros_like(k_pool)
        op(k_pool, v_pool, key, value, slots.contiguous())
        pools.append((k_pool, v_pool))
        flat_k = k_pool.view(-1, heads, head_dim)
        for r in range(rows):
            for s in range(S):
                if slots[r, s] >= 0:
                    assert torch.equal(flat_k[slots[r, s]], key[r, :, s])
        assert int((flat_k != 0).any(-1).any(-1).sum()) == rows * S - 2  # nothing written for the padding
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])


def test_bad_inputs_are_refused_with_the_reason():
    inputs = make_case(random.Random(1), 2, 3, (4, 2), 16, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(**{**inputs, "query": inputs["query"][:, :3]}, scale=1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(**{**inputs, "query": inputs["query"].double()}, scale=1.0)
    with pytest.raises(ValueError, match="come together"):
        paged_attention(**{**inputs, "depths": torch.zeros(2, 3, dtype=torch.long)}, scale=1.0)
    k = inputs["k_pool"]
    with pytest.raises(ValueError, match="different tensors"):
        store_kv_(k, k, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), torch.zeros(1, 1, dtype=torch.long))
