"""Memory planned before it is allocated: the KV caches' bytes from the model configs, against the free memory.

The engine's byte arithmetic lives here, on the ground floor: this room imports no other room of the engine, and the
caches, the model runner and the generator take their sizes from it.

The slot layout needs `slots x positions` up front and is refused, naming the largest batch that fits, when that does
not fit. A paged pool is sized instead: to what every slot could reach at most, capped by a share of the free memory
(on a CPU a smaller share, and the pool only grows as rows need blocks); rows beyond what it holds wait or are
preempted.
"""

from __future__ import annotations

import numbers
import pathlib
import warnings

import torch
from transformers import AutoConfig

from rollout.engine.requests import _outside_the_engine
from specdec.config import SpecConfig

DEFAULT_BLOCK_SIZE = 16  # tokens per block of a paged KV pool

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
        usable = int(USABLE_SHARE * free)
        fitting = usable // per_slot
        if fitting:
            fix = f"the largest max_batch_size that fits is {fitting}; lower max_batch_size or max_seq_len"
        else:  # a slot's bytes are a fixed part (a step's positions) and a part per token
            per_token = kv_cache_plan(model, spec, 2 * max_seq_len)[0] - per_slot  # (for max_seq_len tokens)
            longest = (usable - (per_slot - per_token)) * max_seq_len // per_token
            fix = (
                f"not one slot fits; lower max_seq_len (at most {longest} fit one slot)"
                if longest > 0
                else "not one slot fits, whatever max_seq_len: a step's positions alone take more (free memory, or "
                "lower num_speculative_tokens)"
            )
        raise ValueError(
            f"the KV cache needs {per_slot * max_batch_size / 2**30:.2f} GiB ({max_batch_size} slots x "
            f"{max_seq_len} tokens) but {_device(model)} has {free / 2**30:.2f} GiB free: {fix}"
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
    if num_blocks is not None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 1:
            raise ValueError(
                f"kv_pool_blocks ({num_blocks!r}) must be a positive integer (blocks of {DEFAULT_BLOCK_SIZE} tokens) "
                "or None"
            )
        num_blocks = int(num_blocks)  # (a numpy integer)
        if kv_layout == "slots":
            raise ValueError(
                f"kv_pool_blocks ({num_blocks}) sizes a paged KV pool, and kv_layout='slots' has none: leave "
                "kv_pool_blocks out, or set kv_layout='paged'"
            )
        if not paged:
            warnings.warn(
                f"kv_pool_blocks ({num_blocks}) is not used: kv_layout='auto' keeps slots on {device.type} (a paged "
                "pool on a GPU); set kv_layout='paged' to size a pool here",
                stacklevel=_outside_the_engine(),
            )
    if not paged:
        return check_kv_cache_fits(model, spec, max_batch_size, max_seq_len), None
    itemsize = next(model.parameters()).element_size()
    per_block = kv_bytes_per_token(model.config, itemsize) * DEFAULT_BLOCK_SIZE
    blocks_per_row = min_pool_blocks(max_seq_len, spec)
    # a paged draft model's pool: every slot's blocks (a slot cache's rows hold num_positions + 1 positions)
    draft_bytes = max_batch_size * draft_kv_bytes_per_slot(spec, itemsize, blocks_per_row * DEFAULT_BLOCK_SIZE - 1)
    wanted = max_batch_size * blocks_per_row
    free = free_memory(device)
    if num_blocks is not None:
        if not isinstance(num_blocks, int) or num_blocks < blocks_per_row:
            raise ValueError(
                f"kv_pool_blocks ({num_blocks!r}) must be an integer >= {blocks_per_row}: one sequence of max_seq_len "
                f"{max_seq_len} (plus one step's drafts) takes that many blocks of {DEFAULT_BLOCK_SIZE} tokens"
            )
        used = min(num_blocks, wanted)  # more than every slot's blocks would never be used
        if free is not None and used * per_block + draft_bytes > USABLE_SHARE * free:  # (as a slot cache)
            fitting = max(0, int(USABLE_SHARE * free - draft_bytes) // per_block)
            capped = f" (of which {max_batch_size} slots use {used})" if used < num_blocks else ""
            raise ValueError(
                f"kv_pool_blocks {num_blocks}{capped} takes {used * per_block / 2**30:.2f} GiB of KV cache"
                + (f" (and a draft model's {draft_bytes / 2**30:.2f} GiB)" if draft_bytes else "")
                + f" but {device} has {free / 2**30:.2f} GiB free: at most {fitting} blocks fit; lower kv_pool_blocks "
                "or leave it out (the pool is then planned from the free memory)"
            )
        if used < num_blocks:
            warnings.warn(
                f"kv_pool_blocks ({num_blocks}) is more than {max_batch_size} slots of max_seq_len {max_seq_len} can "
                f"hold ({wanted} blocks of {DEFAULT_BLOCK_SIZE} tokens): the pool holds {wanted}",
                stacklevel=_outside_the_engine(),
            )
            num_blocks = used
        return num_blocks * per_block + draft_bytes, num_blocks
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


def pool_budget(model: torch.nn.Module, max_kv_blocks: int | None, every_slot: int, pinned: bool) -> int | None:
    """The bytes a paged pool planned from the free memory may take (`plan_kv_cache`'s `max_kv_blocks` blocks in the
    weights' dtype), so that a pool holding keys in a narrower dtype (a bf16 autocast over float32 weights) takes more
    blocks in them; None where its size is fixed: `kv_pool_blocks` set it (`pinned`), or it holds `every_slot`'s blocks
    already, all a pool can use."""
    if max_kv_blocks is None or pinned or max_kv_blocks >= every_slot:
        return None
    itemsize = next(model.parameters()).element_size()
    return max_kv_blocks * kv_bytes_per_token(model.config, itemsize) * DEFAULT_BLOCK_SIZE


# ---- bytes --------------------------------------------------------------------------------------------------------


def kv_cache_bytes(model: torch.nn.Module, num_slots: int, num_positions: int) -> int:
    """The bytes a `SlotKVCache` for `model` takes at most (grown to `num_positions`, every layer written): keys and
    values of `[num_slots, H_kv, num_positions + 1, D]` per layer, in the model's parameter dtype."""
    itemsize = next(model.parameters()).element_size()
    return kv_cache_bytes_from_config(model.config, itemsize, num_slots, num_positions)


def kv_cache_bytes_from_config(config, itemsize: int, num_slots: int, num_positions: int) -> int:
    """`kv_cache_bytes` from a model's config alone (nothing loaded), with `itemsize` bytes per value."""
    return kv_bytes_per_token(config, itemsize) * num_slots * (num_positions + 1)


def kv_bytes_per_token(config, itemsize: int) -> int:
    """Bytes of keys and values one token takes in every layer of a model, from its config (0 without attention: such
    a model is refused when its runner is built)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if not getattr(config, "num_attention_heads", None):
        return 0
    kv_heads, head_dim = kv_head_shape(config)
    layer_types = getattr(config, "layer_types", None)
    num_layers = len(layer_types) if layer_types is not None else config.num_hidden_layers
    return 2 * num_layers * kv_heads * head_dim * itemsize


def kv_head_shape(config) -> tuple[int, int]:
    """(KV heads, head size) of a model's attention layers, from its config."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = config.num_attention_heads
    return (getattr(config, "num_key_value_heads", None) or heads), (
        getattr(config, "head_dim", None) or config.hidden_size // heads
    )


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new allocations on `device`: CUDA's own count, MemAvailable on a Linux CPU; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def draft_kv_bytes_per_slot(spec: SpecConfig | None, itemsize: int, num_positions: int) -> int:
    """KV-cache bytes per slot of the spec's draft model (0 without one), from its config: nothing is loaded. A
    draft loaded by name takes the target's dtype, hence `itemsize` (the target's); a loaded one keeps its own."""
    if spec is None or "draft_model" not in spec.methods:
        return 0
    if isinstance(spec.model, torch.nn.Module):
        return kv_cache_bytes(spec.model, 1, num_positions)
    from rollout.models import zoo
    from rollout.models.widen import WIDENED, wide_config

    if str(spec.model) in zoo.WIDENED_NAMES:  # its shape is known without building it
        base, shape = WIDENED[str(spec.model)]
        config = wide_config(AutoConfig.from_pretrained(zoo.model_path(base)), shape)
        return kv_cache_bytes_from_config(config, itemsize, 1, num_positions)
    config = AutoConfig.from_pretrained(draft_model_path(spec.model))
    return kv_cache_bytes_from_config(config, itemsize, 1, num_positions)


def min_pool_blocks(max_seq_len: int, spec: SpecConfig | None) -> int:
    """The fewest blocks a paged pool may have: one sequence of `max_seq_len` tokens plus one step's drafts."""
    num_positions = max_seq_len + 1 + (spec.num_speculative_tokens if spec is not None else 0)
    return -(-num_positions // DEFAULT_BLOCK_SIZE)


def draft_model_path(model) -> pathlib.Path:
    """The folder of a draft model named by a shipped short name or a local path."""
    if not isinstance(model, (str, pathlib.Path)):
        raise ValueError(  # (not its repr: a tokenizer's runs to pages)
            "spec.model must be a path, a shipped short name or a loaded model (a transformers causal LM), got a "
            f"{type(model).__name__}"
        )
    from rollout.models import zoo

    path = zoo.model_path(model) if str(model) in zoo.MODEL_NAMES else pathlib.Path(model)
    if not path.exists():
        raise ValueError(f"spec.model ({model!r}) is neither a zoo model ({', '.join(zoo.ALL_NAMES)}) nor a path")
    return path
