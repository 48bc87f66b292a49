"""The `auto` K policy: each step, the K that maximises predicted emitted tokens per second.

    rate(K) = sum over rows of E[emitted_i | min(K, cap_i)] / T(B, 1 + K, passes(K))

`E` comes from per-position acceptance measured online for each route (`AcceptanceStats`): a proposer a request
named, or the configured cascade of proposers as a whole (its mix of n-gram and draft-model rows is what it earns);
`T` from a step-time
model seeded by a warm-up profile and refitted from every measured step (`StepTimeModel`). K rises at most one position
past those measured so far, so a high rate inherited by unmeasured positions is checked one step at a time, never
bet on a whole K = 8 step at once. K is one number per batch:
the forward is padded to the widest row, so a row given fewer drafts saves no compute (per-request caps still apply).
K = 0 unless some K beats plain decoding, and a new K must beat the current one by `hysteresis` to replace it.
Every `explore_every` steps one step drafts one token more than the chosen K, so the acceptance of the position just
beyond it stays measured (the early tokens of a completion accept differently from the later ones); positions further
out inherit its rate, and if that predicts a gain the policy moves up and measures them. One token more costs little
where a step is compute-bound; drafting the largest K instead would cost a K = 8 step, six times a plain one at 1024
rows on this project's CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.policies import Decision
from specdec.step_time import StepTimeModel


class AcceptanceStats:
    """Per-position acceptance of one proposer: `rate[j]` = P(draft j+1 accepted | drafts 1..j accepted).

    Counts are of rows *asked* for a draft at that position, so a proposer that often has nothing to offer (an n-gram
    lookup without a match) shows it as a lower rate. Counts decay so the estimate follows the run. A position never
    reached yet inherits the rate of the one before it (the first inherits `prior_rate`). The prior is optimistic on
    purpose: a policy that believes drafts pay tries them in its first steps and learns the real rate at once (a few
    rows outweigh `prior_weight`); a pessimistic one would keep K = 0 and never measure.
    """

    def __init__(self, max_k: int, prior_rate: float = 0.9, prior_weight: float = 2.0, decay: float = 0.95):
        self.max_k = max_k
        self.prior_rate = prior_rate
        self.prior_weight = prior_weight
        self.decay = decay
        self.reached = np.zeros(max_k)  # rows asked for draft j whose drafts before j were all accepted
        self.accepted = np.zeros(max_k)  # rows whose draft j was accepted

    def update(self, num_asked: list[int], num_accepted: list[int]) -> None:
        """One step: per row, the drafts it was asked for and how many of them were accepted (a prefix)."""
        asked = np.asarray(num_asked)
        accepted = np.asarray(num_accepted)
        positions = np.arange(1, self.max_k + 1)[:, None]
        self.reached = self.decay * self.reached + ((asked >= positions) & (accepted >= positions - 1)).sum(1)
        self.accepted = self.decay * self.accepted + (accepted >= positions).sum(1)

    def rates(self) -> np.ndarray:
        rates = np.zeros(self.max_k)
        previous = self.prior_rate
        for j in range(self.max_k):
            rates[j] = (self.accepted[j] + self.prior_weight * previous) / (self.reached[j] + self.prior_weight)
            previous = rates[j]
        return rates

    def measured_depth(self) -> int:
        """Leading positions whose measurements outweigh the prior (decayed rows reached >= `prior_weight`)."""
        shallow = np.flatnonzero(self.reached < self.prior_weight)
        return int(shallow[0]) if len(shallow) else self.max_k

    def expected_emitted(self) -> np.ndarray:
        """`[max_k + 1]`: expected tokens a row emits in a step asked for K drafts, K = 0..max_k (bonus included)."""
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.rates()))])


@dataclass
class StepObservation:
    """What the generator reports after a decode step."""

    batch_size: int
    width: int  # tokens fed per row (1 + the most drafts any row had)
    num_draft_passes: int  # sequential draft-model forwards (0 for n-gram drafts)
    seconds: float
    num_asked: dict[str, tuple[list[int], list[int]]]  # route -> (asked per row, accepted per row) of its rows


class AutoPolicy:
    """Picks K per step from measured acceptance and step times.

    Args:
        num_speculative_tokens: the largest K.
        draft_passes: the routes rows can take (a proposer's name, or the cascade's), each True if it runs a draft
            model once per draft token.
        hysteresis: relative gain a new K needs over the current one before it is taken.
        explore_every: steps between exploration steps at one token more than the chosen K (0 = never explore).
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        draft_passes: dict[str, bool],
        time_model: StepTimeModel | None = None,
        hysteresis: float = 0.03,
        explore_every: int = 20,
    ):
        self.explore_every = explore_every
        self.num_steps = 0
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_passes = draft_passes
        self.time_model = time_model if time_model is not None else StepTimeModel()
        self.hysteresis = hysteresis
        self.stats = {route: AcceptanceStats(num_speculative_tokens) for route in draft_passes}
        self.current = 0

    def choose(self, batch_size: int, caps: list[int] | None = None, routes: list[str] | None = None) -> Decision:
        """K for a step of `batch_size` rows; `caps[i]` is row i's largest K, `routes[i]` its route (default: the
        first one)."""
        ks = np.arange(self.num_speculative_tokens + 1)
        caps = np.full(batch_size, self.num_speculative_tokens) if caps is None else np.maximum(np.asarray(caps), 0)
        routes = [next(iter(self.stats))] * batch_size if routes is None else routes
        emitted = np.zeros(len(ks))
        passes = np.zeros(len(ks))
        for route in set(routes):
            rows = np.asarray([r == route for r in routes])
            table = self.stats[route].expected_emitted()
            emitted += table[np.minimum(ks[:, None], caps[rows][None, :])].sum(axis=1)
            if self.draft_passes[route] and (caps[rows] > 0).any():
                passes = np.maximum(passes, np.minimum(ks, caps[rows].max()))
        usable = int(caps.max(initial=0))
        rate = emitted / np.maximum(self.time_model.predict(batch_size, ks + 1, passes), 1e-9)
        best = int(np.argmax(rate[: usable + 1]))
        current = min(self.current, usable)
        if best != current and rate[best] <= rate[current] * (1.0 + self.hysteresis):
            best = current
        # climb one unmeasured position at a time: the positions beyond the measured ones only inherit a rate (the
        # early tokens of a completion accept differently from later ones), and a K = 8 step costs 6x a plain one at
        # 1024 rows on this project's CPU
        best = min(best, 1 + max(self.stats[route].measured_depth() for route in set(routes)))
        self.current = best
        self.num_steps += 1
        if self.explore_every and self.num_steps % self.explore_every == 0 and best > 0:
            best = min(best + 1, usable)  # exploration (while drafting pays at all): measure the next position
        return Decision(best, float(rate[best] / rate[0]))

    def observe(self, observation: StepObservation, warm_up: bool = False) -> None:
        """Learn from a step; a warm-up step (random prompts) informs the step times only, not acceptance."""
        o = observation
        self.time_model.add(o.batch_size, o.width, o.num_draft_passes, o.seconds, prior=warm_up)
        if warm_up:
            return
        for route, (asked, accepted) in observation.num_asked.items():
            if asked:
                self.stats[route].update(asked, accepted)
