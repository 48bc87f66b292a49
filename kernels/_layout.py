"""Layout and validation helpers shared by the verification ops: chains (`greedy_verify`, `rejection_sample`) and
token trees (`tree_greedy_verify`, `tree_rejection_sample`).

Launchers run only the host-side checks (`check_*`: no device sync). The `*_ref` helpers serve the pure-torch
references, which also check what needs a device sync (cumulative counts, parent order, depth).
"""

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

try:  # (not exported by triton.runtime: guarded, so that a Triton that moves it still imports the engine)
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - no such Triton tested
    InterpretedFunction = type("InterpretedFunction", (), {})  # nothing is one: kernels taken as compiled

# The kernels loop over the vocabulary in blocks of at most this many tokens.
MAX_BLOCK_SIZE = 1024

# The tree kernels scan a row's nodes for children in blocks of this many nodes.
NODE_BLOCK_SIZE = 32

# Fills each output row after its emitted tokens (vLLM's placeholder).
PLACEHOLDER_TOKEN_ID = -1

LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PROB_DTYPES = (torch.float32, torch.float64)


def block_size_for(vocab_size: int) -> int:
    """Vocabulary block size of the kernels; references that mirror their sum order use it too."""
    return min(triton.next_power_of_2(vocab_size), MAX_BLOCK_SIZE)


def empty_outputs(num_rows: int, max_num_draft_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """`output_token_ids` `[num_rows, max + 1]` filled with -1 and an uninitialised `num_emitted` `[num_rows]`."""
    output_token_ids = torch.full(
        (num_rows, max_num_draft_tokens + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    return output_token_ids, torch.empty(num_rows, dtype=torch.int64, device=device)


def check_kernel_device(kernel: object, device: torch.device, op_name: str) -> None:
    """`@triton.jit` picks the interpreter at import time, so CPU tensors need TRITON_INTERPRET=1 set before."""
    if device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"{op_name} got CPU tensors but its Triton kernel was built for a GPU: set TRITON_INTERPRET=1 "
            f"before `kernels` is first imported, or call {op_name}_ref"
        )


def check_tensor(
    tensor: object,
    name: str,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    device_of: str = "draft_token_ids",
) -> None:
    """Raise ValueError/TypeError unless `tensor` is a contiguous tensor of `ndim` dims, a dtype in `dtypes`."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected one of: {allowed}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(tensor.shape)}) must be contiguous: call .contiguous() first")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} like {device_of}")


def check_logits(logits: object) -> None:
    """Raise ValueError/TypeError unless `logits` is a 2-D tensor of a logit dtype whose vocabulary (dim 1) is
    contiguous; its rows may be strided (the verifier reads a view of the model's output)."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must have 2 dimension(s), got shape {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in LOGIT_DTYPES)
        raise ValueError(f"logits has dtype {logits.dtype}, expected one of: {allowed}")
    if logits.shape[1] < 1:  # (the block sizes are powers of two of the vocabulary: 0 has none)
        raise ValueError(f"logits (shape {tuple(logits.shape)}) must hold a vocabulary of at least one token")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits (shape {tuple(logits.shape)}) must have a contiguous vocabulary: stride(1) == 1")


def check_python_int(value: object, name: str) -> None:
    """A host int >= 0 (sizes outputs without a device sync)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a python int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_index_vectors(tensors: dict[str, object]) -> None:
    """Check 1-D contiguous int64 tensors, all on the device of the first one (named in the device message)."""
    first_name, first = next(iter(tensors.items()))
    if not isinstance(first, Tensor):
        raise TypeError(f"{first_name} must be a torch.Tensor, got {type(first).__name__}")
    for name, tensor in tensors.items():
        check_tensor(tensor, name, 1, (torch.int64,), first.device, first_name)


def check_draft_layout(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, max_num_draft_tokens: int) -> int:
    """Check the flattened draft arguments; return num_rows. Only host-side checks: no device sync."""
    check_index_vectors({"draft_token_ids": draft_token_ids, "cu_num_draft_tokens": cu_num_draft_tokens})
    check_python_int(max_num_draft_tokens, "max_num_draft_tokens")
    return cu_num_draft_tokens.shape[0]


def check_target_rows(
    target: Tensor, name: str, draft_token_ids: Tensor, num_rows: int, dtypes: tuple[torch.dtype, ...]
) -> int:
    """Check a `[total_drafts + num_rows, vocab_size]` target tensor; return vocab_size."""
    check_tensor(target, name, 2, dtypes, draft_token_ids.device)
    num_target_rows = draft_token_ids.shape[0] + num_rows
    if target.shape[0] != num_target_rows:
        raise ValueError(
            f"{name} has {target.shape[0]} rows, expected total_drafts + num_rows = "
            f"{draft_token_ids.shape[0]} + {num_rows} = {num_target_rows} (each row's drafts plus a bonus row)"
        )
    if target.shape[1] == 0:
        raise ValueError(f"{name} has vocab_size 0 (shape {tuple(target.shape)}), expected at least 1")
    return target.shape[1]


def draft_row_ranges(
    draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, max_num_draft_tokens: int
) -> tuple[Tensor, Tensor]:
    """Per-row `(draft_start, num_drafts)`, each `[num_rows]`, after the checks that need a device sync.

    References only: the kernels trust `cu_num_draft_tokens` (and clamp rows to max_num_draft_tokens).
    """
    total_drafts = draft_token_ids.shape[0]
    num_rows = cu_num_draft_tokens.shape[0]
    draft_start = torch.cat([cu_num_draft_tokens.new_zeros(1), cu_num_draft_tokens[:-1]])[:num_rows]
    num_drafts = cu_num_draft_tokens - draft_start
    if num_rows == 0:
        return draft_start, num_drafts
    if int(cu_num_draft_tokens[-1]) != total_drafts:
        raise ValueError(
            f"cu_num_draft_tokens[-1] is {int(cu_num_draft_tokens[-1])}, expected len(draft_token_ids) = {total_drafts}"
        )
    if bool((num_drafts < 0).any()):
        raise ValueError(f"cu_num_draft_tokens must be non-decreasing, got {cu_num_draft_tokens.tolist()}")
    if int(num_drafts.max()) > max_num_draft_tokens:
        raise ValueError(
            f"a row has {int(num_drafts.max())} drafts, more than max_num_draft_tokens ({max_num_draft_tokens})"
        )
    return draft_start, num_drafts


def padded_drafts(
    draft_token_ids: Tensor,  # [total_drafts]
    draft_start: Tensor,  # [num_rows]
    num_drafts: Tensor,  # [num_rows]
    max_num_draft_tokens: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Drafts as `[num_rows, max + 1]` with -1 after each row's drafts, and each draft's (row, position)."""
    num_rows = draft_start.shape[0]
    device = draft_token_ids.device
    draft_row = torch.repeat_interleave(torch.arange(num_rows, device=device), num_drafts)  # [total_drafts]
    draft_pos = torch.arange(draft_token_ids.shape[0], device=device) - draft_start[draft_row]
    drafts = torch.full((num_rows, max_num_draft_tokens + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    drafts[draft_row, draft_pos] = draft_token_ids
    return drafts, draft_row, draft_pos


# ---------------------------------------------------------------------------------------------
# Token trees: row i owns nodes [cu[i-1], cu[i]) (cu[-1] = 0); local node 0 is the root (the pending token),
# tree_parents holds local parent indices (-1 for the root) with parent[v] < v, and target row v belongs to node v.


def check_tree_layout(tree_token_ids: Tensor, tree_parents: Tensor, cu_num_nodes: Tensor, max_depth: int) -> int:
    """Check the flattened tree arguments; return num_rows. Only host-side checks: no device sync."""
    check_index_vectors({"tree_token_ids": tree_token_ids, "tree_parents": tree_parents, "cu_num_nodes": cu_num_nodes})
    check_python_int(max_depth, "max_depth")
    num_nodes, num_rows = tree_token_ids.shape[0], cu_num_nodes.shape[0]
    if tree_parents.shape[0] != num_nodes:
        raise ValueError(f"tree_parents has {tree_parents.shape[0]} entries, expected one per node ({num_nodes})")
    if num_nodes < num_rows or (num_rows == 0 and num_nodes > 0):
        raise ValueError(
            f"tree_token_ids has {num_nodes} nodes for {num_rows} rows (cu_num_nodes): every row has at least "
            f"its root node, and nodes need a row"
        )
    return num_rows


def check_node_rows(target: Tensor, name: str, tree_token_ids: Tensor, dtypes: tuple[torch.dtype, ...]) -> int:
    """Check a `[num_nodes, width]` tensor with one row per tree node; return its width (vocab_size)."""
    check_tensor(target, name, 2, dtypes, tree_token_ids.device, "tree_token_ids")
    if target.shape[0] != tree_token_ids.shape[0]:
        raise ValueError(
            f"{name} has {target.shape[0]} rows, expected one per tree node: len(tree_token_ids) = "
            f"{tree_token_ids.shape[0]}"
        )
    if target.shape[1] == 0:
        raise ValueError(f"{name} has vocab_size 0 (shape {tuple(target.shape)}), expected at least 1")
    return target.shape[1]


def empty_tree_outputs(num_rows: int, max_depth: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """`output_token_ids` `[num_rows, max_depth + 1]` and `accepted_nodes` `[num_rows, max_depth]` filled with -1,
    and an uninitialised `num_emitted` `[num_rows]`."""
    output_token_ids, num_emitted = empty_outputs(num_rows, max_depth, device)
    accepted_nodes = torch.full((num_rows, max_depth), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    return output_token_ids, num_emitted, accepted_nodes


def tree_nodes_ref(tree_parents: Tensor, cu_num_nodes: Tensor, max_depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """`(node_start [num_rows], node_row [num_nodes], global_parent [num_nodes])`, -1 as the roots' parent.

    References only: checks the layout facts the kernels trust (needs a device sync).
    """
    num_nodes, num_rows = tree_parents.shape[0], cu_num_nodes.shape[0]
    device = tree_parents.device
    node_start = torch.cat([cu_num_nodes.new_zeros(1), cu_num_nodes[:-1]])[:num_rows]
    num_row_nodes = cu_num_nodes - node_start
    if num_rows > 0 and int(cu_num_nodes[-1]) != num_nodes:
        raise ValueError(f"cu_num_nodes[-1] is {int(cu_num_nodes[-1])}, expected len(tree_token_ids) = {num_nodes}")
    if bool((num_row_nodes < 1).any()):
        raise ValueError(
            f"cu_num_nodes must be strictly increasing (every row has at least its root), got {cu_num_nodes.tolist()}"
        )
    node_row = torch.repeat_interleave(torch.arange(num_rows, device=device), num_row_nodes)
    local = torch.arange(num_nodes, device=device) - node_start[node_row]
    is_root = local == 0
    if not bool((tree_parents[is_root] == -1).all()):
        raise ValueError("tree_parents of every root (local node 0) must be -1")
    drafts = ~is_root
    if not bool(((tree_parents[drafts] >= 0) & (tree_parents[drafts] < local[drafts])).all()):
        raise ValueError("tree_parents[v] must lie in [0, v) for every draft node v (parents precede children)")
    global_parent = torch.where(is_root, -1, tree_parents + node_start[node_row])
    # After k rounds a node holds min(depth, k): max_depth + 1 rounds expose any deeper node.
    depth = torch.zeros_like(local)
    for _ in range(max_depth + 1):
        depth = torch.where(is_root, 0, depth[global_parent.clamp(min=0)] + 1)
    if bool((depth > max_depth).any()):
        raise ValueError(f"a tree is deeper than max_depth ({max_depth}): pass the deepest node's depth or more")
    return node_start, node_row, global_parent


def walk_tree_ref(
    accepted: Tensor,  # [num_nodes] bool: the node is accepted if its parent is reached and no earlier sibling is
    global_parent: Tensor,  # [num_nodes]
    node_start: Tensor,  # [num_rows]
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """From each root, move to the first accepted child while there is one.

    Returns `accepted_nodes` `[num_rows, max_depth]` (local, -1 padded), `num_accepted` `[num_rows]` and the
    global index of the node where each row stopped, `[num_rows]`.
    """
    num_nodes = accepted.shape[0]
    accepted_ids = accepted.nonzero().squeeze(1)
    first_accepted_child = torch.full_like(global_parent, num_nodes)  # num_nodes: none
    first_accepted_child.scatter_reduce_(0, global_parent[accepted_ids], accepted_ids, reduce="amin")
    node = node_start.clone()
    walking = torch.ones_like(node, dtype=torch.bool)
    accepted_nodes = torch.full((node.shape[0], max_depth), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=node.device)
    for depth in range(max_depth):
        child = first_accepted_child[node]
        walking &= child < num_nodes
        node = torch.where(walking, child, node)
        accepted_nodes[:, depth] = torch.where(walking, node - node_start, PLACEHOLDER_TOKEN_ID)
    return accepted_nodes, (accepted_nodes >= 0).sum(dim=1), node


def tree_outputs_ref(
    tree_token_ids: Tensor,  # [num_nodes]
    node_start: Tensor,  # [num_rows]
    accepted_nodes: Tensor,  # [num_rows, max_depth]
    num_accepted: Tensor,  # [num_rows]
    last_token_ids: Tensor,  # [num_rows] the token sampled at the node where the row stopped
) -> Tensor:  # [num_rows, max_depth + 1]
    """The accepted path's tokens, then the last token, then -1."""
    path_tokens = tree_token_ids[node_start[:, None] + accepted_nodes.clamp(min=0)]
    path_tokens = torch.where(accepted_nodes >= 0, path_tokens, PLACEHOLDER_TOKEN_ID)
    output_token_ids = F.pad(path_tokens, (0, 1), value=PLACEHOLDER_TOKEN_ID)  # [num_rows, max_depth + 1]
    output_token_ids[torch.arange(node_start.shape[0], device=node_start.device), num_accepted] = last_token_ids
    return output_token_ids
