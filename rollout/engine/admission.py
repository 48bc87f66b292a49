"""Rows in and out of flight: an admission's prefill (one per prompt, shared by its samples), the release of finished
rows and the removal of preempted ones, keeping the rows in flight packed at the front of the slots; every row dropped
(`abort`, `close`), saved and put back. What to admit and whom to preempt is the scheduler's decision
(`rollout.engine.scheduler`).

A mixin over the `Generator`'s state (scheduler, slots, runner, proposers); the generator is the only user.
"""

from __future__ import annotations

import contextlib
import gc
import time

import numpy as np
import torch

from rollout.engine.sampling import Completion
from rollout.engine.sequence import Sequence
from rollout.engine.slots import RowSnapshot
from rollout.engine.trace import StepOutput, StepRecord
from rollout_kernels.device_io import upload
from specdec.auto_policy import StepObservation
from specdec.tree import layout_drafts
from specdec.verify import verify


class Admission:
    """Execute an admission, release finished rows, remove rows (see the module docstring)."""

    def _admit(self, chunks: list[list[list[Sequence]]]) -> StepRecord:
        """Prefill the scheduled chunks of prompt groups into the free slots after the rows in flight, one forward a
        chunk, and sample each sample's first token."""
        start = time.perf_counter()
        self._ahead.last_finish = 0.0  # the next decode step counts from its own launch, not the last one's read
        num_emitted = sum(self._prefill(chunk) for chunk in chunks)
        num_prompts = sum(len(chunk) for chunk in chunks)
        return StepRecord("prefill", num_prompts, 0, 0, 0, num_emitted, time.perf_counter() - start)

    def _prefill(self, groups: list[list[Sequence]]) -> int:
        """One forward over the groups' prompts; sample each sequence's first token. Returns the tokens kept."""
        prompts = [group[0].prompt for group in groups]
        row_start = self.scheduler.num_active
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
        self.scheduler.num_active += len(sequences)
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
        kept = self._commit_prefill(rows, result)
        return kept

    def _postprocess(self, record: StepRecord, observation: StepObservation | None) -> StepOutput:
        """Release the finished rows (the rows in flight stay packed) and append the step's record to the trace."""
        finished = self._release_finished()
        # the proposers' part of releasing and preempting rows (waits, finishing, moving rows) counts as this step's
        # proposing: its read is taken before it, so under async scheduling it falls in the next step's seconds
        record.propose_seconds += self._release_propose_seconds
        self._release_propose_seconds = 0.0
        if self.scheduler.num_active == 0:
            self._ahead.drop()  # a step launched ahead holds only rows that have finished since
        if self.runner.paged:
            usage = self.runner.cache.manager
            record.kv_blocks_used, record.kv_blocks_allocated = usage.num_used, usage.num_blocks
        self.last_trace.append(record)
        return StepOutput(record, finished, observation)

    def _release_finished(self) -> list[Completion]:
        """Hand back the finished rows' completions and keep the active rows packed at the front."""
        s = self.slots
        finished = np.flatnonzero(s.finished.numpy()[: self.scheduler.num_active]).tolist()
        if not finished:
            return []
        done = []
        for row in finished:
            seq = s.sequences[row]
            seq.token_ids, seq.logprobs = s.completion_of(row)
            seq.finish_reason = "stop" if bool(s.stopped[row]) else "length"
            done.append(seq.completion())
        if self.proposers is not None:
            with self._proposers_timed():
                self.proposers.finish(finished, s.token_ids, s.num_tokens[finished].tolist())
        self._remove_rows(finished)
        return done

    @contextlib.contextmanager
    def _proposers_timed(self):
        """Add the host time of the proposers' calls inside to the next step record's `propose_seconds`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._release_propose_seconds += time.perf_counter() - start

    def _preempt(self, rows: list[int]) -> None:
        """Give up `rows` (ascending) unfinished, to be admitted again later (the scheduler queued them)."""
        if self.proposers is not None:  # what they hold is text no row holds any more
            with self._proposers_timed():
                self.proposers.drop(rows)
        self._remove_rows(rows)

    def _remove_rows(self, rows: list[int]) -> None:
        """Take `rows` (ascending) out of flight: the last active rows move into the holes (a paged cache moves their
        block tables, a slot cache their KV), and the slots left behind hold nothing."""
        s, num_active = self.slots, self.scheduler.num_active
        if self.proposers is not None:  # their rows' tokens change below their counts (refilled, moved)
            with self._proposers_timed():
                self.proposers.wait()
        remaining = num_active - len(rows)
        leaving = set(rows)
        holes = [i for i in rows if i < remaining]
        movers = [i for i in range(remaining, num_active) if i not in leaving]
        assert len(holes) == len(movers), f"expected as many holes as movers, got {len(holes)} and {len(movers)}"
        if movers:
            longest = min(int(s.num_tokens[movers].max()) + 1, self.runner.num_positions)
            src, dst = torch.tensor(movers), torch.tensor(holes)  # host: the caches and proposers take them there
            self.runner.copy_rows(src, dst, num_positions=longest)
            if self.proposers is not None:
                with self._proposers_timed():
                    self.proposers.copy_rows(src, dst, longest)
            s.move(movers, holes, longest)
        if self._ahead.in_flight is not None:  # a step launched ahead: its results go to the rows where they are now
            self._ahead.in_flight.rows_moved(num_active, rows, movers, holes)
        for runner in self._runners():  # a paged draft model's cache frees its rows too
            runner.release_rows(remaining, num_active)
        s.forget(remaining, num_active)  # (a snapshot of a row that left, or of one that moved, is not restored)
        self.scheduler.num_active = remaining

    # ---- rows dropped (the engine closed), saved and put back -------------------------------------------------

    def abort(self, requests: list[Sequence] | None = None) -> None:
        """Drop every request queued or in flight (their KV is garbage the next admission overwrites), or only
        `requests` (sequences `add_requests` returned): those queued leave the queue and those in flight their rows,
        which free their slots and blocks, and the other rows go on as if they had never been there (each sample is
        its seed's, whatever the batch). A request that finished (`step` handed it back) or was dropped already is
        passed over. Returns nothing: a dropped request is never handed back."""
        with self._one_call():
            if requests is None:
                self._abort()
                return
            self._check_open()
            self._check_not_generating("abort(requests)")
            self._abort_requests(requests)

    def _abort_requests(self, requests: list[Sequence]) -> None:
        if not isinstance(requests, (list, tuple)) or not all(isinstance(seq, Sequence) for seq in requests):
            raise ValueError(
                f"abort takes a list of the requests add_requests returned (or nothing, to drop all), got "
                f"{requests!r:.80}"
            )
        dropping = {id(seq) for seq in requests}
        queue = self.scheduler.queue
        kept = [seq for seq in queue if id(seq) not in dropping]
        queue.clear()
        queue.extend(kept)
        sequences = self.slots.sequences
        rows = [row for row in range(self.scheduler.num_active) if id(sequences[row]) in dropping]
        if rows:
            with torch.inference_mode():  # (the caches' tensors are made in inference mode)
                if self.proposers is not None:  # what they hold is text no row holds any more
                    with self._proposers_timed():
                        self.proposers.drop(rows)
                self._remove_rows(rows)
        if self.scheduler.num_active == 0:
            self._ahead.drop()  # a step launched ahead holds only rows that are gone

    def _abort(self) -> None:
        self.scheduler.queue.clear()
        self._ahead.reset()
        self._release_propose_seconds = 0.0  # (a step that raised after removing rows)
        if self._closed:
            return
        if self.proposers is not None:  # the rows in flight end unfinished: what they hold leaves the proposers
            self.proposers.drop(list(range(self.scheduler.num_active)))
        # every slot, not only those in flight: a restore to fewer rows left the others holding their blocks
        for runner in self._runners():
            runner.release_rows(0, self.max_batch_size)
        self.scheduler.num_active = 0

    def close(self) -> None:
        """Give back the KV caches, the CUDA graphs and their memory pool now, the target's and a draft model's,
        whatever still refers to this generator (a trainer that rebuilds it plans the next one from the memory freed).
        Its drafting history stays readable (`draft_history`); every other call is refused after it."""
        with self._one_call():
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._abort()
        for runner in self._runners():
            runner.close()
        self._closed = True
        gc.collect()  # a generator's parts refer to each other: their memory returns only once the cycles go
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Generator was closed (its KV cache and graphs are freed): build a new one")

    def snapshot(self) -> list[RowSnapshot]:
        """The rows in flight, in row order, for `restore`."""
        with self._one_call():
            self._check_open()
            self._check_no_step_in_flight()
            self._ahead.decision = None  # a K chosen for rows that may be rolled back
            return self.slots.snapshot(self.num_active, self.scheduler.num_admitted)

    def restore(self, rows: list[RowSnapshot], keep_others: bool = False) -> None:
        """Put rows back as a snapshot saw them, into rows `[0, len(rows))`. The KV cache keeps what the rows had (a
        step only writes past their lengths), so rolling back is lowering lengths. A prefix of a snapshot keeps fewer
        rows in flight: the others leave it unfinished and a paged cache frees their blocks, unless `keep_others`
        (the auto policy's warm-up times growing prefixes of one snapshot): then they keep their KV, and their
        blocks, for a later restore of a longer prefix, until an abort.

        Raises:
            ValueError: a row no longer holds its snapshot's sequence (it finished, moved or was let go), was
                preempted and admitted again since, or a row in flight was admitted since the snapshot, which the
                restore would drop; an empty snapshot with rows in flight (nothing changed).
        """
        with self._one_call():
            self._check_open()
            self._check_not_generating("restore")
            self._check_no_step_in_flight()
            self._check_none_admitted_since(rows)
            self._ahead.decision, self._ahead.last_finish = None, 0.0  # the rows are not those the last step read
            if self.proposers is not None:  # the rows' tokens are rolled back
                self.proposers.wait()
            with torch.inference_mode():
                self.slots.restore(rows)  # (refuses, changing nothing, a row that lost its snapshot's sequence)
            if self.proposers is not None:  # the rows past the snapshot's prefix end unfinished
                self.proposers.drop(list(range(len(rows), self.scheduler.num_active)))
                with torch.inference_mode():  # (a draft model's per-row state is made in inference mode)
                    self.proposers.rewind(list(range(len(rows))), [saved.num_tokens for saved in rows])
            if not keep_others:  # (with the rows an earlier restore kept out of flight)
                for runner in self._runners():
                    runner.release_rows(len(rows), self.max_batch_size)
                self.slots.forget(len(rows), self.max_batch_size)
            self.scheduler.num_active = len(rows)

    def _check_none_admitted_since(self, rows: list[RowSnapshot]) -> None:
        if not isinstance(rows, (list, tuple)) or not all(isinstance(saved, RowSnapshot) for saved in rows):
            raise ValueError(f"restore takes a list that snapshot() returned (or a prefix of it), got {rows!r:.80}")
        in_flight = self.scheduler.num_active
        if not rows:  # (no row to say when it was taken: every row in flight may have come since)
            if in_flight:
                raise ValueError(
                    f"an empty snapshot (or prefix) would drop all {in_flight} rows in flight unfinished, and it does "
                    "not say when it was taken, so rows admitted since cannot be told apart: abort() drops them"
                )
            return
        taken = rows[0].num_admitted
        admitted_at = [seq.admitted_at if seq is not None else -1 for seq in self.slots.sequences[:in_flight]]
        again = [  # (a row holding another sequence is refused by `SlotState.restore`, naming that)
            row
            for row in range(min(len(rows), in_flight))
            if self.slots.sequences[row] is rows[row].sequence and admitted_at[row] >= taken
        ]
        if again:  # preempted and admitted again since: its tokens past its prompt, and their KV, are gone
            raise ValueError(
                f"row {again[0]}'s sample was preempted and admitted again after this snapshot was taken, so what the "
                "snapshot holds of it is gone: restore a snapshot taken since, or a prefix without it"
            )
        since = [row for row in range(len(rows), in_flight) if admitted_at[row] >= taken]
        if since:
            raise ValueError(
                f"{len(since)} rows in flight were admitted after this snapshot was taken, and a restore would drop "
                "them unfinished: restore a snapshot taken since, or abort() first"
            )

    def _check_no_step_in_flight(self) -> None:
        if self._ahead.in_flight is not None:
            raise RuntimeError(
                "a decode step is in flight (async_scheduling runs the host one step ahead): snapshot and restore need "
                "the engine in lockstep; build the generator with async_scheduling=False"
            )
