"""Paged KV kernels against their torch references and against attention written out row by row: chains of new
tokens after a cached prefix (decode, verification), left-padded prefills, token trees, sliding windows, grouped
heads, odd head sizes, blocks scattered through the pool in any order; a row's keys split across 1, 2, several and
more programs than it has key tiles, and the pass that merges the splits."""

import importlib
import random

import pytest
import torch

from rollout_kernels import paged_attention, paged_attention_ref, store_kv_, store_kv_ref_
from rollout_kernels.attention_splits import MAX_SPLITS, choose_num_splits, merge_splits, merge_splits_ref

torch.set_num_threads(1)

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def random_tree(num_nodes: int, rng: random.Random, reach: int | None = None) -> tuple[list[int], list[list[bool]]]:
    """(depths, ancestors) of a random tree whose node 0 is the root and whose parents precede their children (by at
    most `reach` nodes: 1 is a chain)."""
    parents = [-1] + [rng.randrange(max(0, j - (reach or j)), j) for j in range(1, num_nodes)]
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
    ("decode-d128-gqa4", 3, 1, (8, 2), 128, 16, False, False, None),
    ("verify-d64-window", 3, 4, (4, 1), 64, 16, False, False, 9),
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
        error = (out.double() - expected).abs().max().item()
        message = f"{op.__name__} {name}: largest absolute difference {error:.3g}"
        assert torch.allclose(out.double(), expected, atol=TOLERANCE[dtype], rtol=0), message


def test_paged_attention_in_bfloat16_and_with_large_query_blocks():
    inputs = make_case(random.Random(7), 3, 20, (4, 2), 32, 16, torch.bfloat16, prefill=True)
    expected = written_out(inputs, 0.2, None)
    outs = [paged_attention_ref(**inputs, scale=0.2), paged_attention(**inputs, scale=0.2, block_m=32)]
    outs.append(paged_attention(**inputs, scale=0.2, block_m=16, block_n=16, num_splits=3))
    for out in outs:
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


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_split_count_is_attention_by_its_definition(case, num_splits):
    # 16-key tiles and 16-query blocks: rows of up to 4 tiles, prefills of several query blocks; 8 splits leave
    # programs without a key
    name, rows, S, heads, head_dim, block_size, prefill, tree, window = case
    inputs = make_case(random.Random(name), rows, S, heads, head_dim, block_size, torch.float64, prefill, tree)
    expected = written_out(inputs, 0.3, window)
    out = paged_attention(**inputs, scale=0.3, sliding_window=window, block_m=16, block_n=16, num_splits=num_splits)
    error = (out - expected).abs().max().item()
    message = f"{name}, {num_splits} splits: largest absolute difference {error:.3g}"
    assert torch.allclose(out, expected, atol=TOLERANCE[torch.float64], rtol=0), message


def awkward_rows(dtype: torch.dtype) -> dict:
    """Four rows over 16-token pages: a single key (a sequence's first token), a padding row (no queries, a table of
    block 0, as a captured graph's padding rows), a long row of 150 committed keys and 3 new ones, and a row of 32
    whose new tokens start a page, at columns 1 and 2."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, width = 24, 16, 11
    blocks = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(4, width, dtype=torch.long)  # entries past a row's pages point at block 0
    block_tables[0, :1], block_tables[2, :10], block_tables[3, :3] = blocks[:1], blocks[1:11], blocks[11:14]
    longs = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return dict(
        query=torch.randn(4, 3, 4, 16, generator=gen).to(dtype).transpose(1, 2),
        k_pool=torch.randn(num_blocks, block_size, 2, 16, generator=gen).to(dtype),
        v_pool=torch.randn(num_blocks, block_size, 2, 16, generator=gen).to(dtype),
        block_tables=block_tables,
        cache_lens=longs([0, 0, 150, 32]),
        query_start=longs([0, 0, 0, 1]),
        num_queries=longs([1, 0, 3, 2]),
        depths=None,
        ancestors=None,
    )


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (12, 16), (2, 64), (5, 128)])
def test_one_key_a_padding_row_and_a_long_row_at_every_split(num_splits, block_n, window):
    # the long row holds 10 tiles of 16 keys (12 splits: more than it holds), 3 of 64, 2 of 128
    inputs = awkward_rows(torch.float64)
    expected = written_out(inputs, 0.25, window)
    out = paged_attention(**inputs, scale=0.25, sliding_window=window, block_n=block_n, num_splits=num_splits)
    assert torch.allclose(out, expected, atol=TOLERANCE[torch.float64], rtol=0)
    assert not out[1].any() and not out[0, 1:].any() and not out[3, 0].any()  # padding queries are zero


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_keys_before_every_window_are_never_read(dtype, num_splits):
    # NaN in every 16-key tile that lies wholly before all of a row's windows: a kernel that loads one (even to mask
    # it) returns NaN, since 0 x NaN is NaN
    inputs = make_case(random.Random(4), 3, 4, (4, 2), 16, 8, dtype)
    window, block_n = 20, 16
    inputs["cache_lens"] = torch.tensor([100, 70, 129])
    inputs["num_queries"] = torch.tensor([4, 1, 3])
    width = -(-(129 + 4) // 8)
    gen = torch.Generator().manual_seed(0)
    num_blocks = 3 * width
    inputs["block_tables"] = torch.randperm(num_blocks, generator=gen).view(3, width)
    inputs["k_pool"] = torch.randn(num_blocks, 8, 2, 16, generator=gen).to(dtype)
    inputs["v_pool"] = torch.randn(num_blocks, 8, 2, 16, generator=gen).to(dtype)
    expected = written_out(inputs, 0.25, window)  # reads visible keys only
    for r, cache_len in enumerate(inputs["cache_lens"].tolist()):
        unread = (cache_len - window + 1) // block_n * block_n  # the first query's window, down to a tile
        for p in range(unread):
            block = inputs["block_tables"][r, p // 8]
            inputs["k_pool"][block, p % 8] = float("nan")
            inputs["v_pool"][block, p % 8] = float("nan")
    out = paged_attention(**inputs, scale=0.25, sliding_window=window, block_n=block_n, num_splits=num_splits)
    assert torch.allclose(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_a_tree_numbered_in_any_order_keeps_its_window(num_splits):
    # the engine numbers parents before children, the kernel assumes no order: here a branch numbered leaf first, so
    # the first query block (4 queries, depths 8 to 5 in row 0) sees new keys whose index lies before its window's
    # first position (the keys' positions are their depths)
    rng = random.Random(28)  # rows of 9 and 12 new tokens
    inputs = make_case(rng, 2, 12, (2, 1), 16, 4, torch.float64, tree=True)
    inputs["cache_lens"] = torch.tensor([12, 14])  # windows start past a 16-key tile boundary
    for r, n in enumerate(inputs["num_queries"].tolist()):
        depths, ancestors = random_tree(n, rng, reach=1)
        reverse = list(range(n - 1, -1, -1))
        inputs["depths"][r, :n] = torch.tensor(depths)[reverse]
        inputs["ancestors"][r, :n, :n] = torch.tensor(ancestors)[reverse][:, reverse]
    expected = written_out(inputs, 0.25, 2)
    out = paged_attention(**inputs, scale=0.25, sliding_window=2, block_m=4, block_n=16, num_splits=num_splits)
    assert torch.allclose(out, expected, atol=TOLERANCE[torch.float64], rtol=0)


def test_the_split_count_fills_the_sms_from_host_shapes():
    assert choose_num_splits(175 * 8, 32, 132) == 1  # a bulk step fills the GPU already
    assert choose_num_splits(8 * 8, 32, 132) == 5  # a tail of 8 rows x 8 KV heads: 320 programs for 264
    assert choose_num_splits(8 * 8, 3, 132) == 3  # no more splits than the longest row's key tiles
    assert choose_num_splits(1, 10_000, 132) == MAX_SPLITS
    assert choose_num_splits(8 * 8, 32, None) == 1  # no SM count (a CPU): one program a row


def test_the_launcher_splits_a_small_batch_by_itself_and_stays_exact(monkeypatch):
    # a 16-SM device: 2 rows x 2 KV heads x 1 query block = 4 programs, so 8 splits (the table holds 11 tiles of 16)
    module = importlib.import_module("rollout_kernels.paged_attention")
    monkeypatch.setattr(module, "num_sms_of", lambda device: 16)
    counts = []

    def spy(partial_out, *args):
        counts.append(partial_out.shape[3])
        return merge_splits(partial_out, *args)

    monkeypatch.setattr(module, "merge_splits", spy)
    inputs = awkward_rows(torch.float64)
    inputs = {
        k: v[2:] if isinstance(v, torch.Tensor) and k not in ("k_pool", "v_pool") else v for k, v in inputs.items()
    }
    out = paged_attention(**inputs, scale=0.25, block_n=16)
    assert counts == [8]
    assert torch.allclose(out, written_out(inputs, 0.25, None), atol=TOLERANCE[torch.float64], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_merging_splits_is_the_softmax_over_their_union(dtype):
    # one split's scores and another's merged equal one softmax over both key sets; a split that saw no key
    # (lse -inf) weighs nothing; padding columns keep what the output held
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(2)
    rows, S, heads, num_splits, head_dim, keys_per_split = 2, 3, 5, 3, 24, 4
    scores = torch.randn(rows, S, heads, num_splits, keys_per_split, generator=gen, dtype=torch.float64) * 3
    values = torch.randn(rows, S, heads, num_splits, keys_per_split, head_dim, generator=gen, dtype=torch.float64)
    scores[0, 1, 2, 1] = float("-inf")  # split 1 saw nothing there
    partial_out = torch.nan_to_num((torch.softmax(scores, -1)[..., None] * values).sum(-2))
    partial_lse = torch.logsumexp(scores, -1)
    whole = torch.softmax(scores.flatten(-2), -1)[..., None] * values.flatten(-3, -2)
    expected = whole.sum(-2)
    ref = merge_splits_ref(partial_out, partial_lse)
    assert torch.allclose(ref, expected, atol=1e-12, rtol=0)
    out = torch.full((rows, S, heads, head_dim), 7.0, dtype=dtype, device=device)
    query_start, num_queries = torch.tensor([0, 1], device=device), torch.tensor([3, 1], device=device)
    parts = [t.to(dtype).to(device) for t in (partial_out, partial_lse)]
    merge_splits(*parts, query_start, num_queries, out)
    out = out.cpu().double()
    written = torch.tensor([[True, True, True], [False, True, False]])
    assert torch.allclose(out[written], expected[written], atol=TOLERANCE[dtype], rtol=0)
    assert (out[~written] == 7.0).all()


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
