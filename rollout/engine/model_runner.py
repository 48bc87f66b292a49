"""Runs a Hugging Face causal LM over slot rows: one forward for the whole block of new tokens.

Two KV layouts behind one interface. `slots`: a dense `[slots, H_kv, positions, D]` cache handed to the model as a
`transformers.Cache`, with a 4D mask carrying each row's visible keys (on a CPU the fastest form: attention reads
each row's keys in place). `paged`: block pools and block tables (`rollout.engine.paged_cache`), read by the attention
function the engine registers with transformers (`rollout.engine.attention`): no mask, no `Cache`, and KV memory that
follows the tokens in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rollout.engine.attention import paged_attention_for
from rollout.engine.attention_mask import MaskSettings
from rollout.engine.graph_key import current_autocast, observing_autocast
from rollout.engine.graph_runner import GraphRunner
from rollout.engine.kv_cache import SlotKVCache
from rollout.engine.memory_plan import DEFAULT_BLOCK_SIZE, kv_head_shape
from rollout.engine.model_checks import cache_keyword, check_supported, probe
from rollout.engine.paged_cache import PagedKVCache
from rollout.engine.step_batch import StepBatch
from rollout_kernels.device_io import upload
from specdec.verify import RaceKeys, VerifyResult

KV_LAYOUTS = ("auto", "paged", "slots")


class ModelRunner:
    """Owns a model and its KV cache; validates at construction that the model can be served.

    Args:
        model: a transformers causal LM (decoder-only, sdpa or eager attention, attention layers only).
        num_slots: rows held at once.
        num_positions: positions per row (max sequence length plus one step's block).
        kv_layout: "paged" (block pools, attention through the registered function), "slots" (a dense cache and
            4D masks) or "auto": paged on a GPU, slots on a CPU. A model whose attention layers do not call
            transformers' attention interface runs on slots, with a warning saying so.
        max_kv_blocks: the paged pool's planned size in blocks (default: every slot at `num_positions`).
        kv_byte_budget: the bytes a pool planned from the free memory may take (`memory_plan.pool_budget`): its blocks
            then follow the dtype it holds keys in (None: `max_kv_blocks` is fixed).
        block_size: positions per block of the paged pool.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        num_slots: int,
        num_positions: int,
        kv_layout: str = "slots",
        max_kv_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_byte_budget: int | None = None,
    ):
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout ({kv_layout!r}) must be one of {', '.join(KV_LAYOUTS)}")
        self.model = model
        config = model.config
        self.attn_implementation = check_supported(model)
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
        additive = None if self.attn_implementation == "sdpa" else self.dtype  # eager attention adds its mask
        self.masks = MaskSettings(self.layer_windows, self.uniform_window, additive, self.cache_keyword)
        self.num_slots, self.num_positions = num_slots, num_positions
        self.graphs: GraphRunner | None = None  # captured chain steps (`use_graphs`)
        self.verify_in_graph = True  # exact verification replays with the forward (False: after it; for comparisons)
        if kv_layout == "auto":
            kv_layout = "paged" if self.device.type == "cuda" else "slots"
        self._forward_seen = id(model.__dict__.get("forward"))  # the policy's own `forward` when last observed
        self._epoch_seen = 0  # and `Generator.invalidate_graphs`' counter then
        self._first_parameter = next(model.parameters())  # its dtype is the policy's (a cast keeps the object)
        self.forward_autocast = self.observe_autocast()
        if kv_layout == "paged" and not probe(self, "paged"):
            kv_layout = "slots"
        self.kv_layout = kv_layout
        if kv_layout == "paged":
            max_blocks = max_kv_blocks or num_slots * -(-num_positions // block_size)
            self.cache = self._paged_cache(num_slots, num_positions, max_blocks, block_size, kv_byte_budget)
        else:
            self.cache = SlotKVCache(self.num_layers, num_slots, num_positions)

    def observe_autocast(self) -> torch.dtype | None:
        """The autocast the decoder runs under when the policy is called (accelerate's wrapper around `forward`), None
        without: a forward of two tokens through a one-slot cache (which also checks the model can run on it)."""
        seen: list = []
        with observing_autocast(self.model, self.device, seen):
            probe(self, "slots")
        return seen[0] if seen else None

    def kv_dtype(self) -> torch.dtype:
        """The dtype the policy's attention computes in now: its autocast's (its own, or the caller's), else its
        parameters'. sdpa under a bf16 autocast attends in bf16, whatever dtype the projections and rotations left
        the keys in."""
        return current_autocast(self.device, self.forward_autocast) or self.dtype

    def follow_policy_dtype(self, epoch: int = 0, full: bool = True) -> bool:
        """Follow a policy cast (`model.to(torch.bfloat16)`) or run under another autocast since the runner was built:
        the eager attention's additive masks in its parameters' dtype, and a paged pool in the dtype its attention
        computes in (`kv_dtype`; the keys and values held are converted, and graphs of the old pools are captured
        again), as a runner built now would hold them. `epoch`: `Generator.invalidate_graphs`' counter (a change of it
        has the autocast observed again, as the graphs do); `full`: the parameters listed anew (once a call). Returns
        whether the parameters' dtype changed (the graphs then read the policy's modules again). About 1 us a step
        on the development CPU, 6 with `full`."""
        forward = id(self.model.__dict__.get("forward"))
        if forward != self._forward_seen or epoch != self._epoch_seen:  # accelerate's wrapper set or taken back since
            self._forward_seen, self._epoch_seen = forward, epoch
            self.forward_autocast = self.observe_autocast()
        if full:
            self._first_parameter = next(self.model.parameters())
        dtype = self._first_parameter.dtype
        cast = dtype != self.dtype
        if cast:
            self.dtype = dtype
            if self.masks.additive_dtype is not None:
                self.masks = dataclasses.replace(self.masks, additive_dtype=dtype)
        if self.paged:
            wanted = self.kv_dtype()
            if self.cache.dtype != wanted:
                self.cache.retype(wanted)
        return cast

    def use_graphs(self, max_width: int, capture: bool = True, compile: bool = False) -> GraphRunner:
        """Run chain decode steps of up to `max_width` tokens a row through CUDA graphs (paged layout only);
        `capture=False` runs the same padded forward eagerly; `compile`: the decoder's forward through
        `torch.compile`."""
        if not self.paged:
            raise ValueError("CUDA graphs need the paged KV layout (kv_layout='paged')")
        self.graphs = GraphRunner(
            self.model, self.cache, max_width, capture, self.forward_autocast, compile, self.observe_autocast
        )
        return self.graphs

    def _paged_cache(
        self, num_slots: int, num_positions: int, max_blocks: int, block_size: int, byte_budget: int | None
    ) -> PagedKVCache:
        """A pool allocated whole on a GPU (planned from its free memory), grown with the tokens on a CPU."""
        num_kv_heads, head_dim = kv_head_shape(self.model.config)
        initial = None if self.device.type == "cuda" else min(max_blocks, 4 * num_slots + 16)
        cache = PagedKVCache(
            self.num_layers, num_kv_heads, head_dim, self.kv_dtype(), self.device, num_slots, num_positions, max_blocks,
            initial, block_size, byte_budget,
        )  # fmt: skip
        cache.layer_windows = self.windows_by_layer()
        return cache

    def windows_by_layer(self) -> list[int | None]:
        """Each layer's sliding window, as the slot layout's masks apply it (from the config): the paged attention
        takes it where a model applies its window through the mask only and passes none to its attention."""
        layer_types = getattr(self.model.config, "layer_types", None)
        if layer_types is None:
            return [self.uniform_window] * self.num_layers
        return [self.layer_windows[t] for t in layer_types]

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def paged(self) -> bool:
        return self.kv_layout == "paged"

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int | None = None) -> None:
        """Row `dst[i]` holds what row `src[i]` holds (paged: the same blocks, shared; slots: a copy)."""
        self.cache.copy_rows(src, dst, num_positions)

    def reserve_positions(self, num_positions: int) -> None:
        """Room for rows of `num_positions` positions (the slot layout allocates it now, where a forward would grow
        it on demand; a paged pool grows block by block)."""
        if not self.paged:
            self.cache.ensure_capacity(num_positions)

    def close(self) -> None:
        """Drop the KV cache and the CUDA graphs (their buffers and memory pool go back once nothing else holds them);
        the runner serves no forward after it."""
        self.graphs = None
        self.cache = None

    def release_rows(self, start: int, stop: int) -> None:
        """Rows `[start, stop)` are no longer in flight: a paged cache frees the blocks no other row holds."""
        if self.paged:
            self.cache.release_rows(start, stop)

    def compact_paths(self, rows: Tensor, base_positions: Tensor, accepted_nodes: Tensor) -> None:
        """Move each row's accepted token-tree path next to its root (see `SlotKVCache.compact_paths`); the arguments
        are host tensors, uploaded without waiting for the device where the cache needs them there."""
        if not self.paged:
            rows, base_positions, accepted_nodes = (
                upload(t, self.device) for t in (rows, base_positions, accepted_nodes)
            )
        self.cache.compact_paths(rows, base_positions, accepted_nodes)

    def prefill(self, row_start: int, prompts: list[list[int]]) -> Tensor:
        """Prefill `prompts` into slots `[row_start, row_start + len(prompts))`; return last logits `[rows, V]`.

        Left padding puts every row's last prompt token at the same index, so only that position reaches the
        LM head (a prefill never computes logits for every prompt token).
        """
        width = max(len(p) for p in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        lengths = torch.tensor([len(p) for p in prompts])
        self.release_rows(row_start, row_start + len(prompts))  # a new prompt in these slots
        zeros = torch.zeros(len(prompts), dtype=torch.long)
        ids = upload(input_ids, self.device)
        return self.forward(StepBatch.build(row_start, ids, zeros, width - lengths, lengths, last_only=True))[:, 0]

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
        return self.forward(self._decode_batch(row_start, input_ids, num_inputs, cache_lens, depths, ancestors))

    def _decode_batch(self, row_start, input_ids, num_inputs, cache_lens, depths=None, ancestors=None) -> StepBatch:
        """A decode step's `StepBatch` (the arguments as `decode` takes them)."""
        lens, counts = torch.as_tensor(cache_lens), torch.as_tensor(num_inputs)  # host tensors or lists
        starts = torch.zeros(len(lens), dtype=torch.long)
        ids = upload(input_ids, self.device)
        return StepBatch.build(row_start, ids, lens, starts, counts, depths, ancestors)

    def verifies(self, num_rows: int, width: int) -> bool:
        """Whether a chain step of this shape replays its exact verification with its forward (`decode_verified`)."""
        return self.verify_in_graph and self.graphs is not None and self.graphs.serves(num_rows, width)

    def decode_verified(
        self, input_ids: Tensor, num_inputs: Tensor, cache_lens: Tensor, race: RaceKeys, temperatures: Tensor
    ) -> VerifyResult:
        """`decode` of chains from row 0 (`input_ids [rows, S]`, `num_inputs [rows]` and `cache_lens [rows]` host
        int64) and their exact verification (`specdec.verify.verify_padded_chains`, each row's race keys and its
        temperature `[rows]` on the host) in one replay of the graph runner's; only where `verifies`."""
        batch = self._decode_batch(0, input_ids, num_inputs, cache_lens)
        return self.graphs.forward_verified(batch, race, temperatures)

    def forward(self, batch: StepBatch, cache: SlotKVCache | PagedKVCache | None = None) -> Tensor:
        """One forward over `batch` (`rollout.engine.step_batch`): a replayed CUDA graph for a chain step it serves,
        else the model, with the cache's keywords. Returns logits `[rows, S, V]`, or `[rows, 1, V]` for the last
        column only (a left-padded prefill)."""
        cache = self.cache if cache is None else cache
        graphs = self.graphs  # None until `use_graphs` (and during the constructor's probe, before `self.cache`)
        if graphs is not None and cache is self.cache and batch.is_chain_step and graphs.serves(*batch.input_ids.shape):
            return graphs.forward(batch)
        positions = upload(batch.positions, self.device)
        inputs = cache.model_inputs(batch, positions, self.masks)  # a paged step, or a slot cache and 4D masks
        paged = isinstance(cache, PagedKVCache)
        try:
            with paged_attention_for(self.model) if paged else contextlib.nullcontext():
                out = self.model(
                    input_ids=batch.input_ids, position_ids=positions, logits_to_keep=1 if batch.last_only else 0,
                    **inputs,
                )  # fmt: skip
        finally:
            cache.finish()
        return out.logits
