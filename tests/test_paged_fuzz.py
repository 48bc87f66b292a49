"""Randomised tests of the paged KV layout against simple references: the block manager's tables and reference counts
against a dense model of what each row should read; the paged cache's writes, shares, copies on write and tree
compaction against a dense cache per row; the generator on small pools (admission limits, preemption, a pool that
grows) against the slot layout's samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_model, random_prompts

from rollout import Generator, SamplingParams
from rollout.engine.block_manager import BlockManager, OutOfBlocks
from rollout.engine.paged_cache import PagedKVCache
from rollout.engine.step_batch import StepBatch
from rollout_kernels.store_kv import store_kv_ref_
from specdec.config import SpecConfig

# ---- the block manager against a dense model ---------------------------------------------------------------------


def check_bookkeeping(m: BlockManager) -> None:
    """Reference counts are the (row, column) entries holding each block; the free list is exactly the blocks no row
    holds, once each; a row reads only blocks of the pool it holds."""
    held_entries = np.concatenate([m.tables[r, : m.num_row_blocks[r]] for r in range(len(m.tables))])
    assert held_entries.size == 0 or (held_entries.min() >= 0 and held_entries.max() < m.num_blocks), (
        f"expected held blocks in [0, {m.num_blocks}), got {held_entries}"
    )
    counts = np.bincount(held_entries, minlength=m.num_blocks)
    assert len(m.refs) == m.num_blocks, f"expected {m.num_blocks} reference counts, got {len(m.refs)}"
    np.testing.assert_array_equal(m.refs, counts, err_msg="refs != (row, column) entries holding each block")
    free = m.free[: m.num_free]
    assert len(np.unique(free)) == len(free), f"expected no block twice in the free list, got {sorted(free)}"
    assert set(free.tolist()) == set(np.nonzero(counts == 0)[0].tolist()), (
        f"expected the free list to be the unheld blocks {np.nonzero(counts == 0)[0]}, got {sorted(free)}"
    )
    assert (m.num_row_blocks <= m.tables.shape[1]).all()
    for row in range(len(m.tables)):  # past `shared_below` a row's blocks are its own: writes there copy nothing
        alone = m.tables[row, m.shared_below[row] : m.num_row_blocks[row]]
        assert (m.refs[alone] == 1).all(), f"row {row}: a block past shared_below={m.shared_below[row]} is shared"


class DenseModel:
    """A `BlockManager` with a data pool, beside the reference: each row's {position: value} written through it."""

    def __init__(self, rng: np.random.Generator, num_blocks: int, block_size: int, num_slots: int, width: int):
        self.rng = rng
        self.manager = BlockManager(num_blocks, block_size, num_slots, width)
        self.data = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.expected: list[dict[int, int]] = [{} for _ in range(num_slots)]
        self.next_value = 0

    def grow(self, num_blocks: int) -> None:
        added = (num_blocks - self.manager.num_blocks) * self.manager.block_size
        self.data = np.concatenate([self.data, np.full(added, -1, dtype=np.int64)])
        self.manager.grow(num_blocks)

    def write(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        """Blocks for `[0, end)`, the blocks of `[start, end)` made the rows' own, then fresh values written there."""
        m = self.manager
        need = m.needed(rows, end, start)
        need_alloc = m.needed(rows, end)
        copies_bound = m.copies_bound(rows, end, start)  # what reserve trusts without reading reference counts
        assert m.needed_bound(rows, end, start) == need_alloc + copies_bound >= need, "expected a bound of needed()"
        if (m.num_row_blocks[rows] * m.block_size >= start).all():  # rows hold their blocks below the write (a step)
            # what the scheduler trusts without counting: a block column written is a new block or a copy, not both
            columns = (end - start - 1) // m.block_size + 2
            assert need <= columns.sum(), f"needed() said {need}, more than {columns.sum()} columns written"
        if self.rng.random() < 0.3 and need_alloc > m.num_free:  # allocation refused: nothing may change
            before = (m.tables.copy(), m.refs.copy(), m.free.copy(), m.num_free, m.num_row_blocks.copy())
            with pytest.raises(OutOfBlocks):
                m.allocate(rows, end)
            after = (m.tables, m.refs, m.free, m.num_free, m.num_row_blocks)
            for a, b in zip(before, after):
                np.testing.assert_array_equal(a, b, err_msg="a refused allocation changed the manager")
        if need > m.num_free:
            self.grow(m.num_blocks + need - m.num_free + int(self.rng.integers(0, 3)))
        free_before = m.num_free
        m.allocate(rows, end)
        assert free_before - m.num_free == need_alloc, "needed() is not what allocate took"
        free_before = set(m.free[: m.num_free].tolist())
        sources, targets = m.writable(rows, start, end)
        assert len(sources) == len(targets) == len(set(targets.tolist())), "expected one fresh block per copy"
        assert set(targets.tolist()) <= free_before | set(sources.tolist()), "a copy went into a block in use"
        assert len(sources) + need_alloc <= need, f"needed() said {need}, the write took more"
        assert len(sources) <= copies_bound, f"copies_bound() said {copies_bound}, the write copied {len(sources)}"
        bs = m.block_size
        if len(sources):  # every source read before any target is written (as PagedKVCache.prepare copies)
            src = (sources[:, None] * bs + np.arange(bs)).ravel()
            dst = (targets[:, None] * bs + np.arange(bs)).ravel()
            self.data[dst] = self.data[src].copy()
        width = int((end - start).max())
        positions = start[:, None] + np.arange(width)[None, :]
        positions = np.where(positions < end[:, None], positions, -1)
        slots = m.slots(rows, positions)
        for i, row in enumerate(rows):
            columns = np.arange(start[i] // bs, (end[i] - 1) // bs + 1)
            assert (m.refs[m.tables[row, columns]] == 1).all(), f"row {row}: a block it writes is still shared"
            for p, slot in zip(positions[i], slots[i]):
                if p >= 0:
                    self.data[slot] = self.next_value
                    self.expected[row][int(p)] = self.next_value
                    self.next_value += 1

    def share(self, src: np.ndarray, dst: np.ndarray) -> None:
        before = [dict(self.expected[s]) for s in src]
        self.manager.share(src, dst)
        for d, contents in zip(dst, before):
            self.expected[d] = contents

    def release(self, rows: np.ndarray) -> None:
        self.manager.release(rows)
        for r in rows:
            self.expected[r] = {}

    def check(self) -> None:
        m = self.manager
        check_bookkeeping(m)
        for row, contents in enumerate(self.expected):
            if not contents:
                continue
            positions = np.array(sorted(contents))
            assert positions.max() < m.num_row_blocks[row] * m.block_size, f"row {row} reads past its blocks"
            got = self.data[m.slots(np.array([row]), positions[None, :])[0]]
            want = np.array([contents[p] for p in positions])
            np.testing.assert_array_equal(got, want, err_msg=f"row {row} reads another row's or a stale value")


@pytest.mark.parametrize("seed", range(12))
def test_block_manager_matches_a_dense_model_under_random_operations(seed):
    """Writes over ranges crossing block boundaries (allocate, copy on write, store), shares whose sources are also
    destinations, releases and growth, checked after every operation: each row reads what it wrote or was given,
    whoever else shares or shared its blocks; reference counts and the free list agree with the tables."""
    rng = np.random.default_rng(seed)
    num_slots, block_size, width = 6, int(rng.choice([1, 2, 4])), 6
    model = DenseModel(rng, int(rng.integers(2, 8)), block_size, num_slots, width)
    limit = width * block_size
    for _ in range(200):
        op = rng.choice(["write", "write", "share", "release", "grow"], p=[0.35, 0.2, 0.25, 0.12, 0.08])
        if op == "write":
            rows = rng.choice(num_slots, size=int(rng.integers(1, num_slots + 1)), replace=False)
            end = rng.integers(1, limit + 1, size=len(rows))
            start = np.array([rng.integers(0, e) for e in end])  # ranges crossing block boundaries, shared or not
            model.write(rows, start, end)
        elif op == "share":  # sources may be destinations too, a source may fan out to several rows
            dst = rng.choice(num_slots, size=int(rng.integers(1, num_slots + 1)), replace=False)
            src = rng.choice(num_slots, size=len(dst), replace=True)
            model.share(src, dst)
        elif op == "release":
            model.release(rng.choice(num_slots, size=int(rng.integers(1, num_slots + 1)), replace=False))
        else:
            model.grow(model.manager.num_blocks + int(rng.integers(1, 5)))
        model.check()
    model.release(np.arange(num_slots))
    check_bookkeeping(model.manager)
    assert model.manager.num_free == model.manager.num_blocks


# ---- the paged cache against a dense cache per row -----------------------------------------------------------------


class DenseRows:
    """What each row of a `PagedKVCache` should read: its committed values, position by position."""

    def __init__(self, num_slots: int):
        self.rows: list[list[float]] = [[] for _ in range(num_slots)]

    def lens(self, start: int, stop: int) -> torch.Tensor:
        return torch.tensor([len(self.rows[r]) for r in range(start, stop)], dtype=torch.long)


def read_row(cache: PagedKVCache, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `row`'s first `length` keys and values through its block table, `[length]` each (head 0, dim 0)."""
    positions = np.arange(length)[None, :]
    slots = torch.from_numpy(cache.manager.slots(np.array([row]), positions)[0])
    k_pool, v_pool = cache.pools(layer)
    return k_pool.view(-1, *cache.shape)[slots, 0, 0], v_pool.view(-1, *cache.shape)[slots, 0, 0]


def check_cache(cache: PagedKVCache, dense: DenseRows, num_layers: int) -> None:
    check_bookkeeping(cache.manager)
    for row, values in enumerate(dense.rows):
        if not values:
            continue
        assert cache.manager.num_row_blocks[row] * cache.block_size >= len(values), f"row {row} lost blocks"
        want = torch.tensor(values, dtype=torch.float64)
        for layer in range(num_layers):
            keys, vals = read_row(cache, layer, row, len(values))
            torch.testing.assert_close(keys, want + 1000 * layer, rtol=0, atol=0, msg=f"row {row} layer {layer} keys")
            torch.testing.assert_close(vals, -want - 1000 * layer, rtol=0, atol=0, msg=f"row {row} values")


def write_step(cache: PagedKVCache, dense: DenseRows, row_start: int, counts: list[int], rng, num_layers: int):
    """One forward's worth of writes: rows `[row_start, row_start + len(counts))` get `counts[i]` new tokens after their
    committed ones, at random columns of a padded block. Returns (cache lens, the values written `[rows, count]`)."""
    num_rows = len(counts)
    lens = dense.lens(row_start, row_start + num_rows)
    count = torch.tensor(counts, dtype=torch.long)
    width = int(count.max()) + int(rng.integers(0, 3))
    query_start = torch.tensor([int(rng.integers(0, width - c + 1)) for c in counts], dtype=torch.long)
    ids = torch.zeros(num_rows, width, dtype=torch.long)  # the ids play no part in where tokens go
    step = cache.prepare(StepBatch.build(row_start, ids, lens, query_start, count))
    column = torch.arange(width)[None, :] - query_start[:, None]
    valid = (column >= 0) & (column < count[:, None])
    fresh = torch.tensor(rng.integers(1, 10**6, size=(num_rows, width)), dtype=torch.float64)
    assert ((step.slot_mapping >= 0) == valid).all(), "slot mapping: padding must be -1, tokens mapped"
    for layer in range(num_layers):
        k_pool, v_pool = cache.pools(layer)
        key = (fresh + 1000 * layer)[:, None, :, None].expand(-1, 1, -1, 2).contiguous()
        store_kv_ref_(k_pool, v_pool, key, -key, step.slot_mapping)
    written = [fresh[i, int(query_start[i]) : int(query_start[i]) + counts[i]].tolist() for i in range(num_rows)]
    return lens, written


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("growing", [False, True], ids=["fixed-pool", "growing-pool"])
def test_paged_cache_rows_read_what_they_wrote_through_shares_copies_and_compaction(seed, growing):
    """Steps through `prepare()`'s slot mapping (left-padded columns, chains with rejected tails, token trees whose
    accepted path is compacted), `copy_rows` and releases: every row reads back its committed keys and values in every
    layer, as a dense per-row cache would hold them."""
    rng = np.random.default_rng(seed)
    num_layers, num_slots, block_size, num_positions = 2, 6, 4, 40
    max_blocks = num_slots * -(-num_positions // block_size)
    cache = PagedKVCache(
        num_layers, 1, 2, torch.float64, torch.device("cpu"), num_slots, num_positions, max_blocks,
        initial_blocks=2 if growing else None, block_size=block_size,
    )  # fmt: skip
    dense = DenseRows(num_slots)
    for _ in range(80):
        op = rng.choice(["chain", "tree", "share", "release"], p=[0.35, 0.25, 0.25, 0.15])
        row_start = int(rng.integers(0, num_slots))
        num_rows = int(rng.integers(1, num_slots - row_start + 1))
        if op in ("chain", "tree"):
            room = [num_positions - len(dense.rows[r]) for r in range(row_start, row_start + num_rows)]
            if min(room) < 1:
                cache.release_rows(row_start, row_start + num_rows)
                for r in range(row_start, row_start + num_rows):
                    dense.rows[r] = []
                continue
            counts = [int(rng.integers(1, min(6, r) + 1)) for r in room]
            lens, written = write_step(cache, dense, row_start, counts, rng, num_layers)
            if op == "chain":  # a random number of the new tokens is committed (the rest: rejected drafts)
                for i, r in enumerate(range(row_start, row_start + num_rows)):
                    dense.rows[r] += written[i][: int(rng.integers(1, counts[i] + 1))]
            else:  # a tree: an increasing path of nodes is accepted and moved next to the root
                depth = max(counts) - 1
                accepted = torch.full((num_rows, max(depth, 1)), -1, dtype=torch.long)
                for i, r in enumerate(range(row_start, row_start + num_rows)):
                    picked = rng.choice(np.arange(1, counts[i]), size=int(rng.integers(0, counts[i])), replace=False)
                    nodes = sorted(int(n) for n in picked)
                    accepted[i, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
                    dense.rows[r] += [written[i][0]] + [written[i][n] for n in nodes]
                rows = torch.arange(row_start, row_start + num_rows)
                cache.compact_paths(rows, lens, accepted)
        elif op == "share":
            dst = rng.choice(num_slots, size=int(rng.integers(1, num_slots + 1)), replace=False)
            src = rng.choice(num_slots, size=len(dst), replace=True)
            before = [list(dense.rows[s]) for s in src]
            cache.copy_rows(torch.from_numpy(src), torch.from_numpy(dst))
            for d, values in zip(dst, before):
                dense.rows[d] = values
        else:
            cache.release_rows(row_start, row_start + num_rows)
            for r in range(row_start, row_start + num_rows):
                dense.rows[r] = []
        check_cache(cache, dense, num_layers)
    cache.release_rows(0, num_slots)
    assert cache.manager.num_free == cache.num_blocks


def test_a_growing_pool_grows_for_the_blocks_a_step_copies():
    """The copies a step makes of shared blocks are blocks too: a pool that may grow grows for them (here allocation
    needs nothing new, the free list is empty, and both rows write into their shared last block)."""
    cache = PagedKVCache(
        1, 1, 2, torch.float64, torch.device("cpu"), 2, 16, max_blocks=8, initial_blocks=2, block_size=4
    )
    dense = DenseRows(2)
    rng = np.random.default_rng(0)
    _, written = write_step(cache, dense, 0, [6], rng, 1)  # row 0: 2 blocks, the pool's all
    dense.rows[0] = written[0]
    cache.copy_rows(torch.tensor([0]), torch.tensor([1]))
    dense.rows[1] = list(written[0])
    assert cache.manager.num_free == 0 and cache.free_blocks_after_growth() == 6
    _, written = write_step(cache, dense, 0, [1, 1], rng, 1)  # both rows write position 6, in the shared block 1
    dense.rows[0] += written[0]
    dense.rows[1] += written[1]
    check_cache(cache, dense, 1)


# ---- the generator on small pools against the slot layout -----------------------------------------------------------


def check_generator_blocks(gen: Generator) -> None:
    """Only rows in flight hold blocks, and the bookkeeping is consistent."""
    manager = gen.runner.cache.manager
    check_bookkeeping(manager)
    assert (manager.num_row_blocks[gen.num_active :] == 0).all(), (
        f"rows past the {gen.num_active} in flight hold blocks: {manager.num_row_blocks}"
    )


def make_spec(name: str) -> SpecConfig | None:
    if name == "draft-model":
        draft = make_model("llama", seed=5, vocab_size=23, hidden_size=32, intermediate_size=32)
        return SpecConfig(method="draft_model", num_speculative_tokens=3, model=draft)
    return {
        "none": None,
        "ngram-chain": SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1),
        "ngram-tree": SpecConfig(method="ngram", num_speculative_tokens=5, num_candidates=3, prompt_lookup_min=1),
        "ngram-rejection": SpecConfig(
            method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, verification="rejection"
        ),
        "suffix-tree": SpecConfig(method="suffix", num_speculative_tokens=5, num_candidates=2),
    }[name]


MODELS = {
    "llama": dict(arch="llama"),
    "mistral-window": dict(arch="mistral", sliding_window=9),  # keys leave the window within a step's tree
}

# (seed, model, speculation, slots, prompts, max_seq_len, kv_pool_blocks, what the case must exercise): small pools
# admit fewer rows and preempt the latest; None: a CPU pool that starts small and grows
CASES = [
    (0, "llama", "none", 6, 5, 64, 8, "preempt"),
    (2, "llama", "ngram-tree", 6, 4, 64, 10, "preempt"),
    (17, "llama", "ngram-tree", 8, 5, 96, 12, "preempt"),
    (25, "llama", "ngram-chain", 7, 1, 96, 9, "preempt"),
    (4, "llama", "ngram-chain", 8, 4, 256, None, "grow"),  # seed 1 drew 9 samples for 8 slots: its last group waited
    (3, "llama", "ngram-tree", 8, 4, 256, None, "grow"),
    (5, "llama", "ngram-rejection", 8, 5, 80, 9, "preempt"),
    (4, "mistral-window", "ngram-tree", 6, 4, 64, 8, "preempt"),
    (7, "llama", "suffix-tree", 6, 4, 64, 8, "preempt"),
    (3, "llama", "draft-model", 6, 4, 64, 8, "preempt"),
]


@pytest.fixture(scope="module")
def fuzz_model():
    return make_model("llama", seed=4, vocab_size=23)


def random_requests(rng: np.random.Generator, seed: int, num_prompts: int, max_seq_len: int):
    """Prompts of repeated patterns (n-gram drafts get accepted) ending mid-block and at a block's edge, each with its
    own n, temperature, top-k, length cap and seed; a few stop on a token."""
    prompts = [p * int(rng.integers(1, 4)) for p in random_prompts(num_prompts, 23, max_len=12, seed=seed)]
    prompts = [p[: int(rng.choice([15, 16, 17, 32]))] for p in prompts]
    params = [
        SamplingParams(
            n=int(rng.integers(1, 5)),
            temperature=float(rng.choice([0.0, 0.0, 0.8, 1.0])),
            top_k=int(rng.choice([0, 5])),
            max_new_tokens=int(rng.integers(max_seq_len // 3, 2 * max_seq_len // 3)),
            stop_token_ids=[int(rng.integers(1, 23))] if rng.random() < 0.3 else None,  # most run to the cap
            seed=int(rng.integers(0, 1000)),
        )
        for _ in prompts
    ]
    return prompts, params


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-pool{c[6]}" for c in CASES])
def test_generator_on_a_small_pool_samples_what_the_slot_layout_samples(case, fuzz_model):
    """Exact verification: the slot layout without drafts is the reference (each token is the race's at its position);
    rejection sampling: the slot layout with the same drafts. Preempted rows restart and draw the same tokens."""
    seed, model_name, spec_name, slots, num_prompts, max_seq_len, pool, exercised = case
    model = fuzz_model if model_name == "llama" else make_model(seed=4, vocab_size=23, **MODELS[model_name])
    prompts, params = random_requests(np.random.default_rng(seed), seed, num_prompts, max_seq_len)
    spec = make_spec(spec_name)
    reference_spec = spec if spec is not None and spec.verification == "rejection" else None
    reference = Generator(model, max_batch_size=slots, max_seq_len=max_seq_len, spec=reference_spec, kv_layout="slots")
    expected = reference.generate(prompts, params)
    gen = Generator(
        model, max_batch_size=slots, max_seq_len=max_seq_len, spec=spec, kv_layout="paged", kv_pool_blocks=pool
    )
    first_size = gen.runner.cache.num_blocks
    got = gen.generate(prompts, params, on_step=lambda *_: check_generator_blocks(gen))
    for a, b in zip(expected, got):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.token_ids == b.token_ids, f"prompt {a.prompt_index} sample {a.sample_index}"
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-9)
    manager = gen.runner.cache.manager
    assert manager.num_used == 0 and manager.num_free == manager.num_blocks, "blocks not back in the pool"
    trace = gen.last_trace
    if pool is not None:
        assert max(r.kv_blocks_used for r in trace) <= pool
    if exercised == "preempt":
        assert sum(r.num_preempted for r in trace) > 0, "the pool never ran short: nothing was tested"
    else:
        assert gen.runner.cache.num_blocks > first_size, "the pool never grew: nothing was tested"
    if spec is not None:
        assert sum(r.num_accepted for r in trace) > 0, "no draft accepted: the comparison tested nothing"


def test_generator_grows_a_cpu_pool_for_the_copies_of_a_groups_shared_block(fuzz_model):
    """Two samples of a 369-token prompt fill the CPU pool's first 24 blocks exactly; their first decode step copies
    the shared last block for each, which the pool (planned far larger) must grow for."""
    gen = Generator(fuzz_model, max_batch_size=2, max_seq_len=400, kv_layout="paged")
    assert gen.runner.cache.num_blocks == 24 < gen.runner.cache.max_blocks
    prompt = [(7 * i) % 22 + 1 for i in range(23 * 16 + 1)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=0)
    expected = Generator(fuzz_model, max_batch_size=2, max_seq_len=400, kv_layout="slots").generate([prompt], params)
    got = gen.generate([prompt], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert gen.runner.cache.manager.num_used == 0


def test_rows_a_restore_leaves_out_give_their_blocks_back(fuzz_model):
    """`restore` to a prefix of a snapshot keeps fewer rows in flight: the others' blocks are freed then (so that the
    row kept runs to `max_seq_len` in the smallest pool), and they cannot be restored again; with `keep_others` (the
    auto policy's warm-up) they keep their blocks for a longer prefix, and `abort` frees them."""
    prompt = [(7 * i) % 22 + 1 for i in range(16)]
    pool = -(-(80 + 1) // 16)  # the smallest pool a generator of max_seq_len 80 takes: one row at full length
    gen = Generator(fuzz_model, max_batch_size=2, max_seq_len=80, kv_layout="paged", kv_pool_blocks=pool)
    gen.add_requests([prompt], SamplingParams(temperature=0, max_new_tokens=64, n=2))
    for _ in range(18):  # the prefill, then both samples' blocks
        gen.step()
    manager = gen.runner.cache.manager
    saved = gen.snapshot()
    gen.restore(saved[:1])
    assert manager.num_row_blocks[1] == 0 and manager.num_used == manager.num_row_blocks[0]
    with pytest.raises(ValueError, match="row 1 no longer holds the sequence"):
        gen.restore(saved)
    done = []
    while gen.has_unfinished:
        done += gen.step().finished
    assert [len(c.token_ids) for c in done] == [64] and manager.num_used == 0

    gen = Generator(fuzz_model, max_batch_size=4, max_seq_len=32, kv_layout="paged")
    gen.add_requests(random_prompts(4, 23, min_len=5, seed=2), SamplingParams(max_new_tokens=8, seed=0))
    gen.step()  # the prefill: 4 rows, a block each
    saved = gen.snapshot()
    gen.restore(saved[:1], keep_others=True)
    manager = gen.runner.cache.manager
    assert manager.num_used == 4
    gen.restore(saved[:3], keep_others=True)  # a longer prefix: its rows held their KV
    assert gen.num_active == 3
    gen.abort()
    assert manager.num_used == 0, f"{manager.num_used} blocks held after abort: rows hold {manager.num_row_blocks}"


def test_the_auto_policys_calibration_leaves_every_block_free(fuzz_model):
    """The calibration times steps of a prefix of its rows (here its last grid entry is one row at K = 2); when it is
    done, no row holds a block, and a later call's blocks all come back too."""
    spec = SpecConfig(
        method="ngram", num_speculative_tokens=3, num_speculative_tokens_per_batch_size="auto", prompt_lookup_min=1
    )
    gen = Generator(fuzz_model, max_batch_size=4, max_seq_len=32, spec=spec, kv_layout="paged")
    manager = gen.runner.cache.manager
    assert manager.num_used == 0, f"{manager.num_used} blocks held after the calibration: {manager.num_row_blocks}"
    gen.generate(random_prompts(2, 23, seed=1), SamplingParams(n=2, max_new_tokens=6, seed=0))
    assert manager.num_used == 0


def test_the_auto_policys_calibration_fits_a_pool_smaller_than_three_blocks_a_slot(fuzz_model):
    """A pool the user sized small (allowed: it holds one full-length row) still builds a generator with the auto
    policy: its calibration fills only as many rows as the pool holds, or refuses with a ValueError naming the fix."""
    spec = SpecConfig(
        method="ngram", num_speculative_tokens=2, num_speculative_tokens_per_batch_size="auto", prompt_lookup_min=1
    )
    try:
        gen = Generator(fuzz_model, max_batch_size=8, max_seq_len=32, spec=spec, kv_layout="paged", kv_pool_blocks=8)
    except ValueError as error:
        assert "kv_pool_blocks" in str(error)
        return
    assert gen.runner.cache.manager.num_used == 0
