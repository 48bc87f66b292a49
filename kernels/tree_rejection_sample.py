"""Rejection sampling of token trees whose siblings are distinct candidate tokens: lossless w.r.t. the target.

Layout as in `tree_greedy_verify`. The candidates must be chosen without looking at the target's randomness
(n-gram continuations, a draft's top tokens): there are no draft probabilities, as in `rejection_sample` with
`draft_probs=None`. Probabilities come in already processed and randomness as float64 uniforms, so the kernel
and `tree_rejection_sample_ref` return the same tokens for the same uniforms.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import (
    NODE_BLOCK_SIZE,
    PROB_DTYPES,
    block_size_for,
    check_kernel_device,
    check_node_rows,
    check_tensor,
    check_tree_layout,
    empty_tree_outputs,
    tree_nodes_ref,
    tree_outputs_ref,
    walk_tree_ref,
)
from rollout_kernels._triton_common import _inverse_cdf, _tree_row, _weights_total, inverse_cdf_ref


@triton.jit
def _residual_weights(
    cols,  # [BLOCK_SIZE] int32 token ids of this block
    target_row_ptr,  # [vocab_size] p at the node
    tree_token_ids_ptr,  # [num_row_nodes] this row's nodes
    tree_parents_ptr,  # [num_row_nodes]
    vocab_size,
    node,  # local index whose children are removed from p
    scan_start,  # node + 1 to remove them, num_row_nodes to keep p whole
    num_row_nodes,
    NODE_BLOCK_SIZE: tl.constexpr,
):
    p = tl.load(target_row_ptr + cols, mask=cols < vocab_size, other=0.0).to(tl.float64)
    removed = cols < 0
    for block_start in range(scan_start, num_row_nodes, NODE_BLOCK_SIZE):
        nodes = block_start + tl.arange(0, NODE_BLOCK_SIZE)
        in_row = nodes < num_row_nodes
        parents = tl.load(tree_parents_ptr + nodes, mask=in_row, other=-2)
        child_tokens = tl.where(parents == node, tl.load(tree_token_ids_ptr + nodes, mask=in_row, other=-1), -1)
        hits = (child_tokens[:, None] == cols[None, :]).to(tl.int32)  # [NODE_BLOCK_SIZE, BLOCK_SIZE]
        removed = removed | (tl.max(hits, axis=0) > 0)
    return tl.where(removed, 0.0, p)


# At node v with target p (a row summing to 1) and children x_1..x_m tried in order:
#   accept x_k iff u_k * (1 - r_k) < p(x_k), where r_k = p(x_1) + ... + p(x_{k-1}) is the mass of the rejected
#   siblings (summed in that order); on acceptance continue from x_k, else after x_m sample from p with x_1..x_m
#   removed (inverse CDF as in `rejection_sample`; p itself if nothing is left, which only rounding can cause).
#   1 - r_k is sum(p with x_1..x_{k-1} removed) for a row summing to 1: no vocabulary pass per node, and a chain
#   gives exactly `rejection_sample`'s test u < p(x) (x_k are distinct, so each removal subtracts its own mass).
# Lossless by the chain rule over sibling rejections: let p_k be p with x_1..x_{k-1} removed and renormalised,
#   p_k(t) = p(t) / (1 - r_k). Emitting t from p_k is "accept x_k with probability p_k(x_k), else emit t from p_k
#   with x_k removed, i.e. from p_{k+1}": P(t) = p_k(x_k) [t = x_k] + (1 - p_k(x_k)) p_{k+1}(t) = p_k(t), because
#   p_{k+1}(t) = p_k(t) / (1 - p_k(x_k)) for t != x_k. Unrolled from p_1 = p to the final p_{m+1}, the emitted token
#   follows p whichever candidates were proposed, as long as they were picked without seeing the uniforms; an
#   accepted x_k then continues in its own subtree with fresh uniforms and its own target row.
@triton.jit
def _tree_rejection_sample_kernel(
    tree_token_ids_ptr,  # [num_nodes] int64
    tree_parents_ptr,  # [num_nodes] int64, local
    cu_num_nodes_ptr,  # [num_rows] int64
    target_probs_ptr,  # [num_nodes, vocab_size]
    accept_uniforms_ptr,  # [num_nodes] float64
    sample_uniforms_ptr,  # [num_rows] float64
    output_token_ids_ptr,  # [num_rows, max_depth + 1] int64, pre-filled with -1
    num_emitted_ptr,  # [num_rows] int64
    accepted_nodes_ptr,  # [num_rows, max_depth] int64, pre-filled with -1
    vocab_size,
    max_depth,
    BLOCK_SIZE: tl.constexpr,
    NODE_BLOCK_SIZE: tl.constexpr,
):
    row, node_start, num_row_nodes, out_ptr, accepted_ptr = _tree_row(
        cu_num_nodes_ptr, output_token_ids_ptr, accepted_nodes_ptr, max_depth
    )
    row_token_ids_ptr = tree_token_ids_ptr + node_start
    row_parents_ptr = tree_parents_ptr + node_start
    row_accept_uniforms_ptr = accept_uniforms_ptr + node_start

    node = node_start * 0  # int64 local index of the current node
    depth = node_start * 0  # int64 accepted nodes so far
    walking = depth == 0
    while walking:
        target_row_ptr = target_probs_ptr + (node_start + node) * vocab_size
        # One candidate at a time: the accept test of a child depends on the siblings rejected before it.
        child = num_row_nodes  # none
        rejected_mass = tl.full((), 0.0, tl.float64)
        candidate = node + 1
        while (candidate < num_row_nodes) & (child == num_row_nodes):
            is_child = tl.load(row_parents_ptr + candidate) == node
            token = tl.load(row_token_ids_ptr + candidate)
            # Non-children and out-of-vocabulary tokens read p = 0 (never accepted, nothing removed).
            valid = is_child & (token >= 0) & (token < vocab_size)
            p = tl.load(target_row_ptr + token, mask=valid, other=0.0).to(tl.float64)
            u = tl.load(row_accept_uniforms_ptr + candidate)
            accepted = is_child & (u * (1.0 - rejected_mass) < p)
            child = tl.where(accepted, candidate, child)
            rejected_mass += p
            candidate += 1
        # depth < max_depth only fails for a tree deeper than promised: it keeps the stores in the output rows.
        walking = (child < num_row_nodes) & (depth < max_depth)
        tl.store(accepted_ptr + depth, child, mask=walking)
        tl.store(out_ptr + depth, tl.load(row_token_ids_ptr + child, mask=walking), mask=walking)
        node = tl.where(walking, child, node)
        depth += walking.to(tl.int64)

    # Every child of the last node was rejected (or it has none): sample from p without them.
    target_row_ptr = target_probs_ptr + (node_start + node) * vocab_size
    scan_start = node + 1
    weights_args = (target_row_ptr, row_token_ids_ptr, row_parents_ptr, vocab_size, node, scan_start, num_row_nodes)
    total, last_nonzero = _weights_total(_residual_weights, weights_args, NODE_BLOCK_SIZE, vocab_size, BLOCK_SIZE)
    if total == 0:  # all the mass sat on rejected children (rounding only): fall back to p
        scan_start = num_row_nodes + node * 0
        weights_args = (target_row_ptr, row_token_ids_ptr, row_parents_ptr, vocab_size, node, scan_start, num_row_nodes)
        total, last_nonzero = _weights_total(_residual_weights, weights_args, NODE_BLOCK_SIZE, vocab_size, BLOCK_SIZE)
    threshold = tl.load(sample_uniforms_ptr + row) * total
    token = _inverse_cdf(
        _residual_weights, weights_args, NODE_BLOCK_SIZE, vocab_size, threshold, last_nonzero, BLOCK_SIZE
    )
    tl.store(out_ptr + depth, token)
    tl.store(num_emitted_ptr + row, depth + 1)


def tree_rejection_sample(
    tree_token_ids: Tensor,  # [num_nodes] int64
    tree_parents: Tensor,  # [num_nodes] int64, local, -1 for roots
    cu_num_nodes: Tensor,  # [num_rows] int64
    target_probs: Tensor,  # [num_nodes, vocab_size] float32/float64
    accept_uniforms: Tensor,  # [num_nodes] float64
    sample_uniforms: Tensor,  # [num_rows] float64
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Walk each row's tree accepting children by multi-candidate rejection sampling; emit one more sample.

    Args:
        tree_token_ids: `[num_nodes]` int64, all rows' nodes concatenated; each row's node 0 is its root (the
            pending token, never verified). The children of a node must hold distinct tokens, chosen without
            looking at the uniforms (the kernel assumes it, the reference checks it).
        tree_parents: `[num_nodes]` int64 local parent index within the row, -1 for the root, `parent[v] < v`.
            Children are tried in increasing node index.
        cu_num_nodes: `[num_rows]` int64, inclusive cumulative sum of per-row node counts (each at least 1).
        target_probs: `[num_nodes, vocab_size]` float32/float64 processed target distributions (rows sum to 1);
            row v is the distribution of the token that follows node v.
        accept_uniforms: `[num_nodes]` float64 in [0, 1), one per node (the roots' entries are unused).
        sample_uniforms: `[num_rows]` float64 in [0, 1), one per row for its last token.
        max_depth: at least the deepest node's depth (the root has depth 0); a host int: no device sync.

    Returns:
        output_token_ids: `[num_rows, max_depth + 1]` int64: the accepted path's tokens, then the token sampled
            at the node where the walk stopped, then -1. Token j comes from the target row of the path's node
            j - 1 (the root for j = 0).
        num_emitted: `[num_rows]` int64, accepted path length + 1.
        accepted_nodes: `[num_rows, max_depth]` int64 local indices of the accepted draft nodes in path order, -1
            padded.
    """
    num_rows, vocab_size = _check_inputs(
        tree_token_ids, tree_parents, cu_num_nodes, target_probs, accept_uniforms, sample_uniforms, max_depth
    )
    check_kernel_device(_tree_rejection_sample_kernel, tree_token_ids.device, "tree_rejection_sample")
    output_token_ids, num_emitted, accepted_nodes = empty_tree_outputs(num_rows, max_depth, tree_token_ids.device)
    if num_rows == 0:
        return output_token_ids, num_emitted, accepted_nodes
    _tree_rejection_sample_kernel[(num_rows,)](
        tree_token_ids,
        tree_parents,
        cu_num_nodes,
        target_probs,
        accept_uniforms,
        sample_uniforms,
        output_token_ids,
        num_emitted,
        accepted_nodes,
        vocab_size,
        max_depth,
        BLOCK_SIZE=block_size_for(vocab_size),
        NODE_BLOCK_SIZE=NODE_BLOCK_SIZE,
    )
    return output_token_ids, num_emitted, accepted_nodes


def tree_rejection_sample_ref(
    tree_token_ids: Tensor,  # [num_nodes] int64
    tree_parents: Tensor,  # [num_nodes] int64, local, -1 for roots
    cu_num_nodes: Tensor,  # [num_rows] int64
    target_probs: Tensor,  # [num_nodes, vocab_size]
    accept_uniforms: Tensor,  # [num_nodes] float64
    sample_uniforms: Tensor,  # [num_rows] float64
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure-torch `tree_rejection_sample`: same arguments and outputs, runs on any device."""
    _, vocab_size = _check_inputs(
        tree_token_ids, tree_parents, cu_num_nodes, target_probs, accept_uniforms, sample_uniforms, max_depth
    )
    node_start, node_row, global_parent = tree_nodes_ref(tree_parents, cu_num_nodes, max_depth)
    drafts = (global_parent >= 0).nonzero().squeeze(1)  # [num_drafts], in node order
    parents, tokens = global_parent[drafts], tree_token_ids[drafts]
    if not bool(((tokens >= 0) & (tokens < vocab_size)).all()):
        raise ValueError(f"tree_token_ids of draft nodes must lie in [0, vocab_size = {vocab_size})")
    if torch.unique(parents * vocab_size + tokens).shape[0] != drafts.shape[0]:
        raise ValueError("children of a node must hold distinct tokens (tree_token_ids): merge duplicate children")

    # Each child's accept test as if reached: its parent's p(x) against the mass its earlier siblings leave.
    p = target_probs[parents, tokens].double()  # [num_drafts]
    accepted = torch.zeros_like(global_parent, dtype=torch.bool)
    accepted[drafts] = accept_uniforms[drafts] * (1.0 - _rejected_sibling_mass(parents, p)) < p
    accepted_nodes, num_accepted, last_node = walk_tree_ref(accepted, global_parent, node_start, max_depth)

    # The last node's children were all rejected: remove them from its p (p itself if nothing is left).
    p = target_probs[last_node].double()  # [num_rows, vocab_size]
    weights = p.clone()
    removed = parents == last_node[node_row[drafts]]
    weights[node_row[drafts][removed], tokens[removed]] = 0.0
    last_token_ids = inverse_cdf_ref(weights, p, sample_uniforms)  # p where nothing is left
    output_token_ids = tree_outputs_ref(tree_token_ids, node_start, accepted_nodes, num_accepted, last_token_ids)
    return output_token_ids, num_accepted + 1, accepted_nodes


def _rejected_sibling_mass(
    parents: Tensor,  # [num_drafts] global parent of each draft node, in node order
    p: Tensor,  # [num_drafts] float64 parent's p at the draft's token
) -> Tensor:  # [num_drafts] float64
    """Per draft, the sum of p over its earlier siblings, added in sibling order (0.0 + p_1 + p_2 ...) as the kernel
    adds them."""
    order = torch.sort(parents, stable=True).indices  # siblings side by side, in node order
    sorted_parents, sorted_p = parents[order], p[order]
    has_earlier = torch.zeros_like(sorted_parents, dtype=torch.bool)
    has_earlier[1:] = sorted_parents[1:] == sorted_parents[:-1]
    previous = (torch.arange(order.shape[0], device=p.device) - 1).clamp(min=0)
    # Round k makes the k-th sibling's sum final: as many rounds as the widest node has children, minus one.
    num_rounds = int(torch.unique(sorted_parents, return_counts=True)[1].max()) - 1 if order.shape[0] else 0
    sorted_mass = torch.zeros_like(sorted_p)
    for _ in range(num_rounds):
        sorted_mass = torch.where(has_earlier, sorted_mass[previous] + sorted_p[previous], 0.0)
    mass = torch.empty_like(sorted_mass)
    mass[order] = sorted_mass
    return mass


def _check_inputs(
    tree_token_ids: Tensor,
    tree_parents: Tensor,
    cu_num_nodes: Tensor,
    target_probs: Tensor,
    accept_uniforms: Tensor,
    sample_uniforms: Tensor,
    max_depth: int,
) -> tuple[int, int]:
    """Host-side checks (no device sync); return (num_rows, vocab_size)."""
    num_rows = check_tree_layout(tree_token_ids, tree_parents, cu_num_nodes, max_depth)
    vocab_size = check_node_rows(target_probs, "target_probs", tree_token_ids, PROB_DTYPES)
    device = tree_token_ids.device
    for name, uniforms, expected in (
        ("accept_uniforms", accept_uniforms, tree_token_ids.shape[0]),
        ("sample_uniforms", sample_uniforms, num_rows),
    ):
        check_tensor(uniforms, name, 1, (torch.float64,), device, "tree_token_ids")
        if uniforms.shape[0] != expected:
            raise ValueError(f"{name} has {uniforms.shape[0]} entries, expected {expected}")
    return num_rows, vocab_size
