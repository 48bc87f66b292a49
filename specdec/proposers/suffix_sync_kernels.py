"""The suffix proposer's compiled taking in of the rows' tokens (numba): one call per step for every row.

`SuffixTries` (`specdec/proposers/suffix_tries.py`) calls `sync_rows` through its `SuffixIndex`; the counting is
`specdec/proposers/suffix_kernels.py`'s. Compiled once and cached on disk where numba can (`CACHE`); it releases the GIL
(`nogil=True`), so that a background thread may take tokens in while the host prepares the next step.
"""

from __future__ import annotations

import numba
import numpy as np

from specdec.proposers.suffix_kernels import CACHE, insert


@numba.njit(cache=CACHE, nogil=True)
def sync_rows(
    nodes,
    branching,
    table,
    state,
    seen,
    work,
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
    status,
    defer,
):
    """Take in the tokens each of `rows [N]` gained: `token_ids[rows[i], num_inserted[rows[i]]:num_tokens[i]]`
    (`token_ids [*, T]`) go to the row's response (`responses [slots, P]`, after `prompt_len [slots]`) and, behind the
    pending sequences, into the tries: the growing rows' prompt-trie then global-trie frontiers (`frontiers [2, slots,
    D]`) with their new tokens are appended to the pending ones (`pending_frontiers [S, D]`, `pending_tokens [S, W]`,
    `pending_lengths [S]`; `status[0]` of them are in use) and, unless `defer`, all are inserted together, the rows'
    frontiers moved on and the pending ones dropped. Nothing is done, and `status[1]` is set, if a row holds fewer
    tokens than it has inserted (it was rewound). Returns the store's arrays and the pending ones (grown as needed);
    `seen` and `work` must be `scratch(S' * D)` or larger for the S' pending sequences there will be."""
    depth = frontiers.shape[2]
    status[1] = 0
    num_growing, longest = 0, 0
    for i in range(len(rows)):
        gained = num_tokens[i] - num_inserted[rows[i]]
        if gained < 0:
            status[1] = 1
            return nodes, branching, table, pending_frontiers, pending_tokens, pending_lengths
        if gained > 0:
            num_growing += 1
            longest = max(longest, gained)
    first = status[0]
    total = first + 2 * num_growing
    if total > len(pending_frontiers) or longest > pending_tokens.shape[1]:
        capacity = max(total, 2 * len(pending_frontiers))
        grown_frontiers = np.empty((capacity, depth), dtype=pending_frontiers.dtype)
        grown_frontiers[:first] = pending_frontiers[:first]
        grown_tokens = np.zeros((capacity, max(longest, pending_tokens.shape[1])), dtype=np.int64)
        grown_tokens[:first, : pending_tokens.shape[1]] = pending_tokens[:first]
        grown_lengths = np.zeros(capacity, dtype=np.int64)
        grown_lengths[:first] = pending_lengths[:first]
        pending_frontiers, pending_tokens, pending_lengths = grown_frontiers, grown_tokens, grown_lengths
    growing = np.empty(num_growing, dtype=np.int64)
    at = first
    for i in range(len(rows)):
        row = rows[i]
        start = num_inserted[row]
        gained = num_tokens[i] - start
        if gained <= 0:
            continue
        growing[at - first] = row
        for k in range(gained):
            token = token_ids[row, start + k]
            responses[row, start - prompt_len[row] + k] = token
            pending_tokens[at, k] = token
            pending_tokens[at + num_growing, k] = token
        for m in range(depth):
            pending_frontiers[at, m] = frontiers[0, row, m]
            pending_frontiers[at + num_growing, m] = frontiers[1, row, m]
        pending_lengths[at] = pending_lengths[at + num_growing] = gained
        num_inserted[row] = num_tokens[i]
        at += 1
    status[0] = total
    if defer or total == 0:
        return nodes, branching, table, pending_frontiers, pending_tokens, pending_lengths
    nodes, branching, table = insert(
        nodes,
        branching,
        table,
        state,
        seen,
        work,
        pending_frontiers[:total],
        pending_tokens[:total],
        pending_lengths[:total],
        1,
    )
    for g in range(num_growing):
        for m in range(depth):
            frontiers[0, growing[g], m] = pending_frontiers[first + g, m]
            frontiers[1, growing[g], m] = pending_frontiers[first + num_growing + g, m]
    status[0] = 0
    return nodes, branching, table, pending_frontiers, pending_tokens, pending_lengths
