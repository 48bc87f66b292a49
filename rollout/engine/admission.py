"""Rows in and out of flight: admission (a prefill per prompt, shared by its samples), release of finished rows,
and, with a paged KV cache, admission by free blocks and preemption of the latest rows when blocks run short.

A mixin over the `Generator`'s state (queue, slots, runner, proposers); the generator is the only user.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from rollout.engine.sampling import Completion
from rollout.engine.sequence import Sequence
from rollout.engine.trace import StepRecord
from rollout_kernels.device_io import upload
from specdec.tree import layout_drafts
from specdec.verify import verify


class Admission:
    """Admit, release and preempt rows (see the module docstring)."""

    def _admit(self, count: int) -> StepRecord:
        """Move `count` queued sequences into free slots; one left-padded prefill per chunk of distinct prompts."""
        start = time.perf_counter()
        admitted = [self._queue.popleft() for _ in range(count)]
        for seq in admitted:
            seq.admitted_at = next(self._admissions)
        groups: list[list[Sequence]] = []
        for seq in admitted:  # samples of one prompt are consecutive in the queue
            if groups and groups[-1][0].prompt_index == seq.prompt_index:
                groups[-1].append(seq)
            else:
                groups.append([seq])
        chunk: list[list[Sequence]] = []
        num_emitted = num_prompts = 0
        for group in groups:
            longest = max([len(g[0].prompt) for g in chunk] + [len(group[0].prompt)])
            if chunk and longest * (len(chunk) + 1) > self.max_prefill_tokens:
                num_emitted += self._prefill(chunk)
                num_prompts += len(chunk)
                chunk = []
            chunk.append(group)
        if chunk:
            num_emitted += self._prefill(chunk)
            num_prompts += len(chunk)
        return StepRecord("prefill", num_prompts, 0, 0, 0, num_emitted, time.perf_counter() - start)

    def _prefill(self, groups: list[list[Sequence]]) -> int:
        """One forward over the groups' prompts; sample each sequence's first token. Returns the tokens kept."""
        prompts = [group[0].prompt for group in groups]
        row_start = self.num_active
        logits = self.runner.prefill(row_start, prompts)
        sequences = [seq for group in groups for seq in group]
        # row indices stay on the host (the caches and proposers take them there: no device read-back)
        group_of = torch.tensor([g for g, group in enumerate(groups) for _ in group])
        width = max(len(p) for p in prompts)
        if len(sequences) > len(groups):  # fan each prompt's KV out to its samples' slots
            dst = torch.arange(row_start, row_start + len(sequences))
            self.runner.copy_rows(row_start + group_of, dst, num_positions=width)
        if self.proposers is not None and self.proposers.needs_prefill:
            self.proposers.prefill(row_start, prompts, group_of, [seq.proposer_state for seq in sequences])
        self.slots.admit(row_start, sequences)
        self.num_active += len(sequences)
        rows = slice(row_start, row_start + len(sequences))
        uniforms = self._uniforms(rows, torch.zeros(len(sequences), dtype=torch.long))
        result = verify(
            logits[upload(group_of, self.device)],
            torch.zeros(len(sequences), dtype=torch.long, device=self.device),
            layout_drafts([0] * len(sequences), None),
            None,
            self.slots.row_sampling(rows, self.device),
            upload(uniforms[:, 0].contiguous(), self.device),
            upload(uniforms[:, -1].contiguous(), self.device),
            self._race_keys(rows),
        )
        kept, *_ = self._commit(rows, result, in_cache=False)
        return kept

    def _release_finished(self) -> list[Completion]:
        """Hand back the finished rows' completions and keep the active rows packed at the front."""
        s = self.slots
        finished = torch.nonzero(s.finished[: self.num_active])[:, 0].tolist()
        if not finished:
            return []
        done = []
        for row in finished:
            seq = s.sequences[row]
            seq.token_ids, seq.logprobs = s.completion_of(row)
            seq.finish_reason = "stop" if bool(s.stopped[row]) else "length"
            done.append(seq.completion())
        if self.proposers is not None:
            self.proposers.finish(finished, s.token_ids, s.num_tokens[finished].tolist())
        self._remove_rows(finished)
        return done

    def _remove_rows(self, rows: list[int]) -> None:
        """Take `rows` (ascending) out of flight: the last active rows move into the holes (a paged cache moves their
        block tables, a slot cache their KV), and the slots left behind hold nothing."""
        s = self.slots
        remaining = self.num_active - len(rows)
        leaving = set(rows)
        holes = [i for i in rows if i < remaining]
        movers = [i for i in range(remaining, self.num_active) if i not in leaving]
        assert len(holes) == len(movers), f"expected as many holes as movers, got {len(holes)} and {len(movers)}"
        if movers:
            longest = min(int(s.num_tokens[movers].max()) + 1, self.runner.num_positions)
            src, dst = torch.tensor(movers), torch.tensor(holes)  # host: the caches and proposers take them there
            self.runner.copy_rows(src, dst, num_positions=longest)
            if self.proposers is not None:
                self.proposers.copy_rows(src, dst, longest)
            s.move(movers, holes, longest)
        for runner in self._runners():  # a paged draft model's cache frees its rows too
            runner.release_rows(remaining, self.num_active)
        self.num_active = remaining

    def _preempt_for_next_step(self) -> int:
        """A paged cache that cannot give every row blocks for a full-width step gives up the most recently admitted
        rows until it can: they go back to the front of the queue and start over when blocks free up (the same seed
        draws the same tokens: sampling is keyed by position). Returns the number of rows preempted."""
        cache = self.runner.cache
        preempted = 0
        while self.num_active > 1:
            lens = self.slots.cache_len[: self.num_active].numpy()
            need = cache.manager.needed(np.arange(self.num_active), lens + self.max_width, lens)
            if need <= cache.free_blocks_after_growth():
                break
            victim = max(range(self.num_active), key=lambda row: self.slots.sequences[row].admitted_at)
            seq = self.slots.sequences[victim]
            seq.proposer_state = {}
            self._queue.appendleft(seq)
            self._remove_rows([victim])
            preempted += 1
        return preempted

    def _num_admissible(self) -> int:
        """Queued sequences the next admission takes: as many as free slots hold; with a paged cache, only as many
        as its blocks hold (a prompt's blocks once per group, a step's blocks per sample), after keeping a step's
        blocks for every row in flight."""
        count = min(self.max_batch_size - self.num_active, len(self._queue))
        if not self.runner.paged:
            return count
        cache = self.runner.cache
        per_step = -(-self.max_width // cache.block_size) + 1  # a full-width step, and a shared block copied
        budget = cache.free_blocks_after_growth() - self.num_active * per_step
        admitted, previous = 0, None
        for seq in itertools.islice(self._queue, count):
            cost = per_step + (-(-len(seq.prompt) // cache.block_size) if seq.prompt_index != previous else 0)
            if cost > budget:
                break
            budget -= cost
            admitted += 1
            previous = seq.prompt_index
        return admitted if admitted or self.num_active else 1  # nothing in flight: try one, a pool too small says so
