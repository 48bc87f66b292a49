"""race_logits: the Triton kernel draws the torch reference's tokens, token for token, from logits of every dtype, split
over many programs or one; the reference's shortcut is the full race; the log-probabilities are the tempered, filtered
log-softmax's; the race draws the tempered distribution.

On CPU the kernel runs under TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports `kernels`.
"""

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import MIN_P_VALUE, chi_square_p_value

from rollout_kernels.race_logits import race_log_noise, race_log_noise_ref, race_logits, race_logits_ref
from rollout_kernels.race_sample import _log, _log_ref, race_exponentials_ref

torch.set_num_threads(1)

# log-probability tolerance by logits dtype (the log-sum-exp runs in float32 below float64)
LOGPROB_ATOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5, torch.float64: 1e-12}
TEMPERATURES = [1.0, 0.0, 0.7, 1.5, 0.3, 1.0, 0.0, 2.0, 1.0]


def make_case(num_races: int, vocab_size: int, dtype: torch.dtype, seed: int = 0, filtered: bool = False) -> dict:
    """Races over 12 rows of logits (a strided view: rows 3 * vocab_size apart), rows reused and out of order."""
    generator = torch.Generator().manual_seed(seed)
    storage = 3 * torch.randn(12, 3 * vocab_size, generator=generator, dtype=torch.float64)
    storage[:, :vocab_size:5] -= 30  # tokens that never win
    logits = storage.to(dtype)[:, :vocab_size]  # strided rows, in every dtype
    case = dict(
        logits=logits,
        logit_rows=torch.randint(0, 12, (num_races,), generator=generator),
        temperatures=torch.tensor((TEMPERATURES * (num_races // len(TEMPERATURES) + 1))[:num_races]),
        seeds=torch.randint(0, 2**62, (num_races,), generator=generator),
        positions=torch.randint(0, 2**32, (num_races,), generator=generator),
    )
    if filtered:  # keep each race's top half by (logit descending, id ascending): a threshold inside the vocabulary
        rows = logits[case["logit_rows"]].to(torch.float64)
        order = rows.sort(dim=1, descending=True, stable=True).indices
        last = order[:, max(vocab_size // 2 - 1, 0)]
        case["keep_min"] = rows.gather(1, last[:, None])[:, 0].contiguous()
        case["keep_last"] = last.contiguous()
    return case


def reference_logprobs(case: dict, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 log-softmax of x / T over the kept tokens (T = 1 for greedy races), at `token_ids`."""
    x = case["logits"][case["logit_rows"]].to(torch.float64)
    temperature = case["temperatures"].to(torch.float64)
    scaled = x / torch.where(temperature == 0, 1.0, temperature)[:, None]
    if "keep_min" in case:
        ids = torch.arange(x.shape[1])
        kept = (x > case["keep_min"][:, None]) | (
            (x == case["keep_min"][:, None]) & (ids <= case["keep_last"][:, None])
        )
        scaled = scaled.masked_fill(~kept, float("-inf"))
    return torch.log_softmax(scaled, dim=1).gather(1, token_ids[:, None])[:, 0]


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("vocab_size", [1, 2, 1271, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("num_races", [0, 1, 9])
def test_kernel_matches_reference(num_races, dtype, vocab_size, filtered):
    case = make_case(num_races, vocab_size, dtype, filtered=filtered)
    before = {name: tensor.clone() for name, tensor in case.items()}
    token_ids, logprobs = race_logits(**case, split_size=1024)  # up to 4 programs a race
    ref_ids, ref_logprobs = race_logits_ref(**case)
    assert torch.equal(token_ids, ref_ids), "kernel and reference drew different tokens"
    assert all(torch.equal(case[name], before[name]) for name in case), "an input was modified"
    atol = LOGPROB_ATOL[dtype]
    torch.testing.assert_close(logprobs, ref_logprobs, atol=atol, rtol=0)
    torch.testing.assert_close(logprobs, reference_logprobs(case, token_ids), atol=atol, rtol=0)
    if num_races and vocab_size > 2:
        assert bool((logprobs > -30).all()), "a token that never wins was drawn"


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_row_holding_a_nan_draws_token_zero_with_a_nan_log_probability(dtype, filtered):
    """A policy whose logits went NaN (diverged weights): the kernel drew a finite token with a finite log-probability
    (its maxima pass NaN over), the reference failed on an index past the vocabulary. Both now draw token 0 with
    log-probability NaN for such a row, which the generator refuses; the other rows draw as before."""
    case = make_case(9, 1271, dtype, filtered=filtered)
    expected_ids, expected_logprobs = race_logits_ref(**case)
    logits = case["logits"].clone()
    logits[case["logit_rows"][2], 700] = float("nan")  # in the second of three programs of race 2's row
    logits[case["logit_rows"][5], 3] = float("nan")
    nan_rows = torch.isin(case["logit_rows"], case["logit_rows"][[2, 5]])
    case["logits"] = logits
    for token_ids, logprobs in (race_logits(**case, split_size=512), race_logits_ref(**case)):
        assert token_ids[nan_rows].eq(0).all() and logprobs[nan_rows].isnan().all()
        assert torch.equal(token_ids[~nan_rows], expected_ids[~nan_rows])
        torch.testing.assert_close(logprobs[~nan_rows], expected_logprobs[~nan_rows], atol=LOGPROB_ATOL[dtype], rtol=0)


def test_kernel_matches_reference_at_a_real_vocabulary_size():
    """Vocabulary 151936 in bfloat16, the default split (19 programs a race) and a split of 1024 (149)."""
    case = make_case(3, 151936, torch.bfloat16, seed=1, filtered=True)
    ref_ids, ref_logprobs = race_logits_ref(**case)
    for split_size in (None, 1024):
        token_ids, logprobs = race_logits(**case, split_size=split_size)
        assert torch.equal(token_ids, ref_ids)
        torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.01, 1e-4])
def test_log_probabilities_stay_accurate_at_small_temperatures(temperature):
    """Logits of 20 at T = 1e-4 put x / T near 2e5, where float32 numbers are 1/64 apart: the log-probability is formed
    as (x / T - M) - ln(sum), never M + ln(sum) rounded there (it gave -0.6875 for ln 1/2). Two tied top tokens (split
    over two programs) and a third far below: the drawn one has log-probability -ln 2 in float32, as in float64."""
    logits = torch.full((1, 2048), -5.0)
    logits[0, [7, 1500]] = 20.0
    case = dict(
        logits=logits,
        logit_rows=torch.zeros(1, dtype=torch.int64),
        temperatures=torch.tensor([temperature]),
        seeds=torch.tensor([123]),
        positions=torch.tensor([0]),
    )
    truth = -torch.log(torch.tensor(2.0, dtype=torch.float64))
    for op in (race_logits, race_logits_ref):
        token_ids, logprobs = op(**case) if op is race_logits_ref else op(**case, split_size=1024)
        assert token_ids.item() in (7, 1500)
        torch.testing.assert_close(logprobs[0], truth, atol=1e-6, rtol=0)


def test_ties_go_to_the_lowest_token_across_programs():
    """Greedy races over equal maxima in different splits and in one block: the lowest id wins, as torch.argmax."""
    vocab_size = 4096
    logits = torch.zeros(3, vocab_size)
    logits[0, [3000, 1500, 2047, 4000]] = 5.0  # maxima in splits 1, 2 and 3 of 1024 tokens
    logits[1, [1030, 1025]] = 5.0  # one block
    logits[2] = 1.0  # all equal
    case = dict(
        logits=logits,
        logit_rows=torch.arange(3),
        temperatures=torch.zeros(3),
        seeds=torch.zeros(3, dtype=torch.int64),
        positions=torch.zeros(3, dtype=torch.int64),
    )
    for op in (race_logits, race_logits_ref):
        assert op(**case, split_size=1024)[0].tolist() == [1500, 1025, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_shortcut_is_the_full_race(dtype):
    """The reference scores exactly only where its float32 bound cannot rule a token out: on peaked rows, flat rows
    and filtered rows its token is the argmax of every token's exact score `x / T - ln E`."""
    generator = torch.Generator().manual_seed(3)
    num_races, vocab_size = 600, 476
    logits = torch.randn(num_races, vocab_size, generator=generator, dtype=torch.float64)
    logits[:200] *= 8.0  # peaked
    logits[200:400] *= 0.05  # nearly flat
    logits[400:, 100:] -= 200.0  # most of the mass on 100 tokens
    logits = logits.to(dtype)
    temperatures = torch.rand(num_races, generator=generator, dtype=torch.float64) + 0.25
    seeds = torch.randint(0, 2**62, (num_races,), generator=generator)
    positions = torch.randint(0, 2**32, (num_races,), generator=generator)
    keep_min = logits.to(torch.float64).sort(dim=1, descending=True).values[:, 50].contiguous()  # top 51
    keep_last = torch.full((num_races,), vocab_size, dtype=torch.int64)
    scores = logits.to(torch.float64) / temperatures[:, None] - race_log_noise_ref(
        seeds, positions, torch.arange(vocab_size)
    )
    rows = torch.arange(num_races)
    assert torch.equal(race_logits_ref(logits, rows, temperatures, seeds, positions)[0], scores.argmax(dim=1))
    kept = logits.to(torch.float64) >= keep_min[:, None]
    filtered = scores.masked_fill(~kept, float("-inf")).argmax(dim=1)
    assert torch.equal(race_logits_ref(logits, rows, temperatures, seeds, positions, keep_min, keep_last)[0], filtered)
    assert not torch.equal(filtered, scores.argmax(dim=1)), "the filter should change some tokens"


@triton.jit
def _log_kernel(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    x = tl.load(x_ptr + cols, mask=cols < n, other=1.0)
    tl.store(out_ptr + cols, _log(x), mask=cols < n)


def test_logarithm_of_the_noise_is_the_reference_bit_for_bit_and_accurate():
    """`ln E` over the noise's whole range (E from 2^-54 to 37.5): the kernel's series is the reference's, within a
    few ulp of torch.log."""
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(20000, generator=generator, dtype=torch.float64) * 40, 2.0 ** -torch.arange(0.0, 55.0)])
    x = x.clamp_min(2.0**-54)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on the CPU
    out = torch.empty_like(x, device=device)
    # launched as the library launches its kernels: a fused multiply-add rounds once where the reference rounds twice
    _log_kernel[(triton.cdiv(len(x), 1024),)](x.to(device), out, len(x), BLOCK_SIZE=1024, enable_fp_fusion=False)
    out = out.cpu()
    assert torch.equal(out, _log_ref(x)), "the kernel's ln(x) differs from the reference's"
    assert float((out - torch.log(x)).abs().max()) < 1e-14


def test_log_noise_is_the_log_of_the_race_samples_noise():
    """The same noise as `race_sample`'s, keyed by (seed, position, token) only; the kernel's bits are the
    reference's."""
    seeds = torch.tensor([7, 7, 8, 7], dtype=torch.int64)
    positions = torch.tensor([3, 3, 3, 4], dtype=torch.int64)
    log_noise = race_log_noise_ref(seeds, positions, torch.arange(3000))
    assert torch.equal(race_log_noise(seeds, positions, 3000).view(torch.int64), log_noise.view(torch.int64))
    torch.testing.assert_close(log_noise, race_exponentials_ref(seeds, positions, torch.arange(3000)).log())
    assert torch.equal(log_noise[0], log_noise[1])
    assert not torch.equal(log_noise[0], log_noise[2]) and not torch.equal(log_noise[0], log_noise[3])


def test_race_draws_the_tempered_distribution():
    """Many keys (a sample's position advances every token) over one row of logits at T = 0.7: a chi-square test of
    softmax(x / T) passes; the negative control, the same tokens against softmax(x) (T ignored), fails."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 37, generator=generator, dtype=torch.float64)
    num_draws = 40000
    token_ids, _ = race_logits_ref(
        logits,
        torch.zeros(num_draws, dtype=torch.int64),
        torch.full((num_draws,), 0.7, dtype=torch.float64),
        torch.full((num_draws,), 12345),
        torch.arange(num_draws),
    )
    assert chi_square_p_value(token_ids, torch.softmax(logits[0] / 0.7, dim=0)) > MIN_P_VALUE
    assert chi_square_p_value(token_ids, torch.softmax(logits[0], dim=0)) < 1e-6


def test_bad_inputs_are_named():
    case = make_case(2, 11, torch.float32)
    with pytest.raises(ValueError, match=r"seeds has 1 entries, expected one per race \(2\)"):
        race_logits_ref(**{**case, "seeds": case["seeds"][:1]})
    with pytest.raises(ValueError, match="positions has dtype torch.int32"):
        race_logits(**{**case, "positions": case["positions"].int()})
    with pytest.raises(ValueError, match="must have a contiguous vocabulary"):
        race_logits(**{**case, "logits": torch.zeros(11, 12).t()})
    with pytest.raises(ValueError, match="keep_min and keep_last come together"):
        race_logits(**case, keep_min=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shape \(2, 0\)\) must hold a vocabulary of at least one token"):
        race_logits(**{**case, "logits": torch.zeros(2, 0)})
