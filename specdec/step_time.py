"""A model of decode-step time: how long a step takes for B rows fed W tokens each, with P draft-model passes, after
a context of L tokens (the longest row's cache: rows are padded to it).

Shape from a warm-up profile, level from the run. The warm-up times real steps over a grid of (B, K) at a short and a
long context; near a batch size B their times are fitted by least squares as

    prior(B, W, P, L) = a + b (W - 1) + c P + d [W > 1] + L (e + f (W - 1) + g P)

(each coefficient linear in B across the neighbourhood; samples weighted by a Gaussian in log2 B). Each term is a cost
that was measured on this CPU: `a` the plain step, `b` and `c` a token fed and a draft pass, `d` drafting at all (the
draft model's catch-up, the sampling verifier: at 1024 rows the first draft costs twice the next one), `e` reading the
KV cache (a plain step of 1024 rows at a 290-token context costs 2x one at 32), `f` and `g` attention per token fed and
per draft pass. Coefficients are kept non-negative (no token, pass or context makes a step faster). A width's real cost
is not on the line (here, a step fed an even number of tokens per row is ~10% cheaper than it, an odd one dearer): the
warm-up times every width at one batch size, and `factor(W)`, the median of profiled over fitted time at width W,
multiplies the line.

Steps measured during the run then correct it: the prediction is `ratio(B, W) * factor(W) * prior(B, W, P, L)`, where
`ratio(B, W)` is the measured-over-profiled time of recent steps near B fed W tokens per row, shrunk toward the ratio
of all recent steps near B where few were fed W. Other processes share the machine and the profile's random text is
not the run's: the level follows the measured steps at once, and the price of a K follows them as soon as steps at
that K were measured. Without a profile the measured steps are fitted directly.
"""

from __future__ import annotations

import math

import numpy as np

CONTEXT_UNIT = 256  # tokens: context enters the fit in these units, so its columns are on the scale of the others


class _Samples:
    """Rows of (batch size, W, P, seconds, step index, profiled prediction, context), the oldest dropped when full."""

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


def features(widths, passes, context) -> np.ndarray:
    """`[n, 7]`: the fit's terms (module docstring) for each (W, P, context) triple."""
    extra = np.asarray(widths, dtype=float) - 1
    passes = np.asarray(passes, dtype=float)
    context = np.broadcast_to(np.asarray(context, dtype=float) / CONTEXT_UNIT, extra.shape)
    drafting = (extra > 0).astype(float)
    return np.stack([np.ones_like(extra), extra, passes, drafting, context, context * extra, context * passes], 1)


def _local_fit(samples: np.ndarray, weights: np.ndarray, batch_size: int, rounds: int = 3) -> np.ndarray:
    """Weighted least squares of seconds on `features`, each also times (B / batch_size - 1); returns the coefficients
    at `batch_size`.

    Errors are relative (a sample weighs 1 / seconds^2: timing noise grows with the step) and robust to the odd slow
    step: after each fit, a sample `r` times slower or faster than fitted is down-weighted by 1 / (1 + (ln r / 0.35)^4)
    (r = 1.4: half, r = 2: a twentieth) and the fit repeated. One warm-up step of 256 rows measured 572 ms against
    ~25 ms in two other warm-ups (a pause of the process) and, fitted as is, made a plain step look as slow as a K = 8
    one at that size."""
    base = features(samples[:, 1], samples[:, 2], samples[:, 6])
    relative = samples[:, :1] / batch_size - 1.0
    x = np.concatenate([base, base * relative], axis=1)
    seconds = samples[:, 3]
    robust = 1.0 / np.maximum(seconds, 1e-9) ** 2
    for _ in range(rounds):
        coef = _nonnegative_fit(x, weights * robust, seconds, base.shape[1])
        fitted = x @ coef
        ratio = np.where(fitted > 0, seconds / np.maximum(fitted, 1e-12), 1.0)
        robust = _outlier_weight(ratio) / np.maximum(seconds, 1e-9) ** 2
    return coef[: base.shape[1]]


def _outlier_weight(ratio: np.ndarray) -> np.ndarray:
    """1 / (1 + (ln r / 0.35)^4) for a sample `r` times its expected time: r = 1.4 weighs half, r = 2 a twentieth."""
    return 1.0 / (1.0 + (np.log(np.maximum(ratio, 1e-12)) / 0.35) ** 4)


def _nonnegative_fit(x: np.ndarray, weights: np.ndarray, seconds: np.ndarray, num_terms: int) -> np.ndarray:
    """Weighted least squares; a term whose coefficient at the fitted batch size comes out negative is dropped (with
    its batch-size slope) and the rest refitted, until none is (no token, pass or context makes a step faster). Terms
    the samples cannot tell apart share the fit (a small ridge)."""
    xtw = x.T * weights
    gram, target = xtw @ x, xtw @ seconds
    ridge = 1e-6 * (np.trace(gram) + 1e-12)
    kept = np.ones(num_terms, dtype=bool)
    while True:
        columns = np.concatenate([kept, kept])
        coef = np.zeros(2 * num_terms)
        sub = gram[np.ix_(columns, columns)]
        coef[columns] = np.linalg.solve(sub + ridge * np.eye(len(sub)), target[columns])
        negative = np.flatnonzero(coef[1:num_terms] < 0) + 1  # the plain-step term stays whatever its sign
        if not len(negative):
            return coef
        kept[negative[np.argmin(coef[negative])]] = False


class StepTimeModel:
    """Seconds per decode step as a function of batch size, tokens fed per row and draft passes.

    Args:
        bandwidth: width of the batch-size kernel, in log2 units (1.0: a batch twice as large weighs e^-0.5).
        half_life: measured steps after which a step weighs half as much.
        capacity: measured steps kept.
    """

    def __init__(
        self,
        bandwidth: float = 0.75,
        half_life: float = 200.0,
        capacity: int = 4096,
        shrinkage: float = 2.0,
    ):
        self.shrinkage = shrinkage  # pseudo-steps of the all-widths ratio behind each width's own ratio
        self.bandwidth = bandwidth
        self.decay = 0.5 ** (1.0 / half_life)
        self.profile = _Samples(capacity)
        self.measured = _Samples(capacity)
        self.num_steps = 0
        self._profile_fits: dict[int, np.ndarray] = {}  # batch size -> the profile's fit there
        self._width_factors: dict[int, float] | None = None

    def add(
        self,
        batch_size: int,
        width: int,
        num_draft_passes: int,
        seconds: float,
        profiled: bool = False,
        context: int = 0,
    ) -> None:
        """Record a measured step, or (`profiled`) a calibration step, of `batch_size` rows fed `width` tokens after
        `context` cached ones (the longest row's)."""
        if profiled:
            self.profile.add((batch_size, width, num_draft_passes, seconds, 0, 0, context))
            self._forget_profile_fits()
            return
        expected = 0.0
        if self.profile.size:
            terms = features([width], [num_draft_passes], context)[0]
            expected = float(terms @ self._profiled(batch_size)) * self._width_factor([width])[0]
        self.measured.add((batch_size, width, num_draft_passes, seconds, self.num_steps, expected, context))
        self.num_steps += 1

    def _forget_profile_fits(self) -> None:
        self._profile_fits.clear()
        self._width_factors = None

    def predict(
        self, batch_size: int, widths: np.ndarray, num_draft_passes: np.ndarray, context: int = 0
    ) -> np.ndarray:
        """Predicted seconds of a step of `batch_size` rows after `context` cached tokens for each (width, draft
        passes) pair. The profile's fit at a batch size is cached; the correction from measured steps is recomputed
        every call (well under a millisecond: a cache keyed by the context, which grows every step, never hit)."""
        widths, passes = np.asarray(widths), np.asarray(num_draft_passes)
        assert self.profile.size or self.measured.size, "expected a warm-up profile or a measured step first"
        terms = features(widths, passes, context)
        if self.profile.size:
            seconds = terms @ self._profiled(batch_size) * self._width_factor(widths) * self._ratios(batch_size, widths)
        else:
            seconds = terms @ _local_fit(self.measured.view(), self._measured_weights(batch_size), batch_size)
        return seconds

    def _profiled(self, batch_size: int) -> np.ndarray:
        coef = self._profile_fits.get(batch_size)
        if coef is None:
            samples = self.profile.view()
            coef = _local_fit(samples, self._kernel(samples, batch_size), batch_size)
            self._profile_fits[batch_size] = coef
        return coef

    def _width_factor(self, widths) -> np.ndarray:
        """Per width: the median over profiled steps fed that width of their time over the fit's, 1 for a width never
        profiled. The fit is a straight line in the width; real widths are not (on this project's CPU a step fed an
        even number of tokens per row is ~10% cheaper than the line, an odd one dearer), and the warm-up profiles every
        width at one batch size to see it."""
        if self._width_factors is None:
            samples = self.profile.view()
            by_width: dict[int, list[float]] = {}
            for batch_size in np.unique(samples[:, 0]):
                rows = samples[samples[:, 0] == batch_size]
                fitted = features(rows[:, 1], rows[:, 2], rows[:, 6]) @ self._profiled(int(batch_size))
                for width, ratio in zip(rows[:, 1].astype(int), rows[:, 3] / np.maximum(fitted, 1e-12)):
                    by_width.setdefault(int(width), []).append(float(ratio))
            self._width_factors = {width: float(np.median(ratios)) for width, ratios in by_width.items()}
        return np.array([self._width_factors.get(int(w), 1.0) for w in np.atleast_1d(widths)])

    def _ratios(self, batch_size: int, widths: np.ndarray) -> np.ndarray:
        """Per width: measured over profiled time of the recent steps near `batch_size` fed that width, shrunk toward
        the ratio over all widths (1 before any step). A step far off the others (a stall of the process: one step of
        794 rows took 1.5 s against ~0.36 s) is down-weighted by the fit's outlier weight, once in each of two rounds
        (r = 1.4 ends at a quarter); counted as is, it priced its width 30% higher for the next 20 steps and auto left
        the fastest K."""
        if not self.measured.size:
            return np.ones(len(widths))
        samples = self.measured.view()
        weights = self._measured_weights(batch_size)
        if weights.sum() < 1e-3 or (weights * samples[:, 5]).sum() <= 0:
            return np.ones(len(widths))
        for _ in range(2):
            measured, expected = weights * samples[:, 3], weights * samples[:, 5]
            overall = measured.sum() / expected.sum()
            weights = weights * _outlier_weight(samples[:, 3] / np.maximum(samples[:, 5] * overall, 1e-12))
        measured, expected = weights * samples[:, 3], weights * samples[:, 5]
        overall = measured.sum() / max(expected.sum(), 1e-12)
        same = samples[:, 1][None, :] == np.asarray(widths)[:, None]  # [widths, samples]
        mean_expected = expected.sum() / weights.sum()
        return (same @ measured + self.shrinkage * overall * mean_expected) / (
            same @ expected + self.shrinkage * mean_expected
        )

    def _measured_weights(self, batch_size: int) -> np.ndarray:
        samples = self.measured.view()
        return self._kernel(samples, batch_size) * self.decay ** (self.num_steps - samples[:, 4])

    def _kernel(self, samples: np.ndarray, batch_size: int) -> np.ndarray:
        distance = (np.log2(samples[:, 0]) - math.log2(batch_size)) / self.bandwidth
        return np.exp(-0.5 * distance**2)
