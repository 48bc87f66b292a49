"""Logits -> the distribution tokens are drawn from: temperature, top-k, top-p, per row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RowSampling:
    """Per-row sampling settings as tensors on the model's device.

    `temperature == 0` marks a greedy row. `top_k == 0` and `top_p == 1` turn those filters off.
    The flags are decided on the host, so no device sync is needed: `needs_filter` False skips the vocabulary
    sort entirely; `all_greedy` / `any_greedy` pick the greedy path.
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

    Greedy rows get the model's plain log-softmax: their token is the argmax and their reported log-prob is the
    model's own. Computed in at least float32; float64 logits stay float64.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    greedy = sampling.temperature == 0
    scaled = logits.to(dtype) / sampling.divisors().to(dtype)[:, None]
    if not sampling.needs_filter:
        return torch.log_softmax(scaled, dim=-1)
    vocab_size = logits.shape[-1]
    # sorted by the logits themselves (the order of logit / T for T > 0, without the ties a division can round two
    # logits into: `keep_thresholds` cuts on the logits); stable: equal logits keep vocabulary order, so "the top k" is
    # well defined under ties
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    sorted_logits = scaled.gather(1, order)
    rank = torch.arange(vocab_size, device=logits.device)
    top_k = torch.where((sampling.top_k > 0) & ~greedy, sampling.top_k, vocab_size)
    keep = rank[None, :] < top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is below top_p
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    top_p = torch.where(greedy, torch.ones_like(sampling.top_p), sampling.top_p).to(dtype)
    keep = keep & ((mass_before < top_p[:, None]) | (rank[None, :] == 0))
    sorted_logprobs = torch.log_softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.empty_like(sorted_logprobs).scatter_(1, order, sorted_logprobs)


def target_probs(logits: Tensor, logprobs: Tensor, sampling: RowSampling) -> Tensor:
    """Probabilities the verifier samples from: exp(logprobs), one-hot at the argmax for greedy rows."""
    probs = logprobs.exp()
    if sampling.any_greedy:
        greedy = (sampling.temperature == 0)[:, None]
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


_THRESHOLD_CHUNK_ELEMENTS = 1 << 24  # rows x vocabulary per pass of `keep_thresholds`: its temporaries stay bounded


def keep_thresholds(
    logits: Tensor, sampling: RowSampling, rows: Tensor | None = None
) -> tuple[Tensor, Tensor] | tuple[None, None]:
    """The tokens top-k / top-p keep, per row, as a threshold on the logits (`race_logits` takes it):
    `([rows] float64 keep_min, [rows] int64 keep_last)`, token t kept iff `x_t > keep_min` or (`x_t == keep_min` and
    `t <= keep_last`); a row without a filter (or greedy) keeps every token. `(None, None)` when no row filters.
    `rows` (`[n]`): the rows of `logits` to take, in `sampling`'s order (default: every row).

    The kept set is `processed_logprobs`'s: a prefix of the vocabulary sorted by (logit descending, id ascending),
    found by a sort of every row (rows with top-k / top-p keep today's sort), a chunk of rows at a time."""
    if not sampling.needs_filter:
        return None, None
    vocab_size = logits.shape[-1]
    num_rows = len(rows) if rows is not None else logits.shape[0]
    chunk = max(1, _THRESHOLD_CHUNK_ELEMENTS // vocab_size)
    keep_min = torch.empty(num_rows, dtype=torch.float64, device=logits.device)
    keep_last = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    token_ids = torch.arange(vocab_size, device=logits.device)
    for start in range(0, num_rows, chunk):
        part = slice(start, min(start + chunk, num_rows))
        x = logits[rows[part]] if rows is not None else logits[part]
        kept = processed_logprobs(x, sampling.select(part)) > float("-inf")
        least = torch.where(kept, x, float("inf")).amin(dim=1)  # in the logits' dtype: exact in float64 after
        keep_min[part] = least.to(torch.float64)
        keep_last[part] = torch.where(kept & (x == least[:, None]), token_ids, -1).amax(dim=1)
    unfiltered = (sampling.temperature == 0) | (
        ((sampling.top_k <= 0) | (sampling.top_k >= vocab_size)) & (sampling.top_p >= 1)
    )
    keep_min = torch.where(unfiltered, float("-inf"), keep_min)
    keep_last = torch.where(unfiltered, vocab_size, keep_last)
    return keep_min, keep_last
