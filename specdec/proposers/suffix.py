"""Suffix proposer: drafts from every row in flight and from earlier responses, as SuffixDecoding does.

The tries it drafts from, one per distinct prompt and one over every response, and the history they hold live in
`SuffixTries` (`specdec/proposers/suffix_tries.py`); this module is the drafting.

Drafting: for each row, each trie and each match length m (the row's last m tokens, all of which are in the tries:
the row itself is), follow the most frequent child while the path probability (product of count ratios) stays at or
above `min_token_prob`, for at most `min(K, floor(m * max_spec_factor), depth - m)` tokens. The row takes the draft of
highest score, the sum of the path probabilities (the expected accepted length if the counts are right); a draft that
stops short of K goes on, in a second round, from the context it ends in; with `num_candidates > 1` a row's best
distinct drafts become a token tree. Drafts depend only on tokens already emitted, never on the target's random
draws, so verification stays lossless. Chains are drafted by one compiled loop over the rows
(`specdec/proposers/suffix_draft_kernels.py`); `specdec/proposers/suffix_ref.py` is its numpy reference, draft for
draft.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.proposers.base import Drafts, ProposalBatch
from specdec.proposers.suffix_tries import SuffixTries
from specdec.tree import merge_candidates


class SuffixProposer(SuffixTries):
    """Suffix-tree drafts from the batch in flight and the cached responses of earlier calls.

    Args mirror vLLM's suffix decoding fields (`suffix_decoding_*` in `SpecConfig`); `vocab_size` is the target's
    (its value is the separator); `num_slots`/`num_positions` size the per-slot state.
    """

    _CONTINUE_CONTEXT = 3  # a short draft's second round matches at most the draft + this many tokens of the row

    def __init__(
        self,
        num_speculative_tokens: int,
        vocab_size: int,
        num_slots: int,
        num_positions: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        num_candidates: int = 1,
        background: bool = False,
    ):
        super().__init__(vocab_size, num_slots, num_positions, max_tree_depth, max_cached_requests, background)
        self.num_speculative_tokens = num_speculative_tokens
        # a match of m >= 1 drafts at most depth - m tokens: a larger factor caps nothing more, and at most the depth
        # m * factor stays far inside int64 (1e19 or inf wrapped to a negative cap: no drafts at all)
        self.max_spec_factor = min(float(max_spec_factor), float(self.max_tree_depth))
        self.min_token_prob = min_token_prob
        self.num_candidates = num_candidates
        self.sources = (0, 1)  # tries drafted from: 0 the row's prompt trie, 1 the global one (a knob for ablations)
        self.continue_short = True  # a second round for drafts that stop short (a knob for ablations)
        from specdec.proposers import suffix_draft_kernels  # numba: imported with the first suffix proposer

        self._kernels = suffix_draft_kernels

    def compile_kernels(self) -> None:
        """Run the compiled loops once, on a throwaway proposer of two slots: numba compiles a loop at its first call
        (or loads it from its disk cache), and a run's first steps then timed that (15-30 s on the first run of an
        install) as drafting. This one's tries are left as they are."""
        probe = SuffixProposer(
            2,
            self.separator,
            num_slots=2,
            num_positions=16,
            max_tree_depth=self.max_tree_depth,
            max_cached_requests=1,
            num_candidates=self.num_candidates,
        )
        tokens = torch.tensor([[1, 2, 1, 2, 1, 2, 1, 2, 1, 2], [1, 2, 1, 2, 2, 1, 2, 1, 2, 1]])
        probe.begin()
        probe.prefill(0, [[1, 2, 1]], torch.zeros(2, dtype=torch.long), [{}, {}])
        for length in (5, 7):  # a step that drafts, then one that only takes tokens in
            probe.propose(ProposalBatch(tokens, [length, length], [2, 2], sampling=None, draft_uniforms=None))
            probe.update(tokens, [length + 1, length + 1])
        probe.finish([0], tokens, [9])
        probe.drop([1])
        probe.add_responses([[1, 2]], [[2, 1, 2]])  # past max_cached_requests: one response evicted
        probe.begin()

    def propose(self, batch: ProposalBatch) -> Drafts:
        """Take in the tokens each row gained, then draft: a chain per asked row, or with `num_candidates > 1` a
        token tree of at most K nodes."""
        self.wait()
        num_rows = len(batch.num_tokens)
        self._sync(self._all_rows[:num_rows], batch.token_ids.numpy(), np.asarray(batch.num_tokens, dtype=np.int64))
        asked = np.asarray(batch.num_asked, dtype=np.int64)
        if self.num_candidates == 1:
            drafts, counts, scores = self._chains(asked)
            return Drafts(torch.from_numpy(drafts), counts.tolist(), scores=torch.from_numpy(scores))
        cand_rows, tokens, lengths, scores, _ = self._candidates(asked)
        return self._tree(num_rows, asked, cand_rows, tokens, scores)

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
        drafts, counts, scores, _ = self._draft(asked, self._CONTINUE_CONTEXT if self.continue_short else -1)
        return drafts, counts, scores

    def _best(self, asked: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each row's draft of highest score over every (trie, match length) walk (ties: the later walk, i.e. the
        global trie, then the longer match), one round: tokens `[rows, K]` (-1 padded), counts `[rows]`, scores
        `[rows]` and the path probability at the draft's end `[rows]`."""
        return self._draft(asked, -1)

    def _draft(self, asked: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The compiled drafting: one round, and a second from up to `context` tokens of the row (-1: none)."""
        index = self.index
        return self._kernels.draft_chains(
            index.nodes,
            index.branching,
            index._table,
            self._frontiers,
            np.ascontiguousarray(asked, dtype=np.int64),
            np.array(self.sources, dtype=np.int64),
            float(self.max_spec_factor),
            float(self.min_token_prob),
            int(context),
        )

    def _tree(self, num_rows: int, asked: np.ndarray, rows, tokens, scores) -> Drafts:
        """The best `num_candidates` distinct drafts of each row merged into a token tree of at most K nodes."""
        candidates = np.full((num_rows, self.num_candidates, max(tokens.shape[1], 1)), -1, dtype=np.int64)
        if rows.size:
            order = np.lexsort((-scores, rows))  # by row, best first
            _, first = np.unique(np.column_stack([rows[order], tokens[order]]), axis=0, return_index=True)
            kept = order[np.sort(first)]  # distinct drafts, still by row and best first
            kept_rows = rows[kept]
            rank = np.arange(kept.size) - np.searchsorted(kept_rows, kept_rows)
            top = rank < self.num_candidates
            candidates[kept_rows[top], rank[top]] = tokens[kept[top]]
        token_ids, parents, counts = merge_candidates(torch.from_numpy(candidates), asked.tolist())
        return Drafts(token_ids, counts, parents=parents)
