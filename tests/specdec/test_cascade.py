"""A cascade of proposers: a proposer that scores its drafts passes a row on only where a later proposer is measured to
emit more tokens per unit of step time for it."""

from __future__ import annotations

import time

import torch

from specdec.proposers.base import Drafts, ProposalBatch, Proposer
from specdec.proposers.multi import ProposerSet, RelativeCost

K = 4


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


def served_by(proposers: ProposerSet, num_rows: int, requested=None) -> list[str]:
    drafts, _ = proposers.propose(batch(num_rows), requested)
    return [{1: "scored", 2: "later", -1: "none"}[t] for t in drafts.token_ids[:, 0].tolist()]


def test_a_scored_proposer_passes_on_the_rows_a_later_one_earns_more_on():
    scored, later = Fixed(1, [3.9, 2.0, 0.5]), Fixed(2)
    proposers = ProposerSet({"suffix": scored, "draft_model": later}, max_k=K)
    # nothing measured yet: the later proposer is expected to earn the prior's 0.9 + 0.81 + 0.73 + 0.66 = 3.1 drafts
    assert served_by(proposers, 3) == ["scored", "later", "later"]
    assert later.asked[-1] == [0, K, K]  # the later proposer drafts only for the rows passed on
    # the later proposer's drafts are all rejected, step after step: its expected earnings fall below 0.5
    for _ in range(30):
        proposers.propose(batch(3))
        proposers.observe([4, 0, 0], seconds=1.0)
    assert served_by(proposers, 3) == ["scored", "scored", "scored"]


def test_scores_that_overpromise_are_discounted():
    scored, later = Fixed(1, [3.0] * 16), Fixed(2)
    proposers = ProposerSet({"suffix": scored, "draft_model": later}, max_k=K)
    for step in range(40):
        # the later proposer earns 1 draft in 4 at each position (about 0.33 expected accepted drafts), the scored
        # one's rows accept nothing of the 3.0 it promised
        drafts, _ = proposers.propose(batch(16))
        mine = drafts.token_ids[:, 0] == 2
        proposers.observe([(1 if (i + step) % 4 == 0 else 0) if m else 0 for i, m in enumerate(mine.tolist())], 1.0)
    assert proposers.calibration[0].factor() < 0.1
    assert served_by(proposers, 16) == ["later"] * 16


def test_a_row_that_names_a_proposer_keeps_it_and_unscored_proposers_keep_every_row():
    proposers = ProposerSet({"suffix": Fixed(1, [0.0, 0.0]), "draft_model": Fixed(2)}, max_k=K)
    assert served_by(proposers, 2, ["suffix", None]) == ["scored", "later"]
    unscored = ProposerSet({"ngram": Fixed(1), "draft_model": Fixed(2)}, max_k=K)
    assert served_by(unscored, 2) == ["scored", "scored"]
    alone = ProposerSet({"suffix": Fixed(1, [0.0, 0.1])}, max_k=K)  # no later proposer: every draft is kept
    assert served_by(alone, 2) == ["scored", "scored"]


def test_reset_forgets_what_was_measured():
    proposers = ProposerSet({"suffix": Fixed(1, [2.0]), "draft_model": Fixed(2)}, max_k=K)
    for _ in range(30):
        proposers.propose(batch(1))
        proposers.observe([0], seconds=1.0)  # the draft model's rows accept nothing
    assert served_by(proposers, 1) == ["scored"]
    proposers.reset()
    assert served_by(proposers, 1) == ["later"]


def costed(scores: list[float], ratio: float, empty: tuple = ()) -> ProposerSet:
    """A cascade whose next proposer has accepted every draft of one step of 2 rows and costs `ratio` times the rest
    of the step: rates 0.956, 0.980, 0.991, 0.996 (each position's prior is the rate before it), so 4.75 tokens
    expected of a row asked for 4. The first proposer has no draft for the rows in `empty`."""
    proposers = ProposerSet({"suffix": Fixed(1, scores, empty=empty), "draft_model": Fixed(2)}, max_k=K)
    proposers.propose(batch(len(scores)))
    proposers.observe([K] * len(scores), seconds=1.0)
    proposers.relative_cost[1] = RelativeCost()
    proposers.relative_cost[1].update(ratio)
    return proposers


def test_the_next_proposer_runs_only_where_what_it_gains_pays_for_its_time():
    costly = Fixed(2, seconds=0.01)
    proposers = ProposerSet({"suffix": Fixed(1, [1.2, 0.4]), "draft_model": costly}, max_k=K)
    assert served_by(proposers, 2) == ["later", "later"]  # its cost is not measured yet
    # a step of 30 ms of which its sleep took at least 10 ms: it costs at least half the rest of the step
    proposers.observe([K, K], seconds=0.03)
    assert proposers.relative_cost[1].ratio() >= 0.5
    # rows expecting 2.2 and 1.4 tokens from their own drafts, 4.75 from the next proposer's: 2.64x the tokens
    assert served_by(costed([1.2, 0.4], ratio=1.0), 2) == ["later", "later"]  # for 2x the time: pays
    assert served_by(costed([1.2, 0.4], ratio=2.0), 2) == ["scored", "scored"]  # for 3x: does not
    # a row whose own draft expects more (5.0) keeps it; the other one is passed on: 1.52x the tokens for 1.25x
    assert served_by(costed([4.0, 0.4], ratio=0.25), 2) == ["scored", "later"]
    # a row without a draft of its own goes on where the next proposer runs, and stays undrafted where it does not
    # (3 rows: 5.0 + 1.4 + 1 expected tokens, 5.0 + 4.75 + 4.75 with the next one: 1.96x)
    assert served_by(costed([4.0, 0.4, 0.0], ratio=0.5, empty=(2,)), 3) == ["scored", "later", "later"]
    assert served_by(costed([4.0, 0.4, 0.0], ratio=1.5, empty=(2,)), 3) == ["scored", "scored", "none"]
