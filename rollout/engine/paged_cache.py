"""A paged KV cache: per layer a pool of fixed-size blocks, rows holding blocks through a `BlockManager`.

Each forward (a `StepBatch`) becomes a `PagedStep`: where every new token's key and value go (slot mapping), each
row's block table, committed length and new tokens; the attention function registered with transformers
(`rollout.engine.attention`) stores and attends through it, so no mask and no `transformers.Cache` is involved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from rollout.engine.block_manager import BlockManager, OutOfBlocks
from rollout.engine.memory_plan import DEFAULT_BLOCK_SIZE
from rollout.engine.step_batch import StepBatch
from rollout_kernels.device_io import host, upload


@dataclass
class PagedStep:
    """One forward's metadata, on the model's device; `rows` of `S` columns, row r's new tokens at columns
    `[query_start[r], query_start[r] + num_queries[r])` after its `cache_lens[r]` committed ones."""

    cache: PagedKVCache
    slot_mapping: Tensor  # [rows, S] int64 pool slot of each column's token, -1 for padding
    block_tables: Tensor  # [rows, max blocks of the step] int64
    cache_lens: Tensor  # [rows] int64
    query_start: Tensor  # [rows] int64
    num_queries: Tensor  # [rows] int64
    depths: Tensor | None = None  # [rows, S] int64 a tree's node depths (None: chains)
    ancestors: Tensor | None = None  # [rows, S, S] bool which nodes each node sees (None: chains)
    masks: dict = field(default_factory=dict)  # the torch path's visible-key masks, by window: built once a step


class PagedKVCache:
    """Block pools of `num_layers` layers, `[num_blocks, block_size, num_kv_heads, head_dim]` each, and the block
    tables of `num_slots` rows.

    Args:
        max_blocks: the planned pool size in blocks (see `rollout.engine.memory_plan`).
        initial_blocks: blocks allocated at once; the pool grows (doubling, up to `max_blocks`) when rows need more.
            A GPU allocates the whole plan at once; a CPU grows with the tokens in flight.
        num_positions: the most positions a row may hold (its table's width).
        byte_budget: for a pool planned from the free memory, the bytes it may take (see `memory_plan.pool_budget`):
            its size in blocks then follows the dtype it holds (`max_blocks` in the weights' dtype, twice as many in
            bf16 over float32 weights), up to every slot's blocks, and changes with `retype`. None: `max_blocks` is
            fixed.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_slots: int,
        num_positions: int,
        max_blocks: int,
        initial_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        byte_budget: int | None = None,
    ):
        self.block_size = block_size
        self.device = device
        self.shape = (num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.byte_budget = byte_budget
        self.row_blocks = -(-num_positions // block_size)  # one row's at most: a budgeted pool never holds fewer
        self.every_slot = num_slots * self.row_blocks  # every row's at most: a budgeted pool never holds more
        self.whole = initial_blocks is None  # allocated whole at its planned size (a GPU's), not grown with the rows
        self.max_blocks = max_blocks if byte_budget is None else self._budgeted_blocks(dtype)
        first = self.max_blocks if self.whole else min(self.max_blocks, initial_blocks)
        self.manager = BlockManager(first, block_size, num_slots, self.row_blocks)
        pool = (first, block_size, num_kv_heads, head_dim)
        # zeros, never empty: a masked NaN still poisons attention (0 x NaN) on the torch path
        self.k_pools = [torch.zeros(pool, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(pool, dtype=dtype, device=device) for _ in range(num_layers)]
        self.generation = 0  # raised when the pools are reallocated (a captured graph holds their addresses)
        self.layer_windows: list[int | None] = [None] * num_layers  # each layer's sliding window (set by the runner)

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pools[0].dtype

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one block's keys and values in every layer, held in `dtype`."""
        return 2 * self.num_layers * self.block_size * math.prod(self.shape) * dtype.itemsize

    def _budgeted_blocks(self, dtype: torch.dtype) -> int:
        """What a budgeted pool's bytes hold in `dtype`, up to every slot's blocks (and one row's at least)."""
        return max(self.row_blocks, min(self.byte_budget // self.block_bytes(dtype), self.every_slot))

    def retype(self, dtype: torch.dtype) -> None:
        """Hold keys and values in `dtype` from now on, those held converted (the policy was cast, or now runs under
        another autocast: the attention computes in the dtype its own would). The pools are new tensors. A pool
        planned from the free memory (`byte_budget`) holds as many blocks as its bytes do in `dtype`: more in a
        narrower one (allocated at once where the pool is allocated whole), fewer in a wider one, the blocks past
        the last one a row holds dropped first (a float32 -> bf16 -> float32 round trip takes the memory planned
        back, not twice it). A device out of memory for the wider pools leaves them in their dtype and raises."""
        old = self.dtype
        self.generation += 1  # whatever happens below, the pools' addresses change
        if self.byte_budget is not None and dtype.itemsize > old.itemsize:  # wider: fewer blocks first, in `old`
            keep = max(self._budgeted_blocks(dtype), self.manager.shrinkable_to())
            if keep < self.manager.num_blocks:
                for pools in (self.k_pools, self.v_pools):
                    for i, pool in enumerate(pools):
                        pools[i] = pool[:keep].clone()  # one layer at a time
                self.manager.shrink(keep)
                self.max_blocks = max(keep, self._budgeted_blocks(old))  # (if the conversion below fails)
        try:
            for pools in (self.k_pools, self.v_pools):
                for i, pool in enumerate(pools):
                    pools[i] = pool.to(dtype)  # one layer at a time: the old one goes before the next is made
        except torch.OutOfMemoryError as error:
            for pools in (self.k_pools, self.v_pools):
                for i, pool in enumerate(pools):
                    pools[i] = pool.to(old)
            wider = self.num_blocks * self.block_size * len(self.k_pools) * 2 * math.prod(self.shape)
            raise RuntimeError(
                f"the paged KV pool holds {old} and the policy now attends in {dtype}: its {self.num_blocks} blocks "
                f"need {wider * (dtype.itemsize - old.itemsize) / 2**30:.2f} GiB more than {self.device} has free; "
                "build the Generator for the policy as it is now (or set kv_pool_blocks lower)"
            ) from error
        if self.byte_budget is None:
            return
        self.max_blocks = max(self._budgeted_blocks(dtype), self.manager.num_blocks)
        if self.whole and self.max_blocks > self.manager.num_blocks:
            try:
                self._grow(self.max_blocks)
            except torch.OutOfMemoryError:  # the device's memory went elsewhere since the plan: as many as it has
                held = self.manager.num_blocks
                for pools in (self.k_pools, self.v_pools):
                    for i, pool in enumerate(pools):
                        pools[i] = pool[:held]  # (a layer grown before the failure: its first blocks)
                self.max_blocks = held

    def pools(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.k_pools[layer], self.v_pools[layer]

    # ---- rows ---------------------------------------------------------------------------------------------------

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int | None = None) -> None:
        """Row `dst[i]` holds what row `src[i]` holds: the blocks are shared, nothing is copied."""
        self.manager.share(host(src).numpy(), host(dst).numpy())

    def release_rows(self, start: int, stop: int) -> None:
        """Rows `[start, stop)` hold nothing any more (finished, moved away or preempted)."""
        if stop > start:
            self.manager.release(np.arange(start, stop))

    def free_blocks_after_growth(self) -> int:
        """Blocks a row could still get: free ones plus those the pool may grow by."""
        return self.manager.num_free + self.max_blocks - self.manager.num_blocks

    def reserve(self, rows: np.ndarray, num_positions: np.ndarray, write_from: np.ndarray | None = None) -> None:
        """Blocks for the first `num_positions[i]` positions of each row, growing the pool if it must (with
        `write_from`, also for the copies of shared blocks the rows will write from there on); raises OutOfBlocks
        (nothing changed) past the planned size."""
        manager = self.manager
        # a bound first (counting the shared blocks a write copies reads reference counts; the bound does not)
        if manager.needed_bound(rows, num_positions, write_from) > manager.num_free:
            needed = manager.needed(rows, num_positions, write_from)
            if needed > manager.num_free:
                self._grow(manager.num_blocks - manager.num_free + needed)
        manager.allocate(rows, num_positions)

    def _grow(self, wanted: int) -> None:
        if wanted > self.max_blocks:
            raise OutOfBlocks(f"{wanted} blocks needed, the pool holds at most {self.max_blocks}")
        size = min(self.max_blocks, max(wanted, 2 * self.manager.num_blocks))
        extra = size - self.manager.num_blocks
        for pools in (self.k_pools, self.v_pools):
            for i, pool in enumerate(pools):
                pools[i] = torch.cat([pool, pool.new_zeros((extra, *pool.shape[1:]))])
        self.manager.grow(size)
        self.generation += 1

    # ---- one forward ----------------------------------------------------------------------------------------------

    def model_inputs(self, batch: StepBatch, positions: Tensor, masks=None) -> dict:
        """The forward's keywords for `batch`: the step's metadata for the registered attention function (no mask, no
        `transformers.Cache`)."""
        return {"use_cache": False, "rollout_step": self.prepare(batch)}

    def finish(self) -> None:
        """Nothing to undo after a forward (the slot cache's counterpart forgets its step)."""

    def prepare(self, batch: StepBatch) -> PagedStep:
        """Blocks for the rows' new tokens (copying a shared block a row is about to write), and the step's metadata
        on the device."""
        slot_mapping = self.write_plan(batch)
        end = batch.cache_lens.numpy() + batch.num_queries.numpy()
        tables = self.tables(batch.row_start, len(end))[:, : max(int(self.manager.blocks_for(end).max(initial=1)), 1)]
        return PagedStep(
            self,
            upload(torch.from_numpy(slot_mapping), self.device),
            upload(torch.from_numpy(np.ascontiguousarray(tables)), self.device),
            upload(batch.cache_lens, self.device),
            upload(batch.query_start, self.device),
            upload(batch.num_queries, self.device),
            None if batch.depths is None else upload(batch.depths, self.device),
            None if batch.ancestors is None else upload(batch.ancestors, self.device),
        )

    def write_plan(self, batch: StepBatch) -> np.ndarray:
        """Blocks for the rows' new tokens (a decode step's were reserved before the forward), a shared block a row
        is about to write copied to a block of its own (on the device, in stream order); returns the pool slot of
        each column's token `[rows, width]` (-1 for padding)."""
        rows = np.arange(batch.row_start, batch.row_start + batch.num_rows)
        lens, count = batch.cache_lens.numpy(), batch.num_queries.numpy()
        end = lens + count
        writing = count > 0
        rows_w, lens_w, end_w = rows[writing], lens[writing], end[writing]
        self.reserve(rows_w, end_w, lens_w)  # new blocks, and room for the shared ones copied (a decode step's: there)
        sources, targets = self.manager.writable(rows_w, lens_w, end_w)
        if len(sources):
            src = upload(torch.from_numpy(sources), self.device)
            dst = upload(torch.from_numpy(targets), self.device)
            for pool in (*self.k_pools, *self.v_pools):
                pool[dst] = pool[src]
        return self.manager.slots(rows, batch.cache_positions.numpy())

    def tables(self, row_start: int, num_rows: int) -> np.ndarray:
        """`[rows, max blocks per row]` the block tables of rows `[row_start, row_start + num_rows)` (a view: read it
        before the next change)."""
        return self.manager.tables[row_start : row_start + num_rows]

    def compact_paths(self, rows: Tensor, base_positions: Tensor, accepted_nodes: Tensor) -> None:
        """Move each row's accepted token-tree path next to its root, within the row's blocks, in every layer: node
        `accepted_nodes[i, j]` (written at `base + node`) goes to `base + 1 + j`. Sources are read before writing.
        Every argument is on the host (the step read the accepted nodes with its results): no read of the device."""
        nodes = accepted_nodes.numpy()
        base = base_positions.numpy()[:, None]
        row_index, depth = np.nonzero(nodes > np.arange(nodes.shape[1])[None, :] + 1)  # node j + 1 is in place
        if not len(row_index):
            return
        owners = rows.numpy()[row_index]
        src = self.manager.slots(owners, (base[row_index, 0] + nodes[row_index, depth])[:, None])[:, 0]
        dst = self.manager.slots(owners, (base[row_index, 0] + 1 + depth)[:, None])[:, 0]
        src, dst = upload(torch.from_numpy(src), self.device), upload(torch.from_numpy(dst), self.device)
        for pool in (*self.k_pools, *self.v_pools):
            flat = pool.view(-1, *self.shape)
            flat[dst] = flat[src]
