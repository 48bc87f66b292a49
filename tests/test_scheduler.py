"""The scheduler decides each step before it runs: admission in prompt groups and prefill chunks, preemption of the
latest rows counted without changing anything, and a decode step's blocks reserved before its forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import make_model, random_prompts

from rollout import Generator, SamplingParams
from rollout.engine.block_manager import BlockManager
from specdec.config import SpecConfig


def _random_manager(seed: int) -> tuple[BlockManager, np.random.Generator]:
    """A manager whose rows hold blocks of their own and blocks shared with others (as a GRPO group's do)."""
    rng = np.random.default_rng(seed)
    manager = BlockManager(64, 4, 10, 12)
    lens = rng.integers(1, 30, size=10)
    manager.allocate(np.arange(10), lens)
    for _ in range(4):  # some rows take another row's blocks, then grow past them
        src, dst = rng.choice(10, size=2, replace=False)
        manager.share(np.array([src]), np.array([dst]))
        manager.allocate(np.array([dst]), np.array([int(lens[src]) + int(rng.integers(0, 9))]))
    return manager, rng


@pytest.mark.parametrize("seed", range(12))
def test_needed_after_release_is_what_a_release_leaves(seed):
    manager, rng = _random_manager(seed)
    held = manager.num_row_blocks * manager.block_size
    released = rng.choice(10, size=int(rng.integers(0, 6)), replace=False)
    kept = np.setdiff1d(np.arange(10), released)
    start = np.maximum(held[kept] - rng.integers(0, 6, size=len(kept)), 0)  # writes into held (maybe shared) blocks
    end = start + rng.integers(1, 9, size=len(kept))
    refs_before = manager.refs.copy()
    predicted = manager.needed_after_release(released, kept, end, start)
    assert (manager.refs == refs_before).all(), "needed_after_release changed the manager"
    after = copy.deepcopy(manager)
    after.release(released)
    assert predicted == (after.needed(kept, end, start), after.num_free)


def test_admission_keeps_a_prompts_samples_together_and_chunks_prefills():
    model = make_model("llama")
    prompts = random_prompts(5, min_len=8, max_len=8, seed=1)  # 8 tokens each: two prompts fill a 16-token chunk
    gen = Generator(model, max_batch_size=12, max_seq_len=16, max_prefill_tokens=16)
    gen.add_requests(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0))
    scheduled = gen.scheduler.schedule()
    chunks = scheduled.prefill_chunks
    assert [[[s.prompt_index for s in group] for group in chunk] for chunk in chunks] == [
        [[0, 0], [1, 1]],
        [[2, 2], [3, 3]],
        [[4, 4]],
    ]
    assert len(gen.scheduler.queue) == 0 and scheduled.preempted == []


def test_a_decode_steps_blocks_are_reserved_before_its_forward_and_preemption_still_happens():
    model = make_model("qwen2")
    prompts = random_prompts(6, min_len=10, max_len=20, seed=7)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=0)
    spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    reference = Generator(model, max_batch_size=18, max_seq_len=64, spec=spec).generate(prompts, params)
    gen = Generator(model, max_batch_size=18, max_seq_len=64, kv_layout="paged", kv_pool_blocks=16, spec=spec)
    manager = gen.runner.cache.manager
    short: list[int] = []  # per decode forward: rows that lacked a block for a token fed to them
    allocated: list[int] = []  # per allocation inside a decode forward: the blocks it took
    allocate, decode = manager.allocate, gen.runner.decode
    in_forward = [False]

    def spy_allocate(rows, num_positions):
        if in_forward[0]:
            allocated.append(int(np.maximum(manager.blocks_for(num_positions) - manager.num_row_blocks[rows], 0).sum()))
        return allocate(rows, num_positions)

    def spy_decode(row_start, input_ids, num_inputs, cache_lens, *tree):
        num_rows = len(cache_lens)
        end = torch.as_tensor(cache_lens).numpy() + torch.as_tensor(num_inputs).numpy()
        short.append(int((manager.num_row_blocks[row_start : row_start + num_rows] < manager.blocks_for(end)).sum()))
        in_forward[0] = True
        try:
            return decode(row_start, input_ids, num_inputs, cache_lens, *tree)
        finally:
            in_forward[0] = False

    manager.allocate, gen.runner.decode = spy_allocate, spy_decode
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert sum(r.num_preempted for r in gen.last_trace) > 0, "the pool never ran short: nothing was tested"
    assert len(short) == sum(r.kind == "decode" for r in gen.last_trace)
    assert sum(short) == 0, "a decode forward ran before its rows held their blocks"
    assert sum(allocated) == 0, "a decode forward allocated blocks"
    assert max(r.num_drafted for r in gen.last_trace) > 0, "no drafts: every step was one token wide"


def _prefilled_prompts(gen: Generator) -> list[int]:
    """Prompts each prefill step of the last call admitted (a prompt split over two admissions counts twice)."""
    return [r.batch_size for r in gen.last_trace if r.kind == "prefill"]


@pytest.mark.parametrize("kv_layout", ["slots", "paged"])
def test_a_prompts_samples_are_admitted_together_and_sample_what_they_sampled_apart(kv_layout):
    # a GRPO group admitted as slots free up was prefilled over and over, one admission per slot or two freed
    model = make_model("llama")
    prompts = random_prompts(12, min_len=3, max_len=9, seed=2)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=20, seed=5)
    outs = {}
    for whole in (True, False):
        gen = Generator(model, max_batch_size=16, max_seq_len=32, kv_layout=kv_layout)
        gen.scheduler.whole_groups = whole
        outs[whole] = [(o.token_ids, o.finish_reason, o.logprobs) for o in gen.generate(prompts, params)]
        admitted = _prefilled_prompts(gen)
        if whole:  # 3 <= 16 // 4: each prompt in one admission
            assert sum(admitted) == len(prompts)
        else:
            assert sum(admitted) > len(prompts), "no group was split: the comparison tests nothing"
    assert outs[True] == outs[False]  # tokens are keyed by sample and position, not by when a row was admitted


def test_a_group_larger_than_a_quarter_of_the_slots_is_still_split_and_one_larger_than_all_of_them_runs():
    model = make_model("llama")
    prompts = random_prompts(5, min_len=3, max_len=9, seed=3)
    for n, slots in ((5, 16), (7, 4)):  # waiting for 5 of 16 slots would idle too many; 7 never fit in 4
        splits = []
        for whole in (True, False):
            gen = Generator(model, max_batch_size=slots, max_seq_len=32)
            gen.scheduler.whole_groups = whole
            outs = gen.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=12, seed=1))
            assert len(outs) == n * len(prompts) and all(o.token_ids for o in outs)
            splits.append(_prefilled_prompts(gen))
        assert splits[0] == splits[1] and sum(splits[0]) > len(prompts)


def test_whole_groups_cut_the_queue_back_to_a_prompts_first_sample():
    model = make_model("llama")
    gen = Generator(model, max_batch_size=16, max_seq_len=32)
    prompts = random_prompts(3, min_len=4, max_len=4, seed=4)
    gen.add_requests(prompts, [SamplingParams(n=n, max_new_tokens=4) for n in (2, 3, 4)])  # indices 0 0 1 1 1 2 2 2 2
    scheduler = gen.scheduler
    assert [scheduler.whole_groups_of(c) for c in range(10)] == [0, 1, 2, 2, 2, 5, 5, 5, 5, 9]
    scheduler.num_active = 3  # rows in flight: a first group cut is left waiting
    scheduler.queue.popleft(), scheduler.queue.popleft()  # 1 1 1 2 2 2 2
    assert [scheduler.whole_groups_of(c) for c in range(8)] == [0, 0, 0, 3, 3, 3, 3, 7]
    scheduler.num_active = 0  # nothing in flight: a part of the group is admitted rather than nothing
    assert [scheduler.whole_groups_of(c) for c in range(4)] == [0, 1, 2, 3]
    scheduler.whole_groups = False
    scheduler.num_active = 3
    assert [scheduler.whole_groups_of(c) for c in range(8)] == list(range(8))


def test_where_a_small_pools_blocks_set_the_count_groups_are_split_as_before():
    # blocks free up only as rows finish: a group waiting for them was admitted alone, each group's tail drained first
    model = make_model("llama")
    prompts = random_prompts(8, min_len=20, max_len=30, seed=1)
    params = [SamplingParams(n=8, max_new_tokens=8 + 5 * (i % 7), ignore_eos=True, seed=0) for i in range(8)]
    runs = []
    for whole in (True, False):
        gen = Generator(model, max_batch_size=64, max_seq_len=64, kv_layout="paged", kv_pool_blocks=20)
        gen.scheduler.whole_groups = whole
        outs = gen.generate(prompts, params)
        runs.append(([o.token_ids for o in outs], [(r.kind, r.batch_size) for r in gen.last_trace]))
    assert runs[0] == runs[1]  # the same samples over the same steps
    assert sum(batch for kind, batch in runs[0][1] if kind == "prefill") > len(prompts), "no group was split"
