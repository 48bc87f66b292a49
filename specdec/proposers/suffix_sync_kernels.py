"""The suffix proposer's compiled taking in of the rows' tokens (numba): one call per step for every row.

`SuffixTries` (`specdec/proposers/suffix_tries.py`) calls `take_rows`, then counts the pending sequences into each of
its two node stores with `insert` (`specdec/proposers/suffix_kernels.py`'s counting). Compiled once and cached on
disk (`cache=True`).
"""

from __future__ import annotations

import numba
import numpy as np

from specdec.proposers.suffix_kernels import insert

__all__ = ["insert", "take_rows"]


@numba.njit(cache=True)
def take_rows(
    frontiers,
    num_inserted,
    prompt_len,
    responses,
    rows,
    token_ids,
    num_tokens,
    pending_frontiers,
    pending_tokens,
    pending_lengths,
    pending_slots,
    status,
):
    """Take in the tokens each of `rows [N]` gained: `token_ids[rows[i], num_inserted[rows[i]]:num_tokens[i]]`
    (`token_ids [*, T]`) go to the row's response (`responses [slots, P]`, after `prompt_len [slots]`) and, as one
    sequence per growing row, behind the pending ones: its frontiers in the two stores (`frontiers [2, slots, D]`)
    to `pending_frontiers [2, S, D]`, its new tokens to `pending_tokens [S, W]` and `pending_lengths [S]`, its slot
    to `pending_slots [S]`; `status[0]` of them are in use before and after. `num_inserted` moves on; the caller
    counts the pending sequences into the stores. Nothing is done, and `status[1]` is set, if a row holds fewer tokens
    than it has inserted (it was rewound). Returns the pending arrays (grown as needed)."""
    depth = frontiers.shape[2]
    status[1] = 0
    num_growing, longest = 0, 0
    for i in range(len(rows)):
        gained = num_tokens[i] - num_inserted[rows[i]]
        if gained < 0:
            status[1] = 1
            return pending_frontiers, pending_tokens, pending_lengths, pending_slots
        if gained > 0:
            num_growing += 1
            longest = max(longest, gained)
    first = status[0]
    total = first + num_growing
    if total > pending_frontiers.shape[1] or longest > pending_tokens.shape[1]:
        capacity = max(total, 2 * pending_frontiers.shape[1])
        grown_frontiers = np.empty((2, capacity, depth), dtype=pending_frontiers.dtype)
        grown_frontiers[:, :first] = pending_frontiers[:, :first]
        grown_tokens = np.zeros((capacity, max(longest, pending_tokens.shape[1])), dtype=np.int64)
        grown_tokens[:first, : pending_tokens.shape[1]] = pending_tokens[:first]
        grown_lengths = np.zeros(capacity, dtype=np.int64)
        grown_lengths[:first] = pending_lengths[:first]
        grown_slots = np.zeros(capacity, dtype=np.int64)
        grown_slots[:first] = pending_slots[:first]
        pending_frontiers, pending_tokens = grown_frontiers, grown_tokens
        pending_lengths, pending_slots = grown_lengths, grown_slots
    at = first
    for i in range(len(rows)):
        row = rows[i]
        start = num_inserted[row]
        gained = num_tokens[i] - start
        if gained <= 0:
            continue
        for k in range(gained):
            token = token_ids[row, start + k]
            responses[row, start - prompt_len[row] + k] = token
            pending_tokens[at, k] = token
        for s in range(2):
            for m in range(depth):
                pending_frontiers[s, at, m] = frontiers[s, row, m]
        pending_lengths[at] = gained
        pending_slots[at] = row
        num_inserted[row] = num_tokens[i]
        at += 1
    status[0] = total
    return pending_frontiers, pending_tokens, pending_lengths, pending_slots
