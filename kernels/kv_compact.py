"""KV-cache compaction after tree verification: move each row's accepted path next to its root, in place.

A step writes node v of row r at position `base_positions[r] + v`. The accepted draft nodes (`accepted_nodes` from
`tree_greedy_verify` / `tree_rejection_sample`) then move to `base + 1, base + 2, ...`, so the committed sequence is
contiguous and the row's length can simply grow by the emitted count.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import LOGIT_DTYPES, MAX_BLOCK_SIZE, check_kernel_device, check_tensor

CACHE_DTYPES = LOGIT_DTYPES


# Path a_0 < a_1 < ... of row r: move base + a_j -> base + 1 + j for j = 0, 1, ... in that order.
# In place is safe in this order: parents precede children, so a_k >= k + 1, and step k reads base + a_k, beyond
# every position base + 1 + j (j < k) written before it. A step may overwrite a position an earlier step read
# (a_i = j + 1 for i < j), which is fine after that read; each element d is loaded and stored with the same offsets,
# hence by the same thread. One program per (row, head) owns disjoint memory (rows are distinct slots).
@triton.jit
def _compact_kv_kernel(
    keys_ptr,  # [num_slots, num_heads, seq_len, head_dim]
    values_ptr,  # [num_slots, num_heads, seq_len, head_dim]
    rows_ptr,  # [num_rows] int64 slot of each row
    base_positions_ptr,  # [num_rows] int64 position of each row's root
    accepted_nodes_ptr,  # [num_rows, max_depth] int64 local node indices, -1 padded
    num_heads,
    seq_len,
    head_dim,
    max_depth,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(rows_ptr + row)  # int64, so the offsets below are int64 too
    base = tl.load(base_positions_ptr + row)
    head_offset = (slot * num_heads + head) * seq_len * head_dim
    offsets = tl.arange(0, BLOCK_D)
    for j in range(0, max_depth):
        node = tl.load(accepted_nodes_ptr + row.to(tl.int64) * max_depth + j)
        source = base + node
        # node == j + 1 is already in place; -1 ends the path; the bounds keep a bad input inside the cache.
        moving = (node > j + 1) & (source < seq_len) & (base >= 0)
        # A limit rather than `mask & moving`: the interpreter turns a block & scalar bool into int8.
        limit = tl.where(moving, head_dim, 0)
        source_offset = head_offset + source * head_dim
        target_offset = head_offset + (base + 1 + j) * head_dim
        for d_start in range(0, head_dim, BLOCK_D):
            cols = d_start + offsets
            mask = cols < limit
            key = tl.load(keys_ptr + source_offset + cols, mask=mask)
            value = tl.load(values_ptr + source_offset + cols, mask=mask)
            tl.store(keys_ptr + target_offset + cols, key, mask=mask)
            tl.store(values_ptr + target_offset + cols, value, mask=mask)


def compact_kv_(
    keys: Tensor,  # [num_slots, num_heads, seq_len, head_dim]
    values: Tensor,  # [num_slots, num_heads, seq_len, head_dim]
    rows: Tensor,  # [num_rows] int64
    base_positions: Tensor,  # [num_rows] int64
    accepted_nodes: Tensor,  # [num_rows, max_depth] int64
) -> None:
    """Move each row's accepted tree path to the positions right after its root, in place, for one layer.

    Args:
        keys: `[num_slots, num_heads, seq_len, head_dim]` float16, bfloat16, float32 or float64 key cache.
        values: same shape and dtype as keys, a different tensor.
        rows: `[num_rows]` int64 distinct slots, one per verified row.
        base_positions: `[num_rows]` int64 position where each row's root (node 0) was written; node v was
            written at `base + v`.
        accepted_nodes: `[num_rows, max_depth]` int64 local indices of the accepted draft nodes in path order,
            -1 padded, as returned by the tree verifiers. Node `accepted_nodes[r, j]` moves to `base + 1 + j`.
    """
    max_depth = _check_inputs(keys, values, rows, base_positions, accepted_nodes)
    check_kernel_device(_compact_kv_kernel, keys.device, "compact_kv_")
    num_rows, num_heads, seq_len, head_dim = rows.shape[0], keys.shape[1], keys.shape[2], keys.shape[3]
    if num_rows == 0 or max_depth == 0 or keys.numel() == 0:
        return
    _compact_kv_kernel[(num_rows, num_heads)](
        keys,
        values,
        rows,
        base_positions,
        accepted_nodes,
        num_heads,
        seq_len,
        head_dim,
        max_depth,
        BLOCK_D=min(triton.next_power_of_2(head_dim), MAX_BLOCK_SIZE),
    )


def compact_kv_ref_(
    keys: Tensor,  # [num_slots, num_heads, seq_len, head_dim]
    values: Tensor,  # [num_slots, num_heads, seq_len, head_dim]
    rows: Tensor,  # [num_rows] int64
    base_positions: Tensor,  # [num_rows] int64
    accepted_nodes: Tensor,  # [num_rows, max_depth] int64
) -> None:
    """Pure-torch `compact_kv_`: same arguments, same in-place result, runs on any device."""
    _check_inputs(keys, values, rows, base_positions, accepted_nodes)
    num_slots, seq_len = keys.shape[0], keys.shape[2]
    if not bool(((rows >= 0) & (rows < num_slots)).all()) or rows.unique().shape[0] != rows.shape[0]:
        raise ValueError(f"rows must be distinct slots in [0, num_slots = {num_slots}), got {rows.tolist()}")
    if not bool((base_positions >= 0).all()):
        raise ValueError(f"base_positions must be >= 0, got {base_positions.tolist()}")
    on_path = accepted_nodes >= 0
    if not bool((on_path.cummin(dim=1).values == on_path).all()):
        raise ValueError("accepted_nodes must hold each row's path first, then only -1")
    row, step = on_path.nonzero(as_tuple=True)
    if not bool((accepted_nodes[row, step] >= step + 1).all()):
        raise ValueError("accepted_nodes[r, j] must be >= j + 1 (parents precede children in a tree)")
    source = base_positions[row] + accepted_nodes[row, step]
    if source.numel() and int(source.max()) >= seq_len:
        raise ValueError(f"base_positions + accepted_nodes reach position {int(source.max())}, past seq_len {seq_len}")
    # Gathering every source before writing gives the kernel's result: no step reads a position written before it.
    target = base_positions[row] + 1 + step
    slots = rows[row]
    for cache in (keys, values):
        cache[slots, :, target] = cache[slots, :, source]  # [num_moves, num_heads, head_dim]


def _check_inputs(keys: Tensor, values: Tensor, rows: Tensor, base_positions: Tensor, accepted_nodes: Tensor) -> int:
    """Host-side checks (no device sync); return max_depth."""
    if not isinstance(keys, Tensor):
        raise TypeError(f"keys must be a torch.Tensor, got {type(keys).__name__}")
    device = keys.device
    check_tensor(keys, "keys", 4, CACHE_DTYPES, device, "keys")
    check_tensor(values, "values", 4, (keys.dtype,), device, "keys")
    if values.shape != keys.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, expected the shape of keys {tuple(keys.shape)}")
    if values.data_ptr() == keys.data_ptr() and keys.numel() > 0:
        raise ValueError("keys and values are the same tensor: pass the two caches of the layer")
    check_tensor(rows, "rows", 1, (torch.int64,), device, "keys")
    num_rows = rows.shape[0]
    check_tensor(base_positions, "base_positions", 1, (torch.int64,), device, "keys")
    check_tensor(accepted_nodes, "accepted_nodes", 2, (torch.int64,), device, "keys")
    for name, tensor in (("base_positions", base_positions), ("accepted_nodes", accepted_nodes)):
        if tensor.shape[0] != num_rows:
            raise ValueError(f"{name} has {tensor.shape[0]} rows, expected one per entry of rows ({num_rows})")
    return accepted_nodes.shape[1]
