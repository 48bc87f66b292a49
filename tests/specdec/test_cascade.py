"""A cascade of proposers: a proposer that scores its drafts passes rows on only where a later proposer is measured to
emit more tokens for them, in steps where that pays for the later proposer's time."""

from __future__ import annotations

import time

import torch

from specdec.proposers.base import Drafts, ProposalBatch, Proposer
from specdec.proposers.multi import ProposerSet

K = 4
NAMES = {1: "scored", 2: "later", -1: "none"}


class Fixed(Proposer):
    """Drafts `K` tokens of `token` for every row asked (none for the rows in `empty`), with `scores` (None: an
    unscored proposer)."""

    def __init__(self, token: int, scores: list[float] | None = None, seconds: float = 0.0, empty: tuple = ()):
        self.token, self.scores, self.seconds, self.empty, self.asked = token, scores, seconds, empty, []

    def propose(self, batch: ProposalBatch) -> Drafts:
        time.sleep(self.seconds)  # a drafting cost the cascade measures
        self.asked.append(list(batch.num_asked))
        counts = [0 if i in self.empty else min(k, K) for i, k in enumerate(batch.num_asked)]
        token_ids = torch.tensor([[self.token] * c + [-1] * (K - c) for c in counts])
        scores = None if self.scores is None else torch.tensor(self.scores, dtype=torch.float64)
        return Drafts(token_ids, counts, scores=scores)


def batch(num_rows: int) -> ProposalBatch:
    return ProposalBatch(torch.zeros(num_rows, 3, dtype=torch.long), [3] * num_rows, [K] * num_rows, None, None)


def step(proposers: ProposerSet, truth: list[int], seconds: float = 1.0, requested=None) -> list[str]:
    """One step in which the target emits `truth[i]` at every position of row i: a draft is accepted while it says
    that token. Returns who served each row."""
    drafts, _ = proposers.propose(batch(len(truth)), requested)
    served = drafts.token_ids[:, 0].tolist()
    accepted = [int((drafts.token_ids[i] == t).long().cumprod(0).sum()) for i, t in enumerate(truth)]
    emitted = torch.tensor([[t] * (a + 1) + [-1] * (K - a) for t, a in zip(truth, accepted)])
    proposers.observe(accepted, seconds, emitted)
    return [NAMES[s] for s in served]


def test_a_scored_proposer_passes_on_the_rows_a_later_one_earns_more_on():
    scored, later = Fixed(1, [3.9, 2.0, 0.5]), Fixed(2)
    proposers = ProposerSet({"suffix": scored, "draft_model": later}, max_k=K)
    # nothing measured yet: the later proposer is expected to emit the prior's 1 + 0.9 + 0.81 + 0.73 + 0.66 = 4.1
    # tokens, against 1 + score for the scored one's drafts
    assert step(proposers, [1, 1, 1]) == ["scored", "later", "later"]
    assert later.asked[-1] == [0, K, K]  # the later proposer drafts only for the rows passed on
    # the target says what the scored proposer drafts: the later one's drafts are rejected step after step, while
    # the scored one's drafts match the tokens emitted on every row (the ones it passed on included)
    for _ in range(30):
        step(proposers, [1, 1, 1])
    assert proposers.calibration[0].factor() > 0.5
    assert step(proposers, [1, 1, 1]) == ["scored", "scored", "scored"]


def test_scores_that_overpromise_are_discounted():
    proposers = ProposerSet({"suffix": Fixed(1, [3.0] * 16), "draft_model": Fixed(2)}, max_k=K)
    for i in range(40):
        # the later proposer is right on 1 row in 4, the scored one never, whoever served the row
        step(proposers, [2 if (row + i) % 4 == 0 else 3 for row in range(16)])
    assert proposers.calibration[0].factor() < 0.1
    assert step(proposers, [3] * 16) == ["later"] * 16


def test_a_row_that_names_a_proposer_keeps_it_and_unscored_proposers_keep_every_row():
    proposers = ProposerSet({"suffix": Fixed(1, [0.0, 0.0]), "draft_model": Fixed(2)}, max_k=K)
    assert step(proposers, [1, 1], requested=["suffix", None]) == ["scored", "later"]
    unscored = ProposerSet({"ngram": Fixed(1), "draft_model": Fixed(2)}, max_k=K)
    assert step(unscored, [1, 1]) == ["scored", "scored"]
    alone = ProposerSet({"suffix": Fixed(1, [0.0, 0.1])}, max_k=K)  # no later proposer: every draft is kept
    assert step(alone, [1, 1]) == ["scored", "scored"]


def test_reset_forgets_what_was_measured():
    proposers = ProposerSet({"suffix": Fixed(1, [2.0]), "draft_model": Fixed(2)}, max_k=K)
    for _ in range(30):
        step(proposers, [1])  # the target says what suffix drafts: the draft model's drafts are rejected
    assert step(proposers, [1]) == ["scored"]
    proposers.reset()
    assert step(proposers, [1]) == ["later"]


def costed(scores: list[float], ratio: float, empty: tuple = ()) -> ProposerSet:
    """A cascade whose next proposer was measured accepting every draft of one step of 2 rows and costs `ratio` times
    the rest of the step: rates 0.956, 0.980, 0.991, 0.996 (each position's prior is the rate before it), so 4.75
    tokens expected of a row asked for 4. The first proposer has no draft for the rows in `empty`."""
    proposers = ProposerSet({"suffix": Fixed(1, scores, empty=empty), "draft_model": Fixed(2)}, max_k=K)
    proposers.acceptance[1].update([K, K], [K, K])
    proposers.relative_cost[1].update(ratio)
    return proposers


def test_the_next_proposer_runs_only_where_what_it_gains_pays_for_its_time():
    proposers = ProposerSet({"suffix": Fixed(1, [1.2, 0.4]), "draft_model": Fixed(2, seconds=0.01)}, max_k=K)
    # its cost is not measured yet; a step of 30 ms of which its sleep took at least 10 ms: it costs at least half
    # the rest of the step
    assert step(proposers, [2, 2], seconds=0.03) == ["later", "later"]
    assert proposers.relative_cost[1].ratio() >= 0.5
    # rows expecting 2.2 and 1.4 tokens from their own drafts, 4.75 from the next proposer's: 2.64x the tokens
    assert step(costed([1.2, 0.4], ratio=1.0), [2, 2]) == ["later", "later"]  # for 2x the time: pays
    assert step(costed([1.2, 0.4], ratio=2.0), [2, 2]) == ["scored", "scored"]  # for 3x: does not
    # a row whose own draft expects more (5.0) keeps it; the other one is passed on: 1.52x the tokens for 1.25x
    assert step(costed([4.0, 0.4], ratio=0.25), [2, 2]) == ["scored", "later"]
    # a row without a draft of its own goes on where the next proposer runs, and stays undrafted where it does not
    # (3 rows: 5.0 + 1.4 + 1 expected tokens, 5.0 + 4.75 + 4.75 with the next one: 1.96x)
    assert step(costed([4.0, 0.4, 0.0], ratio=0.5, empty=(2,)), [2, 2, 2]) == ["scored", "later", "later"]
    assert step(costed([4.0, 0.4, 0.0], ratio=1.5, empty=(2,)), [2, 2, 2]) == ["scored", "scored", "none"]


def test_a_passed_on_row_still_calibrates_the_scores_by_the_tokens_it_emitted():
    # every row goes to the draft model (its prior promises 4.1 tokens against 3.0), which drafts what suffix drafts;
    # the target emits 3 of those tokens then another one: suffix's drafts of score 2.0, never served, would have had
    # 3 accepted, and its calibration counts them: (1.875 + 0.1) / (1.25 + 0.1) = 1.46 after 20 such steps
    proposers = ProposerSet({"suffix": Fixed(1, [2.0, 2.0]), "draft_model": Fixed(1)}, max_k=K)
    for _ in range(20):
        drafts, served = proposers.propose(batch(2))
        assert served == ["draft_model", "draft_model"]
        proposers.observe([3, 3], 1.0, torch.tensor([[1, 1, 1, 5, -1]] * 2))
    assert 1.4 < proposers.calibration[0].factor() < 1.5
    # where a row emits only what a rejection leaves (one token), the match is a lower bound: 1 of suffix's drafts
    proposers.reset()
    proposers.propose(batch(2))
    proposers.observe([0, 0], 1.0, torch.tensor([[1, -1, -1, -1, -1]] * 2))
    assert proposers.calibration[0].accepted == proposers.calibration[0].scored / 2
