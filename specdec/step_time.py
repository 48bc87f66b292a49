"""A model of decode-step time: how long a step takes for B rows fed W tokens each, with P draft-model passes.

Shape from a warm-up profile, level from the run. The warm-up times real steps over a grid of (B, K); near a batch
size B their times are fitted by weighted least squares as

    prior(B, W, P) = a + b (W - 1) + c P      (each coefficient linear in B across the neighbourhood)

with samples weighted by a Gaussian in log2 B. Steps measured during the run then correct it: the prediction is
`ratio(B, W) * prior(B, W, P)`, where `ratio(B, W)` is the measured-over-profiled time of recent steps near B fed W
tokens per row, shrunk toward the ratio of all recent steps near B where few were fed W. The context grows during a
rollout (the profile ran short prompts) and other processes share the machine: the level follows the measured steps
at once, and the price of a K follows them as soon as steps at that K were measured. Without a profile the measured
steps are fitted directly.
"""

from __future__ import annotations

import math

import numpy as np


class _Samples:
    """Rows of (batch size, W, P, seconds, step index, profiled prediction), the oldest dropped when full."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.data = np.zeros((capacity, 6))
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


def _local_fit(samples: np.ndarray, weights: np.ndarray, batch_size: int) -> np.ndarray:
    """Weighted least squares of seconds on [1, W - 1, P], each also times (B / batch_size - 1); returns the
    coefficients at `batch_size` (a, b, c), slopes clipped at 0 (a token or a draft pass never makes a step faster)."""
    features = np.stack([np.ones(len(samples)), samples[:, 1] - 1, samples[:, 2]], axis=1)
    relative = samples[:, :1] / batch_size - 1.0
    x = np.concatenate([features, features * relative], axis=1)
    xtw = x.T * weights
    gram = xtw @ x
    ridge = 1e-6 * (np.trace(gram) + 1e-12)
    coef = np.linalg.solve(gram + ridge * np.eye(x.shape[1]), xtw @ samples[:, 3])[:3]
    coef[1:] = np.maximum(coef[1:], 0.0)
    return coef


class StepTimeModel:
    """Seconds per decode step as a function of batch size, tokens fed per row and draft passes.

    Args:
        bandwidth: width of the batch-size kernel, in log2 units (1.0: a batch twice as large weighs e^-0.5).
        half_life: measured steps after which a step weighs half as much.
        capacity: measured steps kept.
        refit_every: measured steps a level (or fit) at one batch size is reused for.
    """

    def __init__(
        self,
        bandwidth: float = 0.75,
        half_life: float = 200.0,
        capacity: int = 4096,
        refit_every: int = 8,
        shrinkage: float = 2.0,
    ):
        self.shrinkage = shrinkage  # pseudo-steps of the all-widths ratio behind each width's own ratio
        self.bandwidth = bandwidth
        self.decay = 0.5 ** (1.0 / half_life)
        self.refit_every = refit_every
        self.profile = _Samples(capacity)
        self.measured = _Samples(capacity)
        self.num_steps = 0
        self._profile_fits: dict[int, np.ndarray] = {}
        self._levels: dict[int, tuple[int, np.ndarray]] = {}  # batch size -> (steps when fitted, coefficients)

    def add(self, batch_size: int, width: int, num_draft_passes: int, seconds: float, prior: bool = False) -> None:
        """Record a measured step, or (`prior`) a warm-up profile step, of `batch_size` rows fed `width` tokens."""
        if prior:
            self.profile.add((batch_size, width, num_draft_passes, seconds, 0, 0))
            self._profile_fits.clear()
            self._levels.clear()
            return
        expected = self._profiled(batch_size) @ (1.0, width - 1, num_draft_passes) if self.profile.size else 0.0
        self.measured.add((batch_size, width, num_draft_passes, seconds, self.num_steps, expected))
        self.num_steps += 1

    def clear_profile(self) -> None:
        """Forget the profiled steps (a throwaway first pass)."""
        self.profile = _Samples(self.profile.capacity)
        self._profile_fits.clear()
        self._levels.clear()

    def predict(self, batch_size: int, widths: np.ndarray, num_draft_passes: np.ndarray) -> np.ndarray:
        """Predicted seconds of a step of `batch_size` rows for each (width, draft passes) pair; recomputed every
        `refit_every` measured steps."""
        widths, passes = np.asarray(widths), np.asarray(num_draft_passes)
        key = (batch_size, widths.tobytes(), passes.tobytes())
        cached = self._levels.get(key)
        if cached is not None and self.num_steps - cached[0] < self.refit_every:
            return cached[1]
        assert self.profile.size or self.measured.size, "expected a warm-up profile or a measured step first"
        if self.profile.size:
            coef = self._profiled(batch_size)
            seconds = (coef[0] + coef[1] * (widths - 1) + coef[2] * passes) * self._ratios(batch_size, widths)
        else:
            coef = _local_fit(self.measured.view(), self._measured_weights(batch_size), batch_size)
            seconds = coef[0] + coef[1] * (widths - 1) + coef[2] * passes
        self._levels[key] = (self.num_steps, seconds)
        return seconds

    def _profiled(self, batch_size: int) -> np.ndarray:
        coef = self._profile_fits.get(batch_size)
        if coef is None:
            samples = self.profile.view()
            coef = _local_fit(samples, self._kernel(samples, batch_size), batch_size)
            self._profile_fits[batch_size] = coef
        return coef

    def _ratios(self, batch_size: int, widths: np.ndarray) -> np.ndarray:
        """Per width: measured over profiled time of the recent steps near `batch_size` fed that width, shrunk toward
        the ratio over all widths (1 before any step)."""
        if not self.measured.size:
            return np.ones(len(widths))
        samples = self.measured.view()
        weights = self._measured_weights(batch_size)
        measured, expected = weights * samples[:, 3], weights * samples[:, 5]
        if weights.sum() < 1e-3 or expected.sum() <= 0:
            return np.ones(len(widths))
        overall = measured.sum() / expected.sum()
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
