"""The suffix proposer's compiled loops (numba): the node store's counting and lookups, and drafting.

`SuffixIndex` (`specdec/suffix_index.py`) and `SuffixProposer` (`specdec/proposers/suffix.py`) call these; they
import this module with their first object, so a run that drafts otherwise never imports numba. Every function is
compiled once and cached on disk (`cache=True`).

The store's arrays: `nodes [capacity, 4]` int32 rows `[count, best, token, first child]`, `branching [capacity]` (the
node has children in the hash table), `keys [slots]` int64 (`parent << 21 | token`, -1 empty) and `values [slots]`
int32 (the child), `state [2]` int64 `[num_nodes, num_keys]`. Functions that may add nodes or keys return the four
arrays, reallocated when they grew.

A batch of (parent, token) updates counts the way a vectorised update of the whole batch would: a parent's first
child and the "fresh" shortcut are decided on the records as they were before the batch, and a parent's best child
is raised in rounds (every update compares against the best as it was at the round's start, the last writer wins), so
that ties between children counted in one batch resolve the same way they always have (the numpy reference,
`specdec/proposers/suffix_ref.py`, is the specification).
"""

from __future__ import annotations

import numba
import numpy as np

_EMPTY = -1
_TOKEN_BITS = 21  # as in specdec/suffix_index.py
_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing
_BEST_ROUNDS = 8  # rounds of raising a parent's best child within one batch


@numba.njit(cache=True, inline="always")
def _slot(key, bits):
    return np.int64((np.uint64(key) * _HASH) >> np.uint64(64 - bits))


@numba.njit(cache=True)
def _bits(size):
    bits = 0
    while (1 << bits) < size:
        bits += 1
    return bits


@numba.njit(cache=True)
def _lookup(keys, key):
    """The value slot of `key`, or -1."""
    mask = len(keys) - 1
    slot = _slot(key, _bits(len(keys)))
    while keys[slot] != _EMPTY:
        if keys[slot] == key:
            return slot
        slot = (slot + 1) & mask
    return -1


@numba.njit(cache=True)
def rehash(keys, values, size):
    """The table's entries in a new one of the next power of two >= `size` slots."""
    capacity = 1 << _bits(size)
    new_keys = np.full(capacity, _EMPTY, dtype=np.int64)
    new_values = np.zeros(capacity, dtype=np.int32)
    bits, mask = _bits(capacity), capacity - 1
    for s in range(len(keys)):
        key = keys[s]
        if key != _EMPTY:
            slot = _slot(key, bits)
            while new_keys[slot] != _EMPTY:
                slot = (slot + 1) & mask
            new_keys[slot] = key
            new_values[slot] = values[s]
    return new_keys, new_values


@numba.njit(cache=True)
def reserve(nodes, branching, needed):
    """`nodes` and `branching` with room for `needed` nodes (doubling). Rows past `num_nodes` are left as they come:
    a node's four fields are all written when it is made (so growing touches only the pages it copies)."""
    if needed <= len(nodes):
        return nodes, branching
    capacity = max(needed, 2 * len(nodes))
    new_nodes = np.empty((capacity, 4), dtype=np.int32)
    new_nodes[: len(nodes)] = nodes
    new_branching = np.zeros(capacity, dtype=np.bool_)
    new_branching[: len(branching)] = branching
    return new_nodes, new_branching


@numba.njit(cache=True, inline="always")
def _child(nodes, branching, keys, values, parent, token):
    """The child of `parent` by `token`, -1 if none. Reads only."""
    first = nodes[parent, 3]
    if first >= 0 and nodes[first, 2] == token:
        return np.int64(first)
    if branching[parent]:
        slot = _lookup(keys, (np.int64(parent) << _TOKEN_BITS) | token)
        if slot >= 0:
            return np.int64(values[slot])
    return np.int64(-1)


@numba.njit(cache=True)
def children(nodes, branching, keys, values, parents, tokens):
    """`_child` of each of `parents [N]` (valid nodes) by `tokens [N]`."""
    found = np.empty(len(parents), dtype=np.int64)
    for i in range(len(parents)):
        found[i] = _child(nodes, branching, keys, values, parents[i], tokens[i])
    return found


@numba.njit(cache=True)
def count(nodes, branching, keys, values, state, parents, tokens, delta, out):
    """Count one batch: the child of each of `parents [N]` by `tokens [N]` (created when `delta > 0`; else it must
    exist) gets `delta` added to its count; its id goes to `out [N]`. Returns the store's arrays.

    One pass, update by update. That equals updating the whole batch at once (the reference) for every parent named
    once in the batch; a parent named several times then gets its best child again from its best before the batch,
    in the reference's rounds."""
    n = len(parents)
    nodes, branching = reserve(nodes, branching, state[0] + n)
    # the batch's parents, each with its first update and its best before the batch; `next_same` chains the updates of
    # one parent (a small open-addressing table: it stays in cache where the nodes do not)
    seen_bits = _bits(2 * n + 2)
    seen_parent = np.full(1 << seen_bits, -1, dtype=np.int64)
    seen_first = np.empty(1 << seen_bits, dtype=np.int64)
    seen_last = np.empty(1 << seen_bits, dtype=np.int64)
    next_same = np.full(n, -1, dtype=np.int64)
    fresh = np.zeros(n, dtype=np.bool_)
    old_best = np.empty(n, dtype=np.int64)
    repeated = np.empty(n, dtype=np.int64)  # the slots of parents named more than once
    num_repeated = 0
    bits, seen_mask = _bits(len(keys)), (1 << seen_bits) - 1
    for i in range(n):
        p, token = parents[i], tokens[i]
        slot = _slot(p, seen_bits)
        while seen_parent[slot] >= 0 and seen_parent[slot] != p:
            slot = (slot + 1) & seen_mask
        if seen_parent[slot] < 0:
            seen_parent[slot], seen_first[slot], seen_last[slot] = p, i, i
        else:
            if seen_first[slot] == seen_last[slot]:
                repeated[num_repeated] = slot
                num_repeated += 1
            next_same[seen_last[slot]] = i
            seen_last[slot] = i
        old_best[i] = nodes[p, 1]
        if delta > 0 and nodes[p, 0] == 1 and nodes[p, 3] < 0:
            # a parent seen once (a sequence's end) that never had a child: its child is new, and no other update
            # of this batch names the parent (it would have been counted twice)
            c = state[0]
            state[0] += 1
            nodes[c, 0], nodes[c, 1], nodes[c, 2], nodes[c, 3] = 1, -1, token, -1
            nodes[p, 1] = c
            nodes[p, 3] = c
            fresh[i] = True
            out[i] = c
            continue
        c = _child(nodes, branching, keys, values, p, token)
        if c < 0:
            assert delta > 0, "expected every node of a removed sequence to exist"
            c = state[0]
            state[0] += 1
            nodes[c, 0], nodes[c, 1], nodes[c, 2], nodes[c, 3] = 0, -1, token, -1
            if nodes[p, 3] < 0:
                nodes[p, 3] = c
            else:  # a later child: into the hash table, kept at load <= 1/4
                if 4 * (state[1] + 1) > len(keys):
                    keys, values = rehash(keys, values, 8 * (state[1] + 1))
                    bits = _bits(len(keys))
                key = (np.int64(p) << _TOKEN_BITS) | token
                mask = len(keys) - 1
                slot = _slot(key, bits)
                while keys[slot] != _EMPTY:
                    slot = (slot + 1) & mask
                keys[slot] = key
                values[slot] = c
                state[1] += 1
                branching[p] = True
        out[i] = c
        nodes[c, 0] += delta
        best = nodes[p, 1]
        if delta > 0:
            if best < 0 or nodes[c, 0] > nodes[best, 0]:
                nodes[p, 1] = c
        elif best >= 0 and nodes[best, 0] <= 0:  # a child counted down to 0 is nobody's best
            nodes[p, 1] = -1
    if delta > 0:
        for k in range(num_repeated):
            first = seen_first[repeated[k]]
            nodes[parents[first], 1] = _raise_best(nodes, first, old_best[first], out, fresh, next_same)
    return nodes, branching, keys, values


@numba.njit(cache=True)
def _raise_best(nodes, first, old_best, out, fresh, next_same):
    """The best child, after the batch, of the parent of updates `first`, `next_same[first]`, ... from `old_best`
    (its best before the batch) as a vectorised update of the batch sets it: in rounds, every update compares against
    the best as the round found it, and of several that beat it the last one writes."""
    p_best = old_best
    for _ in range(_BEST_ROUNDS):
        winner = -1
        i = first
        while i >= 0:
            # a child that was its parent's best before the batch stays out (it is the best, or was beaten)
            if not fresh[i] and out[i] != old_best and (p_best < 0 or nodes[out[i], 0] > nodes[p_best, 0]):
                winner = out[i]
            i = next_same[i]
        if winner < 0:
            break
        p_best = winner
    return p_best


@numba.njit(cache=True)
def insert(nodes, branching, keys, values, state, frontier, tokens, lengths, delta):
    """Append `tokens[r, :lengths[r]]` (`[M, T]`) to the sequences with frontiers `[M, D]` (in place), one batch per
    position: every (row, column) of the rows still going on, in row order. Returns the store's arrays."""
    num_rows, depth = frontier.shape
    longest = 0
    for r in range(num_rows):
        longest = max(longest, lengths[r])
    parents = np.empty(num_rows * depth, dtype=np.int64)
    batch_tokens = np.empty(num_rows * depth, dtype=np.int64)
    owners = np.empty(num_rows * depth, dtype=np.int64)
    columns = np.empty(num_rows * depth, dtype=np.int64)
    out = np.empty(num_rows * depth, dtype=np.int64)
    for j in range(longest):
        n = 0
        for r in range(num_rows):
            if lengths[r] > j:
                for m in range(depth):
                    if frontier[r, m] >= 0:
                        parents[n], batch_tokens[n], owners[n], columns[n] = frontier[r, m], tokens[r, j], r, m
                        n += 1
        nodes, branching, keys, values = count(
            nodes, branching, keys, values, state, parents[:n], batch_tokens[:n], delta, out[:n]
        )
        # the child of column m goes to column m + 1 (column 0, the root, stays); a depth-D node (the last column's
        # child) is counted, never extended
        for e in range(n):
            r, m = owners[e], columns[e]
            if e == 0 or owners[e - 1] != r:
                frontier[r, 1:] = -1
            if m + 1 < depth:
                frontier[r, m + 1] = out[e]
    return nodes, branching, keys, values


@numba.njit(cache=True)
def add_sequences(nodes, branching, keys, values, state, roots, tokens, lengths, depth, delta):
    """Insert (+1) or remove (-1) whole sequences `tokens[r, :lengths[r]]` (`[N, T]`) under `roots [N]`, one batch
    per depth: the n-gram ending at position p is the child of the (n-1)-gram ending at p - 1; a batch holds every
    position of every sequence, in row order. Returns the store's arrays."""
    num, width = tokens.shape
    parents = np.full((num, width), -1, dtype=np.int64)
    for r in range(num):
        parents[r, : lengths[r]] = roots[r]
    flat_parents = np.empty(num * width, dtype=np.int64)
    flat_tokens = np.empty(num * width, dtype=np.int64)
    positions = np.empty(num * width, dtype=np.int64)
    out = np.empty(num * width, dtype=np.int64)
    for _ in range(depth):
        n = 0
        for r in range(num):
            for c in range(width):
                if parents[r, c] >= 0:
                    flat_parents[n], flat_tokens[n], positions[n] = parents[r, c], tokens[r, c], r * width + c
                    n += 1
        if n == 0:
            break
        nodes, branching, keys, values = count(
            nodes, branching, keys, values, state, flat_parents[:n], flat_tokens[:n], delta, out[:n]
        )
        parents[:] = -1
        for e in range(n):
            r, c = positions[e] // width, positions[e] % width
            if c + 1 < lengths[r]:
                parents[r, c + 1] = out[e]
    return nodes, branching, keys, values


@numba.njit(cache=True, inline="always")
def _walk(nodes, node, max_len, min_prob, num_open, out, offset):
    """Follow the most frequent child from `node` for up to `max_len` tokens while the path probability stays >=
    `min_prob`, writing the tokens to `out[offset:]`; `num_open` occurrences of `node` leave the first ratio's base.
    Returns the length, the score (the path probabilities summed) and the last path probability (1 if none)."""
    length, score, prob = 0, 0.0, 1.0
    base = nodes[node, 0] - num_open
    if max_len <= 0 or base <= 0:
        return length, score, prob
    for j in range(max_len):
        child = nodes[node, 1]
        if child < 0:
            break
        p = prob * nodes[child, 0] / (base if j == 0 else nodes[node, 0])
        if p < min_prob:
            break
        out[offset + j] = nodes[child, 2]
        length += 1
        score += p
        prob = p
        node = child
    return length, score, prob


@numba.njit(cache=True)
def walk(nodes, start, max_len, min_prob, width, num_open):
    """`_walk` from each of `start [N]`: tokens `[N, width]` (-1 padded), lengths, scores and last probabilities."""
    num = len(start)
    tokens = np.full((num, width), -1, dtype=np.int64)
    lengths = np.zeros(num, dtype=np.int64)
    scores = np.zeros(num)
    probs = np.ones(num)
    row = np.empty(max(width, 1), dtype=np.int64)
    for i in range(num):
        lengths[i], scores[i], probs[i] = _walk(nodes, start[i], min(max_len[i], width), min_prob, num_open[i], row, 0)
        tokens[i, : lengths[i]] = row[: lengths[i]]
    return tokens, lengths, scores, probs


@numba.njit(cache=True)
def draft_chains(nodes, branching, keys, values, frontiers, asked, sources, max_spec_factor, min_prob, context):
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
                keys,
                values,
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


@numba.njit(cache=True)
def _continue(
    nodes,
    branching,
    keys,
    values,
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
            node = _child(nodes, branching, keys, values, node, drafts[r, j])
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
