"""The `auto` K policy: each step, the K that maximises predicted emitted tokens per second.

    rate(K) = sum over rows of E[emitted_i | min(K, cap_i)] / T(B, 1 + K, passes(K), context)

`E` comes from per-position acceptance measured online for each route (`AcceptanceStats`): a proposer a request
named, or the configured cascade of proposers as a whole (its mix of rows is what it earns); `T` from the step-time
table the warm-up measured, corrected by every measured step (`StepTimeTable`). K rises at most one position past
those measured so far, so a high rate inherited by unmeasured positions is checked one step at a time, never bet on a
whole K = 8 step at once (such climb steps, and exploration steps, are marked `measuring` in the trace: their own
predicted gain may be below 1). K is one number per batch: the forward is padded to the widest row, so a row given
fewer drafts saves no compute (per-request caps still apply). K = 0 unless some K beats plain decoding, and a new K
must beat the current one by `hysteresis` to replace it. Acceptance evidence fades every step, also at K = 0, so a
K of 0 chosen on early evidence is tested again later; a step in which no row had a draft (the proposer had nothing
to offer) is no evidence either way. Every `explore_every` steps one step drafts one token more than the chosen K,
and as often (halfway between) one token fewer: up, the acceptance of the position just beyond K stays measured
(positions further out inherit its rate, and if that predicts a gain the policy moves up and measures them); both
ways, the live correction of the step-time table measures the widths next to the chosen one at the run's own batch
size and context. At K = 0 the step up is taken only where one draft accepted at the prior's rate would pay. Why each
of these exists, with the measurements: docs/design/dynamic-k.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.policies import Decision, StepTimerProtocol
from specdec.step_time import StepTimeTable


class AcceptanceStats:
    """Per-position acceptance of one proposer: `rate[j]` = P(draft j+1 accepted | drafts 1..j accepted).

    Counts are of rows *asked* for a draft at that position, so a proposer that often has nothing to offer (an n-gram
    lookup without a match) shows it as a lower rate, in the steps where some row had a draft (a step in which none had
    one fed one token a row, cost a plain step, and is not counted: `AutoPolicy.observe`). The unit of evidence is a
    step, not a row: a step's rate at a position weighs 1 once `rows_per_step` rows reached it (less with fewer), and
    weights decay by `decay` per step so the estimate follows the run (rows of one step are not independent draws: a
    rollout starts every completion at once; and the rows left in flight change as the fast ones finish, so the rate
    drifts within a rollout). A step in which the proposer drafted nothing fades the evidence by `idle_decay` instead. A
    position never reached yet inherits the rate of the position before it (the first inherits `prior_rate`, optimistic
    on purpose: a policy that believes drafts pay tries them and learns the real rate); the inherited rate also stands
    behind every measured one with `prior_weight` steps' worth of evidence.
    """

    def __init__(
        self,
        max_k: int,
        prior_rate: float = 0.9,
        prior_weight: float = 0.1,
        decay: float = 0.8,
        idle_decay: float = 0.95,
        rows_per_step: int = 16,
        recent_steps: int = 27,
    ):
        self.max_k = max_k
        self.prior_rate = prior_rate
        self.prior_weight = prior_weight
        self.decay = decay
        self.idle_decay = idle_decay
        self.rows_per_step = rows_per_step
        self.recent_steps = recent_steps
        self.reached = np.zeros(max_k)  # decayed weight of the steps whose rows reached draft j
        self.accepted = np.zeros(max_k)  # the same steps' weights times their rates at draft j

    def update(self, num_asked: list[int], num_accepted: list[int]) -> None:
        """One step: per row, the drafts it was asked for and how many of them were accepted (a prefix)."""
        asked = np.asarray(num_asked)
        accepted = np.asarray(num_accepted)
        # a row reaches draft p when it was asked for p and accepted the p - 1 before it: p <= min(asked, accepted + 1);
        # rows reaching / accepting each position are the counts at or above it (a few calls whatever the rows)
        depth = self.max_k + 2
        reached_at = np.bincount(np.minimum(asked, accepted + 1), minlength=depth)[::-1].cumsum()[::-1].tolist()
        hits_at = np.bincount(accepted, minlength=depth)[::-1].cumsum()[::-1].tolist()
        decay, old_reached, old_accepted = self.decay, self.reached.tolist(), self.accepted.tolist()
        new_reached, new_accepted = [], []
        for p in range(1, self.max_k + 1):  # Python numbers: numpy's calls on a few cost more than the arithmetic
            reached, hits = reached_at[p], hits_at[p]
            weight = min(reached / self.rows_per_step, 1.0)
            new_reached.append(decay * old_reached[p - 1] + weight)
            new_accepted.append(decay * old_accepted[p - 1] + weight * hits / max(reached, 1))
        self.reached, self.accepted = np.array(new_reached), np.array(new_accepted)

    def age(self) -> None:
        """A step in which this route drafted nothing: its evidence fades by `idle_decay`. A rate measured long ago
        (say in a rollout's first steps, when a suffix proposer has little to draft from) then drifts back to the prior,
        and K climbs to measure it again instead of staying at 0 for good; slower than `decay`, because no newer
        evidence replaces the old one."""
        self.reached *= self.idle_decay
        self.accepted *= self.idle_decay

    def rates(self) -> np.ndarray:
        return np.array(self._rates())

    def _rates(self) -> list[float]:
        # Python floats: the policy reads these every step, and a few numpy calls on 8 numbers cost more than the sums
        rates, previous = [], self.prior_rate
        for accepted, reached in zip(self.accepted.tolist(), self.reached.tolist()):
            previous = (accepted + self.prior_weight * previous) / (reached + self.prior_weight)
            rates.append(previous)
        return rates

    def measured_depth(self) -> int:
        """Leading positions measured recently: a weight of at least a full step's faded by `recent_steps` drafting
        steps at `decay` (so the position one past K, measured by exploration every 20 steps, counts; steps without
        drafts fade it at `idle_decay`, more slowly: a full step stays recent over about 117 of them at 0.95). The
        policy may then climb one position past it: from K = 3 straight to 5, say, when K = 4 itself costs more than
        either."""
        recent = self.decay**self.recent_steps
        return next((j for j, weight in enumerate(self.reached.tolist()) if weight < recent), self.max_k)

    def expected_emitted(self) -> np.ndarray:
        """`[max_k + 1]`: expected tokens a row emits in a step asked for K drafts, K = 0..max_k (bonus included)."""
        return np.array(self._expected_emitted())

    def _expected_emitted(self) -> list[float]:
        emitted, reach, total = [1.0], 1.0, 0.0
        for rate in self._rates():  # 1 + the cumulative sum of the cumulative products of the rates
            reach *= rate
            total += reach
            emitted.append(1.0 + total)
        return emitted


@dataclass
class StepObservation:
    """What the generator reports after a decode step."""

    batch_size: int
    width: int  # tokens fed per row (1 + the most drafts any row had)
    num_draft_passes: int  # sequential draft-model forwards (0 for n-gram drafts)
    seconds: float
    num_asked: dict[str, tuple[list[int], list[int]]]  # route -> (asked per row, accepted per row) of its rows
    context: int = 0  # tokens in the longest row's cache before the step (rows attend over that many)


class AutoPolicy:
    """Picks K per step from measured acceptance and step times.

    Args:
        num_speculative_tokens: the largest K.
        draft_passes: the routes rows can take (a proposer's name, or the cascade's), each True if it runs a draft
            model once per draft token.
        optional_passes: routes that run the draft model in some steps only (a cascade whose first proposer runs no
            model passes its rows on only where the draft model pays): a step is priced by the share of the route's
            recent steps that ran it, and the calibration times the steps both ways.
        hysteresis: relative gain a new K needs over the current one before it is taken.
        explore_every: steps between exploration steps at one token more than the chosen K, with one at one token
            fewer halfway between (0 = never explore).
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        draft_passes: dict[str, bool],
        step_times: StepTimeTable | None = None,
        optional_passes: frozenset[str] = frozenset(),
        hysteresis: float = 0.03,
        explore_every: int = 20,
    ):
        self.explore_every = explore_every
        self.num_steps = 0
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_passes = draft_passes
        self.optional_passes = optional_passes
        # per route with draft passes: the decayed share of its steps that ran them (always 1 unless optional)
        self.pass_share = {route: 1.0 for route, passes in draft_passes.items() if passes}
        self.step_times = step_times if step_times is not None else StepTimeTable()
        self.hysteresis = hysteresis
        self.stats = {route: AcceptanceStats(num_speculative_tokens) for route in draft_passes}
        self.current = 0

    def choose(
        self, batch_size: int, caps: list[int] | None = None, routes: list[str] | None = None, context: int = 0
    ) -> Decision:
        """K for a step of `batch_size` rows after `context` cached tokens (the longest row's); `caps[i]` is row i's
        largest K, `routes[i]` its route (default: the first one)."""
        max_k = self.num_speculative_tokens
        ks = range(max_k + 1)
        names = {next(iter(self.stats))} if routes is None else set(routes)
        caps = [max_k] * batch_size if caps is None else list(caps)
        # each route's rows per cap; one route, every row the same cap (the usual case): no per-row arrays
        if caps and len(names) == 1 and caps.count(caps[0]) == len(caps):
            cap = min(max(int(caps[0]), 0), max_k)
            groups = {next(iter(names)): [batch_size if c == cap else 0 for c in ks]}
            usable = cap
        else:
            caps = np.clip(np.asarray(caps, dtype=np.int64), 0, max_k)
            route_of_row = np.asarray(routes) if len(names) > 1 else None
            groups = {
                route: np.bincount(
                    caps if route_of_row is None else caps[route_of_row == route], minlength=max_k + 1
                ).tolist()
                for route in names
            }
            usable = int(caps.max(initial=0))
        # Python floats over K = 0..max_k: the policy runs between every two steps, and numpy's calls on a few numbers
        # cost more than the arithmetic (most of all with the caches cold after a forward)
        emitted = [0.0] * len(ks)
        passes = [0] * len(ks)
        share = 0.0  # the chance that the step runs the draft passes
        for route, rows_per_cap in groups.items():
            # sum over rows of E[emitted | min(K, cap)]
            table = self.stats[route]._expected_emitted()
            for k in ks:
                emitted[k] += sum(table[min(k, c)] * rows for c, rows in enumerate(rows_per_cap) if rows)
            largest = max((c for c, rows in enumerate(rows_per_cap) if rows), default=0)
            if self.draft_passes[route] and largest > 0:
                passes = [max(p, min(k, largest)) for p, k in zip(passes, ks)]
                share = max(share, self.pass_share[route])
        if share == 0.0:  # no route runs draft passes (or an optional route has not run them for thousands of steps)
            passes = [0] * len(ks)
        widths = np.arange(1, max_k + 2)
        seconds = self.step_times.predict(batch_size, widths, np.array(passes), context)
        if 0.0 < share < 1.0:
            seconds = share * seconds + (1.0 - share) * self.step_times.predict(
                batch_size, widths, np.zeros(len(ks)), context
            )
        seconds = seconds.tolist()
        # this step's place in the exploration cycle (0: one position more, or the one-draft trial at K = 0)
        phase = (self.num_steps + 1) % self.explore_every if self.explore_every else None
        # leaving K = 0 where plain steps run ahead of the device: the plain step after the drafting ones cannot
        # (nothing was launched while they computed), so the first drafting step is priced with that step's extra time
        # (`refill`: the extra time of that plain step; also what prices the one-draft trial at K = 0 below. A step
        # mixing draft passes in and out is read against the table without them: its extra time errs high)
        refill = 0.0
        if max_k > 0 and (not self.current or phase == 0):
            drafting_passes = passes[1] if share >= 1.0 else 0
            refill = self.step_times.refill_seconds(batch_size, seconds[0], seconds[1], drafting_passes, context)
        leaving = 0.0 if self.current else refill
        rate = [e / max(t + (leaving if k else 0.0), 1e-9) for k, (e, t) in enumerate(zip(emitted, seconds))]
        best = max(range(usable + 1), key=rate.__getitem__)  # the first of equal rates, as argmax
        current = min(self.current, usable)
        if best != current and rate[best] <= rate[current] * (1.0 + self.hysteresis):
            best = current
        # climb one unmeasured position at a time: the positions beyond the measured ones only inherit a rate (the
        # early tokens of a completion accept differently from later ones), and a wide step is expensive where the
        # batch is large. A climb step may itself predict a loss (the first draft costs more than the next ones): it
        # is how the positions of a better K get measured.
        climb_to = 1 + max(self.stats[route].measured_depth() for route in names)
        measuring = best > climb_to
        best = min(best, climb_to)
        self.current = best
        self.num_steps += 1
        if best > 0:  # exploration, while drafting pays
            if phase == 0 and best < min(usable, climb_to):  # the next position's acceptance, and a width more
                best, measuring = best + 1, True
            elif phase == self.explore_every // 2:  # a width less
                best, measuring = best - 1, True
        elif phase == 0 and usable > 0 and self._one_draft_could_pay(groups, seconds, rate[0], refill):
            # K = 0 rests on acceptance measured while drafting, which may be stale (docs/design/dynamic-k.md)
            best, measuring = 1, True
        return Decision(best, rate[best] / rate[0], measuring)

    def _one_draft_could_pay(
        self, groups: dict[str, list[int]], seconds: list[float], plain_rate: float, refill: float
    ) -> bool:
        """Whether a step of one draft a row would beat a plain one if the drafts were accepted at the prior's rate
        (`groups`: each route's rows per cap; rows capped at 0 draft nothing). The trial is priced with what it costs
        the plain step after it: where plain steps run ahead of the device, that one cannot (nothing was launched
        while the trial computed), and on an H200 a trial every 20 steps at the prior's rate, priced without it, cost
        the tail 5% where drafts accept little (`refill`: that step's extra time)."""
        emitted = sum(sum(rows) + self.stats[route].prior_rate * sum(rows[1:]) for route, rows in groups.items())
        return emitted / max(seconds[1] + refill, 1e-9) > plain_rate

    def calibrate(self, timer: StepTimerProtocol, short_context: int = 32) -> None:
        """Fill the step-time table with timed steps: B over powers of four up to the slot count, K over 0, 1, K/2 and
        K (every K at the second largest B: a width's cost is not a straight line in the width), each at a short
        context and at the longest one (rows attend over the longest row's cache, so a step's cost grows with it).
        A step timed slower than one that does more work (more rows, or more drafts at the largest B) is timed again:
        the process may have paused inside it."""
        max_k = self.num_speculative_tokens
        largest = timer.max_batch_size
        sizes = sorted({min(4**i, largest) for i in range(largest.bit_length())})
        ks = sorted({0, 1, max_k // 2, max_k})
        contexts = sorted({min(short_context, timer.max_context), timer.max_context}, reverse=True)
        every_k_at = sizes[-2] if len(sizes) > 1 else sizes[-1]
        grid = [(b, k) for b in sizes for k in ks] + [(every_k_at, k) for k in range(max_k + 1) if k not in ks]
        for index, context in enumerate(contexts):
            timer.fill(context)
            if index == 0:
                # a first pass, not kept: first calls pay one-off costs (a GPU compiles each width once; the process's
                # heap grows to the largest step) that would make the first timed steps look slow
                for k in ks:
                    timer.time_step(1, k)
                timer.time_step(largest, max_k)
            for with_models in (True, False) if self.optional_passes else (None,):
                self._time_grid(timer, grid, sizes, ks, with_models)

    def _time_grid(self, timer: StepTimerProtocol, grid, sizes, ks, with_models: bool | None) -> None:
        largest = sizes[-1]
        seconds = {}
        for batch_size, k in grid:
            observation = timer.time_step(batch_size, k, with_models)
            seconds[(batch_size, k)] = observation.seconds
            self.observe(observation, profiled=True)
        for batch_size, k in grid:
            more_work = [seconds[(b, k)] for b in sizes if b > batch_size and (b, k) in seconds]
            if batch_size == largest:
                more_work += [seconds[(batch_size, j)] for j in ks if j > k]
            if more_work and seconds[(batch_size, k)] > min(more_work):
                self.observe(timer.time_step(batch_size, k, with_models), profiled=True)  # the table keeps the faster

    def observe(self, observation: StepObservation, profiled: bool = False) -> None:
        """Learn from a step; a `profiled` step (calibration, random prompts) informs the step times only, not
        acceptance."""
        o = observation
        self.step_times.add(o.batch_size, o.width, o.num_draft_passes, o.seconds, profiled, o.context)
        if profiled:
            return
        for route, stats in self.stats.items():
            asked, accepted = observation.num_asked.get(route, ([], []))
            if asked and o.width > 1:
                stats.update(asked, accepted)
            else:  # asked for nothing; or asked, and no proposer had a draft for any row, so the step fed one
                # token a row and cost what a plain step costs: no evidence either way
                stats.age()
            if asked:
                if route in self.optional_passes:
                    ran = float(o.num_draft_passes > 0)
                    self.pass_share[route] = stats.decay * self.pass_share[route] + (1.0 - stats.decay) * ran
