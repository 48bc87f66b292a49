"""Store a step's keys and values into a paged KV cache: each token at its slot of the pool.

One layer's cache is a pool of fixed-size blocks, `[num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
`block * block_size + offset` (the block manager's slot mapping), -1 for a padding token, which is not stored.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from rollout_kernels._layout import check_kernel_device

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [rows, num_kv_heads, S, head_dim], any strides but a contiguous last dim
    value_ptr,
    k_pool_ptr,  # [num_slots, num_kv_heads, head_dim] (the pool's blocks flattened), contiguous
    v_pool_ptr,
    slot_mapping_ptr,  # [rows, S] int64, -1 = padding (not stored)
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    S,
    num_kv_heads,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token // S
    column = token % S
    slot = tl.load(slot_mapping_ptr + token)
    cols = tl.arange(0, BLOCK_D)
    # a limit rather than `mask & (slot >= 0)`: the interpreter turns a block & scalar bool into int8
    limit = tl.where(slot >= 0, head_dim, 0)
    mask = cols < limit
    source_k = row.to(tl.int64) * stride_kb + head * stride_kh + column * stride_ks
    source_v = row.to(tl.int64) * stride_vb + head * stride_vh + column * stride_vs
    target = (slot * num_kv_heads + head) * head_dim
    tl.store(k_pool_ptr + target + cols, tl.load(key_ptr + source_k + cols, mask=mask), mask=mask)
    tl.store(v_pool_ptr + target + cols, tl.load(value_ptr + source_v + cols, mask=mask), mask=mask)


def store_kv_(
    k_pool: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pool: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key: Tensor,  # [rows, num_kv_heads, S, head_dim]
    value: Tensor,  # [rows, num_kv_heads, S, head_dim]
    slot_mapping: Tensor,  # [rows, S] int64
) -> None:
    """Write each token's key and value at its slot in the pools, in place; slot -1 (padding) is skipped.

    `key`/`value` come as the attention layer has them (after rotary embedding, `[rows, heads, S, head_dim]`, possibly
    a transposed view: only the last dimension must be contiguous).
    """
    _check_store(k_pool, v_pool, key, value, slot_mapping)
    check_kernel_device(_store_kv_kernel, k_pool.device, "store_kv_")
    rows, num_kv_heads, S, head_dim = key.shape
    if rows * S == 0:
        return
    _store_kv_kernel[(rows * S, num_kv_heads)](
        key,
        value,
        k_pool,
        v_pool,
        slot_mapping,
        *key.stride()[:3],
        *value.stride()[:3],
        S,
        num_kv_heads,
        head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_ref_(k_pool: Tensor, v_pool: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
    """`store_kv_` in torch."""
    _check_store(k_pool, v_pool, key, value, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    k_pool.view(-1, num_kv_heads, head_dim)[slots] = key.transpose(1, 2)[keep]
    v_pool.view(-1, num_kv_heads, head_dim)[slots] = value.transpose(1, 2)[keep]


def _check_store(k_pool, v_pool, key, value, slot_mapping) -> None:
    check_pools(k_pool, v_pool)
    if key.dim() != 4 or key.shape != value.shape:
        raise ValueError(f"key and value must be [rows, heads, S, head_dim] alike, got {key.shape} and {value.shape}")
    if key.shape[1] != k_pool.shape[2] or key.shape[3] != k_pool.shape[3]:
        raise ValueError(f"key {tuple(key.shape)} does not fit a pool of [.., .., heads, head_dim] {k_pool.shape}")
    if key.stride(3) != 1 or value.stride(3) != 1:
        raise ValueError("key and value need a contiguous last dimension")
    if key.dtype != k_pool.dtype or value.dtype != v_pool.dtype:
        raise ValueError(f"key and value ({key.dtype}, {value.dtype}) must have the pool's dtype {k_pool.dtype}")
    if slot_mapping.shape != key.shape[:1] + key.shape[2:3] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [rows, S] = {(key.shape[0], key.shape[2])}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")


def check_pools(k_pool: Tensor, v_pool: Tensor) -> None:
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"pools must be [num_blocks, block_size, heads, head_dim] alike, got {k_pool.shape}")
    if k_pool.data_ptr() == v_pool.data_ptr():
        raise ValueError("k_pool and v_pool must be different tensors")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the pools must be contiguous")
    if k_pool.dtype not in CACHE_DTYPES:
        raise ValueError(f"pool dtype {k_pool.dtype} is not one of {CACHE_DTYPES}")
