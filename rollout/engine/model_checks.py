"""What a model must offer to be served, checked when a `ModelRunner` is built: a decoder-only causal LM with
attention layers only, `sdpa` or `eager` attention, keys and values written through the cache it is handed (or, for
the paged layout, through transformers' attention interface). `probe` runs two tokens through a one-slot cache to
find out what config checks cannot.
"""

from __future__ import annotations

import collections
import inspect
import warnings

import torch
from transformers import PreTrainedModel

from rollout.engine.attention import StepMetadataMissing
from rollout.engine.kv_cache import SlotKVCache
from rollout.engine.memory_plan import kv_head_shape
from rollout.engine.paged_cache import PagedKVCache
from rollout.engine.policy_mode import eval_mode
from rollout.engine.step_batch import StepBatch

SUPPORTED_ATTENTION = ("sdpa", "eager")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model.forward` takes a KV cache in the installed transformers: `cache` from 5.24,
    `past_key_values` before (5.24 still takes the old name, with a deprecation warning on every call). A wrapper
    whose forward passes keyword arguments through (PEFT's) is looked through to the model it wraps."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        parameters = inspect.signature(model.forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
        inner = getattr(model, "get_base_model", None)
        if inner is None:
            break
        model = inner()
    return "past_key_values"


def check_supported(model: PreTrainedModel) -> str:
    """The model's attention implementation, if the generator can serve the model; else a ValueError saying why."""
    config = model.config
    name = f"{type(model).__name__} (model_type={config.model_type!r})"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; the generator serves decoder-only causal LMs")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"{name} uses attn_implementation={impl!r}, which does not take a 4D mask; load it with "
            f"attn_implementation='sdpa' or 'eager' (supported: {', '.join(SUPPORTED_ATTENTION)})"
        )
    if getattr(config, "alibi", False) or config.model_type == "bloom":  # Falcon with alibi=True, Bloom
        raise ValueError(
            f"{name} uses ALiBi position biases, which the generator's caches and masks do not carry (rotary and "
            "learned positions are supported)"
        )
    if "local" in (getattr(config, "attention_layers", None) or []):  # GPT-Neo
        raise ValueError(
            f"{name} has local attention layers (config.attention_layers), which apply their own window placed as if "
            "every row were the batch's longest: rows of other lengths would attend to the wrong keys"
        )
    layer_types = getattr(config, "layer_types", None) or []
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"{name} has layers of type {unsupported}: recurrent or non-standard attention state cannot live in a "
            f"slot KV cache (supported layer types: {', '.join(SUPPORTED_LAYER_TYPES)})"
        )
    if not hasattr(config, "num_attention_heads"):
        raise ValueError(f"{name} has no attention heads (recurrent state?); it cannot run on a slot KV cache")
    return impl


def learned_positions(model: torch.nn.Module) -> tuple[int, str] | None:
    """The smallest learned position table (GPT-2's `wpe`, OPT's `embed_positions`) of the language model's own
    modules, as (positions it holds, its module path); None for a model without one (rotary, ALiBi)."""
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:  # the language model's own modules (not a vision tower's position table)
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        decoder = None
    prefix = next((p for p, m in model.named_modules() if m is decoder), None)
    tables = []
    for path, module in model.named_modules():
        if prefix and not path.startswith(prefix + "."):
            continue
        name = path.rsplit(".", 1)[-1]
        if not isinstance(module, torch.nn.Embedding) or module is inputs or not ("pos" in name or name == "wpe"):
            continue
        tables.append((module.num_embeddings - int(getattr(module, "offset", 0)), path))  # (OPT's starts at 2)
    return min(tables) if tables else None


def check_positions(
    model: torch.nn.Module, max_seq_len: int, role: str = "the model", setting: str = "max_seq_len"
) -> None:
    """A ValueError where a learned position table (`learned_positions`) holds fewer positions than a sequence of
    `max_seq_len` tokens takes: a row past it would index outside the table mid-call. Rotary models have no such
    table. `setting` names the length where the caller's user sets it."""
    table = learned_positions(model)
    if table is not None and table[0] < max_seq_len:
        num_positions, path = table
        raise ValueError(
            f"{role} ({type(model).__name__}) has a learned position table of {num_positions} positions "
            f"({path}), fewer than {setting} ({max_seq_len}): a longer sequence would index outside it; lower "
            f"{setting} to {num_positions} or less"
        )


def rope_unscaled_length(model: torch.nn.Module) -> tuple[int, str, str] | None:
    """Where the model's rotary frequencies follow the longest position of each forward (transformers' `dynamic` and
    `longrope` rope types): (the longest sequence they leave unscaled, the rope type, the config field it comes
    from), the smallest over the model's rotary embeddings; None for a model without such a rope."""
    found = []
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if not hasattr(module, "original_max_seq_len") or kinds is None:  # not a rotary embedding
            continue
        for layer_type, kind in kinds.items() if isinstance(kinds, dict) else [(None, kinds)]:
            if "dynamic" in str(kind):  # rescaled once a forward passes the length it was made for
                found.append((module.original_max_seq_len, kind, "max_position_embeddings"))
            elif kind == "longrope":  # the long factors once a forward passes the pretraining length
                params = module.config.rope_parameters
                limit = (params[layer_type] if layer_type else params)["original_max_position_embeddings"]
                found.append((limit, kind, "original_max_position_embeddings"))
    return min(found) if found else None


def check_rope_scaling(model: torch.nn.Module, max_seq_len: int, setting: str = "max_seq_len") -> None:
    """A ValueError where the model's rotary frequencies follow the longest position of each forward
    (`rope_unscaled_length`) and a sequence of `max_seq_len` tokens passes the length they leave unscaled: there
    every row's rotation would depend on the longest row beside it, and on the drafts verified ahead, so samples
    would change with the batch and with speculation. Within it the frequencies stay the unscaled ones: the engine
    feeds no position past `max_seq_len - 1` (padding columns sit at 0, drafts stop before the length cap). `setting`
    names the length where the caller's user sets it."""
    rope = rope_unscaled_length(model)
    if rope is not None and max_seq_len > rope[0]:
        limit, kind, field = rope
        raise ValueError(
            f"{type(model).__name__} uses rope_type {kind!r}, whose rotary frequencies follow the longest position "
            f"of each forward past {field} ({limit}): rows batched together (and drafts verified ahead) would "
            f"change each other's samples. Keep {setting} at {limit} or less (it is {max_seq_len}), or load the model "
            "with a static rope type (default, linear, yarn, llama3)"
        )


def _own_forward_error(model: torch.nn.Module, ids: torch.Tensor) -> Exception | None:
    """The error the model's own forward raises on `ids` with no cache of ours (None: it runs)."""
    try:
        with torch.no_grad(), eval_mode(model):
            model(input_ids=ids, use_cache=False)
    except Exception as err:  # noqa: BLE001 - any failure: the model's own
        return err
    return None


def _device_trouble(err: Exception) -> bool:
    """Out of memory, or a CUDA error left by the probe's failure: not the model's own forward failing."""
    return isinstance(err, torch.OutOfMemoryError) or "CUDA error" in str(err)


def _failing_model_message(model: torch.nn.Module, err: Exception) -> str:
    name = type(model).__name__
    message = f"{name} fails in its own forward, outside the generator too ({type(err).__name__}: {err})"
    dtype = next(model.parameters()).dtype
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm" and dtype == torch.float64:
        return message + (
            ": transformers' grouped_mm experts have no float64 kernel; load it with experts_implementation='eager', "
            "or in float32 or bfloat16"
        )
    return message + ": load it so that its own forward runs (another dtype or implementation), then hand it over"


def probe(runner, layout: str) -> bool:
    """Run two tokens through a one-slot cache of `layout`: every layer must write through it and the outputs must
    be finite. Slots: a model that cannot is refused (ValueError). Paged: False, with a warning, when the model's
    attention does not go through transformers' attention interface (the caller runs it on slots).

    This catches what config checks cannot: a layer keeping state outside the cache, or a model that cannot take
    a per-layer-type mask mapping for its sliding-window layers (the window must be built into the mask).
    """
    name = type(runner.model).__name__
    calls: collections.Counter = collections.Counter()  # paged: attention calls per layer
    if layout == "paged":
        heads, head_dim = kv_head_shape(runner.model.config)
        cache = PagedKVCache(runner.num_layers, heads, head_dim, runner.dtype, runner.device, 1, 4, max_blocks=1,
                             block_size=4)  # fmt: skip
        pools = cache.pools
        cache.pools = lambda layer: (calls.update([layer]), pools(layer))[1]  # the attention asks once a call
    else:
        cache = SlotKVCache(runner.num_layers, num_slots=1, num_positions=4)
    ids = torch.zeros(1, 2, dtype=torch.long, device=runner.device)
    zero, two = torch.zeros(1, dtype=torch.long), torch.full((1,), 2, dtype=torch.long)
    try:
        # eval mode as in generation: in train mode a model with gradient checkpointing turns its cache off
        with torch.no_grad(), eval_mode(runner.model):
            logits = runner.forward(StepBatch.build(0, ids, zero, zero, two), cache=cache)
    except Exception as err:  # the model's own error says what it could not do with our cache or mask
        own = _own_forward_error(runner.model, ids)
        if own is not None and not _device_trouble(own):  # not the cache's doing: the model does not run at all
            raise ValueError(_failing_model_message(runner.model, own)) from err
        if layout == "paged":
            message = f"{name} runs on the slot KV cache: the paged attention failed ({type(err).__name__}: {err})"
            if not calls and not isinstance(err, StepMetadataMissing):  # (Falcon, MPT: their own attention code)
                message = (
                    f"{name} runs on the slot KV cache: its attention layers compute attention themselves rather than "
                    "through transformers' attention interface, which the paged cache plugs into (the paged forward "
                    f"then failed in {type(err).__name__}: {err})"
                )
            if isinstance(err, StepMetadataMissing):  # (StableLM, Nemotron)
                message = (
                    f"{name} runs on the slot KV cache: its attention layers do not pass the forward's keyword "
                    "arguments on to the attention function, and the paged cache's step metadata travels in them"
                )
            warnings.warn(message, stacklevel=3)
            return False
        raise ValueError(f"{name} cannot run on the slot KV cache with 4D masks: {type(err).__name__}: {err}") from err
    if layout == "paged":
        twice = sorted(layer for layer, count in calls.items() if count > 1)
        if twice:  # DiffLlama's differential attention: the second call's keys and values would replace the first's
            warnings.warn(
                f"{name} runs on the slot KV cache: its layers {twice} call the attention more than once a forward, "
                "and the paged cache keeps one call's keys and values per layer",
                stacklevel=3,
            )
            return False
        # layers whose attention went through the paged function (it stores before it attends). Not the pools'
        # contents: a pad token's embedding row is zero in many checkpoints, and so are its keys and values
        written = sum(calls[layer] > 0 for layer in range(runner.num_layers))
        if written != runner.num_layers or not torch.isfinite(logits).all():
            warnings.warn(
                f"{name} runs on the slot KV cache: {runner.num_layers - written} of its {runner.num_layers} attention "
                "layers do not call transformers' attention interface, which the paged cache goes through",
                stacklevel=3,
            )
            return False
        return True
    written = sum(layer.is_initialized for layer in cache.layers)
    if written != runner.num_layers:
        raise ValueError(
            f"{name} wrote keys/values for {written} of {runner.num_layers} layers through the cache: some layers keep "
            "state elsewhere (recurrent or cross-layer caches are not supported)"
        )
    if not torch.isfinite(logits).all():
        raise ValueError(f"{name} produced non-finite logits on a probe forward with the slot KV cache")
    return True
