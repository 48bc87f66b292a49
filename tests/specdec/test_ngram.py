"""NgramProposer: hand-made sequences with known drafts, a loop reference on random rows, and input validation."""

from __future__ import annotations

import pytest
import torch

from specdec.proposers import NgramProposer


def _batch(rows: list[list[int]], num_asked: list[int], width: int | None = None, garbage: int = 7):
    """Left-aligned [num_rows, width] token ids with `garbage` after each row, plus num_tokens and K tensors."""
    width = width or max(len(r) for r in rows) + 3
    token_ids = torch.full((len(rows), width), garbage, dtype=torch.int64)
    for i, r in enumerate(rows):
        token_ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    num_tokens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return token_ids, num_tokens, torch.tensor(num_asked, dtype=torch.int64)


def _rows(drafts: torch.Tensor) -> list[list[int]]:
    """The non-empty rows of a -1 padded [num_rows, width] tensor, without their padding."""
    return [kept for row in drafts.tolist() if (kept := [t for t in row if t >= 0])]


def ngram_candidates_ref(seq: list[int], k: int, min_n: int, max_n: int, num_candidates: int) -> list[list[int]]:
    """Loops: rank occurrences by (match length, position) descending, skip repeats and prefixes of earlier ones."""
    length = len(seq)
    occurrences = []
    for j in range(length - 1):
        n = 0
        while n < max_n and j - n >= 0 and seq[j - n] == seq[length - 1 - n]:
            n += 1
        if n >= min_n:
            occurrences.append((n, j))
    occurrences.sort(reverse=True)
    kept: list[list[int]] = []
    for _, j in occurrences:
        if k == 0:
            break
        cont = seq[j + 1 : min(j + 1 + k, length)]
        if any(prev[: len(cont)] == cont for prev in kept):
            continue
        kept.append(cont)
    return kept[:num_candidates]


def ngram_chain_ref(seq: list[int], k: int, min_n: int, max_n: int) -> list[list[int]]:
    """Loops: the chain draft ranks occurrences by match length, then tokens supplied (up to k), then position."""
    length = len(seq)
    best = None
    for j in range(length - 1):
        n = 0
        while n < max_n and j - n >= 0 and seq[j - n] == seq[length - 1 - n]:
            n += 1
        key = (n, min(k, length - 1 - j), j)
        if n >= min_n and (best is None or key > best):
            best = key
    if best is None or k == 0:
        return []
    j = best[2]
    return [seq[j + 1 : min(j + 1 + k, length)]]


def test_longest_match_beats_a_more_recent_shorter_one():
    # suffix (1, 2, 3): full match at j=2 (-> 9, 9), 2-token match "2 3" at j=6 (-> 5) is more recent
    seq = [1, 2, 3, 9, 9, 2, 3, 5, 1, 2, 3]
    drafts = NgramProposer(2, 1, 3).propose(*_batch([seq], [2]))
    assert drafts.tolist() == [[9, 9]]


def test_most_recent_occurrence_wins_among_equal_lengths():
    seq = [4, 5, 1, 4, 5, 2, 4, 5]  # "4 5" at j=1 (-> 1 4) and j=4 (-> 2 4)
    drafts = NgramProposer(2, 2, 2).propose(*_batch([seq], [2]))
    assert drafts.tolist() == [[2, 4]]


def test_match_length_is_capped_at_prompt_lookup_max():
    # with max 2 both "5 6" occurrences tie at length 2, so the more recent wins although the older one matches 3
    seq = [4, 5, 6, 1, 0, 5, 6, 2, 0, 4, 5, 6]
    assert NgramProposer(1, 1, 2).propose(*_batch([seq], [1])).tolist() == [[2]]
    assert NgramProposer(1, 1, 3).propose(*_batch([seq], [1])).tolist() == [[1]]


def test_no_match_gives_a_row_of_minus_one_and_min_is_respected():
    rows = [[1, 2, 3, 4], [8, 1, 2, 3, 1, 2, 4, 2]]  # row 1: last token 2 recurs, but "4 2" never does
    token_ids, num_tokens, ks = _batch(rows, [3, 3])
    assert NgramProposer(3, 2, 3).propose(token_ids, num_tokens, ks).tolist() == [[-1, -1, -1], [-1, -1, -1]]
    # "2" at j=2 supplies all 3 tokens (3 1 2); the more recent j=5 only 2 (4 2): the full draft wins
    assert NgramProposer(3, 1, 3).propose(token_ids, num_tokens, ks).tolist() == [[-1, -1, -1], [3, 1, 2]]


def test_chain_prefers_an_occurrence_that_supplies_k_tokens_in_periodic_text():
    seq = [11, 12, 13, 14] + [1, 2, 3] * 20  # the most recent "1 2 3" is followed by only 2 tokens
    drafts = NgramProposer(5, 1, 3).propose(*_batch([seq], [5]))
    assert drafts.tolist() == [[1, 2, 3, 1, 2]]


def test_per_row_num_asked_including_zero():
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    drafts = NgramProposer(4, 1, 2).propose(*_batch([seq, seq, seq], [0, 4, 2]))
    assert drafts.tolist() == [[-1, -1, -1, -1], [3, 4, 5, 6], [3, 4, -1, -1]]
    zero = NgramProposer(4, 1, 2).propose(*_batch([seq, seq], [0, 0]))
    assert zero.shape == (2, 0) and zero.dtype == torch.int64


def test_continuation_is_cut_at_the_sequence_end_and_may_overlap_the_suffix():
    seq = [9, 7, 7, 7]  # longest match "7 7" ends at j=2; only s[3] follows
    assert NgramProposer(4, 1, 2).propose(*_batch([seq], [4])).tolist() == [[7, -1, -1, -1]]
    seq = [1, 2, 1, 2, 1, 2]  # "1 2 1 2" ends at j=3 and its continuation runs into the suffix
    assert NgramProposer(3, 2, 4).propose(*_batch([seq], [3])).tolist() == [[1, 2, -1]]


def test_tokens_after_num_tokens_are_ignored():
    rows = [[3, 1, 2, 3], [5, 6, 5]]
    clean = NgramProposer(3, 1, 3).propose(*_batch(rows, [3, 3], width=8, garbage=-5))
    for garbage in (3, 5, 6):  # garbage equal to the last tokens must not create matches or continuations
        noisy = NgramProposer(3, 1, 3).propose(*_batch(rows, [3, 3], width=8, garbage=garbage))
        assert torch.equal(noisy, clean)
    assert clean.tolist() == [[1, 2, 3], [6, 5, -1]]


def test_short_and_empty_rows():
    token_ids, num_tokens, ks = _batch([[4], [4, 4], [1, 2], []], [2, 2, 2, 2], width=4, garbage=4)
    drafts = NgramProposer(2, 1, 3).propose(token_ids, num_tokens, ks)
    assert drafts.tolist() == [[-1, -1], [4, -1], [-1, -1], [-1, -1]]
    no_rows = torch.zeros(0, dtype=torch.int64)
    empty = NgramProposer(2, 1, 3).propose(torch.zeros(0, 4, dtype=torch.int64), no_rows, no_rows)
    assert empty.shape == (0, 0)


def test_candidates_are_distinct_and_ordered():
    # suffix "1 2"; occurrences: j=1 (-> 3 4), j=5 (-> 3 4, a repeat), j=9 (-> 5 6), and "2" alone at j=12 (-> 8 1)
    seq = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 2, 8, 1, 2]
    got = NgramProposer(2, 1, 2).propose_candidates(*_batch([seq], [2]), num_candidates=4)
    assert got.tolist() == [[[5, 6], [3, 4], [8, 1], [-1, -1]]]
    assert got.shape == (1, 4, 2)
    first = NgramProposer(2, 1, 2).propose_candidates(*_batch([seq], [2]), num_candidates=1)
    assert first.tolist() == [[[5, 6]]]


def test_candidates_skip_repeats_and_prefixes_of_higher_ranked_ones():
    # "7 7": j=2 (-> 1 2 9), j=1 (-> 7 1 2); "7" alone: j=6 (-> 7, cut short: a prefix of 7 1 2), j=0 (-> 7 7 1)
    seq = [7, 7, 7, 1, 2, 9, 7, 7]
    got = NgramProposer(3, 1, 2).propose_candidates(*_batch([seq], [3]), num_candidates=4)
    assert _rows(got[0]) == [[1, 2, 9], [7, 1, 2], [7, 7, 1]]
    seq = [4, 1, 2, 4, 1, 2, 4, 1]  # "4 1" at j=4 and j=1, both followed by 2 4 1: one candidate
    got = NgramProposer(3, 1, 2).propose_candidates(*_batch([seq], [3]), num_candidates=3)
    assert _rows(got[0]) == [[2, 4, 1]]


def test_candidates_keep_extensions_of_a_higher_ranked_cut_short_one():
    # "8 3" at j=2 (-> 9 3 8); "3" alone at j=4 (-> 8 3, cut short) and j=0 (-> 8 3 9, extends it)
    seq = [3, 8, 3, 9, 3, 8, 3]
    got = NgramProposer(3, 1, 2).propose_candidates(*_batch([seq], [3]), num_candidates=3)
    assert _rows(got[0]) == [[9, 3, 8], [8, 3], [8, 3, 9]]
    # periodic text: the most recent occurrences are cut short, each next one extends the one above
    seq = [5, 7, 7, 7, 7, 7]
    got = NgramProposer(3, 2, 3).propose_candidates(*_batch([seq], [3]), num_candidates=4)
    assert _rows(got[0]) == [[7], [7, 7], [7, 7, 7]]


def test_candidates_look_past_many_repeats():
    # the 40 most recent occurrences of "0" are all followed by 9; the distinct ones come after them
    seq = [5, 0, 1, 0, 2, 0, 3] + [0, 9] * 40 + [0]
    got = NgramProposer(1, 1, 1).propose_candidates(*_batch([seq, [4, 0, 3]], [1, 1]), num_candidates=4)
    assert _rows(got[0]) == [[9], [3], [2], [1]]
    assert _rows(got[1]) == []


def test_long_repetitive_rows_match_loop_reference():
    gen = torch.Generator().manual_seed(7)
    token_ids = torch.randint(0, 2, (8, 300), generator=gen)
    num_tokens = torch.randint(250, 301, (8,), generator=gen)
    ks = torch.full((8,), 4)
    candidates = NgramProposer(4, 2, 5).propose_candidates(token_ids, num_tokens, ks, num_candidates=6)
    for i in range(8):
        seq = token_ids[i, : num_tokens[i]].tolist()
        assert _rows(candidates[i]) == ngram_candidates_ref(seq, 4, 2, 5, 6)


def test_propose_is_one_of_the_longest_match_candidates():
    gen = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, 3, (16, 40), generator=gen)
    num_tokens = torch.randint(0, 41, (16,), generator=gen)
    ks = torch.randint(0, 5, (16,), generator=gen)
    proposer = NgramProposer(4, 2, 4)
    chain = proposer.propose(token_ids, num_tokens, ks)
    candidates = proposer.propose_candidates(token_ids, num_tokens, ks, 40)
    for i in range(16):
        if (chain[i] >= 0).any():
            assert any(torch.equal(chain[i], c) for c in candidates[i])


@pytest.mark.parametrize("vocab", [2, 3, 6])
@pytest.mark.parametrize(("num_speculative_tokens", "min_n", "max_n"), [(1, 1, 1), (3, 1, 3), (5, 2, 4), (4, 3, 3)])
def test_matches_loop_reference_on_random_rows(vocab, num_speculative_tokens, min_n, max_n):
    gen = torch.Generator().manual_seed(vocab * 100 + num_speculative_tokens * 10 + min_n)
    num_rows, width = 48, 30
    token_ids = torch.randint(0, vocab, (num_rows, width), generator=gen)
    num_tokens = torch.randint(0, width + 1, (num_rows,), generator=gen)
    ks = torch.randint(0, num_speculative_tokens + 1, (num_rows,), generator=gen)
    proposer = NgramProposer(num_speculative_tokens, min_n, max_n)
    chain = proposer.propose(token_ids, num_tokens, ks)
    candidates = proposer.propose_candidates(token_ids, num_tokens, ks, num_candidates=4)
    assert chain.shape == (num_rows, int(ks.max())) and candidates.shape == (num_rows, 4, int(ks.max()))
    for i in range(num_rows):
        seq, k = token_ids[i, : num_tokens[i]].tolist(), int(ks[i])
        ref = ngram_candidates_ref(seq, k, min_n, max_n, 4)
        assert _rows(candidates[i]) == ref, (seq, k)
        assert _rows(chain[i : i + 1]) == ngram_chain_ref(seq, k, min_n, max_n), (seq, k)
        # -1 only after the tokens, never inside
        for row in candidates[i].tolist():
            assert row == sorted(row, key=lambda t: t < 0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1, 2), "num_speculative_tokens"),
        ((3, 0, 2), "prompt_lookup_min"),
        ((3, 1, 0), "prompt_lookup_max"),
        ((3, 3, 2), r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"),
        ((2.0, 1, 2), "num_speculative_tokens"),
    ],
)
def test_constructor_validation(args, match):
    with pytest.raises(ValueError, match=match):
        NgramProposer(*args)


def test_propose_validation():
    proposer = NgramProposer(3, 1, 2)
    token_ids, num_tokens, ks = _batch([[1, 2, 1], [2, 2]], [2, 3])
    with pytest.raises(ValueError, match="token_ids must be a 2-D int64"):
        proposer.propose(token_ids.int(), num_tokens, ks)
    with pytest.raises(ValueError, match="token_ids must be a 2-D int64"):
        proposer.propose(token_ids[0], num_tokens, ks)
    with pytest.raises(ValueError, match="num_tokens must be a 1-D int64"):
        proposer.propose(token_ids, num_tokens.float(), ks)
    with pytest.raises(ValueError, match="num_asked has 1 rows but token_ids has 2"):
        proposer.propose(token_ids, num_tokens, ks[:1])
    with pytest.raises(ValueError, match=r"num_tokens must lie in \[0, 6\]"):
        proposer.propose(token_ids, num_tokens + 4, ks)
    with pytest.raises(ValueError, match=r"num_asked must lie in \[0, num_speculative_tokens=3\]"):
        proposer.propose(token_ids, num_tokens, ks + 1)
    with pytest.raises(ValueError, match="num_asked must lie"):
        proposer.propose(token_ids, num_tokens, ks - 3)
    with pytest.raises(TypeError, match="token_ids must be a torch.Tensor"):
        proposer.propose(token_ids.tolist(), num_tokens, ks)
    with pytest.raises(ValueError, match="num_candidates"):
        proposer.propose_candidates(token_ids, num_tokens, ks, 0)
