"""rejection_sample: the Triton kernel equals the torch reference token for token (same uniforms in, same tokens
out), and the reference emits tokens distributed exactly as the target.

On CPU the kernel runs under TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports `kernels`.
"""

import re

import pytest
import torch
from kernel_cases import (
    DRAFT_COUNTS,
    LARGEST_UNIFORM_BELOW_ONE,
    MIN_P_VALUE,
    chi_square_p_value,
    sparse_distributions,
)
from kernel_cases import assert_kernel_matches_reference as assert_matches

from rollout_kernels import rejection_sample, rejection_sample_ref

torch.set_num_threads(1)


def make_case(counts, vocab_size, dtype, with_draft_probs, mode, seed=0):
    """Inputs for rejection_sample. mode: 'random', 'all_accept' (accepted for any uniform) or 'all_reject'."""
    generator = torch.Generator().manual_seed(seed)
    num_rows, total_drafts = len(counts), sum(counts)
    cu_num_draft_tokens = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    target_probs = sparse_distributions(total_drafts + num_rows, vocab_size, generator)
    draft_probs = sparse_distributions(total_drafts, vocab_size, generator)
    if with_draft_probs:
        draft_token_ids = torch.multinomial(draft_probs, 1, generator=generator).view(-1)
    else:  # n-gram drafts can be any token, including ones the target gives probability 0
        draft_token_ids = torch.randint(0, vocab_size, (total_drafts,), generator=generator)
    verifying_rows = torch.arange(total_drafts) + torch.repeat_interleave(torch.arange(num_rows), torch.tensor(counts))
    if mode == "all_accept":  # p == q, or p one-hot at the n-gram draft: u * q < p for every u < 1
        accepting = draft_probs if with_draft_probs else torch.eye(vocab_size, dtype=torch.float64)[draft_token_ids]
        target_probs[verifying_rows] = accepting
    elif mode == "all_reject":  # p(x) = 0: 0 < 0 fails for every u
        target_probs[verifying_rows, draft_token_ids] = 0.0
        target_probs[verifying_rows] /= target_probs[verifying_rows].sum(dim=-1, keepdim=True)
    return dict(
        draft_token_ids=draft_token_ids,
        cu_num_draft_tokens=cu_num_draft_tokens,
        draft_probs=draft_probs.to(dtype) if with_draft_probs else None,
        target_probs=target_probs.to(dtype),
        accept_uniforms=torch.rand(total_drafts, generator=generator, dtype=torch.float64),
        sample_uniforms=torch.rand(num_rows, generator=generator, dtype=torch.float64),
        max_num_draft_tokens=max(counts, default=0),
    )


def assert_kernel_matches_reference(args):
    return assert_matches(rejection_sample, rejection_sample_ref, args, ("output_token_ids", "num_emitted"))


def emitted_target_probs(args, out):
    """p(token) under the target row that emitted it: never 0 for a valid sampler."""
    counts = torch.diff(args["cu_num_draft_tokens"], prepend=torch.zeros(1, dtype=torch.int64))
    target_start = args["cu_num_draft_tokens"] - counts + torch.arange(len(counts))
    positions = torch.arange(out.shape[1])
    target_rows = (target_start[:, None] + positions).clamp(max=args["target_probs"].shape[0] - 1)
    return torch.where(out >= 0, args["target_probs"][target_rows, out.clamp(min=0)].double(), 1.0)


@pytest.mark.parametrize("mode", ["random", "all_accept", "all_reject"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "ngram"])
@pytest.mark.parametrize("counts", DRAFT_COUNTS.values(), ids=DRAFT_COUNTS.keys())
def test_kernel_matches_reference(counts, with_draft_probs, dtype, mode):
    args = make_case(counts, 1271, dtype, with_draft_probs, mode)
    out, num_emitted = assert_kernel_matches_reference(args)
    counts = torch.tensor(counts)
    if mode == "all_accept":
        assert torch.equal(num_emitted, counts + 1)
    if mode == "all_reject":
        assert torch.equal(num_emitted, torch.ones_like(counts))
        has_drafts = counts > 0
        first_drafts = args["draft_token_ids"][(args["cu_num_draft_tokens"] - counts)[has_drafts]]
        assert (out[has_drafts, 0] != first_drafts).all(), "a rejected draft cannot be the recovered token"
    assert torch.equal((out >= 0).sum(dim=1), num_emitted), "every slot after the emitted tokens holds -1"
    assert (emitted_target_probs(args, out) > 0).all(), "a token with target probability 0 was emitted"


@pytest.mark.parametrize(
    "counts, dtype, with_draft_probs, mode",
    [([0, 2], torch.float32, True, "random"), ([1, 1], torch.float64, False, "all_reject")],
    ids=["fp32-draft_probs-random", "fp64-ngram-all_reject"],
)
def test_kernel_matches_reference_real_vocab(counts, dtype, with_draft_probs, mode):
    assert_kernel_matches_reference(make_case(counts, 151936, dtype, with_draft_probs, mode, seed=1))


def test_many_rows_small_vocab():
    """Many rows over a vocabulary smaller than one block: every accept/reject path, both modes."""
    generator = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 4, (64,), generator=generator).tolist()
    for with_draft_probs in (True, False):
        assert_kernel_matches_reference(make_case(counts, 7, torch.float32, with_draft_probs, "random", seed=4))


@pytest.mark.parametrize("op", [rejection_sample, rejection_sample_ref], ids=lambda op: op.__name__)
def test_zero_draft_probability(op):
    """q(x) = 0 cannot be drawn by a real draft model; it is accepted iff p(x) > 0, and p == q falls back to p."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    target_probs = torch.tensor([[0.2, 0.2, 0.6, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    for draft, target_row, expected in [(2, 0, [2, 3]), (3, 1, [1, -1])]:
        out, num_emitted = op(
            draft_token_ids=torch.tensor([draft]),
            cu_num_draft_tokens=torch.tensor([1]),
            draft_probs=probs,
            target_probs=target_probs[[target_row, 2]].double(),
            accept_uniforms=torch.tensor([LARGEST_UNIFORM_BELOW_ONE], dtype=torch.float64),
            sample_uniforms=torch.tensor([0.75], dtype=torch.float64),
            max_num_draft_tokens=1,
        )
        # draft 2: q = 0 < p = 0.6, accepted, then the bonus token 3.
        # draft 3: p = q = 0 rejected; max(p - q, 0) is all zero, so sample p = [.5, .5, 0, 0] at u = .75: token 1.
        assert out.tolist() == [expected] and num_emitted.tolist() == [2 if expected[1] >= 0 else 1]


@pytest.mark.parametrize("op", [rejection_sample, rejection_sample_ref], ids=lambda op: op.__name__)
def test_uniform_edges_never_return_zero_probability_tokens(op):
    vocab_size = 2500  # three blocks, with zero-probability tokens before, between and after the mass
    target_probs = torch.zeros(3, vocab_size, dtype=torch.float64)
    target_probs[:2, [7, 1100, 2200]] = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    # row 2 is all zero (invalid input): the token is 0, deterministically
    out, num_emitted = op(
        draft_token_ids=torch.zeros(0, dtype=torch.int64),
        cu_num_draft_tokens=torch.tensor([0, 0, 0]),
        draft_probs=None,
        target_probs=target_probs,
        accept_uniforms=torch.zeros(0, dtype=torch.float64),
        sample_uniforms=torch.tensor([0.0, LARGEST_UNIFORM_BELOW_ONE, 0.5], dtype=torch.float64),
        max_num_draft_tokens=0,
    )
    assert out[:, 0].tolist() == [7, 2200, 0] and num_emitted.tolist() == [1, 1, 1]


@pytest.mark.parametrize("op", [rejection_sample, rejection_sample_ref], ids=lambda op: op.__name__)
def test_wider_output_and_no_rows(op):
    args = make_case([1, 2], 50, torch.float64, True, "all_accept") | {"max_num_draft_tokens": 5}
    out, num_emitted = op(**args)
    assert out.shape == (2, 6) and num_emitted.tolist() == [2, 3] and (out[:, 3:] == -1).all()
    no_rows, no_uniforms = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
    for draft_probs in (None, torch.zeros(0, 7)):
        out, num_emitted = op(no_rows, no_rows, draft_probs, torch.zeros(0, 7), no_uniforms, no_uniforms, 2)
        assert out.shape == (0, 3) and num_emitted.shape == (0,)


def valid_args():
    return dict(
        draft_token_ids=torch.tensor([1, 2, 3]),
        cu_num_draft_tokens=torch.tensor([1, 3]),
        draft_probs=torch.full((3, 11), 1 / 11),
        target_probs=torch.full((5, 11), 1 / 11),
        accept_uniforms=torch.rand(3, dtype=torch.float64),
        sample_uniforms=torch.rand(2, dtype=torch.float64),
        max_num_draft_tokens=2,
    )


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("draft_token_ids", torch.tensor([[1, 2, 3]]), "draft_token_ids must have 1 dimension(s)"),
        ("draft_probs", torch.full((3, 12), 1 / 12), "draft_probs has shape (3, 12), expected"),
        ("draft_probs", torch.full((3, 11), 1 / 11, dtype=torch.float16), "draft_probs has dtype torch.float16"),
        ("target_probs", torch.full((6, 11), 1 / 11), "target_probs has 6 rows, expected"),
        ("target_probs", torch.full((11, 5), 1 / 11).t(), "target_probs (shape (5, 11)) must be contiguous"),
        ("accept_uniforms", torch.rand(3), "accept_uniforms has dtype torch.float32, expected one of: float64"),
        ("accept_uniforms", torch.rand(2, dtype=torch.float64), "accept_uniforms has 2 entries, expected 3"),
        ("sample_uniforms", torch.rand(3, dtype=torch.float64), "sample_uniforms has 3 entries, expected 2"),
    ],
)
@pytest.mark.parametrize("op", [rejection_sample, rejection_sample_ref], ids=lambda op: op.__name__)
def test_bad_arguments_are_named(op, name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        op(**valid_args() | {name: value})


def test_reference_checks_what_the_kernel_cannot():
    with pytest.raises(ValueError, match=re.escape("draft_token_ids must lie in [0, vocab_size = 11)")):
        rejection_sample_ref(**valid_args() | {"draft_token_ids": torch.tensor([1, 2, 11])})
    with pytest.raises(ValueError, match=re.escape("more than max_num_draft_tokens (1)")):
        rejection_sample_ref(**valid_args() | {"max_num_draft_tokens": 1})


# Two draft positions and a bonus position over vocabulary 8. Zeros in p check that such tokens never appear;
# q differs from p enough that a wrong residual shows.
TARGET = torch.tensor(
    [
        [0.30, 0.20, 0.15, 0.15, 0.10, 0.10, 0.00, 0.00],
        [0.05, 0.05, 0.40, 0.00, 0.10, 0.10, 0.10, 0.20],
        [0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.20, 0.20],
    ],
    dtype=torch.float64,
)
DRAFT = torch.tensor(
    [
        [0.05, 0.05, 0.10, 0.10, 0.20, 0.20, 0.30, 0.00],
        [0.30, 0.30, 0.00, 0.10, 0.10, 0.10, 0.05, 0.05],
    ],
    dtype=torch.float64,
)
NUM_SAMPLES = 20_000


def sample_chains(with_draft_probs: bool, seed: int):
    """NUM_SAMPLES independent rows with two drafts each, through the reference."""
    generator = torch.Generator().manual_seed(seed)
    num_rows = NUM_SAMPLES
    if with_draft_probs:
        drafts = torch.stack([torch.multinomial(DRAFT[j], num_rows, True, generator=generator) for j in (0, 1)], 1)
    else:  # n-gram: any proposal works; here mostly good guesses, else any token (probability 0 included)
        guesses = torch.stack([torch.multinomial(TARGET[j], num_rows, True, generator=generator) for j in (0, 1)], 1)
        anything = torch.randint(0, 8, (num_rows, 2), generator=generator)
        drafts = torch.where(torch.rand(num_rows, 2, generator=generator) < 0.8, guesses, anything)
    args = dict(
        draft_token_ids=drafts.flatten(),
        cu_num_draft_tokens=torch.arange(1, num_rows + 1) * 2,
        draft_probs=DRAFT.repeat(num_rows, 1) if with_draft_probs else None,
        target_probs=TARGET.repeat(num_rows, 1),
        accept_uniforms=torch.rand(2 * num_rows, generator=generator, dtype=torch.float64),
        sample_uniforms=torch.rand(num_rows, generator=generator, dtype=torch.float64),
        max_num_draft_tokens=2,
    )
    out, num_emitted = rejection_sample_ref(**args)
    return drafts, out, num_emitted


@pytest.fixture(scope="module", params=[True, False], ids=["draft_probs", "ngram"])
def chains(request):
    return sample_chains(with_draft_probs=request.param, seed=int(request.param))


def test_reference_samples_the_target_distribution(chains):
    drafts, out, num_emitted = chains
    # Position j is emitted when drafts 0..j-1 were accepted; whatever was accepted before, it must follow p_j.
    for position in range(3):
        tokens = out[num_emitted > position, position]
        assert len(tokens) > 500, f"too few samples at position {position}: {len(tokens)}"
        p_value = chi_square_p_value(tokens, TARGET[position])
        assert p_value > MIN_P_VALUE, f"position {position}: p-value {p_value:.2e}"
    first_accepted = (num_emitted > 1).double().mean()
    assert 0.1 < first_accepted < 0.9, f"first drafts accepted {first_accepted:.2f}: both outcomes must occur"


def test_wrong_residual_fails_the_same_test(chains):
    """Negative control: resampling from p (not max(p - q, 0)) after a rejection must fail the chi-square test."""
    drafts, out, num_emitted = chains
    generator = torch.Generator().manual_seed(2)
    rejected_first = num_emitted == 1
    wrong = out[:, 0].clone()
    wrong[rejected_first] = torch.multinomial(TARGET[0], int(rejected_first.sum()), True, generator=generator)
    assert chi_square_p_value(out[:, 0], TARGET[0]) > MIN_P_VALUE
    assert chi_square_p_value(wrong, TARGET[0]) < 1e-6
