"""The host one step ahead of the device: a decode step launched while the previous one's results are still on their
way, so that the previous step's bookkeeping (its commit, the release of finished rows, the trace, the caller's
callbacks) runs while the device computes.

A step of one token a row (no drafts) needs nothing the host lacks: its input tokens are the previous step's samples,
already on the device, and each row's cache length grows by exactly one, whatever was sampled. So the generator
launches step t + 1 from step t's device results before reading step t (`Generator(async_scheduling=...)`). A row
that step t finishes (a stop id, its length cap) is learned one step late: it rode along in step t + 1, whose token for
it is dropped. Rows released while a step is in flight move (the last rows fill the holes); the step keeps where each
of its rows went (`rows_moved`), so its results land on the rows they belong to. Samples are keyed by the sample's
seed and the token's position: the tokens are the same, launched ahead or not.

With speculation, a step runs ahead where the K policy drafts nothing for it: before launching, the generator asks
the policy for the next step's K, with the rows as the host knows them (a step's tokens behind). At K = 0 the step is
launched ahead, without drafts; a K > 0 is kept for the next step, which waits for the read (its drafts follow the
tokens in flight). So the bulk's plain steps overlap their bookkeeping (the proposers take in each step's tokens after
the next step is launched) and the tail's drafting steps run in lockstep. A calibration's forced steps never run ahead,
nor does a generator that may draft under rejection sampling (its uniforms are drawn by count, 2K + 1 a step).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rollout_kernels.device_io import PendingRead, upload
from specdec.policies import Decision
from specdec.tree import DraftLayout
from specdec.verify import VerifyResult


@dataclass
class LaunchedStep:
    """A decode step queued on the device, its results on their way to the host (`Generator._finish_decode`)."""

    start: float  # perf_counter when its launch began
    num_rows: int  # rows it was launched with
    context: int  # the longest row's cache length at launch
    decision: Decision  # the K policy's choice
    asked: Tensor  # [rows] drafts asked of each row
    routes: list[str]  # each row's route, when a K policy learns from the step (else empty)
    served: list  # the proposer each row's drafts came from (None: no drafts)
    drafted: bool  # some row was fed drafts
    layout: DraftLayout
    propose_seconds: float
    result: VerifyResult  # on the device
    read: PendingRead  # the packed results, on their way to the host
    base_positions: Tensor  # [rows] where each row's pending token was written
    advanced: bool  # one token a row, the rows' cache lengths raised at launch: a step may be launched behind it
    row_of: np.ndarray | None = None  # [rows] the row each launched row is now (-1: released); None: unchanged
    policy_seconds: float = 0.0  # host time the K policy took: choosing at the launch, learning added at the finish
    behind: bool = False  # launched behind another step, before that one was read
    launch_seconds: float = 0.0  # host time of the launch (drafting, inputs, the forward and verification queued)

    def rows_moved(self, num_active: int, leaving: list[int], movers: list[int], holes: list[int]) -> None:
        """Rows `leaving` were released and rows `movers` moved into `holes` (of `num_active` rows then)."""
        remap = np.arange(num_active)
        remap[leaving] = -1
        remap[movers] = holes
        row_of = self.row_of if self.row_of is not None else np.arange(self.num_rows)
        self.row_of = np.where(row_of >= 0, remap[np.maximum(row_of, 0)], -1)

    def source_rows(self, num_active: int) -> np.ndarray | None:
        """`[num_active]` which launched row each row in flight was (None: the rows have not moved); every row in
        flight was in the step (nothing is admitted while a step is in flight)."""
        if self.row_of is None:
            assert num_active == self.num_rows, f"expected {self.num_rows} rows in flight, got {num_active}"
            return None
        source = np.full(num_active, -1, dtype=np.int64)
        live = np.nonzero(self.row_of >= 0)[0]
        source[self.row_of[live]] = live
        assert (source >= 0).all(), f"expected every row in flight in the launched step, got sources {source}"
        return source

    def next_input_ids(self, num_rows: int, device: torch.device) -> Tensor:
        """`[num_rows, 1]` the token each row in flight sampled in this step, on the device (no read)."""
        sampled = self.result.output_token_ids[:, :1]
        source = self.source_rows(num_rows)
        return sampled if source is None else sampled[upload(torch.from_numpy(source), device)]


class RunAhead:
    """The generator's side of it: the step in flight, and the steps launched with their rows' cache lengths raised
    and not read yet. A step that raises may have left the rows part-way through it (committed and not released,
    admitted and not prefilled, a step launched ahead unread): the generator refuses to step on until `reset` (its
    `abort`)."""

    def __init__(self):
        self.in_flight: LaunchedStep | None = None  # launched ahead by the last call, not read yet
        self.unread = 0  # steps launched with the rows' cache lengths raised, not read yet
        self.failed = False
        self.last_finish = 0.0  # when the last decode step was read, 0 after a prefill (steps are timed from it)
        # the K policy's choice for the next step, made when deciding whether to launch it ahead (it drafts: it waits
        # for the read), with the seconds the choice took and the policy that made it; taken by that step if the
        # generator still has that policy (a calibration swaps in its own)
        self.decision: tuple[Decision, float, object] | None = None

    @contextlib.contextmanager
    def guarded(self):
        """Around a step: refuses after a step that raised, and notes one that does."""
        if self.failed:
            raise RuntimeError(
                "a step raised (or was interrupted) part-way, so the rows in flight may be left between two states; "
                "call abort() (or add_requests without keep_in_flight, which starts over) before stepping again"
            )
        try:
            yield
        except BaseException:
            self.failed = True
            raise

    def drop(self) -> None:
        """Drop the step in flight, if any: its results are not read (what it wrote to the caches is garbage past the
        rows' lengths), but it is waited for, so that none of the generator's work is left running on the device when
        a call returns (a trainer may change the weights next, on another stream)."""
        if self.in_flight is not None:
            self.in_flight.read.wait()
            self.unread -= self.in_flight.advanced
            self.in_flight = None

    def reset(self) -> None:
        """Nothing in flight and nothing lost (the rows were dropped)."""
        self.drop()
        self.unread, self.failed, self.decision, self.last_finish = 0, False, None, 0.0
