"""A fixed-size slot KV cache that transformers models write into and read from.

Each layer holds `[num_slots, H_kv, T_alloc, D]` key and value buffers. A forward pass works on a contiguous range
of slots (the generator keeps its active rows packed at the front), writes the new tokens' keys and values at
per-token slot positions chosen by the caller, and reads back a `[rows, H_kv, kv_len, D]` view. The attention mask,
built by the caller, decides which of those positions each query sees; positions past a row's committed length
are garbage that the mask hides and a later step overwrites, so rollback is lowering a length.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from rollout.engine.attention_mask import MaskSettings
from rollout.engine.step_batch import StepBatch
from rollout_kernels.device_io import upload
from rollout_kernels.kv_compact import compact_kv_, compact_kv_ref_


class SlotLayer(CacheLayerMixin):
    """One layer's buffers; allocated lazily on first write so any head count or head size fits."""

    is_sliding = False

    def __init__(self, cache: SlotKVCache):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        shape_k = (self.cache.num_slots, key_states.shape[1], self.cache.capacity + 1, key_states.shape[3])
        shape_v = (self.cache.num_slots, value_states.shape[1], self.cache.capacity + 1, value_states.shape[3])
        # zeros, never empty: a masked NaN still poisons attention (0 x NaN)
        self.keys = torch.zeros(shape_k, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(shape_v, dtype=value_states.dtype, device=value_states.device)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write `[rows, H, S, D]` states at the prepared slots; return `[rows, H, kv_len, D]` views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif (key_states.dtype, value_states.dtype) != (self.keys.dtype, self.values.dtype):
            # the policy cast since, or a caller's autocast put on or taken off (under autocast, keys leave the rotary
            # embedding in float32 and values the projection in bfloat16): what rows in flight hold is cast along
            self.keys, self.values = self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        step = self.cache.step
        assert step is not None, "expected SlotKVCache.prepare() before the forward pass"
        rows = slice(step.row_start, step.row_start + key_states.shape[0])
        # advanced indices [rows, S] around a slice put the S dim before H: write `[rows, S, H, D]`
        self.keys[rows][step.row_index, :, step.write_positions] = key_states.transpose(1, 2)
        self.values[rows][step.row_index, :, step.write_positions] = value_states.transpose(1, 2)
        return self.keys[rows, :, : step.kv_len], self.values[rows, :, : step.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        step = self.cache.step
        return (step.kv_len if step is not None else query_length), 0

    def get_seq_length(self) -> int:
        step = self.cache.step
        return step.kv_len if step is not None else 0

    def grow(self, capacity: int) -> None:
        """Room for `capacity` positions (and the scratch one after them), keeping what the rows hold."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], capacity + 1, old.shape[3]))
            new[:, :, : self.cache.capacity] = old[:, :, : self.cache.capacity]  # the old scratch column stays behind
            setattr(self, name, new)

    def get_max_length(self) -> int:
        return self.cache.num_positions

    get_max_cache_shape = get_max_length  # its name before transformers 5.x renamed it


class _Step:
    """Where the current forward writes: slot range start, `[rows, S]` positions, and the key length it reads."""

    def __init__(self, row_start: int, write_positions: Tensor, kv_len: int):
        self.row_start = row_start
        self.write_positions = write_positions
        self.row_index = torch.arange(write_positions.shape[0], device=write_positions.device)[:, None]
        self.kv_len = kv_len


class SlotKVCache(Cache):
    """`[num_slots, H_kv, capacity, D]` KV buffers per layer, the capacity growing with the longest row up to
    `num_positions`: the memory follows the tokens in flight, not the length cap.

    The committed length of each row is the caller's to track (the generator keeps it on the host, where the
    scheduler needs it); the cache only knows where the current forward writes and how far it reads.

    Args:
        num_layers: decoder layers of the model.
        num_slots: rows the cache can hold at once (the generator's `max_batch_size`).
        num_positions: positions per row at most (`max_seq_len` plus room for one step's drafts). One extra scratch
            position past the capacity receives the writes of padding tokens, so they never clobber real keys.
        initial_positions: the first capacity (doubled while a row needs more).
    """

    def __init__(self, num_layers: int, num_slots: int, num_positions: int, initial_positions: int = 256):
        self.num_slots = num_slots
        self.num_positions = num_positions
        self.capacity = min(num_positions, initial_positions)
        self.step: _Step | None = None
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    @property
    def scratch_position(self) -> int:
        return self.capacity

    def ensure_capacity(self, num_positions: int) -> None:
        """Room for `num_positions` positions per row (doubling, up to the cap); call before building a step's write
        positions, which point padding at the scratch position past the capacity."""
        assert num_positions <= self.num_positions, f"expected <= {self.num_positions} positions, got {num_positions}"
        if num_positions <= self.capacity:
            return
        capacity = min(self.num_positions, max(num_positions, 2 * self.capacity))
        for layer in self.layers:
            if layer.is_initialized:
                layer.grow(capacity)
        self.capacity = capacity

    def prepare(self, row_start: int, write_positions: Tensor, kv_len: int) -> None:
        """Set where the next forward writes.

        Args:
            row_start: first slot of the contiguous slot range the forward covers.
            write_positions: `[rows, S]` int64 position of each input token in its row; padding tokens point at
                `scratch_position`.
            kv_len: number of leading positions the attention reads (the mask's last dimension).
        """
        assert kv_len <= self.capacity, f"expected kv_len <= {self.capacity}: ensure_capacity first"
        assert row_start + write_positions.shape[0] <= self.num_slots, "expected the row range inside the slots"
        self.step = _Step(row_start, write_positions, kv_len)

    def finish(self) -> None:
        self.step = None

    def model_inputs(self, batch: StepBatch, positions: Tensor, masks: MaskSettings) -> dict:
        """The forward's keywords for `batch` (`positions`: its position ids on the device): this cache, set to write
        the new tokens (padding at the scratch position), and the 4D masks of what each query sees. `finish()` after
        the forward."""
        kv_len = batch.kv_len
        self.ensure_capacity(kv_len)  # before the padding is pointed at the scratch position past the capacity
        write_positions = torch.where(batch.valid, batch.cache_positions, self.scratch_position)
        device = batch.input_ids.device
        host = (batch.cache_lens, write_positions, batch.valid)
        prefix_lengths, write_positions, valid = (upload(t, device) for t in host)
        ancestors = upload(batch.ancestors, device) if batch.ancestors is not None else None
        attention_mask = masks.build(prefix_lengths, write_positions, valid, positions, kv_len, ancestors)
        self.prepare(batch.row_start, write_positions, kv_len)
        return {"attention_mask": attention_mask, "use_cache": True, masks.cache_keyword: self}

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int | None = None) -> None:
        """Copy slots `src` into slots `dst` (`[n]` each), keys and values; sources are read before any write.

        Used to fan a prefilled prompt out to its n samples and to keep the active rows packed at the front.
        `num_positions` limits the copy to the leading positions that can hold valid data.
        """
        end = self.capacity if num_positions is None else min(num_positions, self.capacity)
        buffers = [b for layer in self.layers if layer.is_initialized for b in (layer.keys, layer.values)]
        if not buffers:
            return
        if buffers[0].is_cuda:  # one gather (every source read first) and one scatter per buffer: no device sync
            src, dst = upload(src, buffers[0].device), upload(dst, buffers[0].device)  # pinned: no wait
            for buffer in buffers:
                view = buffer[:, :, :end]
                view.index_copy_(0, dst, view.index_select(0, src))
            return
        # on a CPU, block copies beat indexing: each run of consecutive destinations is one copy, from one source row
        # (a prompt fanned out to its samples) or from as many consecutive ones (rows packed); sources that are also
        # destinations are read into a block of their own first
        src_list, dst_list = src.tolist(), dst.tolist()
        overlap = bool(set(src_list) & set(dst_list))
        sources = sorted(set(src_list)) if overlap else []
        where = {row: i for i, row in enumerate(sources)}
        runs = _runs([where[s] for s in src_list] if overlap else src_list, dst_list)
        for buffer in buffers:
            view = buffer[:, :, :end]
            origin = view.index_select(0, torch.tensor(sources, device=view.device)) if overlap else view
            for s, d, length, fan in runs:
                block = origin[s : s + 1].expand(length, -1, -1, -1) if fan else origin[s : s + length]
                view[d : d + length].copy_(block)

    def compact_paths(self, rows: Tensor, base_positions: Tensor, accepted_nodes: Tensor) -> None:
        """Move each row's accepted token-tree path next to its root, in every layer.

        Args:
            rows: `[n]` slots; base_positions: `[n]` where each root (node 0) was written, node v at base + v;
            accepted_nodes: `[n, max_depth]` tree-local path, -1 padded. Node `accepted_nodes[i, j]` moves to
            `base + 1 + j`, after which the committed prefix is contiguous again.
        """
        op = compact_kv_ if accepted_nodes.is_cuda else compact_kv_ref_
        for layer in self.layers:
            if layer.is_initialized:
                op(layer.keys, layer.values, rows, base_positions, accepted_nodes)


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int, bool]]:
    """Split the row pairs into runs of consecutive destinations: `(first source, first destination, length, fan)`,
    `fan` when the run repeats one source, else its sources are consecutive too."""
    runs: list[list] = []
    for s, d in zip(src, dst):
        if runs:
            first_s, first_d, length, fan = runs[-1]
            if d == first_d + length:
                if (fan or length == 1) and s == first_s:
                    runs[-1][2:] = [length + 1, True]
                    continue
                if not fan and s == first_s + length:
                    runs[-1][2] = length + 1
                    continue
        runs.append([s, d, 1, False])
    return [tuple(run) for run in runs]
