"""The attention function the engine registers with transformers' `AttentionInterface` for its paged cache.

Every attention layer of a Hugging Face causal LM calls `fn(module, query, key, value, attention_mask, **kwargs)`
with the query, key and value after rotary embedding and every keyword argument given to the model's forward. The
engine passes a `PagedStep` as `rollout_step`: the layer's keys and values are stored at their slots, then each
query attends over its row's blocks (Triton kernels on a GPU, their torch references elsewhere). Transformers builds
no mask for an implementation it has no mask function for, so none is built.

The model is switched to this implementation only for the engine's own forwards (`paged_attention_for`), so a
trainer's model trains with its own attention.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from transformers import AttentionInterface

from rollout.engine.paged_cache import PagedStep
from rollout_kernels.paged_attention import attend_gathered, paged_attention, visible_keys
from rollout_kernels.store_kv import store_kv_, store_kv_ref_

ATTENTION_NAME = "rollout_paged"


class StepMetadataMissing(ValueError):
    """The paged attention was called without the step's metadata (outside the engine, or by a model whose layers
    do not pass the forward's keyword arguments on to their attention)."""


# keywords some models pass that change attention in ways this function does not implement
UNSUPPORTED = ("softcap", "s_aux", "sinks")


def paged_attention_forward(
    module: torch.nn.Module,
    query: Tensor,  # [rows, heads, S, head_dim]
    key: Tensor,  # [rows, kv_heads, S, head_dim]
    value: Tensor,  # [rows, kv_heads, S, head_dim]
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    rollout_step: PagedStep | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Store this layer's new keys and values, then attend; returns `[rows, S, heads, head_dim]` and no weights."""
    if rollout_step is None:
        raise StepMetadataMissing(
            f"the {ATTENTION_NAME!r} attention runs inside the rollout engine only (it needs the step's paged-cache "
            "metadata); load the model with attn_implementation='sdpa' to run it elsewhere. A paged Generator sets it "
            "on the model's config during its forwards: a forward of the same model object from another thread then "
            "meets it; run them one after another, or give that thread its own model object"
        )
    extra = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if extra:
        raise ValueError(f"{type(module).__name__} passes {extra} to its attention, which the paged path lacks")
    step = rollout_step
    if sliding_window is None:  # a model that applies its window through the mask only (PhiMoE, Qwen2-MoE)
        sliding_window = step.cache.layer_windows[module.layer_idx]
    k_pool, v_pool = step.cache.pools(module.layer_idx)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dtype = query.dtype  # under autocast (a trainer's bf16) the projections may differ from the pool's dtype
    query, key, value = (t.to(k_pool.dtype) for t in (query, key, value))
    metadata = (step.slot_mapping, step.block_tables, step.cache_lens, step.query_start, step.num_queries)
    if torch.compiler.is_compiling():  # one opaque op: the compiler traces the layers around it without a break
        out = torch.ops.rollout.paged_attention_step(
            query, key, value, k_pool, v_pool, *metadata, step.depths, step.ancestors, scale, sliding_window
        )
    else:
        out = _store_and_attend(
            query, key, value, k_pool, v_pool, *metadata, step.depths, step.ancestors, scale, sliding_window, step.masks
        )
    return out.to(dtype), None


def _store_and_attend(
    query: Tensor,  # [rows, heads, S, head_dim]
    key: Tensor,  # [rows, kv_heads, S, head_dim]
    value: Tensor,  # [rows, kv_heads, S, head_dim]
    k_pool: Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_pool: Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: Tensor,  # [rows, S] int64
    block_tables: Tensor,  # [rows, max_blocks] int64
    cache_lens: Tensor,  # [rows] int64
    query_start: Tensor,  # [rows] int64
    num_queries: Tensor,  # [rows] int64
    depths: Tensor | None,  # [rows, S] int64
    ancestors: Tensor | None,  # [rows, S, S] bool
    scale: float,
    sliding_window: int | None,
    masks: dict | None = None,
) -> Tensor:
    """Stores the keys and values at their slots, then attends: `[rows, S, heads, head_dim]`. Triton kernels on a GPU,
    their torch references elsewhere; there the visible-key mask is kept in `masks` by window, for the step's other
    layers (None: built for this call only)."""
    if query.is_cuda:
        store_kv_(k_pool, v_pool, key, value, slot_mapping)
        return paged_attention(
            query,
            k_pool,
            v_pool,
            block_tables,
            cache_lens,
            query_start,
            num_queries,
            scale,
            sliding_window,
            depths,
            ancestors,
        )
    store_kv_ref_(k_pool, v_pool, key, value, slot_mapping)
    mask = masks.get(sliding_window) if masks is not None else None
    if mask is None:  # one mask a step (per window), shared by the layers
        kv_len = block_tables.shape[1] * k_pool.shape[1]
        mask = visible_keys(
            cache_lens, query_start, num_queries, kv_len, query.shape[2], sliding_window, depths, ancestors
        )
        if masks is not None:
            masks[sliding_window] = mask
    return attend_gathered(query, k_pool, v_pool, block_tables, mask, scale)


@torch.library.custom_op("rollout::paged_attention_step", mutates_args=("k_pool", "v_pool"))
def _paged_attention_step(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    cache_lens: Tensor,
    query_start: Tensor,
    num_queries: Tensor,
    depths: Tensor | None,
    ancestors: Tensor | None,
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    """`_store_and_attend` as one operator for `torch.compile` (`rollout.engine.compiled_forward`): the compiler
    calls it and never traces its launchers, whose checks would break the graph at every layer. Each call builds its
    own mask on a CPU."""
    out = _store_and_attend(
        query, key, value, k_pool, v_pool, slot_mapping, block_tables, cache_lens, query_start, num_queries, depths,
        ancestors, scale, sliding_window,
    )  # fmt: skip
    return out.contiguous()


@_paged_attention_step.register_fake
def _(query, key, value, k_pool, v_pool, slot_mapping, block_tables, cache_lens, *args) -> Tensor:
    rows, num_heads, S, head_dim = query.shape
    return query.new_empty(rows, S, num_heads, head_dim)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextlib.contextmanager
def paged_attention_for(model: torch.nn.Module):
    """Run `model`'s attention layers through the paged function for the block, and restore its own after. The
    layers read `config._attn_implementation` when they are called, so setting it on the config is enough."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
