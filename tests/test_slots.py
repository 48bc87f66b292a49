"""The rows' host state: committing a step's tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.engine.slots import SlotState


def random_slots(seed: int, num_slots: int = 12, max_seq_len: int = 24, max_width: int = 5) -> SlotState:
    """Rows part way through their completions, some a token or two from their length cap (never past `max_seq_len`
    tokens, as the generator caps them), every row with a stop id or more."""
    g = torch.Generator().manual_seed(seed)
    s = SlotState(num_slots, max_seq_len + max_width)  # the generator's positions: max_seq_len + one step's width
    s.token_ids = torch.randint(0, 50, (num_slots, max_seq_len + max_width), generator=g)
    s.num_tokens = torch.randint(3, max_seq_len - 4, (num_slots,), generator=g)
    s.cache_len = s.num_tokens - 1
    s.max_num_tokens = torch.minimum(s.num_tokens + torch.randint(1, 8, (num_slots,), generator=g), torch.tensor(24))
    s.max_num_tokens[3::4] = s.num_tokens[3::4] + 1
    stops = torch.randint(0, 50, (num_slots, 3), generator=g)
    s.stop_ids = torch.where(torch.rand(num_slots, 3, generator=g) < 0.5, stops, -1)
    s.stop_ids[:, 0] = stops[:, 0]  # every row one stop id at least
    return s


def reference_commit(s: SlotState, row_start: int, num_emitted, token_ids, logprobs, in_cache: bool) -> list[int]:
    """`SlotState.commit`, row by row: the emitted tokens up to and including the first stop id, within the cap."""
    kept_per_row = []
    for i in range(len(num_emitted)):
        row = row_start + i
        kept, stopped = 0, False
        for j in range(int(num_emitted[i])):
            if s.num_tokens[row] + kept >= s.max_num_tokens[row]:
                break
            s.token_ids[row, s.num_tokens[row] + kept] = token_ids[i, j]
            s.logprobs[row, s.num_tokens[row] + kept] = logprobs[i, j]
            kept += 1
            if int(token_ids[i, j]) in s.stop_ids[row].tolist():
                stopped = True
                break
        if in_cache:
            s.cache_len[row] += num_emitted[i]
        s.num_tokens[row] += kept
        s.stopped[row] = stopped
        s.finished[row] = stopped or bool(s.num_tokens[row] >= s.max_num_tokens[row])
        kept_per_row.append(kept)
    return kept_per_row


def assert_same_rows(got: SlotState, want: SlotState) -> None:
    """The same state where it is read: counts, cache lengths, flags and every token and log-prob below the count."""
    for name in ("num_tokens", "cache_len", "finished", "stopped"):
        assert torch.equal(getattr(got, name), getattr(want, name)), (
            f"{name}: {getattr(got, name)} != {getattr(want, name)}"
        )
    below = torch.arange(got.token_ids.shape[1])[None, :] < want.num_tokens[:, None]
    assert torch.equal(got.token_ids[below], want.token_ids[below]), "tokens below the count differ"
    assert torch.equal(got.logprobs[below], want.logprobs[below]), "log-probs below the count differ"


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("width", [1, 2, 5])
@pytest.mark.parametrize("in_cache", [True, False])
def test_a_commit_keeps_the_emitted_tokens_up_to_a_stop_id_within_the_cap(seed, width, in_cache):
    """Rows that emit a stop id (first, mid-way, last), reach their length cap, emit fewer tokens than the width or go
    on: every count, flag, token and log-prob a later step reads is what committing row by row gives. One token a row
    takes a path of its own (every row keeping it), and a wider step writes past the rows' new counts."""
    g = torch.Generator().manual_seed(100 + seed)
    slots = random_slots(seed)
    want = copy.deepcopy(slots)
    row_start, num_rows = 2, 8
    tokens = torch.randint(0, 50, (num_rows, width), generator=g)
    column = torch.randint(0, width, (num_rows,), generator=g)
    stop_rows = torch.arange(0, num_rows, 3)
    tokens[stop_rows, column[stop_rows]] = slots.stop_ids[row_start + stop_rows, 0]  # some rows emit a stop id
    logprobs = -torch.rand(num_rows, width, generator=g, dtype=torch.float64)
    emitted = torch.randint(1, width + 1, (num_rows,), generator=g)
    kept = slots.commit(row_start, emitted, tokens, logprobs, in_cache)
    assert kept.tolist() == reference_commit(want, row_start, emitted, tokens, logprobs, in_cache)
    assert_same_rows(slots, want)
    if width == 1:  # the one-token path met rows that stop, rows that reach their cap and rows that go on
        done = slots.finished[row_start : row_start + num_rows]
        stopped = slots.stopped[row_start : row_start + num_rows]
        assert stopped.any() and (done & ~stopped).any() and (~done).any()
