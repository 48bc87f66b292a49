"""The rows' host state: committing a step's tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.engine.slots import SlotState

FIELDS = ("token_ids", "logprobs", "num_tokens", "cache_len", "finished", "stopped")


def random_slots(seed: int, num_slots: int = 12, num_positions: int = 24) -> SlotState:
    """Rows part way through their completions, some one token from their length cap, stop ids of varying count."""
    g = torch.Generator().manual_seed(seed)
    s = SlotState(num_slots, num_positions)
    s.token_ids = torch.randint(0, 50, (num_slots, num_positions), generator=g)
    s.num_tokens = torch.randint(3, num_positions - 4, (num_slots,), generator=g)
    s.cache_len = s.num_tokens - 1
    s.max_num_tokens = s.num_tokens + torch.randint(1, 4, (num_slots,), generator=g)  # 1: the next token is the last
    s.max_num_tokens[3::4] = s.num_tokens[3::4] + 1
    stops = torch.randint(0, 50, (num_slots, 3), generator=g)
    s.stop_ids = torch.where(torch.rand(num_slots, 3, generator=g) < 0.5, stops, -1)
    s.stop_ids[:, 0] = stops[:, 0]  # every row one stop id at least
    return s


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("in_cache", [True, False])
def test_one_token_a_row_commits_what_the_general_path_commits(seed, in_cache):
    """A plain step's commit (one token a row, every row keeping it) takes a path without masks: rows that stop on a
    stop id, reach their length cap or go on must come out exactly as the path for several tokens a row leaves them
    (fed the same token with a second column it must ignore)."""
    g = torch.Generator().manual_seed(100 + seed)
    fast = random_slots(seed)
    general = copy.deepcopy(fast)
    row_start, num_rows = 2, 8
    tokens = torch.randint(0, 50, (num_rows, 1), generator=g)
    tokens[::3, 0] = fast.stop_ids[row_start : row_start + num_rows : 3, 0]  # some rows emit a stop id
    logprobs = -torch.rand(num_rows, 1, generator=g, dtype=torch.float64)
    emitted = torch.ones(num_rows, dtype=torch.long)
    kept_fast = fast.commit(row_start, emitted, tokens, logprobs, in_cache)
    kept_general = general.commit(
        row_start, emitted.clone(), torch.cat([tokens, tokens + 1], 1), torch.cat([logprobs, logprobs], 1), in_cache
    )
    assert torch.equal(kept_fast, kept_general)
    for name in FIELDS:
        assert torch.equal(getattr(fast, name), getattr(general, name)), f"{name} differs"
    assert fast.stopped.any() and fast.finished[~fast.stopped].any(), "expected rows stopped and rows capped"
