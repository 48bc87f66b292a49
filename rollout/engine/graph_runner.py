"""CUDA graphs for the paged decode and verification forward, one per (rows bucket, width).

An eager Hugging Face forward launches several hundred kernels, each costing host time: on an H100 a 1B policy's
decode forward took 14 ms on the host against 5 ms on the device (`scripts/probe_step.py`). A captured graph
launches them all at once. A decode step feeds each row its pending token plus up to K drafts; the width (K + 1 at
most) changes every step with the batch, so a graph is captured per width and per padded row count:

- rows are padded up to the next bucket (1, 2, 4, 8, then every 16 to 128, every 32 to 512, every 64 beyond);
  a padding row has no queries and no KV slots, so the kernels skip it and it writes nothing;
- a row narrower than the width (fewer drafts) is padded the same way inside the row: its extra columns are
  neither stored nor attended, and their logits are never read;
- the graph reads persistent device buffers (token ids, positions, slot mapping, block tables, lengths) that each
  step fills: its tokens, and its metadata in one asynchronous copy from pinned memory; it ends with the LM head (a
  plain bias-free linear layer in the hidden states' dtype) writing every position's logits into one persistent
  `[cells, vocab]` buffer, which a step reads before the next replay (stream order); no graph keeps an output of its
  own. An LM head of another kind runs eagerly after the replay, over the real rows, from a persistent buffer of
  hidden states;
- a verifying graph (`forward_verified`: chains under exact verification) goes on with the step's verification,
  `specdec.verify.verify_padded_chains` over every cell, the rows' race keys and temperatures staged with the
  metadata, and packs its results into one persistent buffer for the step's read. Other steps verify eagerly after a
  forward-only graph of their shape.

Graphs are captured largest first into one memory pool shared by all of them, in eval mode and inference mode, and
under the autocast the policy's forward computes in (a trainer's bf16 over float32 weights), so that a replayed step
computes in the precision of the eager prefills and trees. What a graph depends on besides its shape (the weights'
and KV pools' addresses, the adapters' state, the autocast dtype, the training flag, a user counter) is one
`GraphKey` (`rollout.engine.graph_key`), compared by `refresh` (whole once per `generate` or `add_requests` call,
its cheap part every `step`): a changed key drops the graphs and their pool, and each shape is captured again, into
a new pool, when a step first needs it. A step in train mode, a prefill, a tree, and rows or widths past the largest
bucket run eagerly. `capture=False` runs the same padded forward without capturing (how a CPU tests the padding
and buffers).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from rollout.engine.attention import paged_attention_for
from rollout.engine.compiled_forward import CompiledForward
from rollout.engine.graph_key import GraphKey, graph_key, tuner_layers
from rollout.engine.paged_cache import PagedKVCache, PagedStep
from rollout.engine.policy_mode import eval_mode
from rollout.engine.step_batch import StepBatch
from rollout_kernels.device_io import upload_into
from specdec.verify import RaceKeys, VerifyResult, verify_padded_chains

# config fields with which a causal LM changes its logits after the LM head (softcapping, scaling)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def row_buckets(max_rows: int) -> list[int]:
    """The padded row counts graphs are captured at, ascending, the last one `max_rows`."""
    sizes = [1, 2, 4, 8, *range(16, 129, 16), *range(160, 513, 32), *range(576, max_rows + 1, 64)]
    return [s for s in sizes if s < max_rows] + [max_rows]


class GraphRunner:
    """Captured forwards of a model over a paged cache (see the module docstring).

    Args:
        model: the causal LM (its decoder and LM head are used separately).
        cache: the paged KV cache the forwards read and write.
        max_width: the widest step (1 + the largest K).
        capture: False runs the padded forward eagerly (no CUDA needed).
        forward_autocast: the autocast dtype the policy's own forward enters (accelerate's wrapper), None without.
        compile: the decoder's forward through `torch.compile` (`rollout.engine.compiled_forward`).
        observe_autocast: called again for `forward_autocast` when the policy's forward is patched or unpatched
            (`accelerator.prepare` after the generator was built) and on `Generator.invalidate_graphs`; None keeps the
            value given.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        max_width: int,
        capture: bool = True,
        forward_autocast: torch.dtype | None = None,
        compile: bool = False,
        observe_autocast: Callable[[], torch.dtype | None] | None = None,
    ):
        self.model, self.cache, self.max_width, self.capture = model, cache, max_width, capture
        self.forward_autocast, self._observe_autocast = forward_autocast, observe_autocast
        self._compile = compile
        self.decoder = self.lm_head = self.compiled = None
        self.max_rows, self.table_width = cache.manager.tables.shape
        self.buckets = row_buckets(self.max_rows)
        self.device = cache.device
        cells = self.max_rows * max_width
        with torch.inference_mode(False):  # written by steps inside and outside inference mode
            self.ids = torch.zeros(cells, dtype=torch.long, device=self.device)
            # positions, slot mapping, block tables, cache lengths, query starts, query counts, and for verification
            # the rows' seeds, race positions and temperatures (float32 bits): one int64 buffer (`_regions`)
            rows = self.max_rows
            size = 2 * cells + rows * self.table_width + 6 * rows
            self.meta = torch.zeros(size, dtype=torch.long, device=self.device)
            # two host buffers, used in turn: a step launched ahead stages its metadata while the last step's copies
            # may still be queued behind the device's work (filled through numpy views of the same memory)
            pinned = self.device.type == "cuda"
            self._staging = [torch.zeros(size, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
            self._staging_host = [staging.numpy() for staging in self._staging]
            self._region_cache: dict[tuple[int, int], list[tuple[int, int, tuple[int, ...]]]] = {}
            hidden_size = model.config.get_text_config().hidden_size
            self.hidden = torch.zeros(cells, hidden_size, dtype=next(model.parameters()).dtype, device=self.device)
            self.logits: Tensor | None = None
            self._read_modules()
            # a verifying graph's results, packed as the step's read takes them: [rows, 1 + 2 width] at most
            self.packed = torch.zeros(self.max_rows * (1 + 2 * max_width), dtype=torch.long, device=self.device)
        self.head_in_graph = False  # the last forward ran the LM head into `self.logits`
        self._copied: list[torch.cuda.Event | None] = [None, None]  # the last copy out of each staging buffer
        self._turn = 0  # the staging buffer the next step fills
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (rows, width, verifying)
        self.pool = None
        # captures run on one side stream: the allocator caches blocks per stream, so the warm-up runs of all
        # captures reuse one stream's blocks
        self._stream = torch.cuda.Stream(self.device) if capture else None
        self._layers = tuner_layers(model)
        self._modules = list(model.modules())
        with eval_mode(model, self._modules):  # the state the graphs are captured from (eval mode, as steps run)
            self.key = self._key(epoch=0)
        self.recaptures: list[str] = []  # what changed, each time `refresh` dropped the graphs
        # the persistent buffers, then what the captures hold
        buffers = (self.ids, self.meta, self.hidden, self.logits, self.packed)
        self._buffer_bytes = sum(t.numel() * t.element_size() for t in buffers if t is not None)
        self.memory_bytes = self._buffer_bytes
        self.capture_seconds = 0.0
        self.error: str | None = None  # a failed capture: the reason, and the graphs are off
        config = model.config.get_text_config()
        scaled = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1.0)]
        if scaled:  # the LM head runs outside the graph as a plain projection: a model that transforms it runs eager
            self.error = f"{type(model).__name__} transforms its logits ({', '.join(scaled)})"

    # ---- what a step asks -----------------------------------------------------------------------------------------

    def bucket(self, num_rows: int) -> int:
        return next(b for b in self.buckets if b >= num_rows)

    def serves(self, num_rows: int, width: int) -> bool:
        """Whether a chain step of this shape runs here (False: eager). A step in train mode runs eagerly: its dropout
        masks are drawn anew at every forward."""
        fits = 0 < num_rows <= self.max_rows and width <= self.max_width
        return fits and self.error is None and not self.key.training

    def refresh(self, epoch: int = 0, full: bool = True) -> list[str]:
        """Compare the policy's state with the graphs' key (see `rollout.engine.graph_key`); on a change, drop the
        graphs (each shape is captured again when first needed). Returns what changed. `full=False` (a step of the
        public engine) keeps the tensors' addresses of the last full check and lists no modules anew: a few
        microseconds a module instead of milliseconds for a large policy."""
        if full:
            self._modules = list(self.model.modules())
        key = self._key(epoch, full)
        changed = key.changes(self.key)
        if self._observe_autocast is not None and {"forward", "epoch"} & set(changed):
            self.forward_autocast = self._observe_autocast()  # (a forward of two tokens: a rare change)
            key = self._key(epoch, full)
            changed = key.changes(self.key)
        if "tensors" in changed:  # new modules (an adapter injected, the LM head replaced) come with new tensors
            self._layers = tuner_layers(self.model)
            self._read_modules()
            key = self._key(epoch)
        if changed:
            self.drop_graphs()
            self.recaptures.append(", ".join(changed))
            self.key = key
        return changed

    def _read_modules(self) -> None:
        """The decoder and LM head the steps call, as the policy holds them now, and the logits buffer a plain
        projection head writes into in the graph (None for any other head: it runs as its module)."""
        decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
        if self._compile and decoder is not self.decoder:
            self.compiled = CompiledForward(decoder)
        self.decoder, self.lm_head = decoder, head
        cells = self.max_rows * self.max_width
        dtype = next(self.model.parameters()).dtype
        if self.hidden.dtype != dtype:  # a policy cast: the final hidden states an eager head reads come in its dtype
            with torch.inference_mode(False):
                self.hidden = torch.zeros(cells, self.hidden.shape[1], dtype=dtype, device=self.device)
        if isinstance(head, torch.nn.Linear) and head.bias is None:
            shape, dtype = (cells, head.out_features), head.weight.dtype
            if self.logits is None or tuple(self.logits.shape) != shape or self.logits.dtype != dtype:
                with torch.inference_mode(False):
                    self.logits = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            self.logits = None
        buffers = (self.ids, self.meta, self.hidden, self.logits, getattr(self, "packed", None))
        self._buffer_bytes = sum(t.numel() * t.element_size() for t in buffers if t is not None)

    def drop_graphs(self) -> None:
        """Drop every graph (each shape is captured again when a step first needs it) and their memory pool: the next
        capture takes a new pool (torch refuses to capture into one whose graphs are all gone), and the old pool's
        device memory goes back here, before the new graphs need as much again."""
        had_graphs = bool(self.graphs)
        self.graphs.clear()
        self.pool = None
        if had_graphs and self.capture:
            torch.cuda.empty_cache()  # (waits for the device: a policy change is rare, not a step's cost)
        self.memory_bytes = self._buffer_bytes

    def _key(self, epoch: int, full: bool = True) -> GraphKey:
        previous = None if full else self.key
        return graph_key(
            self.model, self._layers, self.device, self.forward_autocast, self.cache.generation, epoch, previous,
            self._modules,
        )  # fmt: skip

    def _autocast(self):
        """The autocast a forward of the policy runs under (see `refresh`); nothing without one."""
        dtype = self.key.autocast
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def forward(self, batch: StepBatch) -> Tensor:
        """Logits `[rows, width, V]` of one chain step (`batch`), computed as the eager paged forward computes them,
        with the rows padded to their bucket."""
        num_rows, width = batch.num_rows, batch.width
        self._run(batch, verifying=False)
        if self.head_in_graph:  # read before the next replay writes it (stream order)
            return self.logits[: num_rows * width].view(num_rows, width, -1)
        with self._autocast():
            return self.lm_head(self.hidden[: num_rows * width]).view(num_rows, width, -1)

    def forward_verified(self, batch: StepBatch, race: RaceKeys, temperatures: Tensor) -> VerifyResult:
        """One chain step and its exact verification (`specdec.verify.verify_padded_chains`) in one replay: the
        forward, the LM head over every position and the race of every node, with the rows' race keys and
        temperatures (`[rows]` host tensors) staged with the step's metadata. Returns the rows' results, packed for
        the step's read too: views of a buffer that the next verifying run (a replay, a capture's warm-up, an
        uncaptured body) overwrites, so a reader copies them before the next step runs (in stream order on a GPU)."""
        num_rows, width = batch.num_rows, batch.width
        temperature_bits = temperatures.to(torch.float32).view(torch.int32).to(torch.long)
        self._run(batch, verifying=True, race=[race.seeds, race.positions, temperature_bits])
        packed = self.packed[: num_rows * (1 + 2 * width)].view(num_rows, 1 + 2 * width)
        if self.device.type != "cuda":  # a host "read" is the tensor itself: the next step must not overwrite it
            packed = packed.clone()
        tokens, logprobs = packed[:, 1 : 1 + width], packed[:, 1 + width :].view(torch.float64)
        return VerifyResult(tokens, packed[:, 0], logprobs, packed=packed)

    def _run(self, batch: StepBatch, verifying: bool, race: list[Tensor] | None = None) -> None:
        """Stage the step's inputs (its race keys too, `race`, when `verifying`) and replay its shape's graph (run the
        padded body where none is captured)."""
        num_rows, width = batch.num_rows, batch.width
        padded = self.bucket(num_rows)
        # the tokens first: a step launched ahead feeds a view of the last step's results in `self.packed`, which a
        # capture's warm-up run below overwrites (it reads the ids, and stages padding metadata of its own)
        ids = self.ids[: padded * width].view(padded, width)
        ids[:num_rows].copy_(batch.input_ids)
        if padded > num_rows:
            ids[num_rows:].zero_()
        graph = self._graph(padded, width, verifying)
        slot_mapping = self.cache.write_plan(batch)
        tables = self.cache.tables(batch.row_start, num_rows)
        metadata = [batch.positions, slot_mapping, tables, batch.cache_lens, batch.query_start, batch.num_queries]
        self._stage(padded, width, metadata + (race or []))  # a forward-only step stages no race keys
        if graph is None:
            self._body(padded, width, verifying)
        else:
            graph.replay()

    # ---- the captured part ----------------------------------------------------------------------------------------

    def _regions(self, rows: int, width: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(offset, size, shape) of each part of the `rows` x `width` metadata in the buffers, in `_views` order and
        back to back from 0, so that a step's parts go to the device in one copy (each shape has its own layout: a
        graph reads the views of its shape)."""
        regions = self._region_cache.get((rows, width))
        if regions is None:
            shapes = [(rows, width), (rows, width), (rows, self.table_width)] + [(rows,)] * 6
            regions, offset = [], 0
            for shape in shapes:
                size = int(np.prod(shape))
                regions.append((offset, size, shape))
                offset += size
            self._region_cache[(rows, width)] = regions
        return regions

    def _views(self, rows: int, width: int) -> list[Tensor]:
        """The metadata buffer's views for `rows` x `width`: positions, slot mapping, tables, lengths, starts,
        counts, then the race's seeds, positions and temperature bits."""
        return [self.meta[offset : offset + size].view(shape) for offset, size, shape in self._regions(rows, width)]

    def _stage(self, rows: int, width: int, parts: list) -> None:
        """Fill the metadata buffer's `rows` x `width` views from host arrays or tensors (`parts`, in `_views` order,
        each of the real rows only; the views past the last part are left as they are): padding rows get no queries
        and slot -1, then one asynchronous copy of them all."""
        turn, self._turn = self._turn, 1 - self._turn
        copied = self._copied[turn]
        if copied is not None and not copied.query():
            copied.synchronize()  # the copies of two steps back still read this buffer (rarely: a step syncs)
        staging, end = self._staging_host[turn], 0
        for region, ((offset, size, shape), part) in enumerate(zip(self._regions(rows, width), parts)):
            staged = staging[offset : offset + size].reshape(shape)
            part = part.numpy() if isinstance(part, torch.Tensor) else np.asarray(part)  # (not Tensor.__array__)
            staged[: len(part)] = part
            staged[len(part) :] = -1 if region == 1 else 0  # padding: slot -1 (nothing stored), all else 0
            end = offset + size
        upload_into(self.meta[:end], self._staging[turn][:end])
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()

    def _body(self, rows: int, width: int, verifying: bool = False) -> None:
        """The forward over the buffers' `rows` x `width` views: every position's logits into `self.logits` (the LM
        head in the graph), or the final hidden states into `self.hidden`; `verifying`: then the step's exact
        verification, its results into `self.packed`."""
        positions, slot_mapping, tables, lens, starts, counts, seeds, race_positions, temperature_bits = self._views(
            rows, width
        )
        step = PagedStep(self.cache, slot_mapping, tables, lens, starts, counts)
        ids = self.ids[: rows * width].view(rows, width)
        with paged_attention_for(self.model), self._autocast():
            decoder = self.compiled if self.compiled is not None else self.decoder
            out = decoder(input_ids=ids, position_ids=positions, use_cache=False, rollout_step=step)
        hidden = out.last_hidden_state.reshape(rows * width, -1)
        # in the graph only where it computes what the eager head would: in the weights' dtype, under no other autocast
        same_dtype = self.logits is not None and hidden.dtype == self.logits.dtype
        self.head_in_graph = same_dtype and self.key.autocast in (None, self.logits.dtype)
        if self.head_in_graph:
            torch.mm(hidden, self.lm_head.weight.t(), out=self.logits[: rows * width])
        elif not verifying:  # the eager head reads them after the replay
            self.hidden[: rows * width].copy_(hidden)
        if not verifying:
            return
        if self.head_in_graph:
            logits = self.logits[: rows * width]
        else:  # the head the eager step runs, in the graph (over the padding rows too)
            with self._autocast():
                logits = self.lm_head(hidden)
        fed = torch.arange(width, device=self.device)[None, :] < counts[:, None]
        temperatures = temperature_bits.to(torch.int32).view(torch.float32)
        result = verify_padded_chains(
            logits, torch.where(fed, ids, -1), temperatures, RaceKeys(seeds, race_positions)
        )  # fmt: skip
        packed = self.packed[: rows * (1 + 2 * width)].view(rows, 1 + 2 * width)
        packed[:, 0] = result.num_emitted
        packed[:, 1 : 1 + width] = result.output_token_ids
        packed[:, 1 + width :] = result.logprobs.view(torch.long)

    def _graph(self, rows: int, width: int, verifying: bool) -> torch.cuda.CUDAGraph | None:
        """The graph of this shape (with verification or not), captured now if it is missing; None where graphs are
        not captured."""
        if not self.capture or self.error is not None:
            return None
        if self.cache.generation != self.key.pools:  # pools reallocated mid-call: the graphs read stale ones
            self.refresh(self.key.epoch, full=False)
        graph = self.graphs.get((rows, width, verifying))
        return graph if graph is not None else self._capture(rows, width, verifying)

    def capture_all(self, max_rows: int | None = None, verifying: bool = False) -> None:
        """Capture every bucket up to `max_rows` at every width, largest first (they share one memory pool), then
        hand back what the warm-up runs left cached; `verifying`: the graphs that verify too (`forward_verified`)."""
        if self.capture:
            torch.cuda.empty_cache()
            before, held = torch.cuda.memory_reserved(self.device), self.memory_bytes
        for rows in sorted((b for b in self.buckets if max_rows is None or b <= self.bucket(max_rows)), reverse=True):
            for width in range(self.max_width, 0, -1):
                self._graph(rows, width, verifying)
        if self.capture:
            torch.cuda.empty_cache()
            self.memory_bytes = held + torch.cuda.memory_reserved(self.device) - before

    def _capture(self, rows: int, width: int, verifying: bool) -> torch.cuda.CUDAGraph | None:
        """Capture the forward at this shape (after one eager run on a side stream, which compiles the kernels)
        with every row padding, so that nothing is written; None, and the graphs off, if capture fails."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self._stage(rows, width, [np.zeros((0, width))] * 2 + [np.zeros((0, self.table_width))] + [np.zeros(0)] * 6)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        try:
            # inference mode: with autograd on, every layer's activations were kept for a backward until the
            # forward returned, and the pool grew by them (13 GB for 24 graphs of a 1B model at up to 512 rows);
            # eval mode: a trainer builds the generator with its policy in train mode, and dropout captured in a
            # graph would be replayed in every decode step
            with torch.inference_mode(), eval_mode(self.model), torch.cuda.stream(stream):
                self._body(rows, width, verifying)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph.capture_begin(pool=self.pool)
                try:
                    self._body(rows, width, verifying)
                finally:
                    graph.capture_end()
        except Exception as err:  # noqa: BLE001 - any capture failure: run eagerly, said once
            self.error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            torch.cuda.current_stream(self.device).wait_stream(stream)
            del graph
            self.drop_graphs()  # what the captures held goes back to the eager steps (an OOM left it held)
            torch.cuda.empty_cache()  # (the failed capture's own, where it was the first)
            warnings.warn(f"CUDA graph capture failed, decoding eagerly: {self.error}", RuntimeWarning, stacklevel=2)
            return None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graphs[(rows, width, verifying)] = graph
        self.memory_bytes += torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds += time.perf_counter() - start
        return graph
