"""Top-k / top-p as `race_logits` takes them: `keep_thresholds` keeps exactly the tokens `processed_logprobs` keeps
(the teacher-forced log-probs' distribution), ties included, a chunk of rows at a time."""

from __future__ import annotations

import pytest
import torch

from specdec import processing
from specdec.processing import RowSampling, keep_thresholds, processed_logprobs


def settings(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> RowSampling:
    return RowSampling(
        temperature=torch.full((rows,), temperature),
        top_k=torch.full((rows,), top_k, dtype=torch.long),
        top_p=torch.full((rows,), top_p),
        needs_filter=True,
        all_greedy=False,
        any_greedy=False,
    )


def kept_by_thresholds(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    keep_min, keep_last = keep_thresholds(logits, sampling)
    x = logits.to(torch.float64)
    ids = torch.arange(logits.shape[1])
    return (x > keep_min[:, None]) | ((x == keep_min[:, None]) & (ids <= keep_last[:, None]))


def test_a_division_that_rounds_two_logits_together_does_not_split_the_kept_sets():
    """1.5000004 / 0.7 and 1.5000005 / 0.7 round to one float32: the cut at top_k = 2 falls between them, and both
    views must keep the larger logit (sorting by logit / T with ties by id kept the smaller one's id first)."""
    logits = torch.tensor([[0.0, 1.5000004, 1.5000005, 5.0]])
    sampling = settings(1, temperature=0.7, top_k=2)
    assert (logits / 0.7)[0, 1] == (logits / 0.7)[0, 2]  # the premise: a tie made by the division
    kept = processed_logprobs(logits, sampling) > float("-inf")
    assert kept.tolist() == [[False, False, True, True]]
    assert torch.equal(kept_by_thresholds(logits, sampling), kept)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.7), (7, 0.5), (1, 1.0)])
def test_thresholds_keep_what_the_processed_distribution_keeps(top_k, top_p, monkeypatch):
    """Random logits with repeated values (ties), several rows per chunk and rows across chunks."""
    monkeypatch.setattr(processing, "_THRESHOLD_CHUNK_ELEMENTS", 3 * 97)  # three rows a pass: chunks are exercised
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-20, 20, (10, 97), generator=generator).float() / 4  # many equal logits
    sampling = settings(10, temperature=0.9, top_k=top_k, top_p=top_p)
    kept = processed_logprobs(logits, sampling) > float("-inf")
    assert torch.equal(kept_by_thresholds(logits, sampling), kept)
    rows = torch.tensor([9, 0, 4])  # a subset of rows, in another order
    keep_min, keep_last = keep_thresholds(logits, settings(3, 0.9, top_k, top_p), rows)
    full_min, full_last = keep_thresholds(logits, sampling)
    assert torch.equal(keep_min, full_min[rows]) and torch.equal(keep_last, full_last[rows])
