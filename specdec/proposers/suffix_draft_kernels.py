"""The suffix proposer's drafting, compiled (numba): each row's chain draft from the tries as they stand.

`SuffixProposer` (`specdec/proposers/suffix.py`) calls `draft_chains` once a step over every row; the node store and
its lookups are `specdec/proposers/suffix_kernels.py`'s. Compiled once and cached on disk where numba can (`CACHE`).
"""

from __future__ import annotations

import numba
import numpy as np

from specdec.proposers.suffix_kernels import CACHE, _child, _walk


@numba.njit(cache=CACHE)
def draft_chains(nodes, branching, table, frontiers, asked, sources, max_spec_factor, min_prob, context):
    """Each row's chain draft, as `SuffixProposer` documents it: the best-scoring first-round walk over every
    (source trie, match length), then, where `context >= 0` and the draft stops short, the best second-round walk from
    the context it ends in (the draft's last m tokens, or the whole draft plus up to `context` tokens of the row).

    Args: `frontiers [tries, slots, D]` (rows first), `asked [rows]`, `sources [S]` (trie indices). Returns tokens
    `[rows, K]` (-1 padded), counts `[rows]`, scores `[rows]` and the first round's last path probabilities `[rows]`.
    """
    num_rows, depth = len(asked), frontiers.shape[2]
    width = 0
    for r in range(num_rows):
        width = max(width, asked[r])
    drafts = np.full((num_rows, width), -1, dtype=np.int64)
    counts = np.zeros(num_rows, dtype=np.int64)
    scores = np.zeros(num_rows)
    ends = np.ones(num_rows)
    walked = np.empty(max(width, 1), dtype=np.int64)
    node_counts = np.empty(depth, dtype=np.int64)
    limits = np.empty(depth, dtype=np.int64)
    for r in range(num_rows):
        if asked[r] <= 0:
            continue
        best = -1.0
        for s in sources:
            for m in range(1, depth):
                node = frontiers[s, r, m]
                node_counts[m] = nodes[node, 0] if node >= 0 else 0
                limits[m] = min(asked[r], np.int64(np.floor(m * max_spec_factor)), depth - m)
            for m in range(1, depth):
                # a node seen once is the row's own occurrence: nothing followed it yet
                if node_counts[m] < 2 or limits[m] < 1:
                    continue
                # an m-gram as frequent as the (m+1)-gram that ends with it occurs only there: both walk alike up to
                # the shorter limit, so only the one of larger limit walks (the longer on a tie)
                if m + 1 < depth and node_counts[m] == node_counts[m + 1] and limits[m] <= limits[m + 1]:
                    continue
                if m > 1 and node_counts[m - 1] == node_counts[m] and limits[m] < limits[m - 1]:
                    continue
                length, score, prob = _walk(nodes, frontiers[s, r, m], limits[m], min_prob, 1, walked, 0)
                if length > 0 and score >= best:  # ties: the later walk (the global trie, the longer match)
                    best = score
                    drafts[r, :length] = walked[:length]
                    drafts[r, length:] = -1
                    counts[r], scores[r], ends[r] = length, score, prob
        if context >= 0 and 0 < counts[r] < asked[r]:
            _continue(
                nodes,
                branching,
                table,
                frontiers,
                r,
                asked[r],
                sources,
                max_spec_factor,
                min_prob,
                context,
                drafts,
                counts,
                scores,
                ends,
                walked,
            )
    return drafts, counts, scores, ends


@numba.njit(cache=CACHE)
def _continue(
    nodes,
    branching,
    table,
    frontiers,
    r,
    asked,
    sources,
    max_spec_factor,
    min_prob,
    context,
    drafts,
    counts,
    scores,
    ends,
    walked,
):
    """Row r's short draft goes on with the best walk from the context it ends in; in place."""
    depth = frontiers.shape[2]
    num_drafted = counts[r]
    remaining = asked - num_drafted
    best_more, best_match, best_length = -1.0, -1, 0
    kept = np.empty(remaining, dtype=np.int64)
    # walkers: the row's last c tokens then the whole draft (c = 0: from the root), then the draft's last m tokens;
    # each from every source trie, in that order (ties: the later walker)
    num_first = len(sources) * (context + 1)
    for w in range(num_first + len(sources) * max(num_drafted - 1, 0)):
        if w < num_first:
            s, c = sources[w // (context + 1)], w % (context + 1)
            skip, match = 0, num_drafted + c
            if match >= depth:
                continue
            node = np.int64(frontiers[s, r, c])
        else:
            s, m = sources[(w - num_first) // (num_drafted - 1)], (w - num_first) % (num_drafted - 1) + 1
            skip, match = num_drafted - m, m
            if match >= depth:
                continue
            node = np.int64(frontiers[s, r, 0])
        j = skip
        while node >= 0 and j < num_drafted:
            node = _child(nodes, branching, table, node, drafts[r, j])
            j += 1
        if node < 0:
            continue
        # the row's own text ends in this context (no continuation yet) only where it is the row's own suffix node
        num_open = 1 if node == frontiers[s, r, match] else 0
        limit = min(remaining, np.int64(np.floor(match * max_spec_factor)), depth - match)
        length, more, _ = _walk(nodes, node, limit, min_prob, num_open, walked, 0)
        if length > 0 and (more > best_more or (more == best_more and match >= best_match)):
            best_more, best_match, best_length = more, match, length
            kept[:length] = walked[:length]
    if best_length > 0:
        drafts[r, num_drafted : num_drafted + best_length] = kept[:best_length]
        counts[r] += best_length
        scores[r] += ends[r] * best_more
