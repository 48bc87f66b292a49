"""The suffix proposer: exact counts, the best-scoring draft, history kept across calls, eviction, save/load."""

from __future__ import annotations

import collections
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import make_model, random_prompts

from rollout import Generator, SamplingParams
from specdec.config import SpecConfig, SpecDecodeParams
from specdec.proposers.base import ProposalBatch
from specdec.proposers.suffix import SuffixProposer
from specdec.proposers.suffix_tries import SuffixTries
from specdec.suffix_index import SuffixIndex

SEP = 97  # the separator of a proposer built for a 97-token vocabulary


def ngram_counts(sequences: list[list[int]], depth: int) -> collections.Counter:
    counts = collections.Counter()
    for seq in sequences:
        for end in range(len(seq)):
            for n in range(1, min(depth, end + 1) + 1):
                counts[tuple(seq[end - n + 1 : end + 1])] += 1
    return counts


def padded(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences as rows `[N, longest]` (0 past each end) and their lengths `[N]`."""
    lengths = np.array([len(s) for s in sequences])
    tokens = np.zeros((len(sequences), lengths.max()), dtype=np.int64)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    return tokens, lengths


def trie_counts(index: SuffixIndex, root: int) -> collections.Counter:
    """Every n-gram of the trie under `root` with a nonzero count, by walking first children and the hash table."""
    table = index._table[index._table[:, 0] >= 0]  # [parent, token, child] of the later children
    children = collections.defaultdict(list)
    for parent, node in zip(table[:, 0].tolist(), table[:, 2].tolist()):
        children[parent].append(node)
    for node, child in enumerate(index.first[: index.num_nodes].tolist()):
        if child >= 0:
            children[node].append(child)
    counts, stack = collections.Counter(), [(root, ())]
    while stack:
        node, path = stack.pop()
        for child in children[node]:
            gram = path + (int(index.token[child]),)
            if index.count[child] > 0:
                counts[gram] = int(index.count[child])
            stack.append((child, gram))
    return counts


def contents(proposer: SuffixProposer) -> tuple[dict[bytes, list[list[int]]], list[list[int]]]:
    """What each prompt trie and the global trie should hold: prompts, cached responses, responses in flight."""
    responses = [(key, r.tolist()) for key, r in proposer.history]
    for slot in np.flatnonzero(proposer._in_flight).tolist():
        n = int(proposer._num_inserted[slot] - proposer._prompt_len[slot])
        responses.append((proposer._slot_prompt[slot], proposer._responses[slot, :n].tolist()))
    by_prompt = {key: [np.frombuffer(key, dtype=np.int32).tolist()] for key in proposer.prompts}
    for key, response in responses:
        by_prompt[key].append([SEP] + response)
    return by_prompt, [[SEP] + r for _, r in responses]


def assert_counts_exact(proposer: SuffixProposer) -> None:
    proposer.flush()  # finished rows' last tokens go in with the next step's
    by_prompt, everything = contents(proposer)
    depth = proposer.max_tree_depth
    assert trie_counts(proposer.index, proposer.global_root) == ngram_counts(everything, depth)
    for key, sequences in by_prompt.items():
        assert trie_counts(proposer.index, proposer.prompts[key].root) == ngram_counts(sequences, depth)


def test_index_counts_every_ngram_and_forgets_removed_sequences():
    rng = np.random.default_rng(0)
    index = SuffixIndex(max_depth=5)
    root = index.new_root()
    sequences = [rng.integers(0, 4, size=rng.integers(1, 30)).tolist() for _ in range(12)]
    tokens, lengths = padded(sequences)
    index.insert(index.start(np.full(len(sequences), root)), tokens, lengths)
    assert trie_counts(index, root) == ngram_counts(sequences, 5)
    index.insert(index.start(np.full(5, root)), tokens[:5], lengths[:5], delta=-1)
    assert trie_counts(index, root) == ngram_counts(sequences[5:], 5)
    # best: a child of largest count wherever a node has a live child
    for node in range(1, index.num_nodes):
        best = index.best[node]
        if best >= 0:
            assert index.count[best] > 0


def test_many_sequences_through_one_node_store_count_exactly():
    # thousands of nodes (keys of parents past 2^10 overflow 32 bits), parents whose first child is made in the call,
    # and many sequences asking for the same new child at once (few tokens, long sequences); counted one token at a
    # time as rows in flight are, from a node store and a hash table too small at first (the table grows between
    # chunks of one call's keys)
    rng = np.random.default_rng(2)
    sequences = [rng.integers(0, 6, size=rng.integers(40, 120)).tolist() for _ in range(30)]
    tokens, lengths = padded(sequences)
    index = SuffixIndex(max_depth=7, capacity=64, table_capacity=64)
    root = index.new_root()
    index.insert(index.start(np.full(len(sequences), root)).astype(np.int32), tokens, lengths)
    assert index.num_nodes > 4096 and len(index._table) > 64
    assert trie_counts(index, root) == ngram_counts(sequences, 7)
    by_depth = SuffixIndex(max_depth=7, capacity=64, table_capacity=64)  # a call's keys by the thousand
    root = by_depth.new_root()
    by_depth.add_sequences(np.full(len(sequences), root), tokens, lengths)
    assert trie_counts(by_depth, root) == ngram_counts(sequences, 7)


def proposal(token_lists: list[list[int]], asked: list[int]) -> ProposalBatch:
    width = max(len(t) for t in token_lists)
    token_ids = torch.zeros(len(token_lists), width, dtype=torch.long)
    for i, t in enumerate(token_lists):
        token_ids[i, : len(t)] = torch.tensor(t)
    return ProposalBatch(token_ids, [len(t) for t in token_lists], asked, None, torch.zeros(len(asked), max(asked)))


def test_draft_follows_the_most_frequent_continuation_and_its_probabilities():
    proposer = SuffixProposer(4, vocab_size=SEP, num_slots=4, num_positions=64, max_tree_depth=8)
    prompt = [5, 6, 7]
    proposer.prefill(0, [prompt], torch.zeros(3, dtype=torch.long), [{}, {}, {}])
    # two earlier siblings said "1 2 3 4" and "1 2 3 9"; the third row has just said "1"
    rows = [prompt + [1, 2, 3, 4], prompt + [1, 2, 3, 9], prompt + [1]]
    drafts = proposer.propose(proposal(rows, [0, 0, 4]))
    # after "1" (match length 1) at most 1 token: 2 (seen twice of 2 other occurrences); after SEP 1 (m = 2): 2 3;
    # then a second round from the context the draft ends in: "SEP 1 2 3" went on with 4 once and 9 once (p = 1/2)
    assert drafts.num_drafted == [0, 0, 3]
    assert drafts.token_ids[2, :2].tolist() == [2, 3] and int(drafts.token_ids[2, 2]) in (4, 9)
    # a path probability below min_token_prob stops the draft: 4 and 9 each follow "1 2 3" half of the time
    strict = SuffixProposer(4, SEP, 4, 64, max_tree_depth=8, max_spec_factor=4.0, min_token_prob=0.6)
    strict.prefill(0, [prompt], torch.zeros(3, dtype=torch.long), [{}, {}, {}])
    drafts = strict.propose(proposal(rows, [0, 0, 4]))
    assert drafts.token_ids[2].tolist() == [2, 3, -1, -1]  # the second round's 1/2 is below 0.6 too
    assert_counts_exact(strict)


def test_prompt_lookup_and_other_prompts_both_draft():
    proposer = SuffixProposer(3, SEP, 4, 64, max_tree_depth=6, max_spec_factor=2.0)
    proposer.prefill(0, [[10, 11, 12, 13, 14], [20, 21]], torch.tensor([0, 1]), [{}, {}])
    # row 0 ends on a piece of its prompt: its prompt trie drafts the rest; row 1 follows row 0's response
    rows = [[10, 11, 12, 13, 14, 30, 31, 32, 33, 11, 12], [20, 21, 30, 31]]
    drafts = proposer.propose(proposal(rows, [3, 3]))
    assert drafts.token_ids.tolist() == [[13, 14, -1], [32, 33, 11]]  # row 1: "SEP 30 31" matched, 3 tokens
    assert_counts_exact(proposer)


def test_a_finished_rows_last_tokens_draft_at_the_next_step_and_eviction_waits_for_them():
    proposer = SuffixProposer(3, SEP, 4, 64, max_tree_depth=6, max_spec_factor=2.0, max_cached_requests=1)
    prompt = [5, 6]
    proposer.prefill(0, [prompt], torch.zeros(2, dtype=torch.long), [{}, {}])
    proposer.propose(proposal([prompt + [1], prompt + [2]], [2, 2]))
    # row 0 finishes with tokens the tries have not seen: "7 8 9" is inserted with the next step's tokens
    finished = proposal([prompt + [1, 7, 8, 9], prompt + [2]], [0, 0])
    proposer.finish([0], finished.token_ids, [6])
    proposer.copy_rows(torch.tensor([1]), torch.tensor([0]), 8)
    # the next step's row says "7 8": only the finished row's last tokens continue it
    drafts = proposer.propose(proposal([prompt + [2, 7, 8]], [2]))
    assert drafts.token_ids[0, :1].tolist() == [9]
    assert_counts_exact(proposer)
    # a cap below the rows finishing at once: a response is evicted whose last tokens were deferred; they go in first
    proposer.prefill(1, [prompt], torch.zeros(1, dtype=torch.long), [{}])
    rows = proposal([prompt + [2, 7, 8, 4], prompt + [3, 3]], [0, 0])
    proposer.finish([0, 1], rows.token_ids, [6, 4])
    assert [r.tolist() for _, r in proposer.history] == [[3, 3]]
    assert_counts_exact(proposer)  # the tries hold the one cached response, exactly
    # responses added while a finished row's last tokens wait: evicting that row's response still finds them inserted
    proposer.prefill(0, [prompt], torch.zeros(1, dtype=torch.long), [{}])
    proposer.finish([0], proposal([prompt + [7, 7]], [0]).token_ids, [4])
    proposer.add_responses([prompt], [[1, 1]])
    assert [r.tolist() for _, r in proposer.history] == [[1, 1]]
    assert_counts_exact(proposer)


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_greedy_with_suffix_equals_plain_greedy_and_history_raises_acceptance(num_candidates):
    model = make_model("llama")
    prompts = [p * 3 for p in random_prompts(5, max_len=5, seed=3)] + random_prompts(4, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=24, n=2)
    plain = Generator(model, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    spec = SpecConfig(method="suffix", num_speculative_tokens=4, num_candidates=num_candidates)
    gen = Generator(model, max_batch_size=4, max_seq_len=96, spec=spec)
    accepted = []
    for _ in range(2):
        outs = gen.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        accepted.append(sum(r.num_accepted for r in gen.last_trace))
        assert_counts_exact(gen.draft_history)
    assert accepted[1] > accepted[0] > 0
    assert gen.draft_history.stats()["responses"] == 2 * len(prompts) * 2
    if num_candidates > 1:  # some row verified a branching tree: more nodes than its depth
        assert any(r.num_drafted > sum(r.drafted_per_position) for r in gen.last_trace)


def test_eviction_drops_the_oldest_responses_first():
    model = make_model("qwen2")
    prompts = random_prompts(6, seed=8)
    spec = SpecConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_max_cached_requests=4)
    gen = Generator(model, max_batch_size=3, max_seq_len=64, spec=spec)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    gen.generate(prompts[:3], params)
    first = [r.tolist() for _, r in gen.draft_history.history]
    outs = gen.generate(prompts[3:], params)
    kept = list(gen.draft_history.history)
    assert len(kept) == 4
    assert [r.tolist() for _, r in kept[:1]] == first[-1:]  # the newest of the first call survives
    assert sorted(r.tolist() for _, r in kept[1:]) == sorted(o.token_ids for o in outs)
    assert len(gen.draft_history.prompts) == 4  # the two evicted prompts' tries are gone
    assert_counts_exact(gen.draft_history)
    gen.draft_history.clear()
    assert gen.draft_history.stats()["responses"] == 0


def test_the_history_cleared_or_loaded_mid_call_keeps_the_rows_in_flight(tmp_path):
    """`clear()` or `load()` from an `on_step` callback dropped the rows in flight from the tries, and the call then
    failed at their finish (KeyError). The cached responses go now; the rows in flight stay and join the history as
    they finish, the counts stay exact, and the samples are the ones the call draws without it."""
    model = make_model("llama")
    prompts = [p * 2 for p in random_prompts(6, max_len=6, seed=11)]
    spec = SpecConfig(method="suffix", num_speculative_tokens=3)
    params = SamplingParams(n=2, max_new_tokens=14, seed=0)
    plain = Generator(model, max_batch_size=4, max_seq_len=64, spec=spec)
    plain.generate(prompts, params)
    plain.draft_history.save(tmp_path / "history.npz")
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    for action in ("clear", "load"):
        gen = Generator(model, max_batch_size=4, max_seq_len=64, spec=spec)
        gen.generate(prompts, params)  # a history to drop
        history = gen.draft_history
        done = []

        def midway(record, num_finished, total, history=history, action=action, done=done):
            # rows in flight and some finished: the case this is about
            if record.kind == "decode" and num_finished >= 2 and history._in_flight.any() and not done:
                done.append(len(history.history))
                history.clear() if action == "clear" else history.load(tmp_path / "history.npz")

        outs = gen.generate(prompts, params, on_step=midway)
        assert [o.token_ids for o in outs] == expected, action
        assert done and done[0] > 0
        num_loaded = 0 if action == "clear" else 2 * len(prompts)
        assert 0 < len(history.history) - num_loaded < 2 * len(prompts)  # those that finished after it, not before
        assert_counts_exact(history)


def test_no_cached_requests_keeps_no_history():
    model = make_model("qwen2")
    spec = SpecConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_max_cached_requests=0)
    gen = Generator(model, max_batch_size=2, max_seq_len=64, spec=spec)
    gen.generate(random_prompts(4, seed=9), SamplingParams(temperature=0, max_new_tokens=8, n=2))
    assert gen.draft_history.stats()["responses"] == 0 and not gen.draft_history.prompts
    assert_counts_exact(gen.draft_history)


def test_save_and_load_round_trip(tmp_path):
    model = make_model("llama")
    prompts = [p * 2 for p in random_prompts(4, max_len=6, seed=10)]
    params = SamplingParams(temperature=0, max_new_tokens=16, n=2)
    spec = SpecConfig(method="suffix", num_speculative_tokens=3)
    gen = Generator(model, max_batch_size=4, max_seq_len=64, spec=spec)
    gen.generate(prompts, params)
    gen.draft_history.save(tmp_path / "history.npz")
    gen.generate(prompts, params)
    second = [(r.num_drafted, r.num_accepted) for r in gen.last_trace]

    other = Generator(model, max_batch_size=4, max_seq_len=64, spec=spec)
    other.draft_history.load(tmp_path / "history.npz")
    assert other.draft_history.stats()["responses"] == len(prompts) * 2
    other.generate(prompts, params)
    assert [(r.num_drafted, r.num_accepted) for r in other.last_trace] == second
    with pytest.raises(ValueError, match="cannot load a suffix history"):
        other.draft_history.load(tmp_path / "missing.npz")
    # a name without .npz is the file's name (numpy added .npz, and load of the same name found nothing)
    gen.draft_history.save(str(tmp_path / "history"))
    assert (tmp_path / "history").is_file() and not (tmp_path / "history.npz.npz").exists()
    third = Generator(model, max_batch_size=4, max_seq_len=64, spec=spec)
    third.draft_history.load(str(tmp_path / "history"))
    assert third.draft_history.stats()["responses"] == gen.draft_history.stats()["responses"]


def test_load_takes_only_the_newest_responses_the_history_keeps(tmp_path):
    """A file of more responses than `max_cached_requests` loads as its newest ones: the store is the one those alone
    build (the older ones, inserted and evicted at once, left their nodes in it until a later call's rebuild: with
    `max_cached_requests=0`, a whole loaded history's memory for nothing)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 50, 5).tolist() for _ in range(6)]
    responses = [rng.integers(0, 50, 30).tolist() for _ in range(6)]
    full = SuffixTries(vocab_size=50, num_slots=2, num_positions=64, max_tree_depth=6)
    full.add_responses(prompts, responses)
    full.save(tmp_path / "six.npz")
    for keep in (0, 2, 6, 9):
        loaded = SuffixTries(vocab_size=50, num_slots=2, num_positions=64, max_tree_depth=6, max_cached_requests=keep)
        loaded.load(tmp_path / "six.npz")
        newest = SuffixTries(vocab_size=50, num_slots=2, num_positions=64, max_tree_depth=6)
        if keep:
            newest.add_responses(prompts[-keep:], responses[-keep:])
        assert loaded.stats() == newest.stats(), keep
        assert [r.tolist() for _, r in loaded.history] == responses[len(responses) - min(keep, 6) :]


def test_adopt_moves_a_history_as_it_is_and_refuses_what_cannot_move():
    """`adopt` takes another proposer's tries as they are (the same counts and nodes, where `load` rebuilds them),
    empties the other, evicts past its own `max_cached_requests`, and refuses another depth or vocabulary."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 50, 5).tolist() for _ in range(4)]
    responses = [rng.integers(0, 50, 20).tolist() for _ in range(4)]
    old = SuffixTries(vocab_size=50, num_slots=2, num_positions=64, max_tree_depth=6)
    old.add_responses(prompts, responses)
    stats = old.stats()
    new = SuffixTries(vocab_size=50, num_slots=2, num_positions=64, max_tree_depth=6)
    new.adopt(old)
    assert new.stats() == stats and old.stats()["responses"] == 0 and old.stats()["nodes"] == 1
    new.adopt(new)  # its own history: kept (it was emptied)
    assert new.stats() == stats
    small = SuffixTries(vocab_size=50, num_slots=2, num_positions=64, max_tree_depth=6, max_cached_requests=1)
    small.adopt(new)
    assert [r.tolist() for _, r in small.history] == responses[-1:]
    for other in (SuffixTries(vocab_size=50, num_slots=2, num_positions=64, max_tree_depth=5),
                  SuffixTries(vocab_size=60, num_slots=2, num_positions=64, max_tree_depth=6)):  # fmt: skip
        with pytest.raises(ValueError, match="adopt: that history counts n-grams up to"):
            small.adopt(other)
    with pytest.raises(ValueError, match="adopt takes another suffix proposer's history, got str"):
        small.adopt("history.npz")


def test_a_history_made_for_another_vocabulary_is_refused_on_load(tmp_path):
    """`load` checks token ids as `add_responses` does: a history saved for a larger vocabulary (or a damaged file)
    would otherwise be drafted from, feeding the target ids past its vocabulary."""
    big = SuffixProposer(3, vocab_size=1000, num_slots=1, num_positions=16)
    big.add_responses([[1]], [[2, 700, 800, 900]])
    big.save(tmp_path / "history.npz")
    small = SuffixProposer(3, vocab_size=100, num_slots=1, num_positions=16)
    small.add_responses([[1]], [[2, 3]])
    with pytest.raises(ValueError, match=r"response_tokens hold ids outside this model's vocabulary \[0, 100\)"):
        small.load(tmp_path / "history.npz")
    assert [r.tolist() for _, r in small.history] == [[2, 3]]  # what it held is kept
    small.add_responses([[1]], [[]])  # an empty response (and an empty history) round-trips
    small.save(tmp_path / "small.npz")
    small.load(tmp_path / "small.npz")
    assert [r.tolist() for _, r in small.history] == [[2, 3], []]


def _saved_arrays(path) -> dict:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", "BadZipFile"),
        ("npy", "expected an .npz archive"),
        ("owner out of range", "response_prompt names prompt 2 of 2"),
        ("fewer owners", "response_prompt names 1 prompts for 2 responses"),
        ("lengths past the tokens", "response_lens add up to 7 tokens, response_tokens holds 5"),
        ("negative length", "response_lens holds a negative value"),
        ("float lengths", "response_lens must be one row of integers"),
        ("lengths that wrap around", "response_lens holds a length of 4611686018427387907 tokens"),
    ],
)
def test_a_damaged_history_file_is_refused_and_the_history_kept(tmp_path, damage, message):
    """`load` reads the whole file and checks that its arrays make one history before it replaces anything: a damaged
    file is one ValueError naming what is wrong, never another exception, a history half replaced or responses split
    at the wrong places."""
    saved = SuffixProposer(3, vocab_size=10, num_slots=1, num_positions=16)
    saved.add_responses([[1, 2], [7]], [[3, 4, 5], [8, 9]])
    good = tmp_path / "good.npz"
    saved.save(good)
    path, arrays = tmp_path / "damaged.npz", _saved_arrays(good)
    if damage == "truncated":
        path.write_bytes(good.read_bytes()[:100])
    elif damage == "npy":
        path = tmp_path / "damaged.npy"
        np.save(path, arrays["response_tokens"])
    else:
        changed = {
            "owner out of range": {"response_prompt": np.array([0, 2])},
            "fewer owners": {"response_prompt": np.array([0])},
            "lengths past the tokens": {"response_lens": np.array([3, 4])},
            "negative length": {"response_lens": np.array([6, -1])},
            "float lengths": {"response_lens": np.array([3.0, 2.0])},
            # four lengths 2^62 too long: their int64 sum wraps around to the 5 tokens there are
            "lengths that wrap around": {
                "response_lens": np.array([3, 2, 0, 0]) + 2**62,
                "response_prompt": np.array([0, 1, 1, 1]),
            },
        }[damage]
        np.savez(path, **{**arrays, **changed})
    proposer = SuffixProposer(3, vocab_size=10, num_slots=1, num_positions=16)
    proposer.add_responses([[1]], [[6, 6]])
    with pytest.raises(ValueError, match=f"cannot load a suffix history from .*{message}"):
        proposer.load(path)
    assert [r.tolist() for _, r in proposer.history] == [[6, 6]] and proposer.stats()["prompts"] == 1
    proposer.load(good)  # the good file loads, responses where they were
    assert [r.tolist() for _, r in proposer.history] == [[3, 4, 5], [8, 9]]


def three_steps_in_lockstep():
    """A generator of 4 sampled rows, 3 steps in, its suffix proposer in lockstep with the reference (no history
    kept), and the lockstep."""
    from specdec.proposers.suffix_ref import Lockstep

    spec = SpecConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_max_cached_requests=0)
    gen = Generator(make_model("llama"), max_batch_size=4, max_seq_len=64, spec=spec, async_scheduling=False)
    lockstep = Lockstep.replacing(gen.draft_history)
    gen.proposers.proposers["suffix"] = lockstep
    gen.add_requests(random_prompts(2, seed=14), SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=3))
    for _ in range(3):
        gen.step()
    return gen, lockstep


def test_a_restored_snapshot_takes_the_rolled_back_text_out_of_the_tries():
    """`Generator.restore` rolls rows back: what they generated since the snapshot is text no row holds any more, so
    it leaves the tries, which hold exactly the prompts, the cached responses and the rows in flight; the reference
    drafts alike at every step (`Lockstep`)."""
    gen, lockstep = three_steps_in_lockstep()
    saved = gen.snapshot()
    for _ in range(4):
        gen.step()
    gen.restore(saved)
    gen.step()  # the rows take in what they sample now, after the snapshot's text
    assert_counts_exact(lockstep.new)
    gen.abort()
    gen.generate(random_prompts(2, seed=15), SamplingParams(temperature=0, max_new_tokens=4))
    assert_counts_exact(lockstep.new)  # nothing kept (max_cached_requests=0): no prompt, no response
    assert not lockstep.new.prompts and lockstep.num_drafted > 0


def test_rows_given_up_unfinished_leave_the_tries():
    """Rows preempted by a pool short of blocks start over later, and rows a restore leaves out of a snapshot's
    prefix are dropped: what either had taken in is text no row holds, so it leaves the tries, which hold exactly the
    prompts, the cached responses and the rows in flight (no prompt trie kept for nothing); the reference drafts
    alike at every step (`Lockstep`)."""
    from specdec.proposers.suffix_ref import Lockstep

    model = make_model("qwen2")
    spec = SpecConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_max_cached_requests=0)
    gen = Generator(model, max_batch_size=18, max_seq_len=64, kv_layout="paged", kv_pool_blocks=16, spec=spec)
    lockstep = Lockstep.replacing(gen.draft_history)
    gen.proposers.proposers["suffix"] = lockstep
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=0)
    gen.generate(random_prompts(6, min_len=10, max_len=20, seed=7), params)
    assert sum(r.num_preempted for r in gen.last_trace) > 0, "expected a pool that preempts"
    assert_counts_exact(lockstep.new)
    assert not lockstep.new.prompts and not lockstep.new._in_flight.any()

    gen.add_requests(random_prompts(2, seed=14), SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=3))
    for _ in range(3):
        gen.step()
    saved = gen.snapshot()
    assert len(saved) == 4
    gen.step()
    gen.restore(saved[:1])  # the first row goes on, the other three are left out
    gen.step()
    assert_counts_exact(lockstep.new)
    assert int(lockstep.new._in_flight.sum()) == 1 and lockstep.num_drafted > 0


def test_aborted_and_closed_rows_leave_the_tries_and_a_refused_restore_drops_nothing():
    """`abort` and `close` end the rows in flight unfinished (a call that keeps rows in flight starts after an abort
    without `begin`'s clean-up); a restore refused because a row holds another sequence now changes no row of the
    tries (the rows it would have left out are still in flight)."""
    model = make_model("qwen2")
    spec = SpecConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_max_cached_requests=0)
    gen = Generator(model, max_batch_size=4, max_seq_len=64, spec=spec, async_scheduling=False)
    history = gen.draft_history
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=3)
    gen.add_requests(random_prompts(2, seed=14), params)
    for _ in range(4):
        gen.step()
    gen.abort()
    gen.add_requests(random_prompts(2, seed=15), replace(params, max_new_tokens=8), keep_in_flight=True)
    while gen.has_unfinished:
        gen.step()
    assert_counts_exact(history)
    assert not history.prompts

    lengths = [SamplingParams(temperature=1.0, max_new_tokens=m, seed=3) for m in (3, 30, 30, 30)]
    gen.add_requests(random_prompts(4, seed=16), lengths)
    gen.step()
    saved = gen.snapshot()
    while gen.num_active == 4:  # the short row finishes and the last row moves into its slot
        gen.step()
    with pytest.raises(ValueError, match="row 0 no longer holds the sequence this snapshot saw there"):
        gen.restore(saved[:2])
    assert int(history._in_flight.sum()) == 3
    while gen.has_unfinished:
        gen.step()
    assert_counts_exact(history)
    gen.add_requests(random_prompts(2, seed=17), params)
    gen.step()
    gen.close()
    assert history.stats()["prompts"] == 0 and not history._in_flight.any()


def test_interrupted_call_leaves_only_finished_responses():
    model = make_model("qwen2")
    gen = Generator(model, max_batch_size=4, max_seq_len=64, spec=SpecConfig(method="suffix"))

    def stop_after_a_few(record, finished, total):
        if len(gen.last_trace) == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gen.generate(
            random_prompts(6, seed=11), SamplingParams(temperature=0, max_new_tokens=12), on_step=stop_after_a_few
        )
    finished = gen.draft_history.stats()["responses"]
    gen.generate(random_prompts(2, seed=12), SamplingParams(temperature=0, max_new_tokens=4))
    assert not gen.draft_history._in_flight.any()
    assert gen.draft_history.stats()["responses"] == finished + 2
    assert_counts_exact(gen.draft_history)


def test_suffix_combines_with_a_draft_model_requests_and_policies():
    model = make_model("llama")
    draft = make_model("llama", seed=1, num_hidden_layers=1)
    prompts = [p * 3 for p in random_prompts(4, max_len=5, seed=13)]
    params = SamplingParams(temperature=0, max_new_tokens=16)
    plain = Generator(model, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    for spec in (
        SpecConfig(method=["suffix", "draft_model"], model=draft, num_speculative_tokens=3),
        SpecConfig(
            method="suffix", num_speculative_tokens=4, num_speculative_tokens_per_batch_size=[[1, 2, 4], [3, 4, 1]]
        ),
        SpecConfig(method="suffix", num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto"),
    ):
        gen = Generator(model, max_batch_size=4, max_seq_len=96, spec=spec)
        assert gen.draft_history.stats()["responses"] == 0  # auto's warm-up leaves nothing behind
        for _ in range(2):
            assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in plain]
    gen = Generator(model, max_batch_size=4, max_seq_len=96, spec=SpecConfig(method=["ngram", "suffix"]))
    mixed = [
        SamplingParams(temperature=0, max_new_tokens=16, spec=SpecDecodeParams(method=m))
        for m in ("suffix", "ngram", None, "suffix")
    ]
    assert [o.token_ids for o in gen.generate(prompts, mixed)] == [o.token_ids for o in plain]


@pytest.mark.parametrize(
    "field,value",
    [
        ("suffix_decoding_max_tree_depth", 1),
        ("suffix_decoding_max_cached_requests", -1),
        ("suffix_decoding_max_spec_factor", 0),
        ("suffix_decoding_min_token_prob", 1.5),
    ],
)
def test_a_bad_suffix_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        SpecConfig(method="suffix", **{field: value})


@pytest.mark.parametrize("factor", [1e19, float("inf")])
def test_a_spec_factor_past_the_depth_drafts_as_the_depth_allows(factor):
    """A match of m tokens drafts at most depth - m tokens whatever the factor: a factor too large for int64 (m x 1e19,
    inf) drafts what a factor of the depth does (it drafted nothing: the cap wrapped negative)."""
    drafts = {}
    for f in (9.0, factor):
        proposer, rows, asked = copied_texts_proposer(f)  # depth 9
        out = proposer.propose(proposal(rows, asked))
        drafts[f] = [out.token_ids[i, :n].tolist() for i, n in enumerate(out.num_drafted)]
    assert sum(len(d) for d in drafts[9.0]) > 24  # the comparison is not vacuous
    assert drafts[factor] == drafts[9.0]


def test_numpy_numbers_are_taken_as_python_ones():
    spec = SpecConfig(
        method="suffix",
        num_speculative_tokens=np.int64(3),
        num_candidates=np.int32(2),
        suffix_decoding_max_tree_depth=np.int16(12),
        suffix_decoding_max_cached_requests=np.uint8(7),
        suffix_decoding_max_spec_factor=np.float32(1.5),
        suffix_decoding_min_token_prob=np.float64(0.25),
        num_speculative_tokens_per_batch_size=[[np.int64(1), np.int64(8), np.int64(3)], (9, np.int32(64), 1)],
    )
    fields = ("num_speculative_tokens", "num_candidates", "suffix_decoding_max_tree_depth")
    assert [(getattr(spec, f), type(getattr(spec, f))) for f in fields] == [(3, int), (2, int), (12, int)]
    assert type(spec.suffix_decoding_max_cached_requests) is int and spec.suffix_decoding_max_cached_requests == 7
    assert (spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob) == (1.5, 0.25)
    assert type(spec.suffix_decoding_max_spec_factor) is float and type(spec.suffix_decoding_min_token_prob) is float
    assert spec.num_speculative_tokens_per_batch_size == [[1, 8, 3], [9, 64, 1]]
    assert all(type(v) is int for entry in spec.num_speculative_tokens_per_batch_size for v in entry)
    ngram = SpecConfig(method="ngram", prompt_lookup_min=np.int64(2), prompt_lookup_max=np.int8(3))
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (2, 3) and type(ngram.prompt_lookup_max) is int
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(np.float64\(3.0\)\) must be an integer"):
        SpecConfig(method="suffix", num_speculative_tokens=np.float64(3.0))  # a real is not taken for a count
    # a K table built in numpy (or torch) whole, or row by row: its rows as lists of Python's integers
    for table in (np.array([[1, 8, 3], [9, 64, 1]]), [np.array([1, 8, 3]), np.array([9, 64, 1])]):
        spec = SpecConfig(method="suffix", num_speculative_tokens=3, num_speculative_tokens_per_batch_size=table)
        assert spec.num_speculative_tokens_per_batch_size == [[1, 8, 3], [9, 64, 1]]
        assert all(type(v) is int for entry in spec.num_speculative_tokens_per_batch_size for v in entry)
    with pytest.raises(ValueError, match=r"entry \[1.5, 8.0, 3.0\] must be three integers"):
        SpecConfig(
            method="suffix", num_speculative_tokens=3, num_speculative_tokens_per_batch_size=np.array([[1.5, 8, 3]])
        )


@pytest.mark.parametrize(
    "field,value,method",
    [
        ("num_candidates", True, "ngram"),
        ("prompt_lookup_min", True, "ngram"),
        ("prompt_lookup_max", True, "ngram"),
        ("suffix_decoding_max_tree_depth", 1025, "suffix"),
        ("suffix_decoding_max_tree_depth", 10**9, "suffix"),
    ],
)
def test_bools_and_a_depth_past_the_bound_are_refused_by_the_config(field, value, method):
    """True is an int to Python and was taken as 1 (num_candidates) or refused only by the Generator; a depth of 1e9
    failed in numpy's words allocating the frontiers."""
    with pytest.raises(ValueError, match=rf"^{field} \({value!r}\) must be an integer"):
        SpecConfig(method=method, **{field: value})


def test_trees_from_a_cascade_are_refused():
    with pytest.raises(ValueError, match="num_candidates"):
        SpecConfig(method=["suffix", "ngram"], num_candidates=3)


def test_whole_sequences_added_by_depth_match_token_by_token_insertion():
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, 5, size=rng.integers(1, 40)).tolist() for _ in range(9)]
    tokens, lengths = padded(sequences)
    by_token, by_depth = SuffixIndex(max_depth=6), SuffixIndex(max_depth=6)
    a, b = by_token.new_root(), by_depth.new_root()
    by_token.insert(by_token.start(np.full(9, a)), tokens, lengths)
    by_depth.add_sequences(np.full(9, b), tokens, lengths)
    assert trie_counts(by_depth, b) == trie_counts(by_token, a) == ngram_counts(sequences, 6)
    by_depth.add_sequences(np.full(4, b), tokens[:4], lengths[:4], delta=-1)
    assert trie_counts(by_depth, b) == ngram_counts(sequences[4:], 6)


@pytest.mark.parametrize("depth", [0, 1, 2.5])
def test_a_proposer_built_directly_refuses_a_depth_that_drafts_nothing(depth):
    """A depth of 1 counts single tokens only: no match length is left to draft from (it failed in the reference and
    in token trees); `SpecConfig` refuses it too."""
    with pytest.raises(ValueError, match=r"suffix_decoding_max_tree_depth .* must be an integer >= 2"):
        SuffixProposer(3, vocab_size=10, num_slots=1, num_positions=16, max_tree_depth=depth)


def test_a_vocabulary_beyond_the_trie_keys_is_refused():
    with pytest.raises(ValueError, match="vocabularies of up to 2097151 tokens, got 2097152"):
        SuffixProposer(3, vocab_size=1 << 21, num_slots=2, num_positions=8)
    SuffixProposer(3, vocab_size=(1 << 21) - 1, num_slots=2, num_positions=8)  # the largest that fits


def every_walk_drafts(proposer: SuffixProposer, asked: list[int]) -> list[list[int]]:
    """The draft of highest score of each row over every (trie, match length) walk, none skipped; a tie goes to the
    later walk (trie, then match length), as in the proposer."""
    index, depth = proposer.index, proposer.max_tree_depth
    drafts = []
    for row, k in enumerate(asked):
        best = (-1.0, [])
        for source in proposer.sources:
            for m in range(1, depth):
                node = int(proposer._frontiers[source, row, m])
                limit = min(k, int(np.floor(m * proposer.max_spec_factor)), depth - m)
                if node < 0 or index.count[node] < 2 or limit < 1:
                    continue
                tokens, lengths, scores, _ = index.walk(
                    np.array([node]), np.array([limit]), proposer.min_token_prob, max(asked), num_open=1
                )
                if lengths[0] > 0 and scores[0] >= best[0]:
                    best = (scores[0], tokens[0, : lengths[0]].tolist())
        drafts.append(best)
    return drafts


def copied_texts_proposer(
    max_spec_factor: float, vocab: int = 6, seed: int = 3
) -> tuple[SuffixProposer, list[list[int]], list[int]]:
    """24 rows whose responses are copies of 4 texts with some tokens changed: long matches seen 2-4 times, so runs
    of match lengths with one count whose limits differ, and drafts cut short where the copies disagree. A small
    `vocab` makes a row's draft repeat its own last tokens often."""
    rng = np.random.default_rng(seed)
    proposer = SuffixProposer(5, SEP, 24, 128, max_tree_depth=9, max_spec_factor=max_spec_factor)
    prompts = [rng.integers(0, vocab, size=5).tolist() for _ in range(3)]
    proposer.prefill(0, prompts, torch.arange(24) % 3, [{} for _ in range(24)])
    texts = rng.integers(0, vocab, size=(4, 60))
    rows = []
    for i in range(24):
        text = texts[i % 4, : rng.integers(10, 60)].copy()
        edits = rng.random(len(text)) < 0.1
        text[edits] = rng.integers(0, vocab, size=int(edits.sum()))
        rows.append(prompts[i % 3] + text.tolist())
    asked = rng.integers(0, 6, size=24).tolist()
    return proposer, rows, asked


@pytest.mark.parametrize("max_spec_factor", [1.0, 0.5])
def test_drafts_equal_the_best_over_every_match_length(max_spec_factor):
    """The proposer walks once per run of equally frequent match lengths (their continuations are the same); its
    first round's drafts must be those of walking from every match length."""
    proposer, rows, asked = copied_texts_proposer(max_spec_factor)
    proposer.propose(proposal(rows, asked))  # takes the rows in
    drafts, counts, scores, _ = proposer._best(np.array(asked))
    expected = every_walk_drafts(proposer, asked)
    assert sum(len(d) for _, d in expected) > 24  # most rows have a draft: the comparison is not vacuous
    assert [drafts[i, :n].tolist() for i, n in enumerate(counts)] == [d for _, d in expected]
    assert scores == pytest.approx([max(s, 0.0) for s, _ in expected])  # a row without a draft scores 0


def continued_drafts(
    proposer: SuffixProposer, asked: list[int], first: list[list[int]]
) -> tuple[list[list[int]], list[float]]:
    """The second round, written out: a draft shorter than asked goes on with the best walk from the trie node of
    the last m tokens of (the row's text + the draft), m <= len(draft) + 3; the row's own occurrence is open where its
    text itself ends with those m tokens; ties go to the longer m. Returns the drafts and each continuation's score
    (0 where none)."""
    index, depth = proposer.index, proposer.max_tree_depth
    out, extra = [], []
    for row, (k, draft) in enumerate(zip(asked, first)):
        if not 0 < len(draft) < k:
            out.append(draft)
            extra.append(0.0)
            continue
        response = proposer._responses[row, : proposer._num_inserted[row] - proposer._prompt_len[row]].tolist()
        text = [SEP] + response
        best = (-1.0, -1, [])
        for source in proposer.sources:
            for m in range(1, min(len(draft) + 3, depth - 1) + 1):
                context = (text + draft)[-m:]
                if len(text) + len(draft) < m:
                    continue
                node = int(proposer._frontiers[source, row, 0])
                for token in context:
                    node = int(index.child(np.array([node]), np.array([token]))[0]) if node >= 0 else -1
                limit = min(k - len(draft), int(np.floor(m * proposer.max_spec_factor)), depth - m)
                if node < 0 or limit < 1:
                    continue
                num_open = np.array([int(text[-m:] == context)])
                tokens, lengths, scores, _ = index.walk(
                    np.array([node]), np.array([limit]), proposer.min_token_prob, k, num_open=num_open
                )
                if lengths[0] > 0 and (scores[0], m) >= best[:2]:
                    best = (scores[0], m, tokens[0, : lengths[0]].tolist())
        out.append(draft + best[2])
        extra.append(max(best[0], 0.0))
    return out, extra


@pytest.mark.parametrize("max_spec_factor", [1.0, 0.5])
@pytest.mark.parametrize("vocab", [6, 2])
def test_short_drafts_go_on_from_the_context_they_end_in(max_spec_factor, vocab):
    extended = 0
    for seed in (0, 1, 2, 13):  # with 2 tokens, seed 13 has a draft whose context is the row's own open ending
        proposer, rows, asked = copied_texts_proposer(max_spec_factor, vocab, seed)
        drafts = proposer.propose(proposal(rows, asked))
        first, counts, first_scores, ends = proposer._best(np.array(asked))
        first = [first[i, :n].tolist() for i, n in enumerate(counts)]
        got = [drafts.token_ids[i, :n].tolist() for i, n in enumerate(drafts.num_drafted)]
        expected, extra = continued_drafts(proposer, asked, first)
        assert got == expected
        # a continuation adds its expected accepted drafts, reached only if the whole first draft is accepted
        assert drafts.scores.numpy() == pytest.approx(first_scores + ends * np.array(extra))
        extended += sum(len(g) > len(f) for g, f in zip(got, first))
    assert extended >= 8  # drafts went on: the comparison is not vacuous


def _run_with_background(background: bool) -> tuple[list, list, dict, Generator]:
    model = make_model("llama")
    # K = 0 while 5 or more rows are in flight (the tokens go in through `update`), drafts below
    spec = SpecConfig(
        method="suffix", num_speculative_tokens=3, num_speculative_tokens_per_batch_size=[[1, 4, 3], [5, 8, 0]]
    )
    gen = Generator(model, max_batch_size=8, max_seq_len=96, spec=spec)
    gen.draft_history.background = background
    prompts = [p * 3 for p in random_prompts(3, max_len=5, seed=21)] + random_prompts(3, seed=22)
    outputs, traces = [], []
    for temperature in (0.0, 1.0):  # the second call drafts from the first's responses
        params = SamplingParams(temperature=temperature, max_new_tokens=40, n=2, seed=5)
        outputs.append([(o.token_ids, o.logprobs) for o in gen.generate(prompts, params)])
        traces.append([(r.batch_size, r.num_drafted, r.num_accepted) for r in gen.last_trace])
    gen.add_requests(random_prompts(2, seed=23), SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=7))
    for _ in range(3):
        gen.step()
    saved = gen.snapshot()
    for _ in range(4):
        gen.step()
    gen.restore(saved)  # rolled back while a background insertion may run
    while gen.has_unfinished:
        gen.step()
    return outputs, traces, gen.draft_history.stats(), gen


def test_tokens_taken_in_on_a_background_thread_draft_and_sample_alike(monkeypatch):
    """`background=True` (on a GPU) inserts a step's tokens on a thread while the generator goes on; every other call
    waits for it first, so the drafts and samples, step by step, are those of inserting at once, through finishing
    rows moved, a second call drafting from the first and a restore."""
    from specdec.proposers import suffix_tries

    handed_over = []
    thread = suffix_tries._taking_in_thread
    monkeypatch.setattr(suffix_tries, "_taking_in_thread", lambda: handed_over.append(1) or thread())
    at_once = _run_with_background(False)
    assert not handed_over
    threaded = _run_with_background(True)
    assert threaded[0] == at_once[0]  # tokens and log-probs
    assert threaded[1] == at_once[1] and sum(d for trace in threaded[1] for _, d, _ in trace) > 0
    assert threaded[2] == at_once[2]
    assert len(handed_over) > 10  # the thread did take tokens in
    assert_counts_exact(threaded[3].draft_history)


def test_a_background_update_takes_the_tokens_in_before_the_next_call_reads_the_tries():
    proposer = SuffixProposer(3, vocab_size=SEP, num_slots=2, num_positions=32, background=True)
    proposer.prefill(0, [[1, 2, 3]], torch.zeros(2, dtype=torch.long), [{}, {}])
    tokens = torch.tensor([[1, 2, 3, 4, 5, 0], [1, 2, 3, 5, 4, 5]])
    proposer.update(tokens, [5, 6])
    assert proposer._taking_in is not None  # handed to the thread
    proposer.wait()
    assert proposer._num_inserted.tolist() == [5, 6]
    assert_counts_exact(proposer)


def test_an_error_taking_tokens_in_on_the_background_thread_is_raised_by_the_next_call():
    proposer = SuffixProposer(3, vocab_size=SEP, num_slots=2, num_positions=32, background=True)
    proposer.prefill(0, [[1, 2, 3]], torch.zeros(2, dtype=torch.long), [{}, {}])

    def broken(*args, **kwargs):
        raise RuntimeError("insertion failed")

    proposer._sync = broken
    tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]])
    proposer.update(tokens, [4, 4])  # returns: the insertion runs on the thread
    with pytest.raises(RuntimeError, match="insertion failed"):
        proposer.wait()


def test_a_signal_during_the_wait_leaves_the_insertion_to_be_waited_for_again():
    """Ctrl-C while the generator waits for the background insertion: the insertion runs on (a thread cannot be
    interrupted), so the next call must wait for it again before it touches the tries."""
    from concurrent.futures import Future

    class Interrupted(Future):
        def result(self, timeout=None):
            if not self.done():
                raise KeyboardInterrupt
            return super().result(timeout)

    proposer = SuffixProposer(3, vocab_size=SEP, num_slots=2, num_positions=32, background=True)
    proposer._taking_in = pending = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        proposer.wait()
    assert proposer._taking_in is pending  # still to be waited for
    pending.set_result(None)
    proposer.wait()
    assert proposer._taking_in is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_its_own_insertion_thread():
    """A child forked after the parent started the insertion thread has no such thread: work handed to the parent's
    would never run (and the child's `wait` would hang), so the child makes its own."""
    from specdec.proposers import suffix_tries

    assert suffix_tries._taking_in_thread().submit(int, 1).result() == 1
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its insertion thread runs work
        ok = suffix_tries._TAKING_IN is None and suffix_tries._taking_in_thread().submit(int, 2).result(timeout=10) == 2
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_restore_that_changes_only_the_pending_token_leaves_no_old_token_in_the_tries():
    """A restore may give a row another pending token at the length the tries have already taken in: the old token
    is text no row holds, so it leaves the tries (the rows start over), in the compiled proposer and the reference
    alike (`Lockstep`)."""
    gen, lockstep = three_steps_in_lockstep()
    model = gen.model
    saved = gen.snapshot()
    gen.step()  # the tries take in the rows up to their pending tokens, then the rows move on
    dead = lockstep.new._dead_tokens
    gen.restore(saved)
    gen.step()
    assert lockstep.new._dead_tokens == dead  # the same pending tokens: no row starts over
    vocab = model.config.vocab_size
    gen.restore([replace(s, pending=(s.pending + 1) % vocab) for s in saved])
    gen.step()
    for tries in (lockstep.new, lockstep.ref):
        tries.flush()
        for row in range(gen.num_active):
            num_inserted, prompt_len = int(tries._num_inserted[row]), int(gen.slots.prompt_len[row])
            assert num_inserted == saved[row].num_tokens  # (the last step's tokens go in with the next step's)
            taken_in = tries._responses[row, : num_inserted - prompt_len].tolist()
            assert taken_in == gen.slots.token_ids[row, prompt_len:num_inserted].tolist(), row
    assert_counts_exact(lockstep.new)  # (the reference drafted alike at every step)


def test_a_fork_while_an_insertion_runs_in_the_background_waits_for_it():
    """A process forked while a background insertion ran (a data loader's workers, say) copied half-updated tries and a
    future that no thread of the child completes: its first history call (`wait`) hung for good. A fork now waits for
    the insertion first, so the child holds the tries as they were after it."""
    import signal

    history = SuffixProposer(4, vocab_size=97, num_slots=64, num_positions=2048, background=True)
    history.prefill(0, [list(range(1, 20))], torch.zeros(64, dtype=torch.long), [{} for _ in range(64)])
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 97, (64, 2048)))
    history.update(tokens, [2000] * 64)  # handed to the thread: ~120k tokens, counted for a while
    assert not history._taking_in.done(), "the insertion finished before the fork: nothing was tested"
    pid = os.fork()
    if pid == 0:  # the child: exit at once whatever happens, never into pytest
        code = 1
        try:
            signal.alarm(30)  # hung in wait: killed
            history.wait()
            code = 0 if history.stats()["tokens"] == 0 else 2
        finally:
            os._exit(code)
    history.wait()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_whole_responses_go_in_runs_padded_to_their_own_longest(monkeypatch):
    """`add_responses`, `load` and the rebuild padded every response to the longest one: one response of 4000 tokens
    among 5000 of 150 took 7 GB and 13 s (2 GB and 3 s without it). Runs of consecutive responses are padded to their
    own longest now, within `_PADDED_CELLS`; the tries count the same n-grams."""
    import specdec.proposers.suffix_tries as suffix_tries

    rng = np.random.default_rng(0)
    responses = [rng.integers(0, 97, 30).tolist() for _ in range(200)]
    responses[3] = rng.integers(0, 97, 3000).tolist()
    prompts = [[1, 2, 3], [4, 5]] * 100

    def built(cells: int) -> tuple[SuffixTries, list]:
        monkeypatch.setattr(suffix_tries, "_PADDED_CELLS", cells)
        tries = SuffixTries(vocab_size=97, num_slots=1, num_positions=16, max_tree_depth=6)
        shapes, add = [], tries.index.add_sequences

        def recording(roots, tokens, lengths, delta=1):
            shapes.append(np.shape(tokens))
            return add(roots, tokens, lengths, delta)

        tries.index.add_sequences = recording
        tries.add_responses(prompts, responses)
        return tries, shapes[1:]  # (the first inserts the two prompts' own tries)

    whole, [shape] = built(1 << 40)  # one insertion, as before
    assert shape == (400, 3001)  # every response (twice: its prompt's trie and the global one) padded to 3001
    runs, shapes = built(4096)
    assert shapes[1] == (2, 3001) and max(rows * cols for rows, cols in shapes) <= 2 * 4096  # (the outlier alone)
    assert suffix_tries._runs_within([5, 5, 50, 5, 5], 20) == [2, 3, 5]
    counts = [np.sort(t.index.count[: t.index.num_nodes]) for t in (whole, runs)]
    sizes = [{k: v for k, v in t.stats().items() if k != "bytes"} for t in (whole, runs)]  # (capacity: grown apart)
    assert sizes[0] == sizes[1] and np.array_equal(*counts)


def test_a_store_of_more_dead_tokens_than_live_ones_is_rebuilt_with_what_it_holds():
    """Evicted responses leave their nodes in the store until a call starts with more dead tokens than live ones
    (and 65,536 at least): the rebuilt store holds only the live history, counted exactly, and drafts as a store
    that never held the evicted ones (never run by a test before)."""
    rng = np.random.default_rng(0)
    responses = [rng.integers(0, 8, size=35_000).tolist() for _ in range(3)]  # 2 evicted: 70,000 dead tokens

    def drafts(proposer: SuffixProposer) -> list[list[int]]:
        proposer.begin()
        proposer.prefill(0, [[1, 2, 3]], torch.zeros(1, dtype=torch.long), [{}])
        tokens = torch.tensor([[1, 2, 3, *responses[-1][:6]]])
        return proposer.propose(ProposalBatch(tokens, [9], [4], sampling=None, draft_uniforms=None)).token_ids.tolist()

    evicting = SuffixProposer(4, vocab_size=SEP, num_slots=2, num_positions=64, max_cached_requests=1)
    evicting.add_responses([[1, 2, 3]] * 3, responses)
    grown = evicting.stats()["nodes"]
    fresh = SuffixProposer(4, vocab_size=SEP, num_slots=2, num_positions=64, max_cached_requests=1)
    fresh.add_responses([[1, 2, 3]], responses[-1:])
    assert drafts(evicting) == drafts(fresh)
    assert evicting.stats()["nodes"] == fresh.stats()["nodes"] < grown
    assert evicting._dead_tokens == 0
    assert_counts_exact(evicting)


@pytest.mark.parametrize(
    "prompts, responses, message",
    [
        ("1 2", [[1]], "prompts and responses must be lists of token-id lists"),
        ([[1]], [[1, [2]]], r"responses\[0\] must be a list of token ids in \[0, 97\)"),  # ragged
        ([[1]], [[1, 97]], r"responses\[0\] must be a list of token ids in \[0, 97\)"),  # the separator's id
        ([[-1]], [[1]], r"prompts\[0\] must be a list of token ids in \[0, 97\)"),
    ],
)
def test_responses_added_by_hand_are_checked(prompts, responses, message):
    proposer = SuffixProposer(2, vocab_size=SEP, num_slots=2, num_positions=16)
    with pytest.raises(ValueError, match=message):
        proposer.add_responses(prompts, responses)
    assert proposer.stats()["responses"] == 0
