"""Logits -> the distribution tokens are drawn from: temperature, top-k, top-p, per row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollout_kernels.keep_threshold import keep_threshold, keep_threshold_ref


@dataclass
class RowSampling:
    """Per-row sampling settings as tensors on the model's device.

    `temperature == 0` marks a greedy row. `top_k == 0` and `top_p == 1` turn those filters off.
    The flags are decided on the host, so no device sync is needed: `needs_filter` False skips the top-k / top-p
    thresholds entirely; `all_greedy` / `any_greedy` pick the greedy path.
    """

    temperature: Tensor  # [rows] float
    top_k: Tensor  # [rows] int64
    top_p: Tensor  # [rows] float
    needs_filter: bool
    all_greedy: bool
    any_greedy: bool

    def repeat(self, repeats: Tensor, total: int) -> RowSampling:
        """Expand to target rows: row i repeated `repeats[i]` times (`total` = repeats.sum(), known on the host)."""
        return RowSampling(
            self.temperature.repeat_interleave(repeats, output_size=total),
            self.top_k.repeat_interleave(repeats, output_size=total),
            self.top_p.repeat_interleave(repeats, output_size=total),
            self.needs_filter,
            self.all_greedy,
            self.any_greedy,
        )

    def divisors(self) -> Tensor:
        """`[rows]` what each row's logits are divided by: its temperature, 1 for a greedy row (temperature 0)."""
        return torch.where(self.temperature == 0, torch.ones_like(self.temperature), self.temperature)

    def select(self, rows: Tensor | slice) -> RowSampling:
        """The settings of `rows` (`[n]` indices on the settings' device, or a slice); the host flags stay those of
        all rows."""
        return RowSampling(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.needs_filter,
            self.all_greedy,
            self.any_greedy,
        )


def processed_logprobs(logits: Tensor, sampling: RowSampling) -> Tensor:
    """Log-probabilities `[rows, V]` of the distribution each row samples from (-inf outside top-k/top-p).

    The kept tokens are those of `keep_thresholds`, the set the verification race draws from, so a reported log-prob
    and a drawn token always agree on it. Greedy rows and rows without a filter get the model's plain log-softmax
    (of logits / T): their reported log-prob is the model's own. Computed in at least float32; float64 logits stay
    float64.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.to(dtype) / sampling.divisors().to(dtype)[:, None]
    if not sampling.needs_filter:
        return torch.log_softmax(scaled, dim=-1)
    keep_min, keep_last = keep_thresholds(logits, sampling)
    x = logits.to(torch.float64)
    token_ids = torch.arange(logits.shape[-1], device=logits.device)
    kept = (x > keep_min[:, None]) | ((x == keep_min[:, None]) & (token_ids <= keep_last[:, None]))
    return torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)


def target_probs(logits: Tensor, logprobs: Tensor, sampling: RowSampling) -> Tensor:
    """Probabilities the verifier samples from: exp(logprobs), one-hot at the argmax for greedy rows."""
    probs = logprobs.exp()
    if sampling.any_greedy:
        greedy = (sampling.temperature == 0)[:, None]
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


_THRESHOLD_CHUNK_ELEMENTS = 1 << 22  # rows x vocabulary per pass of the reference: its temporaries stay bounded


def keep_thresholds(
    logits: Tensor, sampling: RowSampling, rows: Tensor | None = None
) -> tuple[Tensor, Tensor] | tuple[None, None]:
    """The tokens top-k / top-p keep, per row, as a threshold on the logits (`race_logits` takes it):
    `([rows] float64 keep_min, [rows] int64 keep_last)`, token t kept iff `x_t > keep_min` or (`x_t == keep_min` and
    `t <= keep_last`); a row without a filter (or greedy) keeps every token. `(None, None)` when no row filters.
    `rows` (`[n]`): the rows of `logits` to take, in `sampling`'s order (default: every row).

    The kept set is a prefix of the vocabulary sorted by (logit descending, id ascending): the first top_k, cut where
    its mass reaches top_p, the mass of `x / T` summed as fixed-point weights (`rollout_kernels.keep_threshold`: exact
    sums, so the Triton kernel that runs on CUDA and the torch reference elsewhere agree bit for bit, and no row of the
    vocabulary is sorted). Up to the fixed point's rounding it is the softmax's mass: a row whose cumulative mass lands
    within about 1e-6 of top_p can keep one token more or fewer than a float sort + cumsum would."""
    if not sampling.needs_filter:
        return None, None
    logit_rows = rows if rows is not None else torch.arange(logits.shape[0], device=logits.device)
    args = (
        logits,
        logit_rows.contiguous(),
        sampling.temperature.contiguous(),
        sampling.top_k.contiguous(),
        sampling.top_p.contiguous(),
    )
    if logits.is_cuda:
        return keep_threshold(*args)
    return keep_threshold_ref(*args, elements_per_chunk=_THRESHOLD_CHUNK_ELEMENTS)
