"""compact_kv_: the Triton kernel and the torch reference leave the caches bit for bit the same, each row's accepted
path lands right after its root as if copied from the cache before any move, and nothing else changes.

On CPU the kernel runs under TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports `kernels`.
"""

import random
import re

import pytest
import torch

from rollout_kernels import compact_kv_, compact_kv_ref_

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.float16, torch.float64, torch.bfloat16]
NUM_SLOTS, SEQ_LEN, MAX_DEPTH, NUM_TREE_NODES = 8, 40, 6, 16
# Slots of the verified rows: a subset out of order, so slots 1, 3 and 4 must stay untouched.
ROWS = [6, 0, 2, 7, 5]
# Hand-made paths (local node indices), then random ones fill the other rows.
EDGE_PATHS = [
    [2, 3, 5, 9, 12, 15],  # full depth; every step overwrites the position the step before it read
    [],  # nothing accepted
    [1, 2, 3],  # already in place: no move
]


def make_case(num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    shape = (NUM_SLOTS, num_heads, SEQ_LEN, head_dim)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    paths = EDGE_PATHS + [
        sorted(rng.sample(range(1, NUM_TREE_NODES), rng.randint(1, MAX_DEPTH))) for _ in ROWS[len(EDGE_PATHS) :]
    ]
    accepted_nodes = torch.tensor([path + [-1] * (MAX_DEPTH - len(path)) for path in paths])
    # The first row's tree ends at the last position of the cache; the others lie anywhere that fits.
    base_positions = [SEQ_LEN - NUM_TREE_NODES] + [rng.randrange(SEQ_LEN - NUM_TREE_NODES) for _ in ROWS[1:]]
    return keys, values, torch.tensor(ROWS), torch.tensor(base_positions), accepted_nodes


def expected_caches(keys, values, rows, base_positions, accepted_nodes):
    """Each path copied from the cache as it was before any move, and a mask of the positions that may change."""
    expected = [keys.clone(), values.clone()]
    written = torch.zeros(keys.shape[0], keys.shape[2], dtype=torch.bool)
    for slot, base, path in zip(rows.tolist(), base_positions.tolist(), accepted_nodes.tolist()):
        for j, node in enumerate(n for n in path if n >= 0):
            for cache, original in zip(expected, (keys, values)):
                cache[slot, :, base + 1 + j] = original[slot, :, base + node]
            written[slot, base + 1 + j] = True
    return expected, written


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, head_dim", [(3, 3), (3, 80), (1, 128), (5, 1)])
def test_kernel_matches_reference(num_heads, head_dim, dtype):
    keys, values, rows, base_positions, accepted_nodes = make_case(num_heads, head_dim, dtype)
    index_args = (rows, base_positions, accepted_nodes)
    index_copies = [t.clone() for t in index_args]
    (expected_keys, expected_values), written = expected_caches(keys, values, *index_args)
    results = {}
    for op in (compact_kv_, compact_kv_ref_):
        results[op.__name__] = (keys.clone(), values.clone())
        assert op(*results[op.__name__], *index_args) is None
    kernel_keys, kernel_values = results["compact_kv_"]
    ref_keys, ref_values = results["compact_kv_ref_"]
    assert torch.equal(kernel_keys, ref_keys) and torch.equal(kernel_values, ref_values), "kernel != reference"
    assert torch.equal(kernel_keys, expected_keys) and torch.equal(kernel_values, expected_values)
    # Everything outside the written positions, other slots included, is as before.
    unchanged = ~written[:, None, :, None].expand_as(keys)
    for cache, original in ((kernel_keys, keys), (kernel_values, values)):
        assert torch.equal(cache[unchanged], original[unchanged]), "a position outside the paths changed"
        assert torch.equal(cache[[1, 3, 4]], original[[1, 3, 4]]), "a slot of no row changed"
    assert written.sum() == (accepted_nodes >= 0).sum() and written[rows[0], SEQ_LEN - NUM_TREE_NODES + 6]
    assert all(torch.equal(t, c) for t, c in zip(index_args, index_copies)), "an index argument was modified"


@pytest.mark.parametrize("op", [compact_kv_, compact_kv_ref_], ids=lambda op: op.__name__)
def test_wrong_order_would_differ(op):
    """The path [2, 3] moves 2 -> 1, then 3 -> 2: done the other way round, position 1 would get node 3."""
    keys = torch.arange(4, dtype=torch.float32).view(1, 1, 4, 1).repeat(1, 2, 1, 3)
    values = -keys
    op(keys, values, torch.tensor([0]), torch.tensor([0]), torch.tensor([[2, 3]]))
    assert keys[0, :, :, 0].tolist() == [[0, 2, 3, 3]] * 2 and torch.equal(values, -keys)


@pytest.mark.parametrize("op", [compact_kv_, compact_kv_ref_], ids=lambda op: op.__name__)
def test_no_rows_and_no_depth(op):
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    originals = keys.clone(), values.clone()
    no_rows = torch.zeros(0, dtype=torch.int64)
    op(keys, values, no_rows, no_rows, torch.zeros(0, 3, dtype=torch.int64))
    op(keys, values, torch.tensor([1]), torch.tensor([2]), torch.zeros(1, 0, dtype=torch.int64))
    assert torch.equal(keys, originals[0]) and torch.equal(values, originals[1])


def valid_args():
    return dict(
        keys=torch.randn(3, 2, 10, 4),
        values=torch.randn(3, 2, 10, 4),
        rows=torch.tensor([2, 0]),
        base_positions=torch.tensor([1, 4]),
        accepted_nodes=torch.tensor([[2, 4], [-1, -1]]),
    )


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("keys", torch.randn(3, 2, 10), "keys must have 4 dimension(s)"),
        ("keys", torch.randn(3, 2, 4, 10).transpose(2, 3), "keys (shape (3, 2, 10, 4)) must be contiguous"),
        ("keys", torch.zeros(3, 2, 10, 4, dtype=torch.int32), "keys has dtype torch.int32"),
        ("values", torch.randn(3, 2, 10, 4).double(), "values has dtype torch.float64, expected one of: float32"),
        ("values", torch.randn(3, 2, 11, 4), "values has shape (3, 2, 11, 4), expected the shape of keys"),
        ("rows", torch.tensor([2, 0], dtype=torch.int32), "rows has dtype torch.int32"),
        ("base_positions", torch.tensor([1]), "base_positions has 1 rows, expected one per entry of rows (2)"),
        ("accepted_nodes", torch.tensor([2, 4]), "accepted_nodes must have 2 dimension(s)"),
    ],
)
@pytest.mark.parametrize("op", [compact_kv_, compact_kv_ref_], ids=lambda op: op.__name__)
def test_bad_arguments_are_named(op, name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        op(**valid_args() | {name: value})


@pytest.mark.parametrize("op", [compact_kv_, compact_kv_ref_], ids=lambda op: op.__name__)
def test_keys_and_values_must_differ(op):
    args = valid_args()
    with pytest.raises(ValueError, match="keys and values are the same tensor"):
        op(**args | {"values": args["keys"]})


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("rows", torch.tensor([2, 2]), "rows must be distinct slots in [0, num_slots = 3)"),
        ("rows", torch.tensor([3, 0]), "rows must be distinct slots in [0, num_slots = 3)"),
        ("base_positions", torch.tensor([-1, 4]), "base_positions must be >= 0"),
        ("accepted_nodes", torch.tensor([[-1, 2], [-1, -1]]), "accepted_nodes must hold each row's path first"),
        ("accepted_nodes", torch.tensor([[1, 1], [-1, -1]]), "accepted_nodes[r, j] must be >= j + 1"),
        ("accepted_nodes", torch.tensor([[2, 9], [-1, -1]]), "reach position 10, past seq_len 10"),
    ],
)
def test_reference_checks_what_the_kernel_cannot(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compact_kv_ref_(**valid_args() | {name: value})
