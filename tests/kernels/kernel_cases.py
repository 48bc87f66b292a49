"""Cases and checks shared by the kernel tests: draft counts, random trees, sparse distributions, and the
kernel-equals-reference and tree-walk assertions.

A plain module, not a conftest: pytest puts tests/kernels on sys.path when it collects the tests next to it.
"""

import random
from collections.abc import Callable

import torch
from scipy.stats import chisquare

# Draft counts per row: rows with 0, 1 and the maximum number of drafts, alone and mixed.
DRAFT_COUNTS = {
    "no_drafts": [0, 0, 0],
    "one_draft": [1, 1],
    "max_drafts": [4, 4, 4],
    "mixed": [0, 4, 1, 3, 0, 2, 4],
}
# (depth, most children per node) of each row's tree: only a root, chains, wide and deep trees, mixed.
TREE_SHAPES = {
    "root_only": [(0, 0), (0, 0), (0, 0)],
    "chains": [(1, 1), (8, 1), (0, 0), (3, 1)],
    "wide": [(1, 4), (2, 4), (1, 2)],
    "mixed": [(0, 0), (8, 2), (3, 4), (5, 3), (1, 1), (6, 4)],
}
LOGIT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# No tolerances anywhere: kernel and reference agree exactly. The chi-square tests use fixed seeds; this is the
# p-value below which a distribution counts as different from the target.
MIN_P_VALUE = 1e-3
LARGEST_UNIFORM_BELOW_ONE = 1.0 - 2.0**-53


def assert_kernel_matches_reference(op: Callable, op_ref: Callable, args: dict, output_names: tuple[str, ...]):
    """`op(**args)` equals `op_ref(**args)` output by output, and no input tensor was modified; returns op's outputs."""
    tensors = {name: value.clone() for name, value in args.items() if isinstance(value, torch.Tensor)}
    outputs = op(**args)
    ref_outputs = op_ref(**args)
    for name, out, ref in zip(output_names, outputs, ref_outputs, strict=True):
        assert torch.equal(out, ref), f"{name}: kernel {out.tolist()} != reference {ref.tolist()}"
    assert all(torch.equal(args[name], value) for name, value in tensors.items()), "an input was modified"
    return outputs


def sparse_distributions(num: int, vocab_size: int, generator: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    """Peaked float64 distributions with about a third of the tokens at probability 0 (as after top-k/top-p)."""
    logits = scale * torch.randn(num, vocab_size, generator=generator, dtype=torch.float64)
    logits[torch.rand(num, vocab_size, generator=generator) < 0.3] = float("-inf")
    logits[:, 0] = 0.0  # at least one token with probability > 0
    return torch.softmax(logits, dim=-1)


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    assert counts[probs == 0].sum() == 0, f"tokens of probability 0 were emitted: {counts.tolist()}"
    support = probs > 0
    return chisquare(counts[support].numpy(), (probs[support] * counts.sum()).numpy()).pvalue


def random_parents(depth: int, width: int, rng: random.Random, max_nodes: int = 20) -> list[int]:
    """Local parents of a random tree exactly `depth` deep, the root with `width` children, other nodes with at most
    `width`, numbered in a random order that keeps parents first (siblings are rarely adjacent)."""
    parents, depths, num_children = [-1], [0], [0]
    for node in range(depth):  # a spine reaches the full depth
        parents.append(node), depths.append(node + 1), num_children.append(0)
        num_children[node] += 1
    node = 0
    while node < len(parents):
        while depths[node] < depth and num_children[node] < width and len(parents) < max_nodes:
            if node > 0 and rng.random() < 0.4:
                break
            parents.append(node), depths.append(depths[node] + 1), num_children.append(0)
            num_children[node] += 1
        node += 1
    order, available = [], [0]  # a random topological order
    while available:
        order.append(available.pop(rng.randrange(len(available))))
        available += [child for child, parent in enumerate(parents) if parent == order[-1]]
    label = {old: new for new, old in enumerate(order)}
    return [-1] + [label[parents[old]] for old in order[1:]]


def children_of(parents: list[int]) -> list[list[int]]:
    children = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(node)
    return children


def tree_layout(trees: list[list[int]], tokens: list[int]) -> dict:
    """`tree_token_ids`, `tree_parents` and `cu_num_nodes` of the rows' trees (local parents) and their tokens."""
    return dict(
        tree_token_ids=torch.tensor(tokens, dtype=torch.int64),
        tree_parents=torch.tensor([p for parents in trees for p in parents], dtype=torch.int64),
        cu_num_nodes=torch.tensor([len(parents) for parents in trees]).cumsum(0),
    )


def assert_tree_walk(
    args: dict,
    out: torch.Tensor,
    num_emitted: torch.Tensor,
    accepted_nodes: torch.Tensor,
    token_fits: Callable[[int, int], bool],  # (global node, token it emitted) -> the op's rule holds
    token_fact: str,  # what token_fits failing means, e.g. "is not the argmax"
    stop_fact: str,  # what an emitted token equal to a child of the last node means
) -> list[list[int]]:
    """The accepted nodes form a path from the root whose tokens are the emitted ones, every emitted token fits the
    row that emitted it, and the last one is none of the children where the walk stopped. Returns the children of
    each row's last node."""
    cu = [0] + args["cu_num_nodes"].tolist()
    assert torch.equal((out >= 0).sum(dim=1), num_emitted), "every slot after the emitted tokens holds -1"
    assert torch.equal((accepted_nodes >= 0).sum(dim=1) + 1, num_emitted)
    last_children = []
    for row in range(len(cu) - 1):
        start = cu[row]
        parents = args["tree_parents"][start : cu[row + 1]].tolist()
        tokens = args["tree_token_ids"][start : cu[row + 1]].tolist()
        path = [0] + accepted_nodes[row, : num_emitted[row] - 1].tolist()
        for j, node in enumerate(path[1:]):
            assert parents[node] == path[j] and out[row, j] == tokens[node], f"row {row}: {path} is not a path"
        for j, node in enumerate(path):
            assert token_fits(start + node, out[row, j]), f"row {row}: token {j} {token_fact}"
        children = children_of(parents)[path[-1]]
        assert all(tokens[c] != out[row, len(path) - 1] for c in children), f"row {row}: {stop_fact}"
        last_children.append(children)
    return last_children
