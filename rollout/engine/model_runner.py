"""Runs a Hugging Face causal LM over slot rows: per-row positions, a 4D mask, one forward for the whole block."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rollout.engine.attention_mask import build_attention_mask, to_additive
from rollout.engine.kv_cache import SlotKVCache

SUPPORTED_ATTENTION = ("sdpa", "eager")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class ModelRunner:
    """Owns a model and its slot KV cache; validates at construction that the model can be served.

    Args:
        model: a transformers causal LM (decoder-only, sdpa or eager attention, attention layers only).
        num_slots: rows held at once.
        num_positions: positions per row (max sequence length plus one step's block).
    """

    def __init__(self, model: PreTrainedModel, num_slots: int, num_positions: int):
        self.model = model
        config = model.config
        self.attn_implementation = _check_supported(model)
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is None:
            # one mask for every layer: a model-wide window (Mistral) is built into it
            self.layer_windows: dict[str, int | None] | None = None
            self.uniform_window = window
        else:
            self.layer_windows = {t: (window if t == "sliding_attention" else None) for t in set(layer_types)}
            self.uniform_window = None
        self.num_layers = len(layer_types) if layer_types is not None else config.num_hidden_layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache_keyword = cache_keyword(model)
        _probe(self)
        self.cache = SlotKVCache(self.num_layers, num_slots, num_positions)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def scratch_position(self) -> int:
        return self.cache.scratch_position

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int | None = None) -> None:
        self.cache.copy_rows(src, dst, num_positions)

    def prefill(self, row_start: int, prompts: list[list[int]]) -> Tensor:
        """Prefill `prompts` into slots `[row_start, row_start + len(prompts))`; return last logits `[rows, V]`.

        Left padding puts every row's last prompt token at the same index, so only that position reaches the
        LM head (a prefill never computes logits for every prompt token).
        """
        width = max(len(p) for p in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        positions = torch.zeros(len(prompts), width, dtype=torch.long)
        write_positions = torch.full((len(prompts), width), self.scratch_position, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            pad = width - len(prompt)
            input_ids[row, pad:] = torch.tensor(prompt)
            positions[row, pad:] = torch.arange(len(prompt))
            write_positions[row, pad:] = torch.arange(len(prompt))
        valid = write_positions != self.scratch_position
        prefix_lengths = torch.zeros(len(prompts), dtype=torch.long)
        logits = self.forward(
            row_start,
            *self._to_device(input_ids, positions, write_positions, valid, prefix_lengths),
            kv_len=width,
            last_only=True,
        )
        return logits[:, 0]

    def decode(
        self,
        row_start: int,
        input_ids: Tensor,
        num_inputs: list[int] | Tensor,
        cache_lens: list[int] | Tensor,
        depths: Tensor | None = None,
        ancestors: Tensor | None = None,
    ) -> Tensor:
        """Feed each row `num_inputs[i]` tokens (`input_ids [rows, S]`, right-padded) after its `cache_lens[i]`
        committed ones; return logits `[rows, S, V]`. Token s is written at position `cache_lens[i] + s`; the
        caller commits by raising its lengths. The counts come as lists or `[rows]` int64 host tensors (read during
        the call only).

        Without `depths`/`ancestors` the tokens form a causal chain. For a token tree, `depths [rows, S]` gives
        each node's depth (position id = cache length + depth) and `ancestors [rows, S, S]` which nodes it sees.
        """
        width = input_ids.shape[1]
        offsets = torch.arange(width)
        lens, counts = torch.as_tensor(cache_lens), torch.as_tensor(num_inputs)  # host tensors or lists
        valid = offsets[None, :] < counts[:, None]
        slots = lens[:, None] + offsets
        positions = torch.where(valid, lens[:, None] + (offsets if depths is None else depths), 0)
        write_positions = torch.where(valid, slots, self.scratch_position)
        kv_len = int((lens + counts).max())
        tensors = self._to_device(positions, write_positions, valid, lens)
        if ancestors is not None:
            ancestors = ancestors.to(self.device)
        return self.forward(row_start, input_ids.to(self.device), *tensors, kv_len=kv_len, ancestors=ancestors)

    def _to_device(self, *tensors: Tensor) -> list[Tensor]:
        return [t.to(self.device, non_blocking=True) for t in tensors]

    def forward(
        self,
        row_start: int,
        input_ids: Tensor,  # [rows, S]
        positions: Tensor,  # [rows, S]
        write_positions: Tensor,  # [rows, S]; padding tokens point at the scratch position
        valid: Tensor,  # [rows, S] bool
        prefix_lengths: Tensor,  # [rows]
        kv_len: int,
        ancestors: Tensor | None = None,  # [rows, S, S] bool, None = causal chain
        last_only: bool = False,
        cache: SlotKVCache | None = None,
    ) -> Tensor:
        """One forward over slots `[row_start, row_start + rows)`. Returns logits `[rows, S, V]`, or `[rows, 1, V]`
        for the last position only (left-padded prefill, where every row's last token is at S - 1)."""
        cache = self.cache if cache is None else cache
        masks = {}
        windows = self.layer_windows if self.layer_windows is not None else {None: self.uniform_window}
        for layer_type, window in windows.items():
            mask = build_attention_mask(prefix_lengths, write_positions, valid, positions, kv_len, ancestors, window)
            masks[layer_type] = mask if self.attn_implementation == "sdpa" else to_additive(mask, self.dtype)
        attention_mask = masks if self.layer_windows is not None else masks[None]
        cache.prepare(row_start, write_positions, kv_len)
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                attention_mask=attention_mask,
                use_cache=True,
                **{self.cache_keyword: cache},
                logits_to_keep=1 if last_only else 0,
            )
        finally:
            cache.finish()
        return out.logits


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


def _check_supported(model: PreTrainedModel) -> str:
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


def _probe(runner: ModelRunner) -> None:
    """Run two tokens through a one-slot cache: every layer must write through it and the outputs must be finite.

    This catches what config checks cannot: a layer keeping state outside the cache, or a model that cannot take
    a per-layer-type mask mapping for its sliding-window layers (the window must be built into the mask).
    """
    cache = SlotKVCache(runner.num_layers, num_slots=1, num_positions=4)
    ids = torch.zeros(1, 2, dtype=torch.long, device=runner.device)
    pos = torch.arange(2, device=runner.device)[None]
    valid = torch.ones(1, 2, dtype=torch.bool, device=runner.device)
    prefix = torch.zeros(1, dtype=torch.long, device=runner.device)
    name = type(runner.model).__name__
    try:
        # eval mode as in generation: in train mode a model with gradient checkpointing turns its cache off
        with torch.no_grad(), eval_mode(runner.model):
            logits = runner.forward(0, ids, pos, pos, valid, prefix, kv_len=2, cache=cache)
    except Exception as err:  # the model's own error says what it could not do with our cache or mask
        raise ValueError(f"{name} cannot run on the slot KV cache with 4D masks: {type(err).__name__}: {err}") from err
    written = sum(layer.is_initialized for layer in cache.layers)
    if written != runner.num_layers:
        raise ValueError(
            f"{name} wrote keys/values for {written} of {runner.num_layers} layers through the cache: some layers keep "
            "state elsewhere (recurrent or cross-layer caches are not supported)"
        )
    if not torch.isfinite(logits).all():
        raise ValueError(f"{name} produced non-finite logits on a probe forward with the slot KV cache")


@contextlib.contextmanager
def eval_mode(model: PreTrainedModel):
    """Generate in eval mode (no dropout) and hand the model back in the mode the trainer left it."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
