"""The compiled suffix proposer drafts exactly what its numpy reference drafts, step by step, on real rollouts."""

from __future__ import annotations

import numpy as np
import pytest

from rollout import Generator, SamplingParams
from rollout.models import zoo
from rollout.tasks import arithmetic_dataset
from specdec.config import SpecConfig
from specdec.proposers.suffix import SuffixProposer
from specdec.proposers.suffix_ref import Lockstep, SuffixIndexRef, SuffixProposerRef


def lockstep_generator(model, spec: SpecConfig, num_slots: int, max_seq_len: int) -> tuple[Generator, Lockstep]:
    gen = Generator(model, max_batch_size=num_slots, max_seq_len=max_seq_len, spec=spec)
    lockstep = Lockstep.replacing(gen.draft_history)
    gen.proposers.proposers["suffix"] = lockstep
    return gen, lockstep


def assert_same_tries(new: SuffixProposer, ref: SuffixProposerRef) -> None:
    """The same counts and best children along every node a row in flight or a trie root reaches: node ids differ
    (the reference allocates in another order), the tries do not."""
    assert isinstance(ref.index, SuffixIndexRef) and not isinstance(new.index, SuffixIndexRef)
    assert np.array_equal(new._num_inserted, ref._num_inserted)
    reached = 0
    for frontier_new, frontier_ref in zip(new._frontiers.reshape(-1).tolist(), ref._frontiers.reshape(-1).tolist()):
        a, b = frontier_new, frontier_ref
        assert (a < 0) == (b < 0)
        while a >= 0:  # down the best children: the path a draft walks
            assert new.index.count[a] == ref.index.count[b] and new.index.token[a] == ref.index.token[b]
            a, b = int(new.index.best[a]), int(ref.index.best[b])
            assert (a < 0) == (b < 0)
            reached += 1
    assert reached > 0


@pytest.fixture(scope="module")
def task():
    model, tokenizer = zoo.load_model("tiny-target")
    prompts = [
        tokenizer(p, add_special_tokens=False)["input_ids"] for p in arithmetic_dataset(12, "eval", seed=0)["prompt"]
    ]
    return model, prompts


@pytest.mark.slow
@pytest.mark.parametrize(
    "num_candidates,max_cached_requests", [(1, 10000), (1, 40), (2, 10000)], ids=["chains", "evicting", "trees"]
)
def test_compiled_drafts_equal_the_reference_step_by_step(task, num_candidates, max_cached_requests):
    """The shipped tiny target on held-out arithmetic prompts, 12 x 8 samples through 32 slots (rows finish, slots are
    refilled): a first rollout, then a second whose history holds the first (evicting: past 40 cached responses the
    oldest go, so counts also go down). Every step's drafts and scores (and tree parents) are the reference's, and so
    are the tries the rows walk."""
    model, prompts = task
    spec = SpecConfig(
        method="suffix",
        num_speculative_tokens=4,
        num_candidates=num_candidates,
        suffix_decoding_max_cached_requests=max_cached_requests,
    )
    longest = max(len(p) for p in prompts) + 160
    gen, lockstep = lockstep_generator(model, spec, num_slots=32, max_seq_len=longest)
    drafted = []
    for seed in (1, 2):  # first rollout, second rollout
        gen.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=160, seed=seed))
        assert_same_tries(lockstep.new, lockstep.ref)
        drafted.append(lockstep.num_drafted)
    assert lockstep.num_steps > 100 and drafted[0] > 1000 and drafted[1] - drafted[0] > 1000  # not vacuous
    assert lockstep.new.stats() == {**lockstep.ref.stats(), "bytes": lockstep.new.stats()["bytes"]}
