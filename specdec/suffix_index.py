"""Counted suffix tries: the structure the suffix proposer drafts from.

A trie of depth D holds every n-gram (n <= D) of the sequences inserted into it: the node reached from a root by the
tokens `t1..tn` is that n-gram, and its count is the number of positions where the n-gram ends. Following a node's
most frequent child is SuffixDecoding's draft: after the context `c`, the token `x` that most often followed `c`, with
estimated probability `count(c x) / count(c)`. Many tries share one node store (each has its own root), so a prompt's
trie and the global one are updated by the same vectorised calls.

A sequence being inserted is tracked by its frontier: `[D]` node ids, column m the node of its last m tokens (column 0
the root, -1 where the sequence is shorter than m). Appending a token moves every frontier one column right through
the child for that token. Every operation takes a batch of frontiers and runs as one compiled loop
(`specdec/proposers/suffix_kernels.py`). A node's first child is stored with the node; its other children (a branching
point) in one open-addressing hash table keyed by (parent, token): most nodes of a deep trie have one child, so most
steps never hash.
"""

from __future__ import annotations

import numpy as np

_ROOT_COUNT = 1 << 30


def _kernels():
    """The compiled loops, imported with the first index: numba takes ~0.2 s to import, which a run that drafts
    otherwise should not pay."""
    from specdec.proposers import suffix_kernels

    return suffix_kernels


class SuffixIndex:
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
        self.kernels = _kernels()
        self.max_depth = max_depth
        # one row per node, [count, best, token, first child]: the fields a step reads of a node share a cache line;
        # rows past `num_nodes` are unset (a node's fields are all written when it is made)
        self.nodes = np.empty((capacity, 4), dtype=np.int32)
        self.branching = np.zeros(capacity, dtype=bool)  # the node has more children, in the hash table
        # [parent, token, child] of every later child (parent -1: empty), hashed by (parent << 21 | token), at load
        # <= 1/4 (grown to 1/8), 2^17 slots (1.5 MiB) at first
        self._table = np.full((1 << (table_capacity - 1).bit_length(), 3), -1, dtype=np.int32)
        self._state = np.zeros(3, dtype=np.int64)  # [num_nodes, num_keys, runs counted], kept by the kernels
        self._seen, self._work = self.kernels.scratch(1)  # the counting's scratch, grown to the largest batch

    @property
    def num_nodes(self) -> int:
        return int(self._state[0])

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
        return sum(a.nbytes for a in (self.nodes, self.branching, self._table))

    def new_root(self) -> int:
        """A new empty trie; returns its root node."""
        self.nodes, self.branching = self.kernels.reserve(self.nodes, self.branching, self.num_nodes + 1)
        root = self.num_nodes
        self.nodes[root] = (_ROOT_COUNT, -1, -1, -1)  # a root is no n-gram; its count marks it as in every sequence
        self._state[0] += 1
        return root

    def start(self, roots: np.ndarray) -> np.ndarray:
        """`[N, D]` frontiers of empty sequences in the tries of `roots [N]`."""
        frontier = np.full((len(roots), self.max_depth), -1, dtype=np.int32)
        frontier[:, 0] = roots
        return frontier

    def extend(self, frontier: np.ndarray, tokens: np.ndarray, delta: int = 1) -> np.ndarray:
        """Append `tokens [N]` to N sequences with frontiers `[N, D]`: every suffix count changes by `delta` (+1 on
        insert; -1 removes a sequence inserted before, whose nodes must exist). Returns the new frontiers."""
        tokens = np.asarray(tokens)
        return self.insert(frontier, tokens.reshape(-1, 1), np.ones(len(tokens), dtype=np.int64), delta)

    def insert(self, frontier: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, delta: int = 1) -> np.ndarray:
        """Append `tokens[i, :lengths[i]]` (`[N, T]`) to each sequence, in lockstep. Returns the new frontiers."""
        frontier = np.array(frontier, dtype=np.int32, order="C")  # a copy: the kernel moves it in place
        tokens, lengths = _int64(tokens), _int64(lengths)
        self.run(self.kernels.insert, *self.scratch(frontier.size), frontier, tokens, lengths, delta)
        return frontier

    def add_sequences(self, roots: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, delta: int = 1) -> None:
        """Insert (+1) or remove (-1) whole sequences `tokens[i, :lengths[i]]` (`[N, T]`) under `roots [N]`, one depth
        at a time: the n-gram ending at position p is the child of the (n-1)-gram ending at p - 1, so D passes do what
        position by position takes max(lengths) passes."""
        roots, tokens, lengths = _int64(roots), _int64(tokens), _int64(lengths)
        self.run(self.kernels.add_sequences, roots, tokens, lengths, self.max_depth, delta)

    def child(self, parents: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The child of each of `parents [N]` (valid nodes) by its token, -1 where there is none. Reads only."""
        return self.kernels.children(self.nodes, self.branching, self._table, _int64(parents), _int64(tokens))

    def walk(self, start: np.ndarray, max_len: np.ndarray, min_prob: float, width: int, num_open=0):
        """Follow the most frequent child from each `start [N]` node for up to `max_len [N]` tokens, while the
        path's estimated probability (the product of count ratios) stays >= `min_prob`. `num_open` (an int, or `[N]`)
        occurrences of each start node have no continuation yet (the drafting sequence's own): they leave the first
        ratio's base.

        Returns tokens `[N, width]` (-1 padded), lengths `[N]`, scores `[N]` (the sum of the path probabilities at
        every drafted position, i.e. the expected number of accepted tokens if the counts are right) and the path
        probability at the last drafted position `[N]` (1 where nothing was drafted).
        """
        start = _int64(start)
        max_len = np.broadcast_to(_int64(max_len), start.shape).copy()
        num_open = np.broadcast_to(_int64(num_open), start.shape).copy()
        return self.kernels.walk(self.nodes, start, max_len, float(min_prob), int(width), num_open)

    def scratch(self, num_updates: int) -> tuple[np.ndarray, np.ndarray]:
        """The counting kernels' scratch for batches of up to `num_updates` updates (kept; grown when too small)."""
        if len(self._work) < 9 * num_updates:
            self._seen, self._work = self.kernels.scratch(max(num_updates, len(self._work) // 9 * 2))
        return self._seen, self._work

    def run(self, kernel, *args) -> tuple:
        """Call a kernel of `specdec/proposers/suffix_kernels.py` that may grow the store: it takes the store's arrays
        and state first and returns the arrays first, then its other results (returned)."""
        stored = (self.nodes, self.branching, self._table)
        self.nodes, self.branching, self._table, *results = kernel(*stored, self._state, *args)
        return tuple(results)


def _int64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)
