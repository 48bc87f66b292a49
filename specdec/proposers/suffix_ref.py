"""The suffix proposer's numpy reference: its node store, the taking in of the rows' tokens and drafting as they were
before the compiled kernels (`specdec/suffix_index.py`, `specdec/proposers/suffix_kernels.py`,
`specdec/proposers/suffix_draft_kernels.py`), kept as the specification those are held to draft for draft
(`tests/specdec/test_suffix_kernels.py`) and as the "before" of `scripts/bench_suffix.py --kernels`.

Same drafts, same trie counts and best children; nothing in the library runs it. `Lockstep` runs both side by side.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specdec.proposers.base import Drafts, ProposalBatch, Proposer
from specdec.proposers.suffix import SuffixProposer

_EMPTY = -1
_TOKEN_BITS = 21  # a key is parent << 21 | token: vocabularies up to 2M tokens (the separator is vocab_size)
_ROOT_COUNT = 1 << 30
_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing


class SuffixIndexRef:
    """Node store of many depth-limited counted suffix tries.

    Per node: `count` (occurrences of its n-gram), `best` (the child with the largest count, -1 if none), `token`
    (the token on the edge into it) and `first` (its first child; later ones are in the hash table, and `branching`
    marks the nodes that have some). Counts only go down when a sequence is removed; a child whose count falls to 0
    stops being anyone's best, and a `best` whose count fell below a sibling's may stay until the sibling grows again
    (drafts may then be second-best, never wrong: the verifier decides what is kept).
    """

    def __init__(self, max_depth: int, capacity: int = 1 << 12, table_capacity: int = 1 << 17):
        if not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"suffix_decoding_max_tree_depth ({max_depth!r}) must be an integer >= 1")
        self.max_depth = max_depth
        self.num_nodes = 0
        # one row per node, [count, best, token, first child]: the fields a step reads of a node share a cache line
        self.nodes = np.tile(np.array([0, -1, -1, -1], dtype=np.int32), (capacity, 1))
        self.branching = np.zeros(capacity, dtype=bool)  # the node has more children, in the hash table
        # (parent << 21 | token) of every later child, in 2^17 slots (1.5 MiB) from the start: a probe round is ~10
        # numpy calls whatever the keys, so a small history's lookups should mostly end in the first one (8.8k keys at
        # load 1/15 instead of 1/7: 4% less proposer time at 64 rows); a large history grows it as before
        self._keys = np.full(table_capacity, _EMPTY, dtype=np.int64)
        self._values = np.zeros(table_capacity, dtype=np.int32)
        self._num_keys = 0

    @property
    def count(self) -> np.ndarray:
        return self.nodes[:, 0]

    @property
    def best(self) -> np.ndarray:
        return self.nodes[:, 1]

    @property
    def token(self) -> np.ndarray:
        return self.nodes[:, 2]

    @property
    def first(self) -> np.ndarray:
        return self.nodes[:, 3]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.nodes, self.branching, self._keys, self._values))

    def new_root(self) -> int:
        """A new empty trie; returns its root node."""
        root = int(self._allocate(np.array([-1], dtype=np.int32))[0])
        self.count[root] = _ROOT_COUNT  # a root is no n-gram; this count only marks it as shared by every sequence
        return root

    def start(self, roots: np.ndarray) -> np.ndarray:
        """`[N, D]` frontiers of empty sequences in the tries of `roots [N]`."""
        frontier = np.full((len(roots), self.max_depth), -1, dtype=np.int32)
        frontier[:, 0] = roots
        return frontier

    def extend(self, frontier: np.ndarray, tokens: np.ndarray, delta: int = 1) -> np.ndarray:
        """Append `tokens [N]` to N sequences with frontiers `[N, D]`: every suffix count changes by `delta` (+1 on
        insert; -1 removes a sequence inserted before, whose nodes must exist). Returns the new frontiers."""
        flat = np.ascontiguousarray(frontier).ravel()
        at = (flat >= 0).nonzero()[0]  # (row, m) pairs in row order, as flat indices
        children = self._count(flat[at], tokens[at // self.max_depth], delta)
        # the child of column m goes to column m + 1; a depth-D node (the last column's child) is counted, never
        # extended: it lands in the next row's column 0, which the roots then overwrite (one spare past the last row)
        new = np.full(flat.size + 1, -1, dtype=frontier.dtype)
        new[at + 1] = children
        new = new[:-1].reshape(frontier.shape)
        new[:, 0] = frontier[:, 0]
        return new

    def insert(self, frontier: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, delta: int = 1) -> np.ndarray:
        """Append `tokens[i, :lengths[i]]` (`[N, T]`) to each sequence, in lockstep. Returns the new frontiers."""
        frontier = frontier.copy()
        for j in range(int(lengths.max(initial=0))):
            rows = (lengths > j).nonzero()[0]
            if rows.size == len(frontier):  # every sequence goes on
                frontier = self.extend(frontier, tokens[:, j], delta)
            else:
                frontier[rows] = self.extend(frontier[rows], tokens[rows, j], delta)
        return frontier

    def add_sequences(self, roots: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, delta: int = 1) -> None:
        """Insert (+1) or remove (-1) whole sequences `tokens[i, :lengths[i]]` (`[N, T]`) under `roots [N]`, one depth
        at a time: the n-gram ending at position p is the child of the (n-1)-gram ending at p - 1, so D calls do what
        position by position takes max(lengths) calls."""
        num, width = tokens.shape
        valid = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
        parents = np.where(valid, np.asarray(roots, dtype=np.int64)[:, None], -1)
        for _ in range(self.max_depth):
            rows, cols = np.nonzero(parents >= 0)
            if rows.size == 0:
                return
            level = np.full((num, width), -1, dtype=np.int64)
            level[rows, cols] = self._count(parents[rows, cols], tokens[rows, cols], delta)
            parents = np.full((num, width), -1, dtype=np.int64)
            parents[:, 1:] = np.where(valid[:, 1:], level[:, :-1], -1)

    def child(self, parents: np.ndarray, tokens: np.ndarray, first: np.ndarray | None = None) -> np.ndarray:
        """The child of each of `parents [N]` (valid nodes) by its token, -1 where there is none. Reads only.
        `first`: the parents' first children, if the caller has read them already."""
        parents, tokens = parents.astype(np.int64, copy=False), tokens.astype(np.int64, copy=False)
        first = self.first[parents] if first is None else first
        # a node's first child sits in its record; only its later children (branches) go through the hash table
        # (first -1 reads the last node's token, and is masked)
        found = np.where((first >= 0) & (self.token[first] == tokens), first, -1).astype(np.int64)
        ask = ((found < 0) & self.branching[parents]).nonzero()[0]
        if ask.size:
            found[ask] = self._lookup((parents[ask] << _TOKEN_BITS) | tokens[ask])
        return found

    def walk(self, start: np.ndarray, max_len: np.ndarray, min_prob: float, width: int, num_open=0):
        """Follow the most frequent child from each `start [N]` node for up to `max_len [N]` tokens, while the
        path's estimated probability (the product of count ratios) stays >= `min_prob`. `num_open` (an int, or `[N]`)
        occurrences of each start node have no continuation yet (the drafting sequence's own): they leave the first
        ratio's base.

        Returns tokens `[N, width]` (-1 padded), lengths `[N]`, scores `[N]` (the sum of the path probabilities at
        every drafted position, i.e. the expected number of accepted tokens if the counts are right) and the path
        probability at the last drafted position `[N]` (1 where nothing was drafted).
        """
        num = len(start)
        tokens = np.full((num, width), -1, dtype=np.int64)
        lengths = np.zeros(num, dtype=np.int64)
        scores = np.zeros(num)
        prob = np.ones(num)
        node = start.astype(np.int64)
        base = self.count[node] - num_open  # the first step's denominator
        alive = ((max_len > 0) & (base > 0)).nonzero()[0]
        for j in range(width):
            if alive.size == 0:
                break
            child = self.best[node[alive]]
            ok = child >= 0
            alive, child = alive[ok], child[ok]
            p = prob[alive] * self.count[child] / (base[alive] if j == 0 else self.count[node[alive]])
            ok = p >= min_prob
            alive, child, p = alive[ok], child[ok], p[ok]
            tokens[alive, j] = self.token[child]
            lengths[alive] += 1
            scores[alive] += p
            prob[alive] = p
            node[alive] = child
            alive = alive[max_len[alive] > j + 1]
        return tokens, lengths, scores, prob

    # ---- the node store and its hash table -------------------------------------------------------------------------

    def _count(self, parents: np.ndarray, tokens: np.ndarray, delta: int) -> np.ndarray:
        """The child of each parent by its token (created on insert), its count changed by `delta`."""
        children = np.empty(len(parents), dtype=np.int64)
        record = self.nodes.take(parents, axis=0)  # [count, best, token, first] of each parent: one gather
        # fresh: the parent occurs once (a sequence's end) and never had a child, so the child is new and nobody else
        # creates it in this call: most nodes of a deep trie, added with no hashing and no comparing
        fresh = (record[:, 0] == 1) & (record[:, 3] < 0) if delta > 0 else np.zeros(len(parents), bool)
        new = fresh.nonzero()[0]
        if new.size:
            new_parents = parents[new]
            ids = self._allocate(tokens[new].astype(np.int32))
            self.nodes[new_parents, 1] = ids
            self.nodes[new_parents, 3] = ids
            self.nodes[ids[0] : ids[-1] + 1, 0] = 1
            children[new] = ids
        shared = (~fresh).nonzero()[0] if new.size else np.arange(len(parents))
        if shared.size:
            old_parents = parents[shared]
            old_children = self._children(old_parents, tokens[shared].astype(np.int64), record[shared, 3], delta > 0)
            np.add.at(self.count, old_children, np.int32(delta))  # the array's dtype: no cast per element
            if delta > 0:
                self._raise_best(old_parents, old_children, record[shared, 1])
            else:
                dead = self.count[self.best[old_parents]] <= 0
                self.best[old_parents[dead]] = -1
            children[shared] = old_children
        return children

    def _children(self, parents: np.ndarray, tokens: np.ndarray, first: np.ndarray, create: bool) -> np.ndarray:
        """`child`, and the children that are missing created (`create`; else they must all exist). Entries that ask
        for the same new child get the same node."""
        if not create:
            found = self.child(parents, tokens, first)
            assert (found >= 0).all(), "expected every node of a removed sequence to exist"
            return found
        parents, tokens = parents.astype(np.int64, copy=False), tokens.astype(np.int64, copy=False)
        found = np.where((first >= 0) & (self.token[first] == tokens), first, -1).astype(np.int64)
        rest = (found < 0).nonzero()[0]
        if rest.size:
            parents, tokens = parents[rest], tokens[rest]
            ids = np.empty(rest.size, dtype=np.int64)
            hashed = np.ones(rest.size, dtype=bool)
            orphans = (first[rest] < 0).nonzero()[0]
            if orphans.size:  # a parent without children takes the token of the last entry naming it as its first
                owners = parents[orphans]
                self.nodes[owners, 1] = orphans  # `best`, -1 in a parent without children, names entries meanwhile
                lead = self.nodes[owners, 1]
                leads = orphans[lead == orphans]
                self.nodes[parents[leads], 3] = self._allocate(tokens[leads].astype(np.int32))
                self.nodes[owners, 1] = -1
                same = orphans[tokens[lead] == tokens[orphans]]
                ids[same] = self.first[parents[same]]
                hashed[same] = False
            hashed = hashed.nonzero()[0]
            if hashed.size:  # a parent's other children are in the hash table: found there, or created and stored
                ids[hashed] = self._find_or_claim((parents[hashed] << _TOKEN_BITS) | tokens[hashed], tokens[hashed])
                self.branching[parents[hashed]] = True
            found[rest] = ids
        return found

    def _raise_best(self, parents: np.ndarray, children: np.ndarray, best: np.ndarray) -> None:
        """best[p] = the child of largest count among the current best (`best`, before this call) and the children
        just counted."""
        ask = (best != children).nonzero()[0]  # a child that is its parent's best already stays best
        parents, children, best = parents[ask], children[ask], best[ask]
        for _ in range(8):  # several children of one parent in one call: the last write may not be the largest
            better = (best < 0) | (self.count[children] > self.count[best])  # (best -1 reads the last node)
            if not better.any():
                return
            self.best[parents[better]] = children[better]
            best = self.best[parents]

    def _allocate(self, tokens: np.ndarray) -> np.ndarray:
        needed = self.num_nodes + len(tokens)
        if needed > len(self.nodes):
            capacity = max(needed, 2 * len(self.nodes))
            nodes = np.tile(np.array([0, -1, -1, -1], dtype=np.int32), (capacity, 1))
            nodes[: len(self.nodes)] = self.nodes
            branching = np.zeros(capacity, dtype=bool)
            branching[: len(self.branching)] = self.branching
            self.nodes, self.branching = nodes, branching
        ids = np.arange(self.num_nodes, needed, dtype=np.int32)
        self.nodes[self.num_nodes : needed, 2] = tokens  # new nodes are one run: slices, not scatters
        self.num_nodes = needed
        return ids

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        bits = len(self._keys).bit_length() - 1
        return ((keys.astype(np.uint64) * _HASH) >> np.uint64(64 - bits)).astype(np.int64)

    def _lookup(self, keys: np.ndarray) -> np.ndarray:
        found = np.full(len(keys), -1, dtype=np.int64)
        pending, slots = np.arange(len(keys)), self._slots(keys)
        mask = len(self._keys) - 1
        while pending.size:
            stored = self._keys[slots]
            hit = stored == keys
            if hit.any():
                found[pending[hit]] = self._values[slots[hit]]
            on = ~hit & (stored != _EMPTY)  # linear probing: go on past other keys
            pending, keys, slots = pending[on], keys[on], (slots[on] + 1) & mask
        return found

    def _find_or_claim(self, keys: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The children of `keys` (parent << 21 | token): those in the table, and one new node per distinct key that
        is not, created and stored. In chunks that cannot take the table past load 1/2 even if every key is new; it
        grows after a chunk that left it above 1/4, as `_store` grows it (so by the keys stored, not the keys asked)."""
        if 2 * (self._num_keys + len(keys)) <= len(self._keys):  # room for all (a step's keys, as a rule)
            return self._probe(keys, tokens)
        ids = np.empty(len(keys), dtype=np.int64)
        done = 0
        while done < len(keys):
            end = min(len(keys), done + max(len(self._keys) // 2 - self._num_keys, 1))
            ids[done:end] = self._probe(keys[done:end], tokens[done:end])
            done = end
        return ids

    def _probe(self, keys: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """`_find_or_claim` for keys that fit; the table grows after them if they left it above load 1/4. Equal keys
        probe in step (same slots, same table), so the entries that read their key back from a free slot just written
        share it; the last of them written to the slot's value creates the node."""
        ids = np.empty(len(keys), dtype=np.int64)
        pending, slots = np.arange(len(keys)), self._slots(keys)
        mask = len(self._keys) - 1
        while pending.size:
            stored = self._keys[slots]
            free = stored == _EMPTY
            self._keys[slots[free]] = keys[free]
            mine = self._keys[slots] == keys
            new = (mine & free).nonzero()[0]
            if new.size:
                claimed = slots[new]
                self._values[claimed] = new
                creators = new[self._values[claimed] == new]
                self._values[slots[creators]] = self._allocate(tokens[creators].astype(np.int32))
                self._num_keys += len(creators)
            ids[pending[mine]] = self._values[slots[mine]]
            on = ~mine  # linear probing: go on past other keys
            pending, keys, tokens, slots = pending[on], keys[on], tokens[on], (slots[on] + 1) & mask
        if 4 * self._num_keys > len(self._keys):  # load factor <= 1/4 between calls, as `_store` keeps it
            self._rehash(8 * self._num_keys)
        return ids

    def _store(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Insert distinct keys that are not in the table."""
        self._num_keys += len(keys)
        if 4 * self._num_keys > len(self._keys):  # load factor <= 1/4, and 1/8 after growing: probes stay short
            self._rehash(8 * self._num_keys)
        slots = self._slots(keys)
        pending = np.arange(len(keys))
        mask = len(self._keys) - 1
        while pending.size:
            free = pending[self._keys[slots[pending]] == _EMPTY]
            # several keys may want one free slot: write them all, the one that reads back took it, the others probe on
            self._keys[slots[free]] = keys[free]
            took = free[self._keys[slots[free]] == keys[free]]
            self._values[slots[took]] = ids[took]
            done = np.zeros(len(keys), dtype=bool)
            done[took] = True
            pending = pending[~done[pending]]
            slots[pending] = (slots[pending] + 1) & mask

    def _rehash(self, size: int) -> None:
        size = 1 << (size - 1).bit_length()
        occupied = self._keys != _EMPTY
        keys, values = self._keys[occupied], self._values[occupied]
        self._keys = np.full(size, _EMPTY, dtype=np.int64)
        self._values = np.zeros(size, dtype=np.int32)
        self._num_keys -= len(keys)
        self._store(keys, values)


class SuffixProposerRef(SuffixProposer):
    """`SuffixProposer` on the numpy reference: `SuffixIndexRef` and the drafting below, vectorised over rows."""

    index_class = SuffixIndexRef

    # ---- keeping the tries in step with the rows: vectorised numpy, finished rows' tokens deferred in a list ------

    def _start_empty(self) -> None:
        super()._start_empty()
        # finished rows' last tokens, inserted with the next step's (frontiers [2N, D], tokens [2N, L], lengths [2N])
        self._deferred: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def _sync(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray, defer: bool = False) -> None:
        """Insert the tokens each of `rows` gained since the last call (`token_ids[rows[i], :num_tokens[i]]`), with the
        deferred ones. `defer` (finishing rows): keep the tokens for the next insertion instead."""
        self._restart_changed(rows, token_ids)
        rewound = (num_tokens < self._num_inserted[rows]).nonzero()[0]
        if rewound.size:  # rows rolled back: their responses leave the tries, and start over
            self._restart_rows(rows[rewound])
        start = self._num_inserted[rows]
        lengths = num_tokens - start
        grow = (lengths > 0).nonzero()[0]
        if grow.size == 0:
            if not defer:
                self.flush()
            return
        rows, start, lengths = rows[grow], start[grow], lengths[grow]
        offsets = np.arange(int(lengths.max()))
        cols = np.minimum(start[:, None] + offsets, token_ids.shape[1] - 1)
        new = token_ids[rows[:, None], cols]  # [G, max new]
        valid = offsets[None, :] < lengths[:, None]
        columns = (start - self._prompt_len[rows])[:, None] + offsets[None, :]
        self._responses[np.repeat(rows, lengths), columns[valid]] = new[valid]
        self._num_inserted[rows] = num_tokens[grow]
        frontiers = self._frontiers[:, rows].reshape(2 * len(rows), -1)  # both tries
        both = (frontiers, np.concatenate([new, new]), np.concatenate([lengths, lengths]))
        if defer:
            self._deferred.append(both)
            return
        self._frontiers[:, rows] = self._insert(*both).reshape(2, len(rows), -1)

    def _insert(self, frontiers: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Insert `tokens [N, L]` (`lengths [N]`) after `frontiers [N, D]` together with the deferred rows' tokens
        (one call per position for both); returns the N new frontiers."""
        parts = [*self._deferred, (frontiers, tokens, lengths)]
        self._deferred, self._deferred_responses = [], 0
        if len(parts) > 1:
            all_tokens = np.zeros((sum(len(t) for _, t, _ in parts), max(t.shape[1] for _, t, _ in parts)), np.int64)
            first = 0
            for _, part, _ in parts:  # each part's tokens in its rows' first columns (the rest is past the lengths)
                all_tokens[first : first + len(part), : part.shape[1]] = part
                first += len(part)
            frontiers, tokens = np.concatenate([f for f, _, _ in parts]), all_tokens
            lengths = np.concatenate([n for _, _, n in parts])
        inserted = self.index.insert(frontiers, tokens, lengths)
        return inserted[len(inserted) - len(parts[-1][0]) :]

    def flush(self) -> None:
        if self._deferred:
            depth = self.max_tree_depth
            self._insert(np.zeros((0, depth), np.int32), np.zeros((0, 0), np.int64), np.zeros(0, np.int64))
        self._deferred_responses = 0

    # ---- drafting ------------------------------------------------------------------------------------------------

    def _candidates(self, asked: np.ndarray):
        """Every (row, trie, match length) walk worth trying: rows [C], tokens [C, K], lengths [C], scores [C] and the
        path probability at each walk's end [C]."""
        rows = (asked > 0).nonzero()[0]
        depth = self.max_tree_depth
        nodes = self._frontiers[:, rows, 1:][list(self.sources)].reshape(-1, depth - 1)  # [S * R, D - 1]: m = 1..D-1
        owner = np.concatenate([rows] * len(self.sources))
        # a match of m tokens drafts at most floor(m * max_spec_factor) and depth - m tokens, and what the row asked
        match = np.arange(1, depth)
        limit = np.minimum(np.floor(match * self.max_spec_factor).astype(np.int64), depth - match)
        limit = np.minimum(asked[owner][:, None], limit)
        counts = np.where(nodes >= 0, self.index.count[nodes], 0)  # (a -1 reads the last node, and is masked)
        # a node seen once is the row's own occurrence: nothing followed it yet
        usable = (counts >= 2) & (limit >= 1)
        # an m-gram as frequent as the (m+1)-gram that ends with it occurs only there: both have the same continuations,
        # so their walks are the same up to the shorter limit; walk once, from the one whose limit is larger
        same = counts[:, :-1] == counts[:, 1:]
        usable[:, :-1] &= ~(same & (limit[:, :-1] <= limit[:, 1:]))
        usable[:, 1:] &= ~(same & (limit[:, 1:] < limit[:, :-1]))
        which, m = np.nonzero(usable)
        width = int(asked.max(initial=0))
        tokens, lengths, scores, ends = self.index.walk(
            nodes[which, m], limit[which, m], self.min_token_prob, width, num_open=1
        )
        kept = lengths > 0
        return owner[which][kept], tokens[kept], lengths[kept], scores[kept], ends[kept]

    def _chains(self, asked: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's chain draft from the tries as they stand: the best one, continued where it stops short (with
        `continue_short`). Tokens `[rows, K]` (-1 padded), counts `[rows]` and scores `[rows]` (expected accepted
        drafts: the path probabilities summed, a continuation's scaled by the probability of the path it continues)."""
        drafts, counts, scores, ends = self._best(asked)
        if self.continue_short:
            self._continue_short(drafts, counts, scores, ends, asked)
        return drafts, counts, scores

    def _best(self, asked: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each row's draft of highest score (ties: the later candidate, i.e. the longer match): tokens `[rows, K]`
        (-1 padded), counts `[rows]`, scores `[rows]` and the path probability at the draft's end `[rows]`."""
        drafts = np.full((len(asked), int(asked.max(initial=0))), -1, dtype=np.int64)
        counts = np.zeros(len(asked), dtype=np.int64)
        best_scores, best_ends = np.zeros(len(asked)), np.ones(len(asked))
        rows, tokens, lengths, scores, ends = self._candidates(asked)
        if rows.size:
            last = _best_of_each(rows, scores)
            drafts[rows[last]] = tokens[last, : drafts.shape[1]]
            counts[rows[last]] = lengths[last]
            best_scores[rows[last]], best_ends[rows[last]] = scores[last], ends[last]
        return drafts, counts, best_scores, best_ends

    def _continue_short(
        self, drafts: np.ndarray, counts: np.ndarray, scores: np.ndarray, ends: np.ndarray, asked: np.ndarray
    ) -> None:
        """A draft shorter than asked goes on from the context it ends in, the row's text followed by the draft: a
        second round of drafting whose match lengths are the draft's last tokens, or the whole draft plus up to
        `_CONTINUE_CONTEXT` tokens of the row's own text (longer ones add nothing measurable). Its path probability
        starts again at 1; its score adds to the row's scaled by the probability of the path it continues (`ends`).
        In place."""
        rows = ((counts > 0) & (counts < asked)).nonzero()[0]
        if rows.size == 0:
            return
        depth, num_drafted = self.max_tree_depth, counts[rows]  # [E]
        # walkers through the draft, each (row e, source trie, start node, draft tokens skipped, match length at the
        # end): the row's last c tokens then the whole draft (c = 0: from the root), or the draft's last m tokens
        sources = np.array(self.sources)
        e1, src1, c = np.indices((len(rows), len(sources), self._CONTINUE_CONTEXT + 1)).reshape(3, -1)
        e2, src2, m = np.indices((len(rows), len(sources), drafts.shape[1] - 1)).reshape(3, -1)
        src1, src2, m = sources[src1], sources[src2], m + 1
        short = m < num_drafted[e2]
        e2, src2, m = e2[short], src2[short], m[short]
        e, src = np.concatenate([e1, e2]), np.concatenate([src1, src2])
        start = np.concatenate([c, np.zeros_like(m)])  # the frontier column each walker starts from
        skip = np.concatenate([np.zeros_like(c), num_drafted[e2] - m])
        match = np.concatenate([num_drafted[e1] + c, m])
        fits = match < depth  # (so does its start column, at most the match: a tree of depth 2 has columns 0 and 1)
        e, src, start, skip, match = e[fits], src[fits], start[fits], skip[fits], match[fits]
        node = self._frontiers[src, rows[e], start].astype(np.int64)
        keep = node >= 0
        e, src, node, skip, match = e[keep], src[keep], node[keep], skip[keep], match[keep]
        walked, path = num_drafted[e], drafts[rows[e]]  # each walker's draft
        for j in range(int(num_drafted.max())):
            step = ((skip <= j) & (j < walked) & (node >= 0)).nonzero()[0]
            node[step] = self.index.child(node[step], path[step, j])
        found = node >= 0
        e, src, node, match = e[found], src[found], node[found], match[found]
        # the row's own text ends in this context (no continuation yet) only where it is the row's own suffix node
        num_open = (node == self._frontiers[src, rows[e], match]).astype(np.int64)
        remaining = asked[rows] - num_drafted
        limit = np.minimum(
            remaining[e], np.minimum(np.floor(match * self.max_spec_factor).astype(np.int64), depth - match)
        )
        tokens, lengths, more, _ = self.index.walk(node, limit, self.min_token_prob, int(remaining.max()), num_open)
        ok = lengths > 0
        e, match, tokens, lengths, more = e[ok], match[ok], tokens[ok], lengths[ok], more[ok]
        if e.size == 0:
            return
        best = _best_of_each(e, more, match)  # ties: the longer match
        row, start, length = rows[e[best]], counts[rows[e[best]]], lengths[best]
        offsets = np.arange(tokens.shape[1])
        valid = offsets[None, :] < length[:, None]
        drafts[np.repeat(row, length), (start[:, None] + offsets)[valid]] = tokens[best][valid]
        counts[row] += length
        scores[row] += ends[row] * more[best]


def _best_of_each(groups: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """Per distinct value of `groups [N]`, the index of its largest `keys` (compared in order; last ties: the later
    index)."""
    order = np.lexsort((*reversed(keys), groups))
    return order[np.append(groups[order][1:] != groups[order][:-1], True)]


class Lockstep(Proposer):
    """The compiled proposer and the reference behind one proposer: every hook goes to both (alternating which goes
    first), each step's drafts must be identical (tokens, counts, scores, tree parents; AssertionError naming the step
    otherwise), and the time each spends is added to `seconds` (`{"new": ..., "ref": ...}`, also per step in
    `step_seconds` until the caller resets it)."""

    needs_prefill = True

    def __init__(self, new: SuffixProposer, ref: SuffixProposerRef):
        self.new, self.ref = new, ref
        self.num_steps = self.num_drafted = 0
        self.seconds = {"new": 0.0, "ref": 0.0}
        self.step_seconds = {"new": 0.0, "ref": 0.0}

    def _both(self, name: str, *args):
        results = {}
        order = ("new", "ref") if self.num_steps % 2 else ("ref", "new")  # neither always finds the other's cache
        for who in order:
            start = time.perf_counter()
            results[who] = getattr(getattr(self, who), name)(*args)
            elapsed = time.perf_counter() - start
            self.seconds[who] += elapsed
            self.step_seconds[who] += elapsed
        return results["new"], results["ref"]

    def prefill(self, *args) -> None:
        self._both("prefill", *args)

    def copy_rows(self, *args) -> None:
        self._both("copy_rows", *args)

    def finish(self, *args) -> None:
        self._both("finish", *args)

    def drop(self, *args) -> None:
        self._both("drop", *args)

    def rewind(self, *args) -> None:
        self._both("rewind", *args)

    def update(self, *args) -> None:
        self._both("update", *args)

    def begin(self) -> None:
        self._both("begin")

    def reset(self) -> None:
        self._both("reset")

    def wait(self) -> None:
        self._both("wait")

    def propose(self, batch: ProposalBatch) -> Drafts:
        got, expected = self._both("propose", batch)
        step = f"step {self.num_steps}"
        assert got.num_drafted == expected.num_drafted, f"{step}: expected the reference's draft counts"
        assert torch.equal(got.token_ids, expected.token_ids), f"{step}: expected the reference's drafts"
        for field in ("scores", "parents"):
            a, b = getattr(got, field), getattr(expected, field)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{step}: expected equal {field}"
        self.num_steps += 1
        self.num_drafted += sum(expected.num_drafted)
        return expected

    @classmethod
    def replacing(cls, new: SuffixProposer) -> Lockstep:
        """A lockstep of `new` (fresh, as the generator built it) and a reference built alike. `new` takes tokens in
        at once (not on a thread, as on a GPU), so that each call's time is its own."""
        new.background = False
        ref = SuffixProposerRef(
            new.num_speculative_tokens,
            vocab_size=new.separator,
            num_slots=new._num_slots,
            num_positions=new._num_positions,
            max_tree_depth=new.max_tree_depth,
            max_cached_requests=new.max_cached_requests,
            max_spec_factor=new.max_spec_factor,
            min_token_prob=new.min_token_prob,
            num_candidates=new.num_candidates,
        )
        return cls(new, ref)
