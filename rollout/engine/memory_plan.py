"""Memory planned before it is allocated: the KV caches' bytes from the model configs, against the free memory.

The slot layout needs `slots x positions` up front and is refused, naming the largest batch that fits, when that does
not fit. A paged pool is sized instead: to what every slot could reach at most, capped by a share of the free memory
(on a CPU a smaller share, and the pool only grows as rows need blocks); rows beyond what it holds wait or are
preempted.
"""

from __future__ import annotations

import torch

from rollout.engine.kv_cache import free_memory, kv_bytes_per_token, kv_cache_bytes
from rollout.engine.paged_cache import DEFAULT_BLOCK_SIZE
from rollout.engine.speculation import draft_kv_bytes_per_slot
from specdec.config import SpecConfig

USABLE_SHARE = 0.9  # of the free memory, the KV caches may take this much: the rest is for activations and logits
CPU_PAGED_SHARE = 0.4  # a paged pool on a CPU never plans for most of the machine's memory


def kv_cache_plan(model: torch.nn.Module, spec: SpecConfig | None, max_seq_len: int) -> tuple[int, int | None]:
    """(KV-cache bytes per slot, the target's plus the draft model's; bytes free on the model's device, None if
    unknown). Nothing is allocated or loaded: a draft named by path is read from its config."""
    num_positions = max_seq_len + 1 + (spec.num_speculative_tokens if spec is not None else 0)
    itemsize = next(model.parameters()).element_size()
    per_slot = kv_cache_bytes(model, 1, num_positions) + draft_kv_bytes_per_slot(spec, itemsize, num_positions)
    return per_slot, free_memory(_device(model))


def check_kv_cache_fits(model: torch.nn.Module, spec: SpecConfig | None, max_batch_size: int, max_seq_len: int) -> int:
    """The KV caches' bytes for `max_batch_size` slots; a ValueError naming the largest max_batch_size that fits
    when they do not fit the device's free memory."""
    per_slot, free = kv_cache_plan(model, spec, max_seq_len)
    if free is not None and per_slot * max_batch_size > USABLE_SHARE * free:
        raise ValueError(
            f"the KV cache needs {per_slot * max_batch_size / 2**30:.2f} GiB ({max_batch_size} slots x "
            f"{max_seq_len} tokens) but {_device(model)} has {free / 2**30:.2f} GiB free: the largest "
            f"max_batch_size that fits is {int(USABLE_SHARE * free) // per_slot}; lower max_batch_size or max_seq_len"
        )
    return per_slot * max_batch_size


def fitting_batch_size(model: torch.nn.Module, spec: SpecConfig | None, max_seq_len: int, wanted: int) -> int:
    """The largest max_batch_size up to `wanted` whose KV caches fit the device's free memory (at least 1)."""
    per_slot, free = kv_cache_plan(model, spec, max_seq_len)
    if free is None or per_slot == 0:
        return wanted
    return max(1, min(wanted, int(USABLE_SHARE * free) // per_slot))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def plan_kv_cache(
    model: torch.nn.Module,
    spec: SpecConfig | None,
    max_batch_size: int,
    max_seq_len: int,
    kv_layout: str,
    num_blocks: int | None = None,
) -> tuple[int, int | None]:
    """(bytes planned for the KV caches, the paged pool's size in blocks or None for the slot layout).

    `kv_layout` "auto" plans paged on a GPU. `num_blocks` sets the paged pool's size instead of the plan. A paged
    pool that cannot hold one row of `max_seq_len` is refused."""
    device = _device(model)
    paged = kv_layout == "paged" or (kv_layout == "auto" and device.type == "cuda")
    if not paged:
        return check_kv_cache_fits(model, spec, max_batch_size, max_seq_len), None
    num_positions = max_seq_len + 1 + (spec.num_speculative_tokens if spec is not None else 0)
    itemsize = next(model.parameters()).element_size()
    per_block = kv_bytes_per_token(model.config, itemsize) * DEFAULT_BLOCK_SIZE
    draft_bytes = max_batch_size * draft_kv_bytes_per_slot(spec, itemsize, num_positions)
    blocks_per_row = -(-num_positions // DEFAULT_BLOCK_SIZE)
    wanted = max_batch_size * blocks_per_row
    if num_blocks is not None:
        if not isinstance(num_blocks, int) or num_blocks < blocks_per_row:
            raise ValueError(
                f"kv_pool_blocks ({num_blocks!r}) must be an integer >= {blocks_per_row}: one sequence of max_seq_len "
                f"{max_seq_len} (plus one step's drafts) takes that many blocks of {DEFAULT_BLOCK_SIZE} tokens"
            )
        return num_blocks * per_block + draft_bytes, num_blocks
    free = free_memory(device)
    if free is None or per_block == 0:
        return wanted * per_block + draft_bytes, wanted
    share = USABLE_SHARE if device.type == "cuda" else CPU_PAGED_SHARE
    fitting = int(share * free - draft_bytes) // per_block
    if fitting < blocks_per_row:
        raise ValueError(
            f"{device} has {free / 2**30:.2f} GiB free: a paged KV pool there holds {max(fitting, 0)} blocks of "
            f"{DEFAULT_BLOCK_SIZE} tokens, fewer than one sequence of max_seq_len {max_seq_len} needs "
            f"({blocks_per_row}); lower max_seq_len"
        )
    blocks = min(wanted, fitting)
    return blocks * per_block + draft_bytes, blocks
