"""One forward's rows and tokens, built once per forward on the host and read by the model runner, the graph runner
and both KV caches; each cache turns it into the model's keywords (`model_inputs`).

Rows `[row_start, row_start + rows)` of the slots take `S` columns each: row r's new tokens sit at columns
`[query_start[r], query_start[r] + num_queries[r])` (padding around them), after its `cache_lens[r]` committed ones.
New token i of row r is written at cache position `cache_lens[r] + i` and has position id `cache_lens[r] + i` in a
chain, `cache_lens[r] + depths[r, i]` in a token tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class StepBatch:
    """One forward (see the module docstring); the host tensors are read during the forward only."""

    row_start: int  # the first row (slot) of the contiguous range the forward covers
    input_ids: Tensor  # [rows, S] on the device
    cache_lens: Tensor  # [rows] int64 host: tokens each row holds in the cache before this forward
    query_start: Tensor  # [rows] int64 host: the column of each row's first new token
    num_queries: Tensor  # [rows] int64 host: new tokens of each row
    valid: Tensor  # [rows, S] bool host: the column holds a new token
    cache_positions: Tensor  # [rows, S] int64 host: where each new token's KV goes in its row, -1 for padding
    positions: Tensor  # [rows, S] int64 host: each column's position id, 0 for padding
    depths: Tensor | None = None  # [rows, S] int64 a token tree's node depths (None: causal chains)
    ancestors: Tensor | None = None  # [rows, S, S] bool which nodes each node sees (None: causal chains)
    last_only: bool = False  # only the last column's logits (a left-padded prefill)

    @classmethod
    def build(
        cls,
        row_start: int,
        input_ids: Tensor,  # [rows, S] on the device
        cache_lens: Tensor,  # [rows] int64 host
        query_start: Tensor,  # [rows] int64 host
        num_queries: Tensor,  # [rows] int64 host
        depths: Tensor | None = None,  # [rows, S]
        ancestors: Tensor | None = None,  # [rows, S, S]
        last_only: bool = False,
    ) -> StepBatch:
        """The batch with its positions worked out once (the cache positions and position ids of every column)."""
        # numpy on the host tensors' memory: a handful of small ops, each several times cheaper than torch's
        width = input_ids.shape[1]
        lens = cache_lens.numpy()[:, None]
        column = np.arange(width)[None, :] - query_start.numpy()[:, None]
        valid = (column >= 0) & (column < num_queries.numpy()[:, None])
        offsets = column if depths is None else np.take_along_axis(depths.numpy(), np.clip(column, 0, width - 1), 1)
        return cls(
            row_start, input_ids, cache_lens, query_start, num_queries, torch.from_numpy(valid),
            torch.from_numpy(np.where(valid, lens + column, -1)), torch.from_numpy(np.where(valid, lens + offsets, 0)),
            depths, ancestors, last_only,
        )  # fmt: skip

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def is_chain_step(self) -> bool:
        """A decode or verification step of causal chains (what a CUDA graph replays): no tree, every column's
        logits."""
        return self.depths is None and not self.last_only

    @property
    def kv_len(self) -> int:
        """Cache positions the forward reaches: the longest row's committed and new tokens."""
        return int((self.cache_lens + self.num_queries).max())
