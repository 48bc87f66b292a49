"""Per-slot state in persistent host tensors: written when a sequence is admitted, moved when rows are packed,
read by every decode step as slices (no per-row Python loop in the hot path).

Rows `[0, num_active)` are the sequences in flight, packed at the front. A row holds its tokens (prompt + completion,
the last one pending: emitted but not yet in the KV cache) and their log-probabilities, its lengths, its sampling
settings, its stop ids and its random stream (a counter-based hash of the sample's seed, so draws are vectorised).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rollout.engine.sequence import Sequence
from rollout_kernels.device_io import upload
from specdec.processing import RowSampling

TOP_K_OFF = 2**62  # a top-k this large (or any past the vocabulary) keeps every token

_MASK32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (int64 tensors holding values < 2^32): good avalanche, two multiplies."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def counter_uniforms(seeds: Tensor, counters: Tensor) -> Tensor:
    """Uniforms in (0, 1), float64, 53 random bits each: a pure function of (seed, counter), so a row's stream is
    the same whatever else is in the batch.

    Args:
        seeds: `[rows, 1]` int64, 62-bit seeds.
        counters: `[rows, C]` int64, the draw index of each value in its row's stream (< 2^32).
    Returns:
        `[rows, C]` float64, never exactly 0 or 1 (float64: float32 can return exactly 0).
    """
    key = _hash32(counters ^ _hash32(seeds >> 31)) ^ (seeds & 0x7FFFFFFF)
    key = _hash32(key)
    high = _hash32(key ^ 0x9E3779B9) >> 5  # 27 bits
    low = _hash32(key ^ 0x85EBCA6B) >> 6  # 26 bits
    return ((high << 26) + low).to(torch.float64).add_(0.5).mul_(2.0**-53)


@dataclass
class RowSnapshot:
    """One row in flight, as `SlotState.snapshot` saw it."""

    sequence: Sequence
    num_tokens: int
    cache_len: int
    num_draws: int
    pending: int  # its last token: not in the KV cache yet, so a restore may change it
    proposer_state: dict
    num_admitted: int = 0  # the engine's admissions when the snapshot was taken (a row admitted since came later)


class SlotState:
    """The state of `num_slots` rows, each up to `num_positions` tokens.

    Args:
        num_slots: rows held at once (the generator's max_batch_size).
        num_positions: tokens a row may hold (max_seq_len plus one step's block).
    """

    def __init__(self, num_slots: int, num_positions: int):
        self.num_slots = num_slots
        # prompt + completion, pending last; past a row's count: anything (a commit writes past it)
        self.token_ids = torch.zeros(num_slots, num_positions, dtype=torch.long)
        self.logprobs = torch.zeros(num_slots, num_positions, dtype=torch.float64)  # of each completion token
        self.num_tokens = torch.zeros(num_slots, dtype=torch.long)  # prompt + completion tokens
        self.prompt_len = torch.zeros(num_slots, dtype=torch.long)
        self.cache_len = torch.zeros(num_slots, dtype=torch.long)  # tokens with KV in the cache (all but pending)
        self.max_num_tokens = torch.zeros(num_slots, dtype=torch.long)  # prompt + max_new_tokens
        self.spec_cap = torch.zeros(num_slots, dtype=torch.long)  # most drafts the request takes per step
        self.temperature = torch.zeros(num_slots, dtype=torch.float32)
        self.top_k = torch.zeros(num_slots, dtype=torch.long)
        self.top_p = torch.ones(num_slots, dtype=torch.float32)
        self.seed = torch.zeros(num_slots, 1, dtype=torch.long)
        self.num_draws = torch.zeros(num_slots, dtype=torch.long)  # uniforms drawn so far from the row's stream
        self.stop_ids = torch.full((num_slots, 1), -1, dtype=torch.long)  # [slots, S] padded with -1
        self.finished = torch.zeros(num_slots, dtype=torch.bool)
        self.stopped = torch.zeros(num_slots, dtype=torch.bool)  # finished on a stop id (else on the length cap)
        self.sequences: list[Sequence | None] = [None] * num_slots
        # the last `row_sampling` (rows, device, settings), until rows are admitted or moved: the same every step
        self._sampling: tuple[tuple, RowSampling] | None = None
        self.version = 0  # raised whenever rows are admitted or moved (what a row holds changes only then)

    # ---- admit and move ---------------------------------------------------------------------------------------

    def admit(self, row_start: int, sequences: list[Sequence]) -> None:
        """Write `sequences` into rows `[row_start, row_start + len(sequences))`: prompt, lengths, settings, seed."""
        rows = slice(row_start, row_start + len(sequences))
        self._sampling = None
        self.version += 1
        width = max(len(s.stop_ids) for s in sequences)
        if width > self.stop_ids.shape[1]:
            grown = torch.full((self.num_slots, width), -1, dtype=torch.long)
            grown[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = grown
        stops = torch.full((len(sequences), self.stop_ids.shape[1]), -1, dtype=torch.long)
        for i, seq in enumerate(sequences):
            stops[i, : len(seq.stop_ids)] = torch.tensor(sorted(seq.stop_ids), dtype=torch.long)
            self.token_ids[row_start + i, : len(seq.prompt)] = torch.tensor(seq.prompt)
            self.sequences[row_start + i] = seq
        self.stop_ids[rows] = stops
        lengths = torch.tensor([len(s.prompt) for s in sequences])
        self.num_tokens[rows] = lengths
        self.prompt_len[rows] = lengths
        self.cache_len[rows] = lengths
        self.max_num_tokens[rows] = lengths + torch.tensor([s.max_new_tokens for s in sequences])
        self.spec_cap[rows] = torch.tensor([s.spec_cap for s in sequences])
        self.temperature[rows] = torch.tensor([float(s.params.temperature) for s in sequences])
        # a top-k past every vocabulary is off, as one >= the vocabulary is; held below int64's bound
        self.top_k[rows] = torch.tensor([min(s.params.top_k, TOP_K_OFF) for s in sequences])
        self.top_p[rows] = torch.tensor([float(s.params.top_p) for s in sequences])
        self.seed[rows, 0] = torch.tensor([s.seed for s in sequences])
        self.num_draws[rows] = 0
        self.finished[rows] = False
        self.stopped[rows] = False

    def move(self, src: list[int], dst: list[int], num_positions: int) -> None:
        """Copy rows `src` into rows `dst` (the first `num_positions` tokens of each)."""
        s, d = torch.tensor(src), torch.tensor(dst)
        self._sampling = None
        self.version += 1
        self.token_ids[d, :num_positions] = self.token_ids[s, :num_positions]
        self.logprobs[d, :num_positions] = self.logprobs[s, :num_positions]
        for field in (self.num_tokens, self.prompt_len, self.cache_len, self.max_num_tokens, self.spec_cap):
            field[d] = field[s]
        for field in (self.temperature, self.top_k, self.top_p, self.seed, self.num_draws, self.stop_ids):
            field[d] = field[s]
        self.finished[d] = self.finished[s]
        self.stopped[d] = self.stopped[s]
        for i, j in zip(src, dst):
            self.sequences[j] = self.sequences[i]

    # ---- what a step reads --------------------------------------------------------------------------------------

    def pending(self, num_rows: int) -> Tensor:
        """`[rows]` each row's last token (emitted, not yet in the KV cache)."""
        return torch.from_numpy(self.token_ids.numpy()[np.arange(num_rows), self.num_tokens.numpy()[:num_rows] - 1])

    def draft_caps(self, num_rows: int) -> Tensor:
        """`[rows]` the most drafts a row may take this step: its request's cap, and never past its length cap
        (tokens beyond it could not be kept)."""
        room = self.max_num_tokens.numpy()[:num_rows] - self.num_tokens.numpy()[:num_rows] - 1
        return torch.from_numpy(np.minimum(self.spec_cap.numpy()[:num_rows], room))

    def row_sampling(self, rows: slice, device: torch.device) -> RowSampling:
        """The rows' sampling settings as tensors on `device`, with the flags decided here on the host; the same
        tensors (not to be changed) until rows are admitted or moved: a step's uploads are spared."""
        key = (rows.start, rows.stop, device)
        if self._sampling is not None and self._sampling[0] == key:
            return self._sampling[1]
        temperature, top_k, top_p = self.temperature[rows], self.top_k[rows], self.top_p[rows]
        greedy = temperature == 0
        sampling = RowSampling(
            temperature=upload(temperature, device),
            top_k=upload(top_k, device),
            top_p=upload(top_p, device),
            needs_filter=bool(((top_k > 0) | (top_p < 1)).any()),
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
        )
        self._sampling = (key, sampling)
        return sampling

    def uniforms(self, rows: slice, asked: Tensor) -> Tensor:
        """`[rows, 2K + 1]` float64 from each row's own stream, K = max(asked): `asked[i]` for drafting, `asked[i]`
        for acceptance, 1 for the recovered or bonus token (columns: draft | accept | sample; unused ones 0).
        Greedy rows draw nothing."""
        max_k = int(asked.max()) if asked.numel() else 0
        width = 2 * max_k + 1
        col = torch.arange(width)[None, :]
        k = asked[:, None]
        offset = torch.where(col < max_k, col, torch.where(col < 2 * max_k, k + col - max_k, 2 * k))
        used = (col < k) | ((col >= max_k) & (col < max_k + k)) | (col == width - 1)
        sampled = self.temperature[rows] > 0
        values = counter_uniforms(self.seed[rows], self.num_draws[rows, None] + offset)
        self.num_draws[rows] += torch.where(sampled, 2 * asked + 1, 0)
        return torch.where(used & sampled[:, None], values, 0.0)

    # ---- commit ---------------------------------------------------------------------------------------------------

    def commit(
        self, row_start: int, num_emitted: Tensor, token_ids: Tensor, logprobs: Tensor, in_cache: bool
    ) -> Tensor:
        """Append each row's first `num_emitted[i]` tokens of `token_ids [rows, W]` (host tensors), up to and including
        the first stop id and never past the length cap; mark the rows that finished. `in_cache`: the fed tokens
        (pending + accepted drafts, `num_emitted` of them) now have KV in the cache. Returns `[rows]` the tokens kept.

        On numpy views of the rows' tensors (the same memory): a numpy call costs a few times less than a torch one,
        and at a small batch the commit is its calls' fixed cost."""
        emitted, tokens, values = num_emitted.numpy(), token_ids.numpy(), logprobs.numpy()
        num_rows, width = tokens.shape
        rows = slice(row_start, row_start + num_rows)
        num_tokens = self.num_tokens.numpy()[rows].copy()
        max_num_tokens = self.max_num_tokens.numpy()[rows]
        room = max_num_tokens - num_tokens
        stop_ids = self.stop_ids.numpy()[rows]
        row_index = np.arange(row_start, row_start + num_rows)
        if width == 1 and (np.minimum(emitted, room) == 1).all():  # a token a row, every row keeps it
            self.token_ids.numpy()[row_index, num_tokens] = tokens[:, 0]
            self.logprobs.numpy()[row_index, num_tokens] = values[:, 0]
            kept, stopped = emitted, (tokens[:, :1] == stop_ids).any(1)
        else:
            col = np.arange(width)
            is_stop = (tokens[:, :, None] == stop_ids[:, None, :]).any(2) & (col < emitted[:, None])
            first_stop = np.where(is_stop.any(1), is_stop.argmax(1) + 1, width + 1)
            kept = np.minimum(np.minimum(emitted, room), first_stop)
            # every column goes in, those past a row's kept tokens too: they land past its new count, where nothing is
            # read (in bounds: a row holds at most max_seq_len tokens, and its positions one step's width more)
            positions = num_tokens[:, None] + col
            self.token_ids.numpy()[row_index[:, None], positions] = tokens
            self.logprobs.numpy()[row_index[:, None], positions] = values
            stopped = first_stop <= kept
        if in_cache:
            self.cache_len.numpy()[rows] += emitted
        self.num_tokens.numpy()[rows] = num_tokens + kept
        self.stopped.numpy()[rows] = stopped
        self.finished.numpy()[rows] = stopped | (num_tokens + kept >= max_num_tokens)
        return num_emitted if kept is emitted else torch.from_numpy(kept)

    def forget(self, start: int, stop: int) -> None:
        """Rows `[start, stop)` hold no sequence any more (a snapshot of them cannot be restored)."""
        self.sequences[start:stop] = [None] * max(stop - start, 0)

    def completion_of(self, row: int) -> tuple[list[int], list[float]]:
        """Row `row`'s completion tokens and their log-probabilities."""
        start, end = int(self.prompt_len[row]), int(self.num_tokens[row])
        return self.token_ids[row, start:end].tolist(), self.logprobs[row, start:end].tolist()

    def snapshot(self, num_rows: int, num_admitted: int = 0) -> list[RowSnapshot]:
        """Rows `[0, num_rows)` as they are, for `restore`; `num_admitted`: the engine's admissions so far."""
        return [
            RowSnapshot(
                self.sequences[row],
                int(self.num_tokens[row]),
                int(self.cache_len[row]),
                int(self.num_draws[row]),
                int(self.token_ids[row, self.num_tokens[row] - 1]),
                copy.deepcopy(self.sequences[row].proposer_state),
                num_admitted,
            )
            for row in range(num_rows)
        ]

    def restore(self, rows: list[RowSnapshot]) -> None:
        """Put rows back as a snapshot saw them, into rows `[0, len(rows))`; nothing changes if one of them does
        not hold its snapshot's sequence any more (ValueError)."""
        for row, saved in enumerate(rows):
            if self.sequences[row] is not saved.sequence:
                raise ValueError(
                    f"row {row} no longer holds the sequence this snapshot saw there (it finished, moved, or a restore "
                    "to fewer rows let it go): restore a snapshot taken since"
                )
        for row, saved in enumerate(rows):
            self.num_tokens[row], self.cache_len[row] = saved.num_tokens, saved.cache_len
            self.num_draws[row] = saved.num_draws
            self.token_ids[row, saved.num_tokens - 1] = saved.pending
            self.finished[row] = self.stopped[row] = False
            saved.sequence.proposer_state = copy.deepcopy(saved.proposer_state)
