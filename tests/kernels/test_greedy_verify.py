"""greedy_verify: the Triton kernel equals the torch reference token for token, and both follow the greedy rule.

On CPU the kernel runs under TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports `kernels`.
"""

import re

import pytest
import torch
from kernel_cases import DRAFT_COUNTS
from kernel_cases import LOGIT_DTYPES as DTYPES
from kernel_cases import assert_kernel_matches_reference as assert_matches

from rollout_kernels import greedy_verify, greedy_verify_ref

torch.set_num_threads(1)


def make_case(counts: list[int], vocab_size: int, dtype: torch.dtype, mode: str, seed: int = 0):
    """Random logits and drafts that the target accepts at random ('random'), always or never."""
    generator = torch.Generator().manual_seed(seed)
    num_rows, total_drafts = len(counts), sum(counts)
    cu_num_draft_tokens = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    target_logits = torch.randn(total_drafts + num_rows, vocab_size, generator=generator).to(dtype)
    target_argmax = target_logits.argmax(dim=-1)
    # The target row that verifies each draft: draft d of row i is checked by target row d + i.
    verifying_rows = torch.arange(total_drafts) + torch.repeat_interleave(torch.arange(num_rows), torch.tensor(counts))
    matching = target_argmax[verifying_rows]
    if mode == "all_accept":
        draft_token_ids = matching
    elif mode == "all_reject":
        draft_token_ids = (matching + 1) % vocab_size  # argmax takes the lowest index, so never a tie winner
    else:
        random_tokens = torch.randint(0, vocab_size, (total_drafts,), generator=generator)
        draft_token_ids = torch.where(torch.rand(total_drafts, generator=generator) < 0.7, matching, random_tokens)
    return draft_token_ids.contiguous(), cu_num_draft_tokens, target_logits


def assert_kernel_matches_reference(draft_token_ids, cu_num_draft_tokens, target_logits, max_num_draft_tokens):
    args = dict(
        draft_token_ids=draft_token_ids,
        cu_num_draft_tokens=cu_num_draft_tokens,
        target_logits=target_logits,
        max_num_draft_tokens=max_num_draft_tokens,
    )
    return assert_matches(greedy_verify, greedy_verify_ref, args, ("output_token_ids", "num_emitted"))


@pytest.mark.parametrize("mode", ["random", "all_accept", "all_reject"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", DRAFT_COUNTS.values(), ids=DRAFT_COUNTS.keys())
def test_kernel_matches_reference(counts, dtype, mode):
    case = make_case(counts, 1271, dtype, mode)
    out, num_emitted = assert_kernel_matches_reference(*case, max(counts))
    counts = torch.tensor(counts)
    if mode == "all_accept":
        assert torch.equal(num_emitted, counts + 1)
    if mode == "all_reject":
        assert torch.equal(num_emitted, torch.ones_like(counts))
    assert out.shape == (len(counts), max(counts) + 1)
    assert torch.equal((out >= 0).sum(dim=1), num_emitted), "every slot after the emitted tokens holds -1"


@pytest.mark.parametrize(
    "counts, dtype, mode",
    [([2, 0], torch.bfloat16, "all_accept"), ([1, 3], torch.float32, "random")],
    ids=["bf16-all_accept", "fp32-random"],
)
def test_kernel_matches_reference_real_vocab(counts, dtype, mode):
    assert_kernel_matches_reference(*make_case(counts, 151936, dtype, mode, seed=1), max(counts))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_go_to_the_lowest_index(dtype):
    vocab_size = 2500  # three blocks of 1024
    logits = torch.zeros(6, vocab_size)
    logits[0, [5, 1030]] = 3.0  # tie across blocks: the first block wins
    logits[1, [1500, 2100]] = 3.0  # maximum only in later blocks
    logits[2, :] = 1.0  # all equal
    logits[3, :] = float("-inf")  # torch.argmax gives 0
    logits[4, :] = float("-inf")
    logits[4, vocab_size - 1] = -1.0  # the very last token
    logits[5, [1024, 1023]] = 2.0  # either side of a block boundary
    expected = [5, 1500, 0, 0, vocab_size - 1, 1023]
    cu_num_draft_tokens = torch.tensor([0, 0, 0, 0, 0, 0])  # six rows, bonus tokens only
    out, _ = assert_kernel_matches_reference(
        torch.zeros(0, dtype=torch.int64), cu_num_draft_tokens, logits.to(dtype), 0
    )
    assert out[:, 0].tolist() == expected


def test_reference_follows_the_greedy_rule():
    """Accept while draft == argmax, then emit the argmax at the mismatch (or the bonus argmax)."""
    vocab_size = 6
    argmaxes = [2, 4, 3, 5, 0, 5, 5, 1, 3, 1]  # per target row
    target_logits = torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab_size).double()
    draft_token_ids = torch.tensor([2, 4, 1, 5, 5, 3])
    cu_num_draft_tokens = torch.tensor([3, 3, 5, 6])
    # row 0: drafts 2 4 1 vs argmax 2 4 3 (5): accept 2, 4, then emit 3 at the mismatch
    # row 1: no drafts: the bonus argmax 0
    # row 2: drafts 5 5 vs argmax 5 5 (1): accept both, then the bonus 1
    # row 3: draft 3 vs argmax 3 (1): accept 3, then the bonus 1
    expected_out = [[2, 4, 3, -1], [0, -1, -1, -1], [5, 5, 1, -1], [3, 1, -1, -1]]
    for op in (greedy_verify_ref, greedy_verify):
        out, num_emitted = op(draft_token_ids, cu_num_draft_tokens, target_logits, 3)
        assert out.tolist() == expected_out, op.__name__
        assert num_emitted.tolist() == [3, 1, 3, 2], op.__name__


def test_wider_output_and_no_rows():
    case = make_case([1, 2], 50, torch.float32, "all_accept")
    out, num_emitted = assert_kernel_matches_reference(*case, 5)
    assert out.shape == (2, 6) and num_emitted.tolist() == [2, 3]
    no_rows = torch.zeros(0, dtype=torch.int64)
    for op in (greedy_verify, greedy_verify_ref):
        out, num_emitted = op(no_rows, no_rows, torch.zeros(0, 7), 2)
        assert out.shape == (0, 3) and num_emitted.shape == (0,), op.__name__


def valid_args():
    return dict(
        draft_token_ids=torch.tensor([1, 2, 3]),
        cu_num_draft_tokens=torch.tensor([1, 3]),
        target_logits=torch.randn(5, 11),
        max_num_draft_tokens=2,
    )


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("draft_token_ids", torch.tensor([1, 2, 3], dtype=torch.int32), "draft_token_ids has dtype torch.int32"),
        ("cu_num_draft_tokens", torch.tensor([1.0, 3.0]), "cu_num_draft_tokens has dtype torch.float32"),
        ("target_logits", torch.randn(4, 11), "target_logits has 4 rows, expected total_drafts + num_rows"),
        ("target_logits", torch.randn(11, 5).t(), "target_logits (shape (5, 11)) must be contiguous"),
        ("target_logits", torch.zeros(5, 11, dtype=torch.int64), "target_logits has dtype torch.int64"),
        ("target_logits", torch.randn(5), "target_logits must have 2 dimension(s)"),
        ("max_num_draft_tokens", -1, "max_num_draft_tokens must be >= 0"),
    ],
)
@pytest.mark.parametrize("op", [greedy_verify, greedy_verify_ref], ids=lambda op: op.__name__)
def test_bad_arguments_are_named(op, name, value, message):
    args = valid_args() | {name: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        op(**args)


def test_reference_checks_what_the_kernel_cannot():
    args = valid_args()
    with pytest.raises(ValueError, match=r"more than max_num_draft_tokens \(1\)"):
        greedy_verify_ref(**args | {"max_num_draft_tokens": 1})
    with pytest.raises(ValueError, match=r"cu_num_draft_tokens\[-1\] is 2"):
        greedy_verify_ref(**args | {"cu_num_draft_tokens": torch.tensor([1, 2])})
