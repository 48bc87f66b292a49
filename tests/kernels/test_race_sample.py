"""race_sample: the Triton kernel equals the torch reference token for token (the noise is derived from the same
counter on both sides), its logarithm equals the reference's bit for bit, and the race draws tokens distributed
exactly as the given probabilities.

On CPU the kernel runs under TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports `kernels`.
"""

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import MIN_P_VALUE, chi_square_p_value, sparse_distributions

from rollout_kernels.race_sample import (
    _finished_bits,
    _mix_rounds_ref,
    _neg_log,
    _neg_log_ref,
    _room,
    _uniforms_of,
    race_exponentials_ref,
    race_sample,
    race_sample_ref,
)

torch.set_num_threads(1)


def make_case(num_rows: int, vocab_size: int, dtype: torch.dtype, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    probs = sparse_distributions(num_rows, vocab_size, generator).to(dtype)
    return dict(
        probs=probs,
        seeds=torch.randint(0, 2**62, (num_rows,), generator=generator),
        positions=torch.randint(0, 2**32, (num_rows,), generator=generator),
    )


@pytest.mark.parametrize("vocab_size", [1, 2, 1271, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_rows", [0, 1, 9])
def test_kernel_matches_reference(vocab_size, dtype, num_rows):
    case = make_case(num_rows, vocab_size, dtype)
    before = {name: tensor.clone() for name, tensor in case.items()}
    tokens = race_sample(**case)
    assert torch.equal(tokens, race_sample_ref(**case)), "kernel and reference drew different tokens"
    assert all(torch.equal(case[name], before[name]) for name in case), "an input was modified"
    if num_rows:
        assert bool((case["probs"][torch.arange(num_rows), tokens] > 0).all()), "a token of probability 0 was drawn"


def test_kernel_matches_reference_at_a_real_vocabulary_size():
    case = make_case(2, 151936, torch.float32, seed=1)
    case["probs"] = torch.softmax(torch.randn(2, 151936, generator=torch.Generator().manual_seed(2)), dim=-1)
    assert torch.equal(race_sample(**case), race_sample_ref(**case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_shortcut_is_the_full_race(dtype):
    """The reference scores exactly only where its float32 bound cannot rule a token out: on peaked rows (most are
    settled by one exact score), flat rows (most are scored in full) and rows with zeros, its token is the argmax
    of every token's exact score."""
    generator = torch.Generator().manual_seed(3)
    num_rows, vocab_size = 600, 476
    logits = torch.randn(num_rows, vocab_size, generator=generator, dtype=torch.float64)
    logits[:200] *= 8.0  # peaked
    logits[200:400] *= 0.05  # nearly flat
    logits[400:, 100:] = -torch.inf  # top-k style zeros
    probs = torch.softmax(logits, dim=-1).to(dtype)
    seeds = torch.randint(0, 2**62, (num_rows,), generator=generator)
    positions = torch.randint(0, 2**32, (num_rows,), generator=generator)
    noise = race_exponentials_ref(seeds, positions, torch.arange(vocab_size))
    full = (probs.to(torch.float64) / noise).argmax(dim=1)
    assert torch.equal(race_sample_ref(probs, seeds, positions), full)


def test_reference_bound_room_is_a_tight_lower_bound_of_one_minus_u():
    """The reference rules tokens out with `p / room`, `room` taken from a hash before its last mixing round: it must
    never exceed `1 - u` (or a token could be ruled out wrongly) and stays within 2^-23 of it, on random hashes and on
    the extremes (top bits all ones, where `1 - u` is below 2^-23, and all zeros; the last round flipping bit 32)."""
    generator = torch.Generator().manual_seed(4)
    mixed = torch.randint(-(2**63), 2**63 - 1, (64, 500), generator=generator)
    low = torch.randint(0, 2**41, (64, 20), generator=generator)
    mixed[:, :20] = low - 2**41  # bits 63..41 all ones
    mixed[:, 20:40] = low  # all zeros
    mixed[:, 40:60] = low | -(2**63)  # bit 63 set (int64 min: 1 << 63 overflows): the last round flips bit 32
    room = _room(mixed, torch.empty_like(mixed)).to(torch.float64)
    finished = _mix_rounds_ref(mixed.clone(), torch.empty_like(mixed), range(2, 3))
    one_minus_u = 1.0 - _uniforms_of(_finished_bits(finished))
    assert bool((room <= one_minus_u).all()), "room above 1 - u: the bound could rule out a winning token"
    assert bool((room > 0).all()) and bool((one_minus_u - room <= 2.0**-23).all())


@triton.jit
def _neg_log_kernel(u_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    u = tl.load(u_ptr + cols, mask=cols < n, other=0.5)
    tl.store(out_ptr + cols, _neg_log(u), mask=cols < n)


def test_logarithm_is_the_reference_bit_for_bit_and_accurate():
    generator = torch.Generator().manual_seed(0)
    u = torch.cat(
        [
            torch.rand(20000, generator=generator, dtype=torch.float64),
            torch.tensor([2.0**-53 * 0.5, 2.0**-53 * 1.5, 0.5, 1.0 - 2.0**-53, 2.0**-0.5, 2.0**0.5 / 2 + 1e-16]),
        ]
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on the CPU
    out = torch.empty_like(u, device=device)
    # launched as the library launches its kernels: a fused multiply-add rounds once where the reference rounds twice
    _neg_log_kernel[(triton.cdiv(len(u), 1024),)](u.to(device), out, len(u), BLOCK_SIZE=1024, enable_fp_fusion=False)
    out = out.cpu()
    assert torch.equal(out, _neg_log_ref(u)), "the kernel's -ln(u) differs from the reference's"
    truth = -torch.log(u)
    assert float(((out - truth).abs() / truth.abs().clamp_min(1e-300)).max()) < 1e-15  # a few ulp


def test_noise_is_keyed_by_seed_position_and_token_only():
    seeds = torch.tensor([7, 7, 8, 7], dtype=torch.int64)
    positions = torch.tensor([3, 3, 3, 4], dtype=torch.int64)
    noise = race_exponentials_ref(seeds, positions, torch.arange(5000))
    assert torch.equal(noise[0], noise[1])  # same key, same noise, whatever the row
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[3])
    # a token's noise does not depend on which other tokens are asked for
    assert torch.equal(race_exponentials_ref(seeds, positions, torch.tensor([4321, 17]))[:, 0], noise[:, 4321])
    # Exp(1): mean and variance 1, and across rows (different keys) uncorrelated
    flat = race_exponentials_ref(torch.arange(200), torch.zeros(200, dtype=torch.int64), torch.arange(5000))
    assert abs(float(flat.mean()) - 1) < 0.01 and abs(float(flat.var()) - 1) < 0.02
    assert abs(float(torch.corrcoef(flat[:2])[0, 1])) < 0.05


def test_race_draws_the_given_distribution():
    """Many keys (a sample's position advances every token) over one distribution: a chi-square test passes; the
    negative control, the same tokens tested against a slightly different distribution, fails."""
    generator = torch.Generator().manual_seed(3)
    probs = sparse_distributions(1, 37, generator).double()[0]
    num_draws = 40000
    rows = probs.expand(num_draws, -1).contiguous()
    tokens = race_sample_ref(rows, torch.full((num_draws,), 12345), torch.arange(num_draws))
    assert chi_square_p_value(tokens, probs) > MIN_P_VALUE
    shifted = probs.clone()
    support = torch.nonzero(probs)[:, 0]
    shifted[support[0]] += 0.02
    shifted[support[1]] = (shifted[support[1]] - 0.02).clamp_min(1e-3)
    shifted /= shifted.sum()
    assert chi_square_p_value(tokens, shifted) < 1e-6


def test_bad_inputs_are_named():
    case = make_case(2, 11, torch.float32)
    with pytest.raises(ValueError, match=r"seeds has 1 entries, expected one per row of probs \(2\)"):
        race_sample_ref(case["probs"], case["seeds"][:1], case["positions"])
    with pytest.raises(ValueError, match="positions has dtype torch.int32"):
        race_sample_ref(case["probs"], case["seeds"], case["positions"].int())
    with pytest.raises(ValueError, match="probs has dtype torch.float16"):
        race_sample(case["probs"].half(), case["seeds"], case["positions"])
