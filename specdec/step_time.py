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
all recent steps near B where few were fed W. Other processes share the machine and the warm-up's random text is not
the run's: the level follows the measured steps at once, and the price of a K as soon as steps at that K were
measured. Without a warm-up, the recent measured steps are the table.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

Key = tuple[int, int, bool]  # (batch size, width, drafted by a model)


class _Samples:
    """Rows of (batch size, W, P, seconds, step index, tabled prediction, context), the oldest dropped when full."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.data = np.zeros((capacity, 7))
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


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _bracket(values: list[int], x: float) -> tuple[int, int]:
    """The two sorted `values` around `x` (the two nearest at either end; one value twice if there is only one)."""
    i = min(max(bisect.bisect_left(values, x), 1), len(values) - 1)
    return (values[i - 1], values[i]) if len(values) > 1 else (values[0], values[0])


class _Table:
    """Timed steps: (batch size, width, drafted) -> {context: seconds}."""

    def __init__(self, times: dict[Key, dict[int, float]]):
        self.times = times
        self.sizes: dict[bool, list[int]] = {}
        self.widths: dict[tuple[int, bool], list[int]] = {}
        for size, width, drafted in times:
            self.sizes.setdefault(drafted, []).append(size)
            self.widths.setdefault((size, drafted), []).append(width)
        self.sizes = {d: sorted(set(s)) for d, s in self.sizes.items()}
        self.widths = {k: sorted(w) for k, w in self.widths.items()}
        # per mode, the batch size at which the most widths were timed: its row gives the shape in the width
        self.full = {d: max(s, key=lambda b: (len(self.widths[(b, d)]), b)) for d, s in self.sizes.items()}

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
        if full != size and {width, low, high} <= set(self.widths[(full, drafted)]):
            shape = self._between_widths(full, drafted, width, low, high, context)
            value *= self._at_context(self.times[(full, width, drafted)], context) / max(shape, 1e-12)
        return max(value, 1e-9)

    def _between_widths(self, size: int, drafted: bool, width: int, low: int, high: int, context: int) -> float:
        y0 = self._at_context(self.times[(size, low, drafted)], context)
        y1 = self._at_context(self.times[(size, high, drafted)], context)
        return _lerp(width, low, high, y0, y1)

    @staticmethod
    def _at_context(times: dict[int, float], context: int) -> float:
        """Linear between the timed contexts, held at the shortest below them, and above the longest extended along
        the last two (a step's attention reads grow with the context; the warm-up times contexts up to a cap),
        never below the longest's time."""
        contexts = sorted(times)
        context = max(context, contexts[0])
        low, high = _bracket(contexts, context)
        value = _lerp(context, low, high, times[low], times[high])
        return max(value, times[contexts[-1]]) if context > contexts[-1] else value


class StepTimeTable:
    """Seconds per decode step as a function of batch size, tokens fed per row, draft passes and context.

    Args:
        bandwidth: width of the batch-size kernel of the live correction, in log2 units (1.0: a batch twice as large
            weighs e^-0.5).
        half_life: measured steps after which a step weighs half as much.
        capacity: measured steps kept.
        shrinkage: pseudo-steps of the all-widths ratio behind each width's own ratio.
    """

    def __init__(self, bandwidth: float = 0.75, half_life: float = 200.0, capacity: int = 4096, shrinkage: float = 2.0):
        self.bandwidth = bandwidth
        self.decay = 0.5 ** (1.0 / half_life)
        self.shrinkage = shrinkage
        self.profile: dict[Key, dict[int, float]] = {}
        self.measured = _Samples(capacity)
        self.num_steps = 0
        self._table: _Table | None = None

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
        expected = self._tabled(batch_size, [width], [num_draft_passes], context)[0] if self.profile else 0.0
        self.measured.add((batch_size, width, num_draft_passes, seconds, self.num_steps, expected, context))
        self.num_steps += 1

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
        return self._tabled(batch_size, widths, num_draft_passes, context) * self._ratios(batch_size, widths)

    def _tabled(self, batch_size: int, widths, num_draft_passes, context: int) -> np.ndarray:
        if self.profile:
            if self._table is None:
                self._table = _Table(self.profile)
            table = self._table
        else:  # no warm-up: the latest measured step of each (B, W, drafted, context) is the table
            times: dict[Key, dict[int, float]] = {}
            for b, w, p, seconds, _, _, c in self.measured.view()[-256:]:
                times.setdefault((int(b), int(w), p > 0), {})[int(c)] = float(seconds)
            table = _Table(times)
        passes = np.broadcast_to(np.asarray(num_draft_passes), np.shape(widths))
        return np.array([table.seconds(batch_size, int(w), bool(p > 0), context) for w, p in zip(widths, passes)])

    def _ratios(self, batch_size: int, widths: np.ndarray) -> np.ndarray:
        """Per width: measured over tabled time of the recent steps near `batch_size` fed that width, shrunk toward
        the ratio over all widths (1 before any step). A step far off the others (a stall of the process) is
        down-weighted, once in each of two rounds, so that one stall does not reprice its width."""
        if not self.measured.size:
            return np.ones(len(widths))
        samples = self.measured.view()
        distance = (np.log2(samples[:, 0]) - math.log2(batch_size)) / self.bandwidth
        weights = np.exp(-0.5 * distance**2) * self.decay ** (self.num_steps - samples[:, 4])
        if weights.sum() < 1e-3 or (weights * samples[:, 5]).sum() <= 0:
            return np.ones(len(widths))
        for _ in range(2):
            measured, expected = weights * samples[:, 3], weights * samples[:, 5]
            overall = measured.sum() / expected.sum()
            ratio = samples[:, 3] / np.maximum(samples[:, 5] * overall, 1e-12)
            weights = weights / (1.0 + (np.log(np.maximum(ratio, 1e-12)) / 0.35) ** 4)  # r = 1.4: half; r = 2: 1/20
        measured, expected = weights * samples[:, 3], weights * samples[:, 5]
        overall = measured.sum() / max(expected.sum(), 1e-12)
        same = samples[:, 1][None, :] == np.asarray(widths)[:, None]  # [widths, samples]
        mean_expected = expected.sum() / weights.sum()
        return (same @ measured + self.shrinkage * overall * mean_expected) / (
            same @ expected + self.shrinkage * mean_expected
        )
