"""tree_rejection_sample: the Triton kernel equals the torch reference token for token (same uniforms in, same tokens
out), a chain-shaped tree gives exactly what rejection_sample gives without draft probabilities, and the reference
emits tokens distributed exactly as the target, which a variant without sibling removal does not.

On CPU the kernel runs under TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports `kernels`.
"""

import random
import re

import pytest
import torch
from kernel_cases import (
    LARGEST_UNIFORM_BELOW_ONE,
    MIN_P_VALUE,
    assert_tree_walk,
    chi_square_p_value,
    children_of,
    random_parents,
    sparse_distributions,
    tree_layout,
)
from kernel_cases import TREE_SHAPES as COMMON_TREE_SHAPES
from kernel_cases import assert_kernel_matches_reference as assert_matches
from scipy.stats import chisquare

from rollout_kernels import rejection_sample, tree_rejection_sample, tree_rejection_sample_ref

torch.set_num_threads(1)

# The shared tree shapes, plus many later siblings tried after a rejection.
TREE_SHAPES = {**COMMON_TREE_SHAPES, "bushy": [(2, 4)] * 12}


def make_case(shapes, vocab_size: int, dtype: torch.dtype, mode: str, seed: int = 0) -> dict:
    """Random trees with distinct sibling tokens, mostly likely ones (probability-0 tokens included). mode: 'random',
    'all_accept' (every inner node's row is one-hot at one child's token, not always the first) or 'all_reject'
    (every inner node's row gives its children's tokens probability 0)."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    trees = [random_parents(depth, width, rng) for depth, width in shapes]
    # Sharp rows: the likely children hold much of the mass, so the siblings' renormalisation matters.
    target_probs = sparse_distributions(sum(len(parents) for parents in trees), vocab_size, generator, scale=4.0)
    tokens, start = [], 0
    for parents in trees:
        row_tokens = [rng.randrange(vocab_size)] * len(parents)
        for node, children in enumerate(children_of(parents)):
            if not children:
                continue
            row = target_probs[start + node]
            picks = torch.multinomial(row + 1e-4, len(children), replacement=False, generator=generator)
            for child, token in zip(children, picks.tolist()):
                row_tokens[child] = token
            if mode == "all_accept":
                row[:] = torch.nn.functional.one_hot(picks[rng.randrange(len(children))], vocab_size)
            elif mode == "all_reject":
                row[picks] = 0.0
                row /= row.sum()
        tokens += row_tokens
        start += len(parents)
    return dict(
        **tree_layout(trees, tokens),
        target_probs=target_probs.to(dtype),
        accept_uniforms=torch.rand(start, generator=generator, dtype=torch.float64),
        sample_uniforms=torch.rand(len(trees), generator=generator, dtype=torch.float64),
        max_depth=max(depth for depth, _ in shapes),
    )


def assert_kernel_matches_reference(args: dict):
    names = ("output_token_ids", "num_emitted", "accepted_nodes")
    return assert_matches(tree_rejection_sample, tree_rejection_sample_ref, args, names)


def assert_valid_walk(args: dict, out, num_emitted, accepted_nodes) -> list[list[int]]:
    """A path from the root, every emitted token of probability > 0 under the row that emitted it, and the last one
    none of the (rejected) children where the walk stopped (see `assert_tree_walk`). Returns the children of each
    row's last node."""
    return assert_tree_walk(
        args,
        out,
        num_emitted,
        accepted_nodes,
        lambda node, token: args["target_probs"][node, token] > 0,
        "has probability 0",
        "a rejected child was emitted",
    )


@pytest.mark.parametrize("mode", ["random", "all_accept", "all_reject"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shapes", TREE_SHAPES.values(), ids=TREE_SHAPES.keys())
def test_kernel_matches_reference(shapes, dtype, mode):
    args = make_case(shapes, 1271, dtype, mode)
    out, num_emitted, accepted_nodes = assert_kernel_matches_reference(args)
    num_rows, max_depth = len(shapes), args["max_depth"]
    assert out.shape == (num_rows, max_depth + 1) and accepted_nodes.shape == (num_rows, max_depth)
    last_children = assert_valid_walk(args, out, num_emitted, accepted_nodes)
    if mode == "all_accept":
        assert not any(last_children), "the walk must end at a leaf"
    if mode == "all_reject":
        assert (num_emitted == 1).all()


@pytest.mark.parametrize(
    "shapes, dtype, mode",
    [([(2, 3)], torch.float32, "random"), ([(0, 0), (1, 2)], torch.float64, "all_reject")],
    ids=["fp32-random", "fp64-all_reject"],
)
def test_kernel_matches_reference_real_vocab(shapes, dtype, mode):
    args = make_case(shapes, 151936, dtype, mode, seed=1)
    assert_valid_walk(args, *assert_kernel_matches_reference(args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("counts", [[0, 4, 1, 3, 0, 2, 4], [8, 8, 8], [1]], ids=["mixed", "max_8", "one"])
def test_chain_tree_equals_rejection_sample_without_draft_probs(counts, dtype):
    generator = torch.Generator().manual_seed(5)
    num_rows, total_drafts = len(counts), sum(counts)
    target_probs = sparse_distributions(total_drafts + num_rows, 1271, generator).to(dtype)
    # n-gram drafts: mostly likely tokens of the verifying row (draft d of row i: target row d + i), else anything
    row_of_draft = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(counts))
    likely = torch.multinomial(target_probs[torch.arange(total_drafts) + row_of_draft].double(), 1, generator=generator)
    anything = torch.randint(0, 1271, (total_drafts,), generator=generator)
    drafts = torch.where(torch.rand(total_drafts, generator=generator) < 0.7, likely.view(-1), anything)
    accept_uniforms = torch.rand(total_drafts, generator=generator, dtype=torch.float64)
    sample_uniforms = torch.rand(num_rows, generator=generator, dtype=torch.float64)
    expected_out, expected_num_emitted = rejection_sample(
        drafts, torch.tensor(counts).cumsum(0), None, target_probs, accept_uniforms, sample_uniforms, max(counts)
    )
    # The same rows as trees: node k + 1 is draft k, its parent node k; the roots' uniforms are never read.
    is_root = torch.zeros(total_drafts + num_rows, dtype=torch.bool)
    is_root[torch.tensor(counts).cumsum(0) + torch.arange(num_rows) - torch.tensor(counts)] = True
    tree_token_ids = torch.full_like(is_root, 3, dtype=torch.int64)
    tree_token_ids[~is_root] = drafts
    tree_accept_uniforms = torch.full_like(is_root, 0.5, dtype=torch.float64)
    tree_accept_uniforms[~is_root] = accept_uniforms
    tree_parents = torch.tensor([parent for count in counts for parent in range(-1, count)])
    tree_args = (tree_token_ids, tree_parents, (torch.tensor(counts) + 1).cumsum(0), target_probs)
    for op in (tree_rejection_sample, tree_rejection_sample_ref):
        out, num_emitted, accepted_nodes = op(*tree_args, tree_accept_uniforms, sample_uniforms, max(counts))
        assert torch.equal(out, expected_out), op.__name__
        assert torch.equal(num_emitted, expected_num_emitted), op.__name__
        steps = torch.arange(1, max(counts) + 1)
        assert torch.equal(accepted_nodes, torch.where(steps < num_emitted[:, None], steps, -1)), op.__name__


@pytest.mark.parametrize("op", [tree_rejection_sample, tree_rejection_sample_ref], ids=lambda op: op.__name__)
def test_rejected_siblings_and_uniform_edges(op):
    """Over three vocabulary blocks with p = {7: .25, 1100: .5, 2200: .25} on every row: rejected children and
    probability-0 tokens are never sampled at either uniform edge, and a later sibling is tested against the mass
    the rejected ones leave."""
    vocab_size = 2500
    target_probs = torch.zeros(7, vocab_size, dtype=torch.float64)
    target_probs[:, [7, 1100, 2200]] = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    # row 0: children 7 (.99 < .25? no) and 2200 (.99 * .75 < .25? no) rejected; u = 0 samples 1100, not 7.
    # row 1: child 7 rejected, then 2200: .3 * .75 = .225 < .25, accepted (.3 < .25 would not be); the leaf's
    #   u just below 1 samples the last token with mass, 2200.
    # row 2: only a root, u = 0: the first token with mass, 7.
    tree_token_ids = torch.tensor([5, 7, 2200, 5, 7, 2200, 9])
    tree_parents = torch.tensor([-1, 0, 0, -1, 0, 0, -1])
    accept_uniforms = torch.tensor([0.0, 0.99, 0.99, 0.0, 0.99, 0.3, 0.0], dtype=torch.float64)
    sample_uniforms = torch.tensor([0.0, LARGEST_UNIFORM_BELOW_ONE, 0.0], dtype=torch.float64)
    out, num_emitted, accepted_nodes = op(
        tree_token_ids, tree_parents, torch.tensor([3, 6, 7]), target_probs, accept_uniforms, sample_uniforms, 1
    )
    assert out.tolist() == [[1100, -1], [2200, 2200], [7, -1]]
    assert num_emitted.tolist() == [1, 2, 1] and accepted_nodes.tolist() == [[-1], [2], [-1]]


@pytest.mark.parametrize("op", [tree_rejection_sample, tree_rejection_sample_ref], ids=lambda op: op.__name__)
def test_rounding_fallback_to_p(op):
    """A row whose children hold all its mass only because the row sums to less than 1 (a caller error) falls back
    to sampling from p instead of returning a token of probability 0."""
    target_probs = torch.zeros(3, 4, dtype=torch.float64)
    target_probs[0, [0, 1]] = 0.3
    out, num_emitted, accepted_nodes = op(
        torch.tensor([2, 0, 1]),
        torch.tensor([-1, 0, 0]),
        torch.tensor([3]),
        target_probs,
        torch.tensor([0.0, 0.5, 0.9], dtype=torch.float64),  # .5 < .3? no; .9 * .7 = .63 < .3? no
        torch.tensor([0.75], dtype=torch.float64),
        1,
    )
    assert out.tolist() == [[1, -1]] and num_emitted.tolist() == [1]  # p = .3, .3: cdf .3, .6 > .45 at token 1


@pytest.mark.parametrize("op", [tree_rejection_sample, tree_rejection_sample_ref], ids=lambda op: op.__name__)
def test_wider_output_and_no_rows(op):
    args = make_case([(2, 2), (0, 0)], 50, torch.float64, "all_accept") | {"max_depth": 5}
    out, num_emitted, accepted_nodes = op(**args)
    assert out.shape == (2, 6) and accepted_nodes.shape == (2, 5) and (out[:, 3:] == -1).all()
    no_rows, no_uniforms = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
    out, num_emitted, accepted_nodes = op(no_rows, no_rows, no_rows, torch.zeros(0, 7), no_uniforms, no_uniforms, 2)
    assert out.shape == (0, 3) and num_emitted.shape == (0,) and accepted_nodes.shape == (0, 2)


def valid_args():
    return dict(
        tree_token_ids=torch.tensor([1, 2, 3, 4]),
        tree_parents=torch.tensor([-1, 0, 0, -1]),
        cu_num_nodes=torch.tensor([3, 4]),
        target_probs=torch.full((4, 11), 1 / 11),
        accept_uniforms=torch.rand(4, dtype=torch.float64),
        sample_uniforms=torch.rand(2, dtype=torch.float64),
        max_depth=1,
    )


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("tree_parents", torch.tensor([[-1, 0, 0, -1]]), "tree_parents must have 1 dimension(s)"),
        ("target_probs", torch.full((4, 11), 1 / 11, dtype=torch.float16), "target_probs has dtype torch.float16"),
        ("target_probs", torch.full((3, 11), 1 / 11), "target_probs has 3 rows, expected one per tree node"),
        ("accept_uniforms", torch.rand(4), "accept_uniforms has dtype torch.float32, expected one of: float64"),
        ("accept_uniforms", torch.rand(3, dtype=torch.float64), "accept_uniforms has 3 entries, expected 4"),
        ("sample_uniforms", torch.rand(3, dtype=torch.float64), "sample_uniforms has 3 entries, expected 2"),
        ("max_depth", -2, "max_depth must be >= 0"),
    ],
)
@pytest.mark.parametrize("op", [tree_rejection_sample, tree_rejection_sample_ref], ids=lambda op: op.__name__)
def test_bad_arguments_are_named(op, name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        op(**valid_args() | {name: value})


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("tree_token_ids", torch.tensor([1, 2, 2, 4]), "children of a node must hold distinct tokens"),
        (
            "tree_token_ids",
            torch.tensor([1, 2, 11, 4]),
            "tree_token_ids of draft nodes must lie in [0, vocab_size = 11)",
        ),
        ("max_depth", 0, "a tree is deeper than max_depth (0)"),
        ("tree_parents", torch.tensor([-1, 1, 0, -1]), "tree_parents[v] must lie in [0, v)"),
    ],
)
def test_reference_checks_what_the_kernel_cannot(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tree_rejection_sample_ref(**valid_args() | {name: value})


# ---------------------------------------------------------------------------------------------
# Statistics over vocabulary 8. Every row has the same tree shape with freshly drawn distinct candidates:
#   root 0: children 1, 2, 4 (siblings not adjacent); node 1: children 3, 7; node 2: child 6; node 3: child 5.
# The target is a Markov chain: the root row is P0 and the row of a node holding token x is COND[x]. Lossless means
# token 0 ~ P0 and, whenever the walk went on past token j, token j + 1 ~ COND[token j].
STAT_PARENTS = [-1, 0, 0, 1, 0, 3, 2, 1]
P0 = torch.tensor([0.30, 0.20, 0.15, 0.15, 0.10, 0.10, 0.00, 0.00], dtype=torch.float64)
COND = torch.stack([torch.tensor([0.05, 0.05, 0.40, 0.00, 0.10, 0.10, 0.10, 0.20]).roll(x) for x in range(8)]).double()
NUM_SAMPLES = 20_000


def stat_case(num_rows: int, seed: int) -> dict:
    """num_rows trees of the STAT_PARENTS shape, candidates picked before any uniform is drawn: the root's children
    are P0's top 3 tokens in a random order (a draft's top-k); deeper siblings are drawn without replacement from a
    blur of their parent's target row (probability-0 tokens included)."""
    generator = torch.Generator().manual_seed(seed)
    num_nodes = len(STAT_PARENTS)
    tokens = torch.zeros(num_rows, num_nodes, dtype=torch.int64)
    target_probs = torch.empty(num_rows, num_nodes, 8, dtype=torch.float64)
    target_probs[:, 0] = P0
    for node, children in enumerate(children_of(STAT_PARENTS)):  # parents come first: their rows are set
        if node == 0:
            tokens[:, children] = torch.rand(num_rows, 3, generator=generator).argsort(dim=1)
            target_probs[:, children] = COND[tokens[:, children]]
        elif children:
            proposal = 0.6 * target_probs[:, node] + 0.4 / 8
            tokens[:, children] = torch.multinomial(proposal, len(children), generator=generator)
            target_probs[:, children] = COND[tokens[:, children]]
    return dict(
        tree_token_ids=tokens.flatten(),
        tree_parents=torch.tensor(STAT_PARENTS).repeat(num_rows),
        cu_num_nodes=torch.arange(1, num_rows + 1) * num_nodes,
        target_probs=target_probs.view(-1, 8).contiguous(),
        accept_uniforms=torch.rand(num_rows * num_nodes, generator=generator, dtype=torch.float64),
        sample_uniforms=torch.rand(num_rows, generator=generator, dtype=torch.float64),
        max_depth=3,
    )


def without_sibling_removal(args: dict) -> torch.Tensor:
    """Negative control: like the reference except that each child is tested against the full p (accept iff
    u < p(x)) instead of p with the rejected siblings removed and renormalised. Returns output_token_ids."""
    num_rows, num_nodes = args["sample_uniforms"].shape[0], len(STAT_PARENTS)
    tokens = args["tree_token_ids"].view(num_rows, num_nodes)
    probs = args["target_probs"].view(num_rows, num_nodes, 8)
    accept_uniforms = args["accept_uniforms"].view(num_rows, num_nodes)
    rows = torch.arange(num_rows)
    generator = torch.Generator().manual_seed(7)
    out = torch.full((num_rows, 4), -1)
    node = torch.zeros(num_rows, dtype=torch.int64)
    walking = torch.ones(num_rows, dtype=torch.bool)
    for depth in range(4):
        p = probs[rows, node]  # [num_rows, 8]
        chosen = torch.full((num_rows,), -1)
        weights = p.clone()
        for child, parent in enumerate(STAT_PARENTS[1:], start=1):
            tried = walking & (node == parent) & (chosen < 0)
            accepted = tried & (accept_uniforms[:, child] < p[rows, tokens[:, child]])  # full p: the bug
            chosen = torch.where(accepted, child, chosen)
            weights[rows[tried & ~accepted], tokens[tried & ~accepted, child]] = 0.0
        stopping = walking & (chosen < 0)
        sampled = torch.multinomial(weights[stopping], 1, generator=generator).view(-1)
        out[stopping, depth] = sampled
        going = walking & (chosen >= 0)
        out[going, depth] = tokens[going, chosen[going]]
        node = torch.where(going, chosen, node)
        walking = going
    return out


def conditional_p_value(previous: torch.Tensor, tokens: torch.Tensor) -> float:
    """One chi-square over the (previous, token) cells: given previous = x, token must follow COND[x]."""
    observed, expected, num_groups = [], [], 0
    for x in previous.unique().tolist():
        counts = torch.bincount(tokens[previous == x], minlength=8).double()
        support = COND[x] > 0
        assert counts[~support].sum() == 0, f"after {x}, tokens of probability 0: {counts.tolist()}"
        observed.append(counts[support]), expected.append(COND[x][support] * counts.sum())
        num_groups += 1
    return chisquare(torch.cat(observed).numpy(), torch.cat(expected).numpy(), ddof=num_groups - 1).pvalue


@pytest.fixture(scope="module")
def stat_args():
    return stat_case(NUM_SAMPLES, seed=0)


def test_reference_samples_the_target_distribution(stat_args):
    out, num_emitted, accepted_nodes = tree_rejection_sample_ref(**stat_args)
    p_value = chi_square_p_value(out[:, 0], P0)
    assert p_value > MIN_P_VALUE, f"token 0: p-value {p_value:.2e}"
    for position in (1, 2):
        went_on = num_emitted > position
        assert went_on.sum() > 1000, f"too few samples at position {position}: {int(went_on.sum())}"
        p_value = conditional_p_value(out[went_on, position - 1], out[went_on, position])
        assert p_value > MIN_P_VALUE, f"token {position} given token {position - 1}: p-value {p_value:.2e}"
    # Every root child (including the later siblings, tried after a rejection) is accepted often, and so is none.
    first = accepted_nodes[:, 0]
    for node in (-1, 1, 2, 4):
        assert (first == node).double().mean() > 0.05, f"root child {node} accepted too rarely: {first.bincount()}"


def test_kernel_matches_reference_on_the_statistics_trees():
    assert_valid_walk(stat_case(48, seed=1), *assert_kernel_matches_reference(stat_case(48, seed=1)))


def test_without_sibling_removal_fails_the_same_test(stat_args):
    """Negative control: testing each sibling against the full p over-emits early children and must fail."""
    wrong = without_sibling_removal(stat_args)
    out, _, _ = tree_rejection_sample_ref(**stat_args)
    assert chi_square_p_value(out[:, 0], P0) > MIN_P_VALUE
    assert chi_square_p_value(wrong[:, 0], P0) < 1e-6
