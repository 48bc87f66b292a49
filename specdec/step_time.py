"""Decode-step time as a measured table: how long a step of B rows fed W tokens each takes after a context of L
tokens (the longest row's cache: rows are padded to it), with or without draft-model passes.

The warm-up (`AutoPolicy.calibrate`) times real steps on a grid of batch sizes, widths and contexts. A prediction
reads the table and interpolates linearly: in context between the timed contexts (held flat below them, extended
along the last two above them), in width
between the timed widths (shaped by the batch size at which every width was timed: a width's cost is not a straight
line in the width), and in batch size between the timed sizes (extrapolated along the last two beyond the largest).
Repeated timings of one grid point keep the fastest.

Steps measured during the run then correct the table: the prediction is `ratio(B, W) * table(B, W, L)`, where
`ratio(B, W)` is the measured-over-tabled time of recent steps near B fed W tokens per row, shrunk toward the ratio of
the recent steps near B of W's group where few were fed W. The groups are plain steps (W = 1) and drafting steps
(W > 1): the warm-up times every step in lockstep with the device, but in the run a plain step may be launched while
the previous one computes (`rollout.engine.run_ahead`) and cost only the longer of the host's and the device's time,
where a drafting step waits for the tokens its drafts follow and costs both. On an H200 a plain step ran at 0.5-0.8x
of its warm-up time and a drafting one at about 1x, so the drafting widths, priced at the plain steps' ratio, looked
1.3-2x cheaper than they were and auto ran at 0.77-0.84x of no speculation; each group now follows its own steps.
Other processes share the machine and the warm-up's random text is not the run's: the level follows the measured
steps (half of a lasting change within about `half_life` steps), and the price of a K as soon as steps at that K were
measured. Without a warm-up, the recent measured steps are the table.

The correction is kept as decayed sums per (batch-size bin, width), a quarter octave per bin, so that a prediction
costs the same after 100 steps as after 100,000: the policy runs between every two steps, and its time is the step's.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

Key = tuple[int, int, bool]  # (batch size, width, drafted by a model)
CONTEXT_GRAIN = 8  # the table is read at contexts rounded down to this many tokens


class _Samples:
    """The latest rows of (batch size, W, P, seconds, context), the oldest dropped when full: the table of a run
    without a warm-up."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.data = np.zeros((capacity, 5))
        self.size = 0

    def add(self, row: tuple[float, ...]) -> None:
        if self.size == self.capacity:  # drop the oldest half at once: amortised O(1) per sample
            half = self.capacity // 2
            self.data[: self.capacity - half] = self.data[half:]
            self.size -= half
        self.data[self.size] = row
        self.size += 1

    def view(self) -> np.ndarray:
        return self.data[: self.size]


class _Correction:
    """Measured and tabled seconds of the measured steps, summed with their weights per (batch-size bin, width): bins
    a quarter octave apart, every sum faded by `decay` per step. A step's weight is set when it is added: 1, divided by
    1 + (log(r) / 0.35)^4 where r is its measured-over-tabled time over the recent level of its group (plain or
    drafting steps) near its batch size (r = 1.4: half; r = 2: 1/20), so that one stall of the process does not reprice
    its width. The recent level is the ratio of the raw sums of the group's last ~16 steps (`REFERENCE_HALF_LIFE`, all
    steps counted in time), every step counted in full: a lasting change of speed moves it within a few dozen steps,
    after which the new steps weigh in full; before any step of the group near that batch size it is 1, the warm-up's
    own timing, so that a first step that stalled is judged too. A group is never judged by the other's level: a
    drafting step after a run of plain steps launched ahead of the device costs 1.5-2.5x their ratio (it waits for the
    device, they did not), which is its price, not a stall."""

    BINS_PER_OCTAVE = 4
    NUM_BINS = 20 * BINS_PER_OCTAVE + 1  # batch sizes up to 2^20
    REFERENCE_HALF_LIFE = 16.0  # steps

    def __init__(self, bandwidth: float, decay: float, shrinkage: float, plain_prior: float = 1.0):
        self.bandwidth = bandwidth
        self.decay = decay
        self.shrinkage = shrinkage
        self.plain_prior = plain_prior
        self.centres = np.arange(self.NUM_BINS) / self.BINS_PER_OCTAVE  # log2 of each bin's batch size
        self.sums = np.zeros((3, self.NUM_BINS, 0))  # weight, weight x measured, weight x tabled; per bin, width
        self.recent = np.zeros((3, self.NUM_BINS, 2))  # steps, measured, tabled: unweighted, fading fast; per group
        self.recent_decay = 0.5 ** (1.0 / self.REFERENCE_HALF_LIFE)
        self._kernels: dict[int, np.ndarray] = {}

    def kernel(self, batch_size: int) -> np.ndarray:
        """Each bin's weight for a step of `batch_size` rows: a Gaussian in log2 of the batch size."""
        kernel = self._kernels.get(batch_size)
        if kernel is None:
            distance = (self.centres - math.log2(max(batch_size, 1))) / self.bandwidth
            kernel = self._kernels[batch_size] = np.exp(-0.5 * distance**2)
        return kernel

    def add(self, batch_size: int, width: int, seconds: float, tabled: float) -> None:
        if width >= self.sums.shape[2]:
            self.sums = np.concatenate([self.sums, np.zeros((3, self.NUM_BINS, width + 1 - self.sums.shape[2]))], 2)
        group = int(width > 1)
        weight = 1.0
        if tabled > 0:
            ratio = seconds / (tabled * self.recent_level(batch_size, group))
            weight = 1.0 / (1.0 + (math.log(max(ratio, 1e-12)) / 0.35) ** 4)
        row = min(max(round(math.log2(max(batch_size, 1)) * self.BINS_PER_OCTAVE), 0), self.NUM_BINS - 1)
        self.sums *= self.decay
        self.sums[0, row, width] += weight  # scalar writes: a tuple added to a fancy index costs more, every step
        self.sums[1, row, width] += weight * seconds
        self.sums[2, row, width] += weight * tabled
        self.recent *= self.recent_decay
        self.recent[0, row, group] += 1.0
        self.recent[1, row, group] += seconds
        self.recent[2, row, group] += tabled

    def recent_level(self, batch_size: int, group: int) -> float:
        """Measured over tabled time of the last ~16 steps of `group` (0: plain, 1: drafting) near `batch_size`, every
        step in full; 1 before any (the warm-up's own timing)."""
        steps, measured, tabled = (self.recent[:, :, group] @ self.kernel(batch_size)).tolist()
        return measured / tabled if steps >= 0.5 and tabled > 0 else 1.0

    def ratios(self, batch_size: int, widths: np.ndarray) -> np.ndarray:
        """Per width: measured over tabled time near `batch_size`, shrunk toward that of all widths of its group (plain
        or drafting) where few steps were fed that width; before any step of the group, 1 for drafting widths and
        `plain_prior` for the plain one."""
        near = np.einsum("b,sbw->sw", self.kernel(batch_size), self.sums)  # weight, measured, tabled per width
        widths = widths.tolist() if isinstance(widths, np.ndarray) else list(widths)
        # Python numbers over a few widths: numpy's calls cost more than the arithmetic (the policy runs every step)
        weights, measured, tabled = near.tolist()
        missing = [0.0] * (max(widths, default=0) + 1 - len(measured))  # 0 for a width never fed
        weights, measured, tabled = weights + missing, measured + missing, tabled + missing
        priors = []  # per group: (pseudo-measured, pseudo-tabled) seconds standing behind each width's own
        for group, unmeasured in ((range(0, 2), self.plain_prior), (range(2, len(tabled)), 1.0)):
            group_weight = sum(weights[w] for w in group)
            group_measured, group_tabled = sum(measured[w] for w in group), sum(tabled[w] for w in group)
            if group_weight < 1e-3 or group_tabled <= 0:
                priors.append((unmeasured, 1.0))  # seconds that swamp the few measured ones: the ratio is the prior
                continue
            mean_tabled = group_tabled / group_weight
            priors.append((self.shrinkage * group_measured / group_weight, self.shrinkage * mean_tabled))
        return np.array([(measured[w] + priors[w > 1][0]) / (tabled[w] + priors[w > 1][1]) for w in widths])


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _bracket(values: list[int], x: float) -> tuple[int, int]:
    """The two sorted `values` around `x` (the two nearest at either end; one value twice if there is only one)."""
    i = min(max(bisect.bisect_left(values, x), 1), len(values) - 1)
    return (values[i - 1], values[i]) if len(values) > 1 else (values[0], values[0])


class _Table:
    """Timed steps: (batch size, width, drafted) -> {context: seconds}."""

    def __init__(self, times: dict[Key, dict[int, float]]):
        # per grid point: its timed contexts, sorted, and their times (sorted once here: a prediction reads dozens)
        self.times = {key: (sorted(at), [at[c] for c in sorted(at)]) for key, at in times.items()}
        self.sizes: dict[bool, list[int]] = {}
        self.widths: dict[tuple[int, bool], list[int]] = {}
        for size, width, drafted in times:
            self.sizes.setdefault(drafted, []).append(size)
            self.widths.setdefault((size, drafted), []).append(width)
        self.sizes = {d: sorted(set(s)) for d, s in self.sizes.items()}
        self.widths = {k: sorted(w) for k, w in self.widths.items()}
        # per mode, the batch size at which the most widths were timed: its row gives the shape in the width
        self.full = {d: max(s, key=lambda b: (len(self.widths[(b, d)]), b)) for d, s in self.sizes.items()}
        self.full_widths = {d: set(self.widths[(full, d)]) for d, full in self.full.items()}

    def seconds(self, batch_size: int, width: int, drafted: bool, context: int) -> float:
        if drafted not in self.sizes:  # a mode never timed (say, a cascade's draft-model rows): the other one
            drafted = not drafted
        sizes = self.sizes[drafted]
        batch_size = max(batch_size, sizes[0])
        low, high = _bracket(sizes, batch_size)
        at_low = self._at_size(low, width, drafted, context)
        if high == low:
            return at_low
        at_high = self._at_size(high, width, drafted, context)
        value = _lerp(batch_size, low, high, at_low, at_high)
        return max(value, at_high) if batch_size > high else value  # more rows never cost less

    def _at_size(self, size: int, width: int, drafted: bool, context: int) -> float:
        widths = self.widths[(size, drafted)]
        if width in widths:
            return self._at_context(self.times[(size, width, drafted)], context)
        low, high = _bracket(widths, width)
        value = self._between_widths(size, drafted, width, low, high, context)
        full = self.full[drafted]
        if (
            full != size
            and width in self.full_widths[drafted]
            and low in self.full_widths[drafted]
            and (high in self.full_widths[drafted])
        ):
            shape = self._between_widths(full, drafted, width, low, high, context)
            value *= self._at_context(self.times[(full, width, drafted)], context) / max(shape, 1e-12)
        return max(value, 1e-9)

    def _between_widths(self, size: int, drafted: bool, width: int, low: int, high: int, context: int) -> float:
        y0 = self._at_context(self.times[(size, low, drafted)], context)
        y1 = self._at_context(self.times[(size, high, drafted)], context)
        return _lerp(width, low, high, y0, y1)

    @staticmethod
    def _at_context(timed: tuple[list[int], list[float]], context: int) -> float:
        """Linear between the timed contexts, held at the shortest below them, and above the longest extended along
        the last two (a step's attention reads grow with the context; the warm-up times contexts up to a cap),
        never below the longest's time."""
        contexts, times = timed
        if len(contexts) == 1:
            return times[0]
        context = max(context, contexts[0])
        i = min(max(bisect.bisect_left(contexts, context), 1), len(contexts) - 1)
        value = _lerp(context, contexts[i - 1], contexts[i], times[i - 1], times[i])
        return max(value, times[-1]) if context > contexts[-1] else value


class StepTimeTable:
    """Seconds per decode step as a function of batch size, tokens fed per row, draft passes and context.

    Args:
        bandwidth: width of the batch-size kernel of the live correction, in log2 units (1.0: a batch twice as large
            weighs e^-0.5).
        half_life: measured steps after which a step weighs half as much.
        capacity: measured steps kept for a run without a warm-up, whose table is the latest 256 (the latest of each
            grid point among them).
        shrinkage: pseudo-steps of the group's ratio (plain or drafting widths) behind each width's own ratio.
        plain_prior: measured-over-tabled time of a plain step near a batch size where none was measured yet. 1 where
            the run's steps run as the warm-up's did; 0.5 where plain steps may be launched ahead of the device (the
            warm-up times them in lockstep): the least a step that overlaps host and device work can cost, so that an
            unmeasured plain step is never priced above what it may cost, and the policy runs it (and so measures it)
            unless drafting beats even that.
    """

    def __init__(
        self,
        bandwidth: float = 0.75,
        half_life: float = 200.0,
        capacity: int = 512,
        shrinkage: float = 2.0,
        plain_prior: float = 1.0,
    ):
        self.bandwidth = bandwidth
        self.decay = 0.5 ** (1.0 / half_life)
        self.shrinkage = shrinkage
        self.profile: dict[Key, dict[int, float]] = {}
        self.measured = _Samples(capacity)  # the table when there is no warm-up
        self.correction = _Correction(bandwidth, self.decay, shrinkage, plain_prior)
        self._table: _Table | None = None
        self._memo: dict[tuple[int, int, bool, int], float] = {}  # the table's answers, until the profile changes

    def add(
        self,
        batch_size: int,
        width: int,
        num_draft_passes: int,
        seconds: float,
        profiled: bool = False,
        context: int = 0,
    ) -> None:
        """Record a measured step, or (`profiled`) a warm-up step, of `batch_size` rows fed `width` tokens after
        `context` cached ones (the longest row's)."""
        if profiled:
            times = self.profile.setdefault((int(batch_size), int(width), num_draft_passes > 0), {})
            times[int(context)] = min(seconds, times.get(int(context), math.inf))
            self._table = None
            return
        if self.profile:
            tabled = self._tabled(batch_size, [width], [num_draft_passes], context)[0]
            self.correction.add(int(batch_size), int(width), seconds, tabled)
        self.measured.add((batch_size, width, num_draft_passes, seconds, context))

    def profiled_seconds(self, batch_size: int, width: int, num_draft_passes: int, context: int) -> float | None:
        """The warm-up's own timing of this grid point, if it was timed."""
        return self.profile.get((batch_size, width, num_draft_passes > 0), {}).get(context)

    def predict(
        self, batch_size: int, widths: np.ndarray, num_draft_passes: np.ndarray, context: int = 0
    ) -> np.ndarray:
        """Predicted seconds of a step of `batch_size` rows after `context` cached tokens for each (width, draft
        passes) pair."""
        assert self.profile or self.measured.size, "expected a warm-up profile or a measured step first"
        widths = np.atleast_1d(np.asarray(widths))
        if not self.profile:
            return self._tabled(batch_size, widths, num_draft_passes, context)
        return self._tabled(batch_size, widths, num_draft_passes, context) * self.correction.ratios(batch_size, widths)

    def refill_seconds(
        self, batch_size: int, plain_seconds: float, drafting_seconds: float, drafting_passes: int = 0, context: int = 0
    ) -> float:
        """What a plain step that waits for the one before it (as the one after a drafting step does, where plain
        steps run ahead of the device) costs over `plain_seconds`, a plain step's predicted time: the warm-up's
        lockstep time at the measured-over-tabled ratio of `drafting_seconds`, the predicted time of a step of two
        tokens a row (`drafting_passes` draft passes; it runs in lockstep too), less `plain_seconds`. 0 where plain
        steps run as the warm-up's (`plain_prior` 1) or without a warm-up. From the caller's predictions: a second
        reading of the correction cost the policy 13 us a step."""
        if not self.profile or self.correction.plain_prior >= 1.0:
            return 0.0
        plain_tabled, drafting_tabled = self._tabled(batch_size, [1, 2], [0, drafting_passes], context).tolist()
        return max(0.0, plain_tabled * drafting_seconds / max(drafting_tabled, 1e-12) - plain_seconds)

    def _tabled(self, batch_size: int, widths, num_draft_passes, context: int) -> np.ndarray:
        # Python numbers, read one by one below (numpy's broadcasting costs more than the lookups, run every step)
        widths = widths.tolist() if isinstance(widths, np.ndarray) else list(widths)
        passes = num_draft_passes.tolist() if isinstance(num_draft_passes, np.ndarray) else num_draft_passes
        passes = list(passes) if isinstance(passes, (list, tuple)) else [passes] * len(widths)
        if not self.profile:  # no warm-up: the latest measured step of each (B, W, drafted, context) is the table
            times: dict[Key, dict[int, float]] = {}
            for b, w, p, seconds, c in self.measured.view()[-256:]:
                times.setdefault((int(b), int(w), p > 0), {})[int(c)] = float(seconds)
            table = _Table(times)
            return np.array([table.seconds(batch_size, int(w), bool(p > 0), context) for w, p in zip(widths, passes)])
        if self._table is None:
            self._table = _Table(self.profile)
            self._memo = {}
        elif len(self._memo) > 4096:
            self._memo.clear()
        # the context read to CONTEXT_GRAIN tokens: a step then prices every width from a few lookups (the policy's
        # prediction, and `add` comparing the step with it), and the table is read again a few steps later
        context = int(context - context % CONTEXT_GRAIN)
        batch_size = int(batch_size)
        seconds = []
        for w, p in zip(widths, passes):
            key = (batch_size, int(w), p > 0, context)
            value = self._memo.get(key)
            if value is None:
                value = self._memo[key] = self._table.seconds(*key)
            seconds.append(value)
        return np.array(seconds)
