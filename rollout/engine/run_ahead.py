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
"""

from __future__ import annotations

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
