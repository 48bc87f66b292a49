"""tree_greedy_verify: the Triton kernel equals the torch reference token for token, both follow the greedy tree
rule, and a chain-shaped tree gives exactly what greedy_verify gives.

On CPU the kernel runs under TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports `kernels`.
"""

import random
import re

import pytest
import torch
from kernel_cases import LOGIT_DTYPES as DTYPES
from kernel_cases import TREE_SHAPES, assert_tree_walk, children_of, random_parents, tree_layout
from kernel_cases import assert_kernel_matches_reference as assert_matches

from rollout_kernels import greedy_verify, tree_greedy_verify, tree_greedy_verify_ref

torch.set_num_threads(1)


def make_case(shapes, vocab_size: int, dtype: torch.dtype, mode: str, seed: int = 0) -> dict:
    """Random trees over random logits. mode: 'random' (some node holds its parent's argmax), 'all_accept' (every
    inner node has one child holding its argmax, not always the first) or 'all_reject' (none does)."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    trees = [random_parents(depth, width, rng) for depth, width in shapes]
    num_nodes = sum(len(parents) for parents in trees)
    target_logits = torch.randn(num_nodes, vocab_size, generator=generator).to(dtype)
    argmax = target_logits.argmax(dim=-1).tolist()
    tokens, start = [], 0
    for parents in trees:
        row_tokens = [rng.randrange(vocab_size)] * len(parents)
        for node, children in enumerate(children_of(parents)):
            if not children:
                continue
            others = [t for t in rng.sample(range(vocab_size), len(children) + 1) if t != argmax[start + node]]
            picks = others[: len(children)]
            if mode == "all_accept" or (mode == "random" and rng.random() < 0.7):
                picks[rng.randrange(len(picks))] = argmax[start + node]
            for child, token in zip(children, picks):
                row_tokens[child] = token
        tokens += row_tokens
        start += len(parents)
    return dict(**tree_layout(trees, tokens), target_logits=target_logits, max_depth=max(depth for depth, _ in shapes))


def assert_kernel_matches_reference(args: dict):
    names = ("output_token_ids", "num_emitted", "accepted_nodes")
    return assert_matches(tree_greedy_verify, tree_greedy_verify_ref, args, names)


def assert_greedy_walk(args: dict, out, num_emitted, accepted_nodes) -> list[list[int]]:
    """A path from the root, every emitted token the argmax of the previous path node's row, and the walk stops where
    no child holds that argmax (see `assert_tree_walk`). Returns the children of each row's last node."""
    argmax = args["target_logits"].argmax(dim=-1)
    return assert_tree_walk(
        args,
        out,
        num_emitted,
        accepted_nodes,
        lambda node, token: token == argmax[node],
        "is not the argmax",
        "stopped early",
    )


@pytest.mark.parametrize("mode", ["random", "all_accept", "all_reject"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", TREE_SHAPES.values(), ids=TREE_SHAPES.keys())
def test_kernel_matches_reference(shapes, dtype, mode):
    args = make_case(shapes, 1271, dtype, mode)
    out, num_emitted, accepted_nodes = assert_kernel_matches_reference(args)
    num_rows, max_depth = len(shapes), args["max_depth"]
    assert out.shape == (num_rows, max_depth + 1) and accepted_nodes.shape == (num_rows, max_depth)
    last_children = assert_greedy_walk(args, out, num_emitted, accepted_nodes)
    if mode == "all_accept":
        assert not any(last_children), "the walk must end at a leaf"
    if mode == "all_reject":
        assert (num_emitted == 1).all()


@pytest.mark.parametrize(
    "shapes, dtype, mode",
    [([(2, 2)], torch.float32, "random"), ([(0, 0), (1, 3)], torch.bfloat16, "all_accept")],
    ids=["fp32-random", "bf16-all_accept"],
)
def test_kernel_matches_reference_real_vocab(shapes, dtype, mode):
    args = make_case(shapes, 151936, dtype, mode, seed=1)
    assert_greedy_walk(args, *assert_kernel_matches_reference(args))


def test_many_rows_small_vocab():
    """Many trees over 6 tokens, so the same token sits in several branches: only the current node's children count."""
    shapes = [(depth, width) for depth in range(6) for width in range(1, 5)] * 2
    for mode in ("random", "all_accept"):
        args = make_case(shapes, 6, torch.float32, mode, seed=2)
        assert_greedy_walk(args, *assert_kernel_matches_reference(args))


def chain_case(counts: list[int], vocab_size: int, dtype: torch.dtype, seed: int = 0):
    """greedy_verify's inputs (drafts that often match) and the same inputs as chain-shaped trees."""
    generator = torch.Generator().manual_seed(seed)
    num_rows, total_drafts = len(counts), sum(counts)
    target_logits = torch.randn(total_drafts + num_rows, vocab_size, generator=generator).to(dtype)
    # draft d of row i is checked by target row d + i; the row's tree node k + 1 is its draft k
    row_of_draft = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(counts))
    matching = target_logits.argmax(dim=-1)[torch.arange(total_drafts) + row_of_draft]
    random_tokens = torch.randint(0, vocab_size, (total_drafts,), generator=generator)
    drafts = torch.where(torch.rand(total_drafts, generator=generator) < 0.8, matching, random_tokens)
    chain = dict(
        draft_token_ids=drafts,
        cu_num_draft_tokens=torch.tensor(counts, dtype=torch.int64).cumsum(0),
        target_logits=target_logits,
        max_num_draft_tokens=max(counts),
    )
    pending = torch.randint(0, vocab_size, (num_rows,), generator=generator).tolist()
    tokens, parents, start = [], [], 0
    for row, count in enumerate(counts):
        tokens += [pending[row]] + drafts[start : start + count].tolist()
        parents += list(range(-1, count))
        start += count
    tree = dict(
        tree_token_ids=torch.tensor(tokens),
        tree_parents=torch.tensor(parents),
        cu_num_nodes=(torch.tensor(counts) + 1).cumsum(0),
        target_logits=target_logits,
        max_depth=max(counts),
    )
    return chain, tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("counts", [[0, 4, 1, 3, 0, 2, 4], [8, 8], [1]], ids=["mixed", "max_8", "one"])
def test_chain_tree_equals_greedy_verify(counts, dtype):
    chain, tree = chain_case(counts, 1271, dtype)
    expected_out, expected_num_emitted = greedy_verify(**chain)
    for op in (tree_greedy_verify, tree_greedy_verify_ref):
        out, num_emitted, accepted_nodes = op(**tree)
        assert torch.equal(out, expected_out), op.__name__
        assert torch.equal(num_emitted, expected_num_emitted), op.__name__
        steps = torch.arange(1, max(counts) + 1)
        assert torch.equal(accepted_nodes, torch.where(steps < num_emitted[:, None], steps, -1)), op.__name__


@pytest.mark.parametrize("op", [tree_greedy_verify, tree_greedy_verify_ref], ids=lambda op: op.__name__)
def test_follows_the_tree_rule(op):
    """Hand-made trees over one-hot logits: the first matching child in index order wins, siblings need not be
    adjacent, a leaf emits its bonus argmax, and ties in the logits go to the lowest token."""
    vocab_size = 2500  # three blocks of 1024
    argmax = [7, 3, 9, 1030, 4, 5, 2, 0, 1]
    target_logits = torch.nn.functional.one_hot(torch.tensor(argmax), vocab_size).double()
    target_logits[8, [1, 2048]] = 1.0  # a tie across blocks: token 1 wins
    # row 0: root 0 (token 11), children 1 (7), 2 (3), 4 (7, duplicate of 1), 5 (9); node 3 (1030) is a child of 1
    #   root argmax 7 -> node 1 (first of 1 and 4); node 1 argmax 3 has no child holding 3 -> emit 3.
    # row 1: root 0 -> node 1 (token 2), root row argmax 2; node 1 argmax 0 -> no child: the bonus 0.
    # row 2: root only, logits tied: emit 1.
    tree_token_ids = torch.tensor([11, 7, 3, 1030, 7, 9, 50, 2, 60])
    tree_parents = torch.tensor([-1, 0, 0, 1, 0, 0, -1, 0, -1])
    cu_num_nodes = torch.tensor([6, 8, 9])
    out, num_emitted, accepted_nodes = op(tree_token_ids, tree_parents, cu_num_nodes, target_logits, 3)
    assert out.tolist() == [[7, 3, -1, -1], [2, 0, -1, -1], [1, -1, -1, -1]]
    assert num_emitted.tolist() == [2, 2, 1]
    assert accepted_nodes.tolist() == [[1, -1, -1], [1, -1, -1], [-1, -1, -1]]
    target_logits[1] = torch.nn.functional.one_hot(torch.tensor(1030), vocab_size)  # now node 1 -> node 3 (leaf)
    out, num_emitted, accepted_nodes = op(tree_token_ids, tree_parents, cu_num_nodes, target_logits, 3)
    assert out[0].tolist() == [7, 1030, 1030, -1] and accepted_nodes[0].tolist() == [1, 3, -1]


def test_wider_output_and_no_rows():
    args = make_case([(2, 2), (0, 0)], 50, torch.float32, "all_accept") | {"max_depth": 5}
    out, num_emitted, accepted_nodes = assert_kernel_matches_reference(args)
    assert out.shape == (2, 6) and accepted_nodes.shape == (2, 5) and (out[:, 3:] == -1).all()
    no_rows = torch.zeros(0, dtype=torch.int64)
    for op in (tree_greedy_verify, tree_greedy_verify_ref):
        out, num_emitted, accepted_nodes = op(no_rows, no_rows, no_rows, torch.zeros(0, 7), 2)
        assert out.shape == (0, 3) and num_emitted.shape == (0,) and accepted_nodes.shape == (0, 2), op.__name__
        out, num_emitted, accepted_nodes = op(
            torch.tensor([4]), torch.tensor([-1]), torch.tensor([1]), torch.eye(7)[:1], 0
        )
        assert out.tolist() == [[0]] and num_emitted.tolist() == [1] and accepted_nodes.shape == (1, 0), op.__name__


def valid_args():
    return dict(
        tree_token_ids=torch.tensor([1, 2, 3, 4]),
        tree_parents=torch.tensor([-1, 0, 0, -1]),
        cu_num_nodes=torch.tensor([3, 4]),
        target_logits=torch.randn(4, 11),
        max_depth=1,
    )


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("tree_token_ids", torch.tensor([1, 2, 3, 4], dtype=torch.int32), "tree_token_ids has dtype torch.int32"),
        ("tree_parents", torch.tensor([-1, 0, 0]), "tree_parents has 3 entries, expected one per node (4)"),
        ("cu_num_nodes", torch.tensor([[3, 4]]), "cu_num_nodes must have 1 dimension(s)"),
        ("cu_num_nodes", torch.tensor([1, 2, 3, 4, 4]), "tree_token_ids has 4 nodes for 5 rows"),
        ("target_logits", torch.randn(5, 11), "target_logits has 5 rows, expected one per tree node"),
        ("target_logits", torch.randn(11, 4).t(), "target_logits (shape (4, 11)) must be contiguous"),
        ("target_logits", torch.randn(4, 0), "target_logits has vocab_size 0"),
        ("max_depth", -1, "max_depth must be >= 0"),
    ],
)
@pytest.mark.parametrize("op", [tree_greedy_verify, tree_greedy_verify_ref], ids=lambda op: op.__name__)
def test_bad_arguments_are_named(op, name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        op(**valid_args() | {name: value})


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("max_depth", 0, "a tree is deeper than max_depth (0)"),
        ("tree_parents", torch.tensor([-1, 0, 2, -1]), "tree_parents[v] must lie in [0, v)"),
        ("tree_parents", torch.tensor([-1, 0, 0, 0]), "tree_parents of every root (local node 0) must be -1"),
        ("cu_num_nodes", torch.tensor([3, 3]), "cu_num_nodes[-1] is 3, expected len(tree_token_ids) = 4"),
        ("cu_num_nodes", torch.tensor([4, 4]), "cu_num_nodes must be strictly increasing"),
    ],
)
def test_reference_checks_what_the_kernel_cannot(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tree_greedy_verify_ref(**valid_args() | {name: value})
