"""Which KV blocks each row holds: fixed-size blocks of a pool, a block table per slot row, reference counts.

A row's cache position p lives in block `tables[row, p // block_size]`. Rows share blocks by reference: the n samples
of a GRPO group hold their prompt's blocks (prefilled once), and a row moved to another slot takes its table along.
A shared block is copied on a row's first write into it (`writable`). A block returns to the free list when no row
holds it; nothing in the pool moves when a row finishes. All bookkeeping is vectorised over rows on the host (numpy).
"""

from __future__ import annotations

import numpy as np


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than a request needs (the caller preempts rows or waits)."""


class BlockManager:
    """Block tables of `num_slots` rows over a pool of `num_blocks` blocks of `block_size` positions.

    Args:
        num_blocks: blocks in the pool (it may grow: `grow`).
        block_size: positions per block.
        num_slots: rows (the generator's slots).
        max_blocks_per_row: table width: positions a row may reach, over `block_size`, rounded up.
    """

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, max_blocks_per_row: int):
        self.block_size = block_size
        self.num_blocks = 0
        self.refs = np.zeros(0, dtype=np.int32)  # rows holding each block
        self.free = np.zeros(0, dtype=np.int64)  # a stack: free[:num_free] are free
        self.num_free = 0
        # unused entries hold block 0, a valid index (a reader masks them out by length)
        self.tables = np.zeros((num_slots, max_blocks_per_row), dtype=np.int64)
        self.num_row_blocks = np.zeros(num_slots, dtype=np.int64)
        # a row's blocks at table columns >= shared_below[row] are held by that row alone (those below may be shared):
        # a write past it copies nothing, so a step's bookkeeping looks up no reference count there
        self.shared_below = np.zeros(num_slots, dtype=np.int64)
        self.grow(num_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def grow(self, num_blocks: int) -> None:
        """Add blocks `[self.num_blocks, num_blocks)` to the pool (the caller grows its tensors to match)."""
        added = np.arange(num_blocks - 1, self.num_blocks - 1, -1, dtype=np.int64)  # taken lowest first
        free = np.zeros(num_blocks, dtype=np.int64)  # room for every block: all may come back
        free[: self.num_free] = self.free[: self.num_free]
        free[self.num_free : self.num_free + len(added)] = added
        self.free = free
        self.num_free += len(added)
        self.refs = np.concatenate([self.refs, np.zeros(len(added), dtype=np.int32)])
        self.num_blocks = num_blocks

    def shrinkable_to(self) -> int:
        """The fewest blocks the pool can shrink to: one past the highest block a row holds (0 when none is held)."""
        held = np.flatnonzero(self.refs)
        return int(held[-1]) + 1 if len(held) else 0

    def shrink(self, num_blocks: int) -> None:
        """Drop blocks `[num_blocks, self.num_blocks)`, none of them held (see `shrinkable_to`; the caller shrinks its
        tensors to match)."""
        assert self.shrinkable_to() <= num_blocks <= self.num_blocks, "a held block would be dropped"
        free = self.free[: self.num_free]
        kept = free[free < num_blocks]  # (in stack order)
        self.free = np.zeros(num_blocks, dtype=np.int64)
        self.free[: len(kept)] = kept
        self.num_free = len(kept)
        self.refs = self.refs[:num_blocks].copy()
        self.num_blocks = num_blocks
        self.tables[self.tables >= num_blocks] = 0  # entries past a row's blocks: valid indices still (see above)

    def blocks_for(self, num_positions: np.ndarray) -> np.ndarray:
        return -(-num_positions // self.block_size)

    def _take(self, count: int) -> np.ndarray:
        if count > self.num_free:
            raise OutOfBlocks(f"{count} blocks asked, {self.num_free} free of {self.num_blocks}")
        self.num_free -= count
        taken = self.free[self.num_free : self.num_free + count][::-1].copy()
        self.refs[taken] = 1
        return taken

    def _drop(self, blocks: np.ndarray) -> None:
        """One reference fewer to each of `blocks` (repeats allowed); those no row holds go back to the free list."""
        np.subtract.at(self.refs, blocks, 1)
        freed = np.unique(blocks[self.refs[blocks] == 0])
        self.free[self.num_free : self.num_free + len(freed)] = freed[::-1]
        self.num_free += len(freed)

    def allocate(self, rows: np.ndarray, num_positions: np.ndarray) -> None:
        """Give each of `rows` blocks for its first `num_positions[i]` positions (it keeps the ones it has). Raises
        OutOfBlocks, changing nothing, when the pool cannot."""
        have = self.num_row_blocks[rows]
        deficit = np.maximum(self.blocks_for(num_positions) - have, 0)
        total = int(deficit.sum())
        if total == 0:
            return
        if int(self.blocks_for(num_positions).max()) > self.tables.shape[1]:
            raise ValueError(f"a row asked for {int(num_positions.max())} positions, past its table's width")
        blocks = self._take(total)
        which = np.repeat(np.arange(len(rows)), deficit)
        first = np.cumsum(deficit) - deficit  # each row's first new block in `blocks`
        self.tables[rows[which], have[which] + np.arange(total) - first[which]] = blocks
        self.num_row_blocks[rows] = have + deficit

    def needed(self, rows: np.ndarray, num_positions: np.ndarray, write_from: np.ndarray | None = None) -> int:
        """Blocks `allocate(rows, num_positions)` would take from the pool, plus, with `write_from`, the copies
        `writable(rows, write_from, num_positions)` would make of shared blocks."""
        return self._needed(self.refs, rows, num_positions, write_from)

    def needed_after_release(
        self, released: np.ndarray, rows: np.ndarray, num_positions: np.ndarray, write_from: np.ndarray
    ) -> tuple[int, int]:
        """What `needed(rows, num_positions, write_from)` and `num_free` would be after `release(released)`, with
        nothing changed (a block the released rows shared with others is no longer copied on a write)."""
        if not len(released):
            return self.needed(rows, num_positions, write_from), self.num_free
        refs = self.refs.copy()
        held = np.arange(self.tables.shape[1])[None, :] < self.num_row_blocks[released][:, None]
        blocks = self.tables[released][held]
        np.subtract.at(refs, blocks, 1)
        freed = len(np.unique(blocks[refs[blocks] == 0]))
        return self._needed(refs, rows, num_positions, write_from), self.num_free + freed

    def needed_bound(self, rows: np.ndarray, num_positions: np.ndarray, write_from: np.ndarray | None = None) -> int:
        """At least `needed(rows, num_positions, write_from)`, without reading a reference count: the new blocks, and
        with `write_from` the copies' bound (`copies_bound`)."""
        bound = self._new_blocks(rows, num_positions)
        if write_from is not None:
            bound += self.copies_bound(rows, num_positions, write_from)
        return bound

    def _new_blocks(self, rows: np.ndarray, num_positions: np.ndarray) -> int:
        return int(np.maximum(self.blocks_for(num_positions) - self.num_row_blocks[rows], 0).sum())

    def _needed(self, refs: np.ndarray, rows, num_positions, write_from) -> int:
        total = self._new_blocks(rows, num_positions)
        if write_from is not None and self.may_copy(rows, write_from):
            for owners, column in self._written_columns(rows, write_from, num_positions):
                total += int((refs[self.tables[owners, column]] > 1).sum())
        return total

    def share(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Row `dst[i]` drops its blocks and holds those of row `src[i]` (sources read before any row changes)."""
        tables, counts = self.tables[src].copy(), self.num_row_blocks[src].copy()
        held = np.arange(tables.shape[1])[None, :] < counts[:, None]
        np.add.at(self.refs, tables[held], 1)  # before dropping: a row may share with itself
        self.shared_below[src] = counts  # every block of a source is shared now
        self.release(dst)
        self.tables[dst] = tables
        self.num_row_blocks[dst] = counts
        self.shared_below[dst] = counts

    def release(self, rows: np.ndarray) -> None:
        """Rows `rows` hold no block any more."""
        held = np.arange(self.tables.shape[1])[None, :] < self.num_row_blocks[rows][:, None]
        self._drop(self.tables[rows][held])
        self.num_row_blocks[rows] = 0
        self.shared_below[rows] = 0

    def writable(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Make the blocks holding positions `[start[i], end[i])` of each row its own: a block another row also holds
        is replaced by a fresh one. Returns (source blocks, fresh blocks) whose contents the caller copies. Blocks
        must be allocated already."""
        first, last = start // self.block_size, (end - 1) // self.block_size
        # columns [first, last] are the rows' own after this; where nothing past them may be shared, the shared ones
        # end below `first` now (a row's writes move forward: after its first, no column it writes is shared)
        below = self.shared_below[rows]
        lowered = np.where(below <= last + 1, np.minimum(below, first), below)
        if not (first < below).any():  # no row writes a column that may be shared
            self.shared_below[rows] = lowered
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        last = np.minimum(last, below - 1)
        span = int((last - first).max(initial=-1)) + 1
        sources, targets = [], []
        for offset in range(span):
            column = first + offset
            inside = column <= last
            blocks = self.tables[rows[inside], column[inside]]
            shared = self.refs[blocks] > 1
            if not shared.any():
                continue
            fresh = self._take(int(shared.sum()))
            old = blocks[shared]
            self.tables[rows[inside][shared], column[inside][shared]] = fresh
            # the last holders may all copy in the same call: a block none holds any more is freed (the caller
            # copies every source before any target is written, so its content is read first)
            self._drop(old)
            sources.append(old)
            targets.append(fresh)
        self.shared_below[rows] = lowered  # after the copies: a write short of blocks leaves them as they were
        if not sources:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(sources), np.concatenate(targets)

    def may_copy(self, rows: np.ndarray, write_from: np.ndarray) -> bool:
        """Whether a write from positions `write_from[i]` on may meet a block shared with another row (False: it
        copies nothing)."""
        return bool((write_from // self.block_size < self.shared_below[rows]).any())

    def copies_bound(self, rows: np.ndarray, num_positions: np.ndarray, write_from: np.ndarray) -> int:
        """At least the copies `writable(rows, write_from, num_positions)` makes, without reading a reference count:
        one per column written below each row's `shared_below`."""
        first = write_from // self.block_size
        last = np.minimum((num_positions - 1) // self.block_size, self.shared_below[rows] - 1)
        return int(np.maximum(last - first + 1, 0).sum())

    def _written_columns(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray):
        """The held blocks a write of positions `[start[i], end[i])` of each row touches where they may be shared
        (below `shared_below`): per column offset, the rows concerned and their table column (`[owners]`,
        `[owners]`)."""
        first = start // self.block_size
        last = np.minimum((end - 1) // self.block_size, self.num_row_blocks[rows] - 1)
        last = np.minimum(last, self.shared_below[rows] - 1)
        for offset in range(int((last - first).max(initial=-1)) + 1):
            column = first + offset
            inside = column <= last
            yield rows[inside], column[inside]

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """`[rows, S]` the pool slot of each `positions[i, s]` of row `rows[i]`; -1 where the position is < 0."""
        valid = positions >= 0
        safe = np.where(valid, positions, 0)
        blocks = self.tables[rows[:, None], safe // self.block_size]  # (not the rows' whole tables, then a gather)
        return np.where(valid, blocks * self.block_size + safe % self.block_size, -1)
