"""Memory planned before it is allocated: the KV caches' bytes from the model configs, against the free memory."""

from __future__ import annotations

import torch

from rollout.engine.kv_cache import free_memory, kv_cache_bytes
from rollout.engine.speculation import draft_kv_bytes_per_slot
from specdec.config import SpecConfig

USABLE_SHARE = 0.9  # of the free memory, the KV caches may take this much: the rest is for activations and logits


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
