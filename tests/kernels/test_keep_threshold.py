"""`keep_threshold` (Triton, no sort) against `keep_threshold_ref` (torch.topk) and against the definition written out
with a full sort: the same `(keep_min, keep_last)` bit for bit, ties, greedy rows and every filter setting included."""

import importlib

import pytest
import torch
from kernel_cases import assert_kernel_matches_reference

from rollout_kernels.keep_threshold import fixed_point_bits, keep_threshold, keep_threshold_ref, weights_ref

keep_threshold_module = importlib.import_module("rollout_kernels.keep_threshold")  # the package exports the function
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def make_case(vocab_size: int, dtype: torch.dtype, seed: int = 0, num_rows: int = 24) -> dict:
    """Rows of every kind: sharp and flat logits, logits with many ties, -inf tokens; top_k 0 / 1 / mid / V / above V,
    top_p tiny / 0.5 / 0.9 / 1; greedy rows; rows read through `logit_rows` from a strided tensor."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows + 3, vocab_size + 5, generator=generator, dtype=torch.float64)
    x *= torch.rand(num_rows + 3, 1, generator=generator, dtype=torch.float64) * 8
    x[::4] = torch.randint(-6, 6, (len(x[::4]), vocab_size + 5), generator=generator).double() / 2  # ties
    x[1::6, : vocab_size // 3] = float("-inf")
    logits = x.to(dtype)[:, :vocab_size]  # row stride vocab_size + 5
    top_k = torch.tensor([0, 1, 2, 7, 50, vocab_size, vocab_size + 3, vocab_size // 2])
    top_p = torch.tensor([1.0, 1e-9, 0.5, 0.9, 0.999, 1.0, 0.3])
    temperatures = torch.tensor([1.0, 0.7, 1.3, 0.0, 0.05, 2.0])
    rows = torch.arange(num_rows)
    return dict(
        logits=logits,
        logit_rows=torch.randperm(num_rows + 3, generator=generator)[:num_rows],
        temperatures=temperatures[rows % len(temperatures)].contiguous(),
        top_k=top_k[rows % len(top_k)].contiguous(),
        top_p=top_p[(rows // 2) % len(top_p)].to(torch.float64 if dtype == torch.float64 else torch.float32),
    )


def kept_mask(logits: torch.Tensor, keep_min: torch.Tensor, keep_last: torch.Tensor) -> torch.Tensor:
    x = logits.to(torch.float64)
    ids = torch.arange(x.shape[1])
    return (x > keep_min[:, None]) | ((x == keep_min[:, None]) & (ids <= keep_last[:, None]))


def kept_by_sorting(case: dict, weights=None) -> torch.Tensor:
    """The definition with a full sort: the first n of (logit descending, id ascending), n = min(K, the first prefix
    whose weight reaches top_p of the first K's); `weights` (default: the fixed-point ones) of the sorted logits."""
    x = case["logits"][case["logit_rows"]].to(torch.float64)
    num_rows, vocab_size = x.shape
    order = x.sort(dim=1, descending=True, stable=True).indices
    values = x.gather(1, order)
    temperature = case["temperatures"].to(torch.float64)
    divisor = torch.where(temperature == 0, 1.0, temperature)[:, None]
    row_max = values[:, :1]
    if weights is None:
        w = weights_ref(values, row_max, divisor, fixed_point_bits(vocab_size))
    else:
        w = weights(values, row_max, divisor)
    top_k = case["top_k"]
    num_kept = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    rank = torch.arange(vocab_size)
    cumulative = w.masked_fill(rank[None, :] >= num_kept[:, None], 0.0).cumsum(dim=1)
    total = cumulative[:, -1]
    top_p = case["top_p"].to(torch.float64)
    if weights is None:
        target = torch.where(total > 0, (top_p * total).ceil().clamp_min(1.0), 0.0)
    else:
        target = top_p * total
    reached = (cumulative < target[:, None]).sum(dim=1) + 1
    count = torch.where(top_p < 1, torch.minimum(reached, num_kept), num_kept)
    count = torch.where(temperature == 0, vocab_size, count)
    kept_sorted = rank[None, :] < count[:, None]
    return torch.zeros_like(kept_sorted).scatter_(1, order, kept_sorted)


@pytest.mark.parametrize("vocab_size", [1, 2, 97, 1271])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(vocab_size, dtype):
    case = make_case(vocab_size, dtype)
    keep_min, keep_last = assert_kernel_matches_reference(
        keep_threshold, keep_threshold_ref, case, ("keep_min", "keep_last")
    )
    assert torch.equal(kept_mask(case["logits"][case["logit_rows"]], keep_min, keep_last), kept_by_sorting(case))


@pytest.mark.slow
def test_kernel_matches_reference_at_a_real_vocabulary_size(monkeypatch):
    """Vocabulary 151936 (S = 35 fixed-point bits), bfloat16: a top-k + top-p row, a top-p-only row and a top-k-only
    row. Under the interpreter the blocks are 16x wider (19 a pass instead of 297: the same loops, in a few seconds
    instead of a minute); compiled on a GPU, the kernel's own."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(keep_threshold_module, "_BLOCK_SIZE", 8192)
    case = make_case(151936, torch.bfloat16, seed=1, num_rows=3)
    case["top_k"] = torch.tensor([50, 0, 1000])
    case["top_p"] = torch.tensor([0.9, 0.95, 1.0], dtype=case["top_p"].dtype)
    case["temperatures"] = torch.tensor([1.0, 0.8, 1.0])
    keep_min, keep_last = assert_kernel_matches_reference(
        keep_threshold, keep_threshold_ref, case, ("keep_min", "keep_last")
    )
    kept = kept_mask(case["logits"][case["logit_rows"]], keep_min, keep_last)
    assert torch.equal(kept, kept_by_sorting(case))
    assert kept.sum(dim=1)[2] == 1000 and kept.sum(dim=1)[0] <= 50


def test_ties_are_cut_by_id():
    """Equal logits across the cut: the lowest ids stay, as a stable sort keeps them; -0.0 equals +0.0."""
    logits = torch.tensor([[0.0, 1.0, -0.0, 1.0, 1.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    case = dict(
        logits=logits,
        logit_rows=torch.tensor([0, 0, 1, 1]),
        temperatures=torch.ones(4),
        top_k=torch.tensor([3, 6, 2, 0]),
        top_p=torch.tensor([1.0, 1.0, 1.0, 0.5]),
    )
    keep_min, keep_last = assert_kernel_matches_reference(
        keep_threshold, keep_threshold_ref, case, ("keep_min", "keep_last")
    )
    # row 0, top 3: 2.0 (id 6), 1.0 (ids 1, 3); top 6: everything but the last zero (id 5); all equal: the first ids
    assert keep_last.tolist() == [3, 2, 1, 3] and keep_min.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert keep_min[1].view(torch.int64) == 0, "the cut at a zero logit is +0.0"


def test_unfiltered_and_greedy_rows_keep_everything():
    case = make_case(97, torch.float32, num_rows=4)
    case["top_k"] = torch.tensor([0, 97, 500, 5])
    case["top_p"] = torch.tensor([1.0, 1.0, 1.0, 0.5])
    case["temperatures"] = torch.tensor([1.0, 1.0, 1.0, 0.0])
    for op in (keep_threshold, keep_threshold_ref):
        keep_min, keep_last = op(**case)
        assert keep_min.tolist() == [float("-inf")] * 4 and keep_last.tolist() == [97] * 4


def test_fixed_point_mass_is_the_softmax_mass():
    """Away from the razor's edge (the cumulative softmax mass at the cut within 1e-6 of top_p), the fixed-point
    weights cut where float64 softmax probabilities summed in sorted order cut; the edge is rare."""
    case = make_case(4096, torch.float32, seed=2, num_rows=200)
    case["temperatures"] = torch.rand(200, generator=torch.Generator().manual_seed(3)) + 0.3
    exact = kept_by_sorting(case, weights=lambda values, row_max, divisor: torch.exp((values - row_max) / divisor))
    keep_min, keep_last = keep_threshold_ref(**case)
    kept = kept_mask(case["logits"][case["logit_rows"]], keep_min, keep_last)
    differ = (kept != exact).any(dim=1)
    assert int(differ.sum()) <= 2, f"{int(differ.sum())} of 200 rows cut elsewhere"
    probs = torch.softmax(case["logits"][case["logit_rows"]].double() / case["temperatures"].double()[:, None], 1)
    for row in torch.nonzero(differ)[:, 0].tolist():  # only at the edge: the two cuts' masses straddle top_p closely
        top_k = int(case["top_k"][row])
        mass = probs[row].sort(descending=True).values
        mass = mass[:top_k] if 0 < top_k < len(mass) else mass
        cut_mass = (mass.cumsum(0) / mass.sum())[int(kept[row].sum()) - 1 : int(exact[row].sum())]
        assert float((cut_mass - float(case["top_p"][row])).abs().min()) < 1e-6


def test_weights_are_integers_whose_row_sums_are_exact():
    """q <= 2^S, V 2^S <= 2^53: a row's weights sum to the same float64 in any order."""
    for vocab_size in (1, 1271, 151936, 262144):
        assert vocab_size * 2 ** fixed_point_bits(vocab_size) <= 2**53
    x = torch.randn(3, 151936, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = weights_ref(x, x.amax(dim=1, keepdim=True), torch.ones(3, 1, dtype=torch.float64), fixed_point_bits(151936))
    assert torch.equal(q, q.round()) and float(q.max()) == 2.0**35
    assert torch.equal(q.sum(dim=1), q.flip(1).sum(dim=1)) and torch.equal(q.sum(dim=1), q.long().sum(dim=1).double())
    torch.testing.assert_close(q / 2.0**35, torch.exp(x - x.amax(dim=1, keepdim=True)), atol=2**-35, rtol=3e-7)


def test_bad_inputs_are_named():
    case = make_case(11, torch.float32, num_rows=2)
    with pytest.raises(ValueError, match=r"top_k has 1 entries, expected one per row \(2\)"):
        keep_threshold_ref(**{**case, "top_k": case["top_k"][:1]})
    with pytest.raises(ValueError, match="top_k has dtype torch.int32"):
        keep_threshold(**{**case, "top_k": case["top_k"].int()})
    with pytest.raises(ValueError, match="must have a contiguous vocabulary"):
        keep_threshold(**{**case, "logits": torch.zeros(11, 12).t()})
