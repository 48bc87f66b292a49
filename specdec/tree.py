"""Token trees: candidates merged into a prefix tree per row, in the layout the tree kernels and the mask need.

Draft nodes are numbered in insertion order, so parents precede children and a node's children are in candidate
rank order (the order the sampling verifier tries them). A chain is the tree with one child per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rollout_kernels.device_io import host


def merge_candidates(candidates: Tensor, budgets: list[int]) -> tuple[Tensor, Tensor, list[int]]:
    """Merge each row's ranked continuations into a prefix tree of at most `budgets[i]` draft nodes.

    Args:
        candidates: `[rows, C, K]` int64, -1 padded, best first (e.g. `NgramProposer.propose_candidates`).
        budgets: draft nodes allowed per row (the number of draft tokens the row verifies).
    Returns:
        token_ids `[rows, N]` and parents `[rows, N]` (draft-local: -1 = child of the root, i.e. of the row's
        pending token), both -1 padded, and the node count per row.
    """
    rows = candidates.tolist()
    trees: list[tuple[list[int], list[int]]] = []
    for row, budget in zip(rows, budgets):
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for candidate in row:
            parent = -1
            for token in candidate:
                if token < 0:
                    break
                node = children.get((parent, token))
                if node is None:
                    if len(tokens) == budget:
                        break
                    node = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                    children[(parent, token)] = node
                parent = node
        trees.append((tokens, parents))
    width = max([len(t) for t, _ in trees] + [0])
    token_ids = torch.full((len(trees), width), -1, dtype=torch.long)
    parent_ids = torch.full((len(trees), width), -1, dtype=torch.long)
    for i, (tokens, parents) in enumerate(trees):
        token_ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        parent_ids[i, : len(parents)] = torch.tensor(parents, dtype=torch.long)
    return token_ids, parent_ids, [len(t) for t, _ in trees]


def with_root(parents: Tensor) -> Tensor:
    """Draft-local parents `[rows, N]` -> kernel-local `[rows, 1 + N]` with node 0 the root (pending token)."""
    shifted = torch.where(parents >= 0, parents + 1, 0)
    return torch.cat([torch.full_like(parents[:, :1], -1), shifted], dim=1)


def depths_and_ancestors(parents: Tensor, num_nodes: list[int]) -> tuple[Tensor, Tensor]:
    """Depth of every node and the ancestor-or-self relation, from kernel-local parents `[rows, S]` (root first).

    Returns depths `[rows, S]` (root 0) and ancestors `[rows, S, S]` bool (`[b, s, t]`: t is s or above it).
    Padding nodes (index >= num_nodes[b]) are their own only ancestor and sit at depth 0.
    """
    num_rows, width = parents.shape
    valid = torch.arange(width)[None, :] < torch.tensor(num_nodes)[:, None]
    parents = torch.where(valid, parents, -1)
    depths = torch.zeros(num_rows, width, dtype=torch.long)
    ancestors = torch.eye(width, dtype=torch.bool).repeat(num_rows, 1, 1)
    rows = torch.arange(num_rows)
    for node in range(1, width):  # parents precede children: each row's parent entry is final already
        parent = parents[:, node]
        has_parent = parent >= 0
        safe = parent.clamp(min=0)
        depths[:, node] = torch.where(has_parent, depths[rows, safe] + 1, 0)
        inherited = ancestors[rows, safe] & has_parent[:, None]
        ancestors[:, node] |= inherited
    return depths, ancestors


@dataclass
class DraftLayout:
    """Each row's drafts as a tree rooted at its pending token: what the mask, the verifier and the trace need.

    Node 0 of a row is the pending token; nodes 1.. are its drafts. A chain is the tree whose node j's parent is
    node j - 1; when every row is a chain, `depths` and `ancestors` are None (the causal default of the mask builder
    is exactly a chain's ancestor relation) and the verifier takes the chain kernels.
    """

    num_nodes: list[int]  # per row: 1 + draft tokens
    node_counts: Tensor  # [rows] int64 on the host: num_nodes as a tensor (converting a list costs ~0.1 ms a step)
    parents: Tensor  # [rows, width] kernel-local parent of each node, -1 for the root and padding
    row_depths: list[int]  # per row: depth of its deepest node (= draft tokens for a chain)
    is_chain: bool
    depths: Tensor | None = None  # [rows, width] (trees only)
    ancestors: Tensor | None = None  # [rows, width, width] bool (trees only)

    @property
    def width(self) -> int:
        return self.parents.shape[1]

    @property
    def max_depth(self) -> int:
        return max(self.row_depths)


def layout_drafts(num_drafted: list[int], draft_parents: Tensor | None) -> DraftLayout:
    """Build the layout from per-row draft counts and draft-local parents `[rows, >= max count]` (-1 = child of the
    pending token); `draft_parents` None means every row is a chain."""
    num_nodes = [1 + n for n in num_drafted]
    node_counts = host_longs(num_nodes)
    width = max(num_nodes)
    # in numpy: a step lays its drafts out on the host, and numpy's calls cost a few times less than torch's
    chain = torch.from_numpy(np.where(np.arange(width) < node_counts.numpy()[:, None], np.arange(-1, width - 1), -1))
    if draft_parents is not None and width > 1:
        valid = torch.arange(width)[None, :] < node_counts[:, None]
        parents = torch.where(valid, with_root(host(draft_parents[:, : width - 1])), -1)  # a host proposer's
        if not bool((parents == chain).all()):
            depths, ancestors = depths_and_ancestors(parents, num_nodes)
            row_depths = depths.max(dim=1).values.tolist()
            return DraftLayout(num_nodes, node_counts, parents, row_depths, False, depths, ancestors)
    return DraftLayout(num_nodes, node_counts, chain, list(num_drafted), True)


def host_longs(values: list) -> Tensor:
    """int64 host tensor of a (nested) list of ints, through numpy: `torch.tensor` of a list of 1024 ints took ~6x
    longer here, and a decode step converts several."""
    return torch.from_numpy(np.array(values, dtype=np.int64))
