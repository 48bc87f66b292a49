"""The compiled suffix proposer drafts exactly what its numpy reference drafts, step by step, on real rollouts."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rollout import Generator, SamplingParams
from rollout.models import zoo
from rollout.tasks import arithmetic_dataset
from specdec.config import SpecConfig
from specdec.proposers import suffix_kernels
from specdec.proposers.suffix import SuffixProposer
from specdec.proposers.suffix_ref import Lockstep, SuffixIndexRef, SuffixProposerRef
from specdec.suffix_index import SuffixIndex


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


@pytest.mark.parametrize(
    "vocab_size,max_cached_requests,depth", [(16, 1, 24), (4, 2, 24), (8, 3, 24), (8, 2, 2), (8, 3, 3)]
)
def test_small_histories_and_shallow_tries_draft_like_the_reference(vocab_size, max_cached_requests, depth):
    """A history of 1-3 responses, so that most finishes evict while the finished rows' last tokens wait for the next
    step's insertion, and tries of depth 2 and 3 (shallower than a short draft's second round reaches back): a random
    Llama over a few tokens, 4 prompts x 2 samples through 4 slots, three calls; every step's drafts are the
    reference's."""
    from conftest import make_model, random_prompts

    model = make_model("llama", vocab_size=vocab_size)
    spec = SpecConfig(
        method="suffix",
        num_speculative_tokens=4,
        suffix_decoding_max_cached_requests=max_cached_requests,
        suffix_decoding_max_tree_depth=depth,
    )
    gen, lockstep = lockstep_generator(model, spec, num_slots=4, max_seq_len=64)
    prompts = random_prompts(4, vocab_size=vocab_size, min_len=1, max_len=4, seed=1)
    for seed in range(3):
        gen.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=seed))
    assert lockstep.num_steps > 100 and lockstep.num_drafted > 1000  # not vacuous
    assert lockstep.new.stats()["responses"] == max_cached_requests


def trie_paths(index, root: int, depth: int, vocab: int) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every n-gram under `root` with a nonzero count: its count and the token of its best child (-1 if none)."""
    paths, stack = {}, [(root, ())]
    while stack:
        node, path = stack.pop()
        best = int(index.best[node])
        paths[path] = (int(index.count[node]) if path else 0, int(index.token[best]) if best >= 0 else -1)
        if len(path) < depth:
            children = index.child(np.full(vocab, node), np.arange(vocab))
            stack += [(int(c), (*path, t)) for t, c in enumerate(children.tolist()) if c >= 0 and index.count[c] > 0]
    return paths


@pytest.mark.parametrize("seed", range(4))
def test_compiled_store_counts_like_the_reference_when_sequences_share_nodes(seed):
    """Many short sequences over 2-3 tokens in two tries, appended in ragged batches: most parents of a batch are named
    by several sequences with different next tokens, where best children tie. Every n-gram's count and best child
    equal the reference's after every batch."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        depth, vocab, num = int(rng.integers(2, 6)), int(rng.integers(2, 4)), int(rng.integers(1, 9))
        new, ref = SuffixIndex(depth), SuffixIndexRef(depth)
        roots = [(new.new_root(), ref.new_root()) for _ in range(2)]
        owner = rng.integers(0, 2, num)
        frontier_new = new.start(np.array([roots[o][0] for o in owner]))
        frontier_ref = ref.start(np.array([roots[o][1] for o in owner]))
        for _ in range(int(rng.integers(1, 10))):
            width = int(rng.integers(1, 4))
            tokens, lengths = rng.integers(0, vocab, (num, width)), rng.integers(0, width + 1, num)
            frontier_new = new.insert(frontier_new, tokens, lengths)
            frontier_ref = ref.insert(frontier_ref, tokens, lengths)
            for root_new, root_ref in roots:
                assert trie_paths(new, root_new, depth, vocab) == trie_paths(ref, root_ref, depth, vocab)


@pytest.mark.parametrize("seed", range(8))
def test_rows_rolled_back_between_steps_draft_like_the_reference(seed):
    """A row whose token count falls between two proposals (a restored snapshot: the rewind path, which the auto
    policy's warm-up does not reach today) and rows finishing among them: the compiled proposer drafts what the
    reference drafts at every step (`Lockstep` compares them)."""
    import torch

    from specdec.processing import RowSampling
    from specdec.proposers.base import ProposalBatch

    rng = np.random.default_rng(seed)
    slots, vocab, positions = 6, 5, 60
    new = SuffixProposer(4, vocab, slots, positions, max_tree_depth=6)
    both = Lockstep(new, SuffixProposerRef(4, vocab, slots, positions, max_tree_depth=6))
    both.begin()
    prompts = [list(rng.integers(0, vocab, rng.integers(1, 5))) for _ in range(2)]
    both.prefill(0, prompts, torch.tensor([row % 2 for row in range(slots)]), [{} for _ in range(slots)])
    tokens = np.zeros((slots, positions), dtype=np.int64)
    num_tokens = np.array([len(prompts[row % 2]) for row in range(slots)])
    for row in range(slots):
        tokens[row, : num_tokens[row]] = prompts[row % 2]
    live, saved, rewound = np.ones(slots, dtype=bool), None, 0
    no_filter = (torch.ones(slots), torch.zeros(slots, dtype=torch.long), torch.ones(slots))
    sampling = RowSampling(*no_filter, False, False, False)
    for step in range(40):
        if not live.any():
            break
        for row in np.nonzero(live & (num_tokens + 4 < positions))[0]:  # each live row gains 1-3 tokens
            gained = int(rng.integers(1, 4))
            tokens[row, num_tokens[row] : num_tokens[row] + gained] = rng.integers(0, vocab, gained)
            num_tokens[row] += gained
        if step == 3:
            saved = num_tokens.copy()
        if step in (6, 9, 14):  # some rows back to the step-3 snapshot
            back = live & (rng.random(slots) < 0.6) & (saved < num_tokens)
            rewound += int(back.sum())
            num_tokens = np.where(back, saved, num_tokens)
        asked = [4 if live[row] else 0 for row in range(slots)]
        batch = ProposalBatch(
            torch.as_tensor(tokens), num_tokens.tolist(), asked, sampling, torch.zeros(slots, 4, dtype=torch.float64)
        )
        both.propose(batch)
        if step % 7 == 5:  # a row finishes
            row = int(np.nonzero(live)[0][0])
            live[row] = False
            both.finish([row], torch.as_tensor(tokens), [int(num_tokens[row])])
    assert rewound > 0, "no row was rolled back: the rewind path was not tested"
    assert both.num_steps > 10 and both.num_drafted > 0


def _import_kernels_with(env: dict, check: str) -> subprocess.CompletedProcess:
    """Import the suffix kernels in a fresh process under `env` (numba reads its settings when imported), then run
    `check`."""
    code = f"import warnings; warnings.simplefilter('always'); from specdec.proposers import suffix_kernels; {check}"
    root = pathlib.Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(root), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_kernels_compile_uncached_where_numba_can_write_no_cache():
    """A read-only install with an unwritable HOME (a container run as another user): numba found no folder to cache
    in and the kernels' decorators raised at import, a traceback after the model loaded. They compile without a
    cache, and say so once. (NUMBA_CACHE_LOCATOR_CLASSES leaves numba only a locator for zip files: no folder.)"""
    check = (
        "import numpy as np; assert not suffix_kernels.CACHE; seen, work = suffix_kernels.scratch(4); print(len(work))"
    )
    done = _import_kernels_with({"NUMBA_CACHE_LOCATOR_CLASSES": "_ZipCacheLocator"}, check)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["36"]
    assert "numba cannot cache the suffix proposer's kernels" in done.stderr and "NUMBA_CACHE_DIR" in done.stderr


def test_stale_kernel_caches_are_dropped_in_numbas_cache_folder_wherever_it_is(tmp_path):
    """With NUMBA_CACHE_DIR (or a read-only package, which numba caches for under ~/.cache), the caches are not in the
    package's `__pycache__`, the only folder checked for stale kernels: after an edit of `suffix_kernels.py` the
    dependents loaded their old machine code. The check runs in numba's own folder for these files."""
    done = _import_kernels_with({"NUMBA_CACHE_DIR": str(tmp_path)}, "print(suffix_kernels.CACHE)")
    assert done.returncode == 0, done.stderr
    [stamp] = tmp_path.rglob("suffix_kernels.sources")
    assert stamp.parent == pathlib.Path(next(tmp_path.rglob("suffix_kernels._prefetch_probe*.nbi")).parent)


def test_kernel_caches_are_dropped_when_a_kernel_source_changes(tmp_path):
    """A dependent's cached kernels inline `suffix_kernels`' functions, and numba checks a cache against the kernel's
    own file only: the suffix kernels' caches go when any of the three sources changed, and stay otherwise."""
    folder = pathlib.Path(suffix_kernels.__file__).resolve().parent
    for name in ("suffix_kernels", "suffix_sync_kernels", "suffix_draft_kernels"):
        shutil.copy(folder / f"{name}.py", tmp_path / f"{name}.py")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    names = ["suffix_sync_kernels.sync_rows-15.py311.nbi", "suffix_draft_kernels.draft_chains-15.py311.1.nbc"]

    def cached() -> list[str]:
        for name in names:
            (cache / name).touch()
        (cache / "other.nbi").touch()  # not a suffix kernel's: kept
        return sorted(p.name for p in cache.iterdir() if p.suffix in (".nbi", ".nbc"))

    cached()
    assert suffix_kernels._drop_stale_caches(tmp_path, cache)  # no digest yet: whatever is there may be stale
    assert sorted(p.name for p in cache.iterdir()) == ["other.nbi", "suffix_kernels.sources"]
    before = cached()
    assert not suffix_kernels._drop_stale_caches(tmp_path, cache)  # nothing changed
    assert sorted(p.name for p in cache.iterdir() if p.suffix in (".nbi", ".nbc")) == before
    with open(tmp_path / "suffix_kernels.py", "a") as f:  # only the file the others inline changed
        f.write("\n# changed\n")
    assert suffix_kernels._drop_stale_caches(tmp_path, cache)
    assert sorted(p.name for p in cache.iterdir()) == ["other.nbi", "suffix_kernels.sources"]
    cached()
    with open(tmp_path / "suffix_draft_kernels.py", "a") as f:
        f.write("\n# changed\n")
    assert suffix_kernels._drop_stale_caches(tmp_path, cache)
    assert not any(p.name.startswith("suffix_") and p.suffix in (".nbi", ".nbc") for p in cache.iterdir())


def test_building_a_suffix_generator_compiles_every_loop_its_steps_call():
    """Numba compiles a loop at its first call: the first run of an install timed 15-30 s of compiling inside its
    first rollout's steps (43 tokens/s for about 2,300). Building the generator runs every loop once, so its steps
    compile nothing (each loop's compiled signatures, in a fresh process, are the same after two calls)."""
    check = """
import numba
from rollout import Generator, SamplingParams, SpecConfig
from rollout.models import zoo
from specdec.proposers import suffix_draft_kernels, suffix_sync_kernels
model = zoo.load_model("tiny-target")[0]
gens = [
    Generator(model, max_batch_size=4, max_seq_len=96, spec=SpecConfig(method="suffix", num_speculative_tokens=3,
              num_candidates=c, suffix_decoding_max_cached_requests=2))
    for c in (1, 3)
]
def compiled():
    modules = (suffix_kernels, suffix_sync_kernels, suffix_draft_kernels)
    return {(m.__name__, name): len(f.signatures) for m in modules for name, f in vars(m).items()
            if isinstance(f, numba.core.registry.CPUDispatcher)}
before = compiled()
for gen in gens:
    for seed in (0, 1):
        gen.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(n=2, max_new_tokens=40, seed=seed))
after = compiled()
assert before == after, {k: (before[k], after[k]) for k in after if before.get(k) != after[k]}
print(sum(1 for v in before.values() if v))
"""
    done = _import_kernels_with({"OMP_NUM_THREADS": "1"}, check)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 8  # (the loops a run calls, compiled while building)
