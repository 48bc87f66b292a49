"""The suffix proposer's compiled loops (numba): the node store's counting and lookups.

`SuffixIndex` (`specdec/suffix_index.py`) calls these; it imports this module with its first object, so a run that
drafts otherwise never imports numba. Every function is compiled once and cached on disk where numba can (`CACHE`).
Taking in the rows' tokens is `specdec/proposers/suffix_sync_kernels.py`, drafting
`specdec/proposers/suffix_draft_kernels.py`.

The store's arrays: `nodes [capacity, 4]` int32 rows `[count, best, token, first child]`, `branching [capacity]` (the
node has children in the hash table), `table [slots, 3]` int32 rows `[parent, token, child]` (parent -1: empty; a
lookup reads one row, not a key and then a value) and `state [3]` int64 `[num_nodes, num_keys, runs counted]`.
Functions that may add nodes or keys return the three arrays, reallocated when they grew.

A batch of (parent, token) updates counts the way a vectorised update of the whole batch would: a parent's first
child and the "fresh" shortcut are decided on the records as they were before the batch, and a parent's best child
is raised in rounds (every update compares against the best as it was at the round's start, the last writer wins), so
that ties between children counted in one batch resolve the same way they always have (the numpy reference,
`specdec/proposers/suffix_ref.py`, is the specification). Only the order of a parent's own updates matters to that,
so a batch of sequences is counted column by column (every sequence's m-gram node, then the (m+1)-grams): the nodes
of one column were made together, and a column's parents fit a small table of who was named twice.
"""

from __future__ import annotations

import hashlib
import pathlib
import warnings

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

_EMPTY = -1
_TOKEN_BITS = 21  # as in specdec/suffix_index.py
_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing
_BEST_ROUNDS = 8  # rounds of raising a parent's best child within one batch
_AHEAD = 16  # updates between asking for a parent's record and using it
_MAX_NODES = 2**31 - 1  # node ids are int32


_MODULES = ("suffix_kernels", "suffix_sync_kernels", "suffix_draft_kernels")  # the last two compile this one's in


def _drop_stale_caches(sources: pathlib.Path, cache: pathlib.Path) -> bool:
    """Remove the suffix kernels' cached compilations in `cache` (numba's folder for `sources`, the package's
    `specdec/proposers/`) if this module or a dependent changed since they were written; returns whether it removed
    them.

    Numba checks a cached kernel against its own source file only: a kernel of a dependent inlines this module's
    functions, and would load its old machine code after only this file changed (a `git pull` in a source checkout,
    an edit). A digest of the three files, kept beside the caches, tells. Where the folder cannot be written, this
    does nothing (and numba cannot write its caches there either)."""
    digest = hashlib.sha256(b"".join((sources / f"{name}.py").read_bytes() for name in _MODULES)).hexdigest()
    stamp = cache / "suffix_kernels.sources"
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass  # none yet
    try:
        stale = [path for path in cache.glob("suffix_*") if path.suffix in (".nbi", ".nbc")]
        for path in stale:  # (numba takes a cache file gone while its index still names it as a miss)
            path.unlink(missing_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        return False
    return bool(stale)


@intrinsic
def _prefetch(typingctx, array, index):
    """Hint the CPU to fetch `array.flat[index]` (a C-contiguous array) into the cache; no effect on results."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        hint = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32])
        )
        address = builder.bitcast(builder.gep(data, [args[1]]), byte)
        # a read, kept in every cache level, of data
        builder.call(hint, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return numba.types.void(array, index), codegen


def _prefetch_probe(array):
    _prefetch(array, 0)


try:  # numba picks where a kernel's cache goes when the kernel is made: the package's folder, else its user-wide one
    _prefetch_probe = numba.njit(cache=True)(_prefetch_probe)
    CACHE = True  # every suffix kernel is cached on disk (`cache=CACHE`)
except RuntimeError:  # "no locator available": neither can be written (a read-only install, an unwritable HOME)
    _prefetch_probe = numba.njit(_prefetch_probe)
    CACHE = False
    warnings.warn(
        f"numba cannot cache the suffix proposer's kernels (neither {pathlib.Path(__file__).parent} nor its own "
        "cache folder can be written): they compile again in every process, about 30 s; set NUMBA_CACHE_DIR to a "
        "writable folder",
        RuntimeWarning,
        stacklevel=2,
    )
if CACHE:  # (`_cache.cache_path`: numba's own folder for this file, wherever its locator put it)
    _cache_path = getattr(getattr(_prefetch_probe, "_cache", None), "cache_path", None)
    if _cache_path is not None:
        _drop_stale_caches(pathlib.Path(__file__).resolve().parent, pathlib.Path(_cache_path))


def _prefetch_compiles() -> bool:
    """Whether this numba's LLVM takes the prefetch hint as written (its name and pointer type moved across LLVM
    versions); where it does not, the hint is left out, which changes nothing but speed (cached on disk)."""
    try:
        _prefetch_probe(np.zeros(1, dtype=np.int32))
    except Exception:  # noqa: BLE001 - any failure to lower the hint: go without it
        return False
    return True


if not _prefetch_compiles():

    @numba.njit(inline="always")
    def _prefetch(array, index):  # noqa: F811 - the hint left out
        pass


@numba.njit(cache=CACHE, inline="always")
def _slot(key, bits):
    return np.int64((np.uint64(key) * _HASH) >> np.uint64(64 - bits))


@numba.njit(cache=CACHE)
def _bits(size):
    bits = 0
    while (1 << bits) < size:
        bits += 1
    return bits


@numba.njit(cache=CACHE, inline="always")
def _log2(size):
    """log2 of a power of two, in 6 steps."""
    bits = 0
    for step in (32, 16, 8, 4, 2, 1):
        if size >= np.int64(1) << step:
            size >>= step
            bits += step
    return bits


@numba.njit(cache=CACHE)
def _lookup(table, parent, token):
    """The row of `table` holding the child of `parent` by `token`, or -1."""
    mask = len(table) - 1
    slot = _slot((np.int64(parent) << _TOKEN_BITS) | token, _log2(len(table)))
    while table[slot, 0] != _EMPTY:
        if table[slot, 0] == parent and table[slot, 1] == token:
            return slot
        slot = (slot + 1) & mask
    return -1


@numba.njit(cache=CACHE)
def _store(table, parent, token, child):
    """Put a (parent, token) that is not in `table` there, with its child."""
    mask = len(table) - 1
    slot = _slot((np.int64(parent) << _TOKEN_BITS) | token, _log2(len(table)))
    while table[slot, 0] != _EMPTY:
        slot = (slot + 1) & mask
    table[slot, 0], table[slot, 1], table[slot, 2] = parent, token, child


@numba.njit(cache=CACHE)
def rehash(table, size):
    """The table's entries in a new one of the next power of two >= `size` slots."""
    grown = np.full((1 << _bits(size), 3), _EMPTY, dtype=np.int32)
    for s in range(len(table)):
        if table[s, 0] != _EMPTY:
            _store(grown, table[s, 0], table[s, 1], table[s, 2])
    return grown


@numba.njit(cache=CACHE)
def reserve(nodes, branching, needed):
    """`nodes` and `branching` with room for `needed` nodes (doubling). Rows past `num_nodes` are left as they come:
    a node's four fields are all written when it is made (so growing touches only the pages it copies)."""
    if needed <= len(nodes):
        return nodes, branching
    if needed > _MAX_NODES:  # node ids are int32: past this they would wrap, silently
        raise ValueError(
            "the suffix history holds 2^31 - 1 nodes, its most: lower suffix_decoding_max_cached_requests or "
            "suffix_decoding_max_tree_depth, or clear the history"
        )
    capacity = min(max(needed, 2 * len(nodes)), _MAX_NODES)
    new_nodes = np.empty((capacity, 4), dtype=np.int32)
    new_nodes[: len(nodes)] = nodes
    new_branching = np.zeros(capacity, dtype=np.bool_)
    new_branching[: len(branching)] = branching
    return new_nodes, new_branching


@numba.njit(cache=CACHE, inline="always")
def _child(nodes, branching, table, parent, token):
    """The child of `parent` by `token`, -1 if none. Reads only."""
    first = nodes[parent, 3]
    if first >= 0 and nodes[first, 2] == token:
        return np.int64(first)
    if branching[parent]:
        best = nodes[parent, 1]  # the child a sequence most often takes, before hashing
        if best >= 0 and nodes[best, 2] == token:
            return np.int64(best)
        slot = _lookup(table, parent, token)
        if slot >= 0:
            return np.int64(table[slot, 2])
    return np.int64(-1)


@numba.njit(cache=CACHE)
def children(nodes, branching, table, parents, tokens):
    """`_child` of each of `parents [N]` (valid nodes) by `tokens [N]`."""
    found = np.empty(len(parents), dtype=np.int64)
    for i in range(len(parents)):
        found[i] = _child(nodes, branching, table, parents[i], tokens[i])
    return found


@numba.njit(cache=CACHE)
def scratch(num_updates):
    """Scratch for batches of up to `num_updates` updates, kept from call to call: `seen` (`count`'s table of a
    batch's parents, 4 int64 per slot, at load <= 1/2) and `work` (9 int64 per update: 4 for `count`, 5 for its
    callers)."""
    seen = np.empty(4 << _bits(2 * num_updates + 2), dtype=np.int64)
    seen[3::4] = -1  # no batch's stamp: free
    return seen, np.empty(9 * num_updates, dtype=np.int64)


@numba.njit(cache=CACHE)
def count(nodes, branching, table, state, parents, tokens, owners, shared, runs, delta, out, seen, work):
    """Count one batch: the child of each of `parents [N]` by `tokens [N]` (created when `delta > 0`; else it must
    exist) gets `delta` added to its count; its id goes to `out [N]`. `runs [R + 1]`: offsets of runs of updates
    whose parents have one depth (each parent is named in one run only). `owners [N]`, `shared [S]`: with runs of
    one column each (the sequences' nodes for their last m tokens, in a fixed order of the S sequences), the
    sequence of each update and whether it may share its parent with another sequence (True for all at the start;
    updated run by run); both empty: any parent may be shared. `seen`, `work`: `scratch(N)` or larger, kept from
    batch to batch. Returns the store's arrays.

    One pass, update by update. That equals updating the whole batch at once (the reference) for every parent named
    once in the batch; a parent named several times then gets its best child again from its best before the batch,
    in the reference's rounds."""
    n = len(parents)
    assert len(seen) >= 4 * (2 * n + 2) and len(work) >= 4 * n, "expected scratch(N) or larger"
    nodes, branching = reserve(nodes, branching, state[0] + n)
    # per update: the next update of its parent and the parent's best before the batch (kept for a chain's first),
    # its `seen` slot (-1: not chained); and the first update of each parent whose best is decided in rounds. `seen`
    # holds (parent, first update, last update, stamp) per slot, for the parents of one run (a table of the run's
    # size, so that it stays in cache); a slot of another stamp is free, so the table is never cleared
    next_same = work[:n]
    old_best = work[n : 2 * n]
    repeated = work[2 * n : 3 * n]
    slot_of = work[3 * n : 4 * n]
    filtered = len(owners) > 0
    num_repeated = 0
    run, run_start, run_end = 0, 0, 0
    seen_bits, seen_mask, stamp = 0, 0, 0
    for i in range(n):
        if i == run_end:  # a new run: a new stamp
            if filtered:
                # a parent shared at column m is shared at column m - 1: a sequence whose parent was named once in
                # this run names a parent of its own in the next
                for e in range(run_start, i):
                    at = slot_of[e]
                    shared[owners[e]] = at >= 0 and seen[at + 1] != seen[at + 2]
            while runs[run + 1] == i:
                run += 1
            run_start, run_end = i, runs[run + 1]
            seen_bits = _bits(2 * (run_end - i) + 2)
            seen_mask = (1 << seen_bits) - 1
            state[2] += 1
            stamp = state[2]
            run += 1
        # the records this loop reads, asked for ahead: a parent's (and its branching flag) 16 updates ahead; its first
        # and best child's 8 ahead, and the hash table's slot for a parent with more children
        if i + _AHEAD < n:
            _prefetch(nodes, 4 * parents[i + _AHEAD])
            _prefetch(branching, parents[i + _AHEAD])
        if i + _AHEAD // 2 < n:
            q = parents[i + _AHEAD // 2]
            if nodes[q, 3] >= 0:
                _prefetch(nodes, 4 * nodes[q, 3])
            if nodes[q, 1] >= 0 and nodes[q, 1] != nodes[q, 3]:
                _prefetch(nodes, 4 * nodes[q, 1])
            if branching[q]:
                key = (np.int64(q) << _TOKEN_BITS) | tokens[i + _AHEAD // 2]
                _prefetch(table, 3 * _slot(key, _log2(len(table))))
        p, token = parents[i], tokens[i]
        slot_of[i] = -1
        if delta > 0 and nodes[p, 0] == 1 and nodes[p, 3] < 0:
            # a parent seen once (a sequence's end) that never had a child: its child is new, and no other update
            # of this batch names the parent (it would have been counted twice)
            c = state[0]
            state[0] += 1
            nodes[c, 0], nodes[c, 1], nodes[c, 2], nodes[c, 3] = 1, -1, token, -1
            nodes[p, 1] = c
            nodes[p, 3] = c
            out[i] = c
            continue
        chained = -1
        if delta > 0 and nodes[p, 0] >= 2 and (not filtered or shared[owners[i]]):
            # only a parent seen twice can be named twice (each naming is an occurrence, and counts only grow here):
            # chain its updates
            slot = _slot(p, seen_bits)
            while seen[4 * slot + 3] == stamp and seen[4 * slot] != p:
                slot = (slot + 1) & seen_mask
            at = 4 * slot
            slot_of[i] = at
            next_same[i] = -1
            if seen[at + 3] != stamp:
                seen[at], seen[at + 1], seen[at + 2], seen[at + 3] = p, i, i, stamp
                old_best[i] = nodes[p, 1]
            else:
                next_same[seen[at + 2]] = i
                seen[at + 2] = i
                chained = at
        c = _child(nodes, branching, table, p, token)
        if c < 0:
            assert delta > 0, "expected every node of a removed sequence to exist"
            c = state[0]
            state[0] += 1
            nodes[c, 0], nodes[c, 1], nodes[c, 2], nodes[c, 3] = 0, -1, token, -1
            if nodes[p, 3] < 0:
                nodes[p, 3] = c
            else:  # a later child: into the hash table, kept at load <= 1/4
                if 4 * (state[1] + 1) > len(table):
                    table = rehash(table, 8 * (state[1] + 1))
                _store(table, p, token, c)
                state[1] += 1
                branching[p] = True
        out[i] = c
        if chained >= 0 and seen[chained + 1] >= 0 and out[seen[chained + 1]] != c:
            # a second child of the parent in this batch: its best is decided after the batch, in rounds (while all
            # the updates of a parent name one child, update by update decides as the rounds would)
            repeated[num_repeated] = seen[chained + 1]
            num_repeated += 1
            seen[chained + 1] = -1 - seen[chained + 1]
        nodes[c, 0] += delta
        best = nodes[p, 1]
        if delta > 0:
            if best < 0 or nodes[c, 0] > nodes[best, 0]:
                nodes[p, 1] = c
        elif best >= 0 and nodes[best, 0] <= 0:  # a child counted down to 0 is nobody's best
            nodes[p, 1] = -1
    if delta > 0:
        for k in range(num_repeated):
            first = repeated[k]
            nodes[parents[first], 1] = _raise_best(nodes, first, old_best[first], out, next_same)
    return nodes, branching, table


@numba.njit(cache=CACHE)
def _raise_best(nodes, first, old_best, out, next_same):
    """The best child, after the batch, of the parent of updates `first`, `next_same[first]`, ... from `old_best`
    (its best before the batch) as a vectorised update of the batch sets it: in rounds, every update compares against
    the best as the round found it, and of several that beat it the last one writes."""
    p_best = old_best
    for _ in range(_BEST_ROUNDS):
        winner = -1
        i = first
        while i >= 0:
            # a child that was its parent's best before the batch stays out (it is the best, or was beaten)
            if out[i] != old_best and (p_best < 0 or nodes[out[i], 0] > nodes[p_best, 0]):
                winner = out[i]
            i = next_same[i]
        if winner < 0:
            break
        p_best = winner
    return p_best


@numba.njit(cache=CACHE)
def insert(nodes, branching, table, state, seen, work, frontier, tokens, lengths, delta):
    """Append `tokens[r, :lengths[r]]` (`[M, T]`) to the sequences with frontiers `[M, D]` (in place), one batch per
    position: every (row, column) of the rows still going on, column by column and in row order within a column (a
    parent's updates come in row order, which is all that the order of a batch decides). `seen`, `work`:
    `scratch(M * D)` or larger. Returns the store's arrays."""
    num_rows, depth = frontier.shape
    size = num_rows * depth
    assert len(work) >= 9 * size, "expected scratch(M * D) or larger"
    longest = 0
    for r in range(num_rows):
        longest = max(longest, lengths[r])
    # the batch (parent, token, owner row, child) in 4 of the last 5 scratch ints per update, and each column's first
    # update
    parents = work[4 * size : 5 * size]
    batch_tokens = work[5 * size : 6 * size]
    owners = work[6 * size : 7 * size]
    out = work[7 * size : 8 * size]
    runs = np.empty(depth + 1, dtype=np.int64)
    shared = np.empty(num_rows, dtype=np.bool_)
    for j in range(longest):
        n = 0
        for m in range(depth):
            runs[m] = n
            for r in range(num_rows):
                if lengths[r] > j and frontier[r, m] >= 0:
                    parents[n], batch_tokens[n], owners[n] = frontier[r, m], tokens[r, j], r
                    n += 1
        runs[depth] = n
        shared[:] = True
        nodes, branching, table = count(
            nodes,
            branching,
            table,
            state,
            parents[:n],
            batch_tokens[:n],
            owners[:n],
            shared,
            runs,
            delta,
            out[:n],
            seen,
            work,
        )
        # the child of column m goes to column m + 1 (column 0, the root, stays); a depth-D node (the last column's
        # child) is counted, never extended
        for r in range(num_rows):
            if lengths[r] > j:
                frontier[r, 1:] = -1
        for m in range(depth - 1):
            for e in range(runs[m], runs[m + 1]):
                frontier[owners[e], m + 1] = out[e]
    return nodes, branching, table


@numba.njit(cache=CACHE)
def add_sequences(nodes, branching, table, state, roots, tokens, lengths, depth, delta):
    """Insert (+1) or remove (-1) whole sequences `tokens[r, :lengths[r]]` (`[N, T]`) under `roots [N]`, one batch
    per depth: the n-gram ending at position p is the child of the (n-1)-gram ending at p - 1; a batch holds every
    position of every sequence, in row order. Returns the store's arrays."""
    num, width = tokens.shape
    parents = np.full((num, width), -1, dtype=np.int64)
    for r in range(num):
        parents[r, : lengths[r]] = roots[r]
    size = num * width
    seen, work = scratch(size)
    flat_parents = work[4 * size : 5 * size]
    flat_tokens = work[5 * size : 6 * size]
    positions = work[6 * size : 7 * size]
    out = work[7 * size : 8 * size]
    runs = np.zeros(2, dtype=np.int64)  # a batch is one run: its parents have the batch's depth
    none, none_shared = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.bool_)  # any parent may be shared
    for _ in range(depth):
        n = 0
        for r in range(num):
            for c in range(width):
                if parents[r, c] >= 0:
                    flat_parents[n], flat_tokens[n], positions[n] = parents[r, c], tokens[r, c], r * width + c
                    n += 1
        if n == 0:
            break
        runs[1] = n
        nodes, branching, table = count(
            nodes,
            branching,
            table,
            state,
            flat_parents[:n],
            flat_tokens[:n],
            none,
            none_shared,
            runs,
            delta,
            out[:n],
            seen,
            work,
        )
        parents[:] = -1
        for e in range(n):
            r, c = positions[e] // width, positions[e] % width
            if c + 1 < lengths[r]:
                parents[r, c + 1] = out[e]
    return nodes, branching, table


@numba.njit(cache=CACHE, inline="always")
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


@numba.njit(cache=CACHE)
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
