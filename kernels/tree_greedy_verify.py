"""Greedy verification of token trees: follow the child that equals the target argmax, SpecInfer-style.

Tree layout (see `kernels/_layout.py`): row i owns nodes `[cu[i-1], cu[i])`; local node 0 is the root (the pending
token, fed but never verified), `tree_parents` holds local parents with `parent[v] < v`, and target row v is the
target's distribution of the token that follows node v.
"""

import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import (
    LOGIT_DTYPES,
    NODE_BLOCK_SIZE,
    block_size_for,
    check_kernel_device,
    check_node_rows,
    check_tree_layout,
    empty_tree_outputs,
    tree_nodes_ref,
    tree_outputs_ref,
    walk_tree_ref,
)
from rollout_kernels._triton_common import _row_argmax, _tree_row, compute_dtype_for


# Greedy rule from the root v = 0: t = argmax(target row of v); if a child of v holds t (the first in index order),
# accept it and go on from it, else emit t and stop (a leaf always emits its argmax, the bonus token).
# The emitted tokens are argmax(target row) of the path's nodes: an accepted child's token equals that argmax.
# Ties go to the lowest index, as in `greedy_verify`.
@triton.jit
def _tree_greedy_verify_kernel(
    tree_token_ids_ptr,  # [num_nodes] int64
    tree_parents_ptr,  # [num_nodes] int64, local
    cu_num_nodes_ptr,  # [num_rows] int64
    target_logits_ptr,  # [num_nodes, vocab_size]
    output_token_ids_ptr,  # [num_rows, max_depth + 1] int64, pre-filled with -1
    num_emitted_ptr,  # [num_rows] int64
    accepted_nodes_ptr,  # [num_rows, max_depth] int64, pre-filled with -1
    vocab_size,
    max_depth,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NODE_BLOCK_SIZE: tl.constexpr,
):
    row, node_start, num_nodes, out_ptr, accepted_ptr = _tree_row(
        cu_num_nodes_ptr, output_token_ids_ptr, accepted_nodes_ptr, max_depth
    )
    node_offsets = tl.arange(0, NODE_BLOCK_SIZE)

    node = node_start * 0  # int64 local index of the current node
    depth = node_start * 0  # int64 accepted nodes so far
    walking = depth == 0
    while walking:
        best_index = _row_argmax(
            target_logits_ptr + (node_start + node) * vocab_size, vocab_size, COMPUTE_DTYPE, BLOCK_SIZE
        )
        tl.store(out_ptr + depth, best_index)

        # Children come after their parent: scan nodes node+1.. for the first child holding the argmax.
        child = num_nodes  # none
        for block_start in range(node + 1, num_nodes, NODE_BLOCK_SIZE):
            nodes = block_start + node_offsets
            in_row = nodes < num_nodes
            parents = tl.load(tree_parents_ptr + node_start + nodes, mask=in_row, other=-2)
            tokens = tl.load(tree_token_ids_ptr + node_start + nodes, mask=in_row, other=-1)
            matching = (parents == node) & (tokens == best_index)
            child = tl.minimum(child, tl.min(tl.where(matching, nodes, num_nodes), axis=0))
        # depth < max_depth only fails for a tree deeper than promised: it keeps the stores in the output rows.
        walking = (child < num_nodes) & (depth < max_depth)
        tl.store(accepted_ptr + depth, child, mask=walking)
        node = tl.where(walking, child, node)
        depth += walking.to(tl.int64)
    tl.store(num_emitted_ptr + row, depth + 1)


def tree_greedy_verify(
    tree_token_ids: Tensor,  # [num_nodes] int64
    tree_parents: Tensor,  # [num_nodes] int64, local, -1 for roots
    cu_num_nodes: Tensor,  # [num_rows] int64
    target_logits: Tensor,  # [num_nodes, vocab_size]
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Walk each row's tree from the root along children that equal the target argmax; emit one more argmax.

    Args:
        tree_token_ids: `[num_nodes]` int64, all rows' nodes concatenated; each row's node 0 is its root (the
            pending token, never verified), the others are draft tokens.
        tree_parents: `[num_nodes]` int64 local parent index within the row, -1 for the root, `parent[v] < v`.
            Children are tried in increasing node index.
        cu_num_nodes: `[num_rows]` int64, inclusive cumulative sum of per-row node counts (each at least 1).
        target_logits: `[num_nodes, vocab_size]` float16, bfloat16, float32 or float64; row v scores the token
            that follows node v.
        max_depth: at least the deepest node's depth (the root has depth 0); a host int: no device sync.

    Returns:
        output_token_ids: `[num_rows, max_depth + 1]` int64: the accepted path's tokens, then the argmax at the
            node where the walk stopped, then -1. Token j comes from the target row of the path's node j - 1
            (the root for j = 0).
        num_emitted: `[num_rows]` int64, accepted path length + 1.
        accepted_nodes: `[num_rows, max_depth]` int64 local indices of the accepted draft nodes in path order, -1
            padded.
    """
    num_rows = check_tree_layout(tree_token_ids, tree_parents, cu_num_nodes, max_depth)
    vocab_size = check_node_rows(target_logits, "target_logits", tree_token_ids, LOGIT_DTYPES)
    check_kernel_device(_tree_greedy_verify_kernel, tree_token_ids.device, "tree_greedy_verify")
    output_token_ids, num_emitted, accepted_nodes = empty_tree_outputs(num_rows, max_depth, tree_token_ids.device)
    if num_rows == 0:
        return output_token_ids, num_emitted, accepted_nodes
    _tree_greedy_verify_kernel[(num_rows,)](
        tree_token_ids,
        tree_parents,
        cu_num_nodes,
        target_logits,
        output_token_ids,
        num_emitted,
        accepted_nodes,
        vocab_size,
        max_depth,
        COMPUTE_DTYPE=compute_dtype_for(target_logits.dtype),
        BLOCK_SIZE=block_size_for(vocab_size),
        NODE_BLOCK_SIZE=NODE_BLOCK_SIZE,
    )
    return output_token_ids, num_emitted, accepted_nodes


def tree_greedy_verify_ref(
    tree_token_ids: Tensor,  # [num_nodes] int64
    tree_parents: Tensor,  # [num_nodes] int64, local, -1 for roots
    cu_num_nodes: Tensor,  # [num_rows] int64
    target_logits: Tensor,  # [num_nodes, vocab_size]
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure-torch `tree_greedy_verify`: same arguments and outputs, runs on any device."""
    check_tree_layout(tree_token_ids, tree_parents, cu_num_nodes, max_depth)
    check_node_rows(target_logits, "target_logits", tree_token_ids, LOGIT_DTYPES)
    node_start, _, global_parent = tree_nodes_ref(tree_parents, cu_num_nodes, max_depth)
    target_argmax = target_logits.argmax(dim=-1)  # [num_nodes]
    # A draft node matches when it holds its parent's argmax; the walk takes the first matching child.
    matching = (global_parent >= 0) & (tree_token_ids == target_argmax[global_parent.clamp(min=0)])
    accepted_nodes, num_accepted, last_node = walk_tree_ref(matching, global_parent, node_start, max_depth)
    output_token_ids = tree_outputs_ref(
        tree_token_ids, node_start, accepted_nodes, num_accepted, target_argmax[last_node]
    )
    return output_token_ids, num_accepted + 1, accepted_nodes
