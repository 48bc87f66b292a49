"""The scheduler: what the next step runs, decided before anything runs.

It owns the queue of waiting samples, the count of rows in flight and, with a paged KV cache, every block
computation: how many queued samples an admission takes (by free slots and free blocks, a prompt's samples
together), which rows a decode step gives up when blocks run short (the latest admitted), the longest context every
slot can hold, and the blocks a decode step's rows get before its forward (nano-vllm's `can_append`, then allocate).
The generator executes what it decides (`rollout.engine.admission` runs a prefill, `rollout.engine.decode_step` a
decode) and then postprocesses the step (the finished rows released).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from rollout.engine.sequence import Sequence
from rollout.engine.slots import SlotState


@dataclass
class ScheduledStep:
    """The next step: a prefill of `prefill_chunks` (the samples admitted, in chunks of prompt groups, one forward a
    chunk), or, when that is empty, a decode of every row in flight once the `preempted` rows have left."""

    prefill_chunks: list[list[list[Sequence]]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)  # rows given up, ascending (back at the queue's front)

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill_chunks)


class Scheduler:
    """The queue, the rows in flight (rows `[0, num_active)` of `slots`) and the KV blocks they need.

    Args:
        slots: the rows' state (read: lengths and sequences).
        runner: the target's model runner (its `cache` is a paged pool or a dense slot cache).
        max_batch_size: rows held at once.
        max_width: tokens a decode step feeds a row at most (the pending token plus the largest K).
        max_prefill_tokens: padded prompt tokens per prefill forward at most.
    """

    def __init__(self, slots: SlotState, runner, max_batch_size: int, max_width: int, max_prefill_tokens: int):
        self.slots = slots
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_width = max_width
        self.max_prefill_tokens = max_prefill_tokens
        self.queue: deque[Sequence] = deque()
        self.num_active = 0  # rows [0, num_active) are in flight
        # admit a prompt's queued samples together, one prefill for the group (`whole_groups`); off: as slots free up
        self.whole_groups = True
        self.num_admitted = 0  # admissions so far (their order: a pool short of blocks preempts the latest)
        self._highest_prompt_index = -1  # the numbers of prompts added with others in flight never go back

    @property
    def has_unfinished(self) -> bool:
        return bool(self.queue) or self.num_active > 0

    def add(self, sequences: list[Sequence], behind_those_here: bool) -> None:
        """Queue `sequences`; `behind_those_here`: rows queued or in flight stay, and the new prompts are numbered on
        from theirs (admission groups a prompt's samples by their index, so two calls' prompts never share one)."""
        if behind_those_here:  # numbered past every prompt so far, in flight, queued or handed back
            here = itertools.chain(self.queue, self.slots.sequences)
            taken = [seq.prompt_index for seq in here if seq is not None] + [self._highest_prompt_index]
            for seq in sequences:
                seq.prompt_index += max(taken) + 1
        elif not self.queue and self.num_active == 0:  # a call that starts over numbers from 0 again
            self._highest_prompt_index = -1
        self._highest_prompt_index = max([self._highest_prompt_index, *(seq.prompt_index for seq in sequences)])
        self.queue.extend(sequences)

    def schedule(self) -> ScheduledStep:
        """Admit queued samples while slots (and blocks) are free, else decode every row in flight, giving up the
        latest admitted rows first where a paged pool cannot hold a full-width step of all of them."""
        count = self.num_admissible() if self.queue else 0
        if count:
            admitted = [self.queue.popleft() for _ in range(count)]
            for seq in admitted:
                seq.admitted_at, self.num_admitted = self.num_admitted, self.num_admitted + 1
            return ScheduledStep(prefill_chunks=self._prefill_chunks(admitted))
        assert self.num_active > 0, "expected rows in flight: add_requests first"
        victims = self.preemption_victims()
        for row in victims:  # latest admitted first: the earliest of them ends at the queue's front
            seq = self.slots.sequences[row]
            seq.proposer_state = {}  # it starts over: the same seed draws the same tokens (keyed by position)
            self.queue.appendleft(seq)
        return ScheduledStep(preempted=sorted(victims))

    def _prefill_chunks(self, admitted: list[Sequence]) -> list[list[list[Sequence]]]:
        """The admitted samples grouped by prompt (a group shares one prefill), the groups in chunks of at most
        `max_prefill_tokens` padded prompt tokens (a single group may exceed it)."""
        groups: list[list[Sequence]] = []
        for seq in admitted:  # samples of one prompt are consecutive in the queue
            if groups and groups[-1][0].prompt_index == seq.prompt_index:
                groups[-1].append(seq)
            else:
                groups.append([seq])
        chunks: list[list[list[Sequence]]] = [[]]
        for group in groups:
            chunk = chunks[-1]
            longest = max([len(g[0].prompt) for g in chunk] + [len(group[0].prompt)])
            if chunk and longest * (len(chunk) + 1) > self.max_prefill_tokens:
                chunks.append(chunk := [])
            chunk.append(group)
        return chunks

    def can_run_ahead(self) -> bool:
        """Whether the next decode step may be launched before the last one is read (`rollout.engine.run_ahead`):
        nothing to admit (no queued sample, or no free slot for one) and no row to give up (a paged pool holds the
        step's blocks for every row)."""
        if self.queue and self.num_admissible():
            return False
        return not self.preemption_victims()

    # ---- blocks ----------------------------------------------------------------------------------------------------

    def num_admissible(self) -> int:
        """Queued samples the next admission takes: as many as free slots hold; with a paged cache, only as many as
        its blocks hold (a prompt's blocks once per group, a step's blocks per sample), after keeping a step's blocks
        for every row in flight; then, where the slots and not the blocks set the count, only whole groups of a
        prompt's queued samples (`whole_groups`: blocks free up only as rows finish, and a group waiting for a small
        pool's blocks was admitted one at a time, each group's tail drained before the next)."""
        count = self._fitting()
        if count < min(self.max_batch_size - self.num_active, len(self.queue)):
            return count
        return self.whole_groups_of(count)

    def whole_groups_of(self, count: int) -> int:
        """The first `count` queued samples cut back to whole groups (a group: a prompt's samples next to each other in
        the queue, which share one prefill). Admitted as slots free up, a GRPO group was prefilled two to three times
        over as many admissions, one for each slot or two freed (each an eager forward and, on a GPU, a break in the
        host's run ahead); waiting for the group's slots keeps fewer than a group's slots idle meanwhile. A group larger
        than a quarter of the slots is cut all the same (waiting for it would idle too many), and so is the first
        group when nothing is in flight."""
        queue = self.queue
        if not self.whole_groups or count == 0 or count >= len(queue):
            return count
        cut = queue[count].prompt_index
        if queue[count - 1].prompt_index != cut:
            return count
        start, end = count - 1, count + 1
        while start > 0 and queue[start - 1].prompt_index == cut:
            start -= 1
        while end < len(queue) and queue[end].prompt_index == cut:
            end += 1
        if end - start > self.max_batch_size // 4 or (start == 0 and self.num_active == 0):
            return count
        return start

    def _fitting(self) -> int:
        """Queued samples the free slots (and blocks) hold."""
        count = min(self.max_batch_size - self.num_active, len(self.queue))
        if not self.runner.paged:
            return count
        cache = self.runner.cache
        per_step = self._step_blocks(cache.block_size)
        budget = cache.free_blocks_after_growth() - self.num_active * per_step
        admitted, previous = 0, None
        for seq in itertools.islice(self.queue, count):
            cost = per_step + (-(-len(seq.prompt) // cache.block_size) if seq.prompt_index != previous else 0)
            if cost > budget:
                break
            budget -= cost
            admitted += 1
            previous = seq.prompt_index
        return admitted if admitted or self.num_active else 1  # nothing in flight: try one, a pool too small says so

    def _step_blocks(self, block_size: int) -> int:
        """The most blocks a row's full-width step takes: it writes at most this many block columns, each a new block
        or a shared one copied."""
        return -(-self.max_width // block_size) + 1

    def preemption_victims(self) -> list[int]:
        """The rows a decode step gives up first, latest admitted first: the fewest (never every row) after whose
        release the paged pool gives every other row blocks for a full-width step (its new blocks and the copies of
        shared blocks it writes). Nothing changes here: the blocks the victims free are counted, not freed."""
        num_rows = self.num_active
        if not self.runner.paged or num_rows < 2:
            return []
        cache = self.runner.cache
        growth = cache.max_blocks - cache.manager.num_blocks  # blocks the pool may still grow by
        if cache.manager.num_free + growth >= num_rows * self._step_blocks(cache.block_size):
            return []  # room whatever the rows hold (no per-row count)
        lens = self.slots.cache_len[:num_rows].numpy()
        if cache.manager.needed(np.arange(num_rows), lens + self.max_width, lens) <= cache.manager.num_free + growth:
            return []  # the common case: every row fits
        latest_first = sorted(range(num_rows), key=lambda row: self.slots.sequences[row].admitted_at, reverse=True)
        for count in range(1, num_rows - 1):
            released = np.array(latest_first[:count], dtype=np.int64)
            kept = np.setdiff1d(np.arange(num_rows), released)
            need, free = cache.manager.needed_after_release(released, kept, lens[kept] + self.max_width, lens[kept])
            if need <= free + growth:
                return latest_first[:count]
        return latest_first[: num_rows - 1]

    def reserve(self, num_queries: Tensor) -> None:
        """Give the rows in flight blocks for their next `num_queries[i]` tokens (`[rows]` int64, host) before the
        forward that writes them, and room for the copies of shared blocks they write into. The preemption above
        made room for a full-width step, so this never runs short."""
        if not self.runner.paged:
            return
        lens = self.slots.cache_len[: self.num_active].numpy()
        count = num_queries.numpy()
        writing = count > 0
        rows = np.arange(self.num_active)[writing]
        self.runner.cache.reserve(rows, lens[writing] + count[writing], lens[writing])

    def max_uniform_context(self) -> int:
        """The longest context every slot can hold at once, with room for a full-width step after it: the slots'
        positions, or less where a paged pool is smaller than every slot at full length."""
        num_positions = self.runner.num_positions - self.max_width
        if not self.runner.paged:
            return num_positions
        cache = self.runner.cache
        per_row = cache.max_blocks // self.max_batch_size - 2  # a step's new block and a copied shared one
        return max(1, min(num_positions, per_row * cache.block_size - self.max_width))
