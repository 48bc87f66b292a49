"""N-gram (prompt lookup) proposer: draft the tokens that followed an earlier occurrence of the sequence's suffix.

For a row with valid tokens `s[0:L]`, an occurrence is a position `j <= L - 2` whose preceding tokens repeat the row's
last tokens: `s[j - n + 1 : j + 1] == s[L - n : L]` for some `n` in `[prompt_lookup_min, prompt_lookup_max]`. Its
match length is the largest such `n`. It proposes the up to K tokens after it, `s[j + 1 : min(j + 1 + K, L)]`; the
continuation may run into the suffix itself (as in vLLM), and is cut short when the sequence ends first.

Candidate order: longer match first, then the most recent occurrence (largest `j`) first. `propose` (the chain case)
ranks by match length, then by how many of the K draft tokens the occurrence can supply, then recency: in periodic
text with a period below K the most recent occurrence sits within K tokens of the end and would give a draft cut short,
exactly where drafting pays most. vLLM takes the earliest occurrence; we prefer the most recent that supplies K.

The search runs on the host in numpy: one compare of every position against the row's last token, then only the
positions that hit are extended, one token back at a time (why numpy and not torch, measured: docs/design/dynamic-k.md).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rollout_kernels.device_io import host
from specdec.config import SpecConfig
from specdec.proposers.base import Drafts, ProposalBatch, Proposer
from specdec.tree import merge_candidates


class NgramProposer:
    """Prompt-lookup drafts from each row's own prompt and output so far; no model, no state between steps.

    Token ids must be >= 0 (-1 marks padding in the results). Inputs on another device are copied to the host, and
    results come back on the device of `token_ids`.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        for name, value in (
            ("num_speculative_tokens", num_speculative_tokens),
            ("prompt_lookup_min", prompt_lookup_min),
            ("prompt_lookup_max", prompt_lookup_max),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) must be <= prompt_lookup_max ({prompt_lookup_max}); "
                "lower prompt_lookup_min or raise prompt_lookup_max"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Tensor, num_tokens: Tensor, num_asked: Tensor) -> Tensor:
        """Draft a chain per row from its best occurrence: longest match, then most tokens supplied, then most recent.

        Args:
            token_ids: [num_rows, T] int64, each row's prompt + generated tokens, left-aligned; entries at and after
                `num_tokens[i]` are ignored.
            num_tokens: [num_rows] int64, valid length of each row, in [0, T].
            num_asked: [num_rows] int64, the drafts asked of each row, in [0, num_speculative_tokens].

        Returns:
            draft_token_ids: [num_rows, max(num_asked)] int64, -1 after each row's drafts; a row without a
            match of at least `prompt_lookup_min` tokens is all -1.
        """
        tokens, lengths, ks, width = self._host_inputs(token_ids, num_tokens, num_asked)
        drafts = np.full((tokens.shape[0], width), -1, dtype=np.int64)
        rows, ends, match_lens = _find_occurrences(tokens, lengths, ks, self.prompt_lookup_min, self.prompt_lookup_max)
        if rows.size:
            # One score ranks match length, then the draft length the occurrence can supply (up to K), then position;
            # `rows` is sorted, so a segmented max picks each row's best.
            stride = tokens.shape[1] + 1
            supply = np.minimum(ks[rows], lengths[rows] - 1 - ends)
            scores = (match_lens * (width + 1) + supply) * stride + ends
            starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
            best_rows = rows[starts]
            best_ends = np.maximum.reduceat(scores, starts) % stride
            drafts[best_rows] = _continuations(tokens, lengths, ks, best_rows, best_ends, width)
        return torch.from_numpy(drafts).to(token_ids.device)

    def propose_candidates(
        self, token_ids: Tensor, num_tokens: Tensor, num_asked: Tensor, num_candidates: int
    ) -> Tensor:
        """Draft up to `num_candidates` distinct continuations per row, best first (e.g. to build a token tree).

        Candidates are ranked by match length, then by recency. A continuation is dropped when it equals, or is a
        prefix of, the continuation of a higher-ranked occurrence: it would add no path to a tree built from the
        ones above it. A continuation that extends a higher-ranked one cut short by the sequence end is kept.
        `propose` returns candidate 0.

        Args:
            token_ids: [num_rows, T] int64, as in `propose`.
            num_tokens: [num_rows] int64, as in `propose`.
            num_asked: [num_rows] int64, as in `propose`.
            num_candidates: maximum number of candidates per row, >= 1.

        Returns:
            candidate_token_ids: [num_rows, num_candidates, max(num_asked)] int64, -1 after each candidate's
            tokens; unused candidate slots are all -1.
        """
        if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 1:
            raise ValueError(f"num_candidates ({num_candidates!r}) must be an integer >= 1")
        tokens, lengths, ks, width = self._host_inputs(token_ids, num_tokens, num_asked)
        candidates = np.full((tokens.shape[0], num_candidates, width), -1, dtype=np.int64)
        rows, ends, match_lens = _find_occurrences(tokens, lengths, ks, self.prompt_lookup_min, self.prompt_lookup_max)
        if rows.size:
            order = _rank_order(rows, match_lens, tokens.shape[0], self.prompt_lookup_max)
            rows, continuations = _first_distinct(tokens, lengths, ks, rows[order], ends[order], width, num_candidates)
            slots = np.arange(rows.size) - np.searchsorted(rows, rows)  # rank among the row's kept candidates
            candidates[rows, slots] = continuations
        return torch.from_numpy(candidates).to(token_ids.device)

    def _host_inputs(
        self, token_ids: Tensor, num_tokens: Tensor, num_asked: Tensor
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Check the inputs and return host arrays: tokens [num_rows, T], lengths, ks, and max(num_asked)."""
        for name, tensor, ndim in (
            ("token_ids", token_ids, 2),
            ("num_tokens", num_tokens, 1),
            ("num_asked", num_asked, 1),
        ):
            if not isinstance(tensor, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype != torch.int64 or tensor.dim() != ndim:
                raise ValueError(
                    f"{name} must be a {ndim}-D int64 tensor, got {tensor.dim()}-D {tensor.dtype}; "
                    f"pass {'[num_rows, T]' if ndim == 2 else '[num_rows]'} int64"
                )
        num_rows, max_len = token_ids.shape
        for name, tensor in (("num_tokens", num_tokens), ("num_asked", num_asked)):
            if tensor.shape[0] != num_rows:
                raise ValueError(f"{name} has {tensor.shape[0]} rows but token_ids has {num_rows}; pass one per row")
        tokens, lengths, ks = (host(t.detach()).numpy() for t in (token_ids, num_tokens, num_asked))
        if num_rows == 0:
            return tokens, lengths, ks, 0
        if lengths.min() < 0 or lengths.max() > max_len:
            raise ValueError(
                f"num_tokens must lie in [0, {max_len}] (token_ids has {max_len} columns), "
                f"got values in [{lengths.min()}, {lengths.max()}]"
            )
        if ks.min() < 0 or ks.max() > self.num_speculative_tokens:
            raise ValueError(
                f"num_asked must lie in [0, num_speculative_tokens={self.num_speculative_tokens}], "
                f"got values in [{ks.min()}, {ks.max()}]; clamp the K policy's output"
            )
        return tokens, lengths, ks, int(ks.max())


def _find_occurrences(
    tokens: np.ndarray,  # [num_rows, T]
    lengths: np.ndarray,  # [num_rows]
    ks: np.ndarray,  # [num_rows]
    min_n: int,
    max_n: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every occurrence of each row's suffix with a match length >= min_n, in rows with K >= 1.

    Returns rows [num_hits], ends [num_hits] (the position j), match_lens [num_hits] (capped at max_n); sorted by row,
    then position.
    """
    num_rows, width = tokens.shape
    flat_tokens = tokens.reshape(-1)
    last_flat = np.arange(num_rows) * width + np.maximum(lengths - 1, 0)
    # Sparse: only positions holding the last token can match; extend those one token back at a time. Columns past
    # the longest row are garbage for every row: skip them.
    max_len = max(int(lengths.max(initial=0)), 1)
    rows, ends = np.divmod(np.flatnonzero(tokens[:, :max_len] == flat_tokens[last_flat, None]), max_len)
    usable = (ends <= lengths[rows] - 2) & (ks[rows] > 0)
    rows, ends = rows[usable], ends[usable]
    end_flat, suffix_flat = rows * width + ends, last_flat[rows]
    match_lens = np.ones(rows.size, dtype=np.int64)
    alive = np.arange(rows.size)  # hits whose match reaches length m so far
    for m in range(1, max_n):
        # ends >= m (so the occurrence has m earlier tokens) implies the suffix has them too, since ends <= L - 2
        alive = alive[ends[alive] >= m]
        alive = alive[flat_tokens[end_flat[alive] - m] == flat_tokens[suffix_flat[alive] - m]]
        if alive.size == 0:
            break
        match_lens[alive] += 1
    matched = match_lens >= min_n
    return rows[matched], ends[matched], match_lens[matched]


def _rank_order(rows: np.ndarray, match_lens: np.ndarray, num_rows: int, max_n: int) -> np.ndarray:
    """[num_hits] permutation of hits given by (row, position) to (row, match length desc, position desc)."""
    latest_first = np.arange(rows.size - 1, -1, -1)
    keys = rows[latest_first] * (max_n + 1) + (max_n - match_lens[latest_first])
    # a stable sort keeps the latest-first order among ties; numpy radix-sorts 16-bit keys
    keys = keys.astype(np.int16) if num_rows * (max_n + 1) < 2**15 else keys
    return latest_first[np.argsort(keys, kind="stable")]


def _first_distinct(
    tokens: np.ndarray,  # [num_rows, T]
    lengths: np.ndarray,  # [num_rows]
    ks: np.ndarray,  # [num_rows]
    rows: np.ndarray,  # [num_hits], sorted, each row's hits in rank order
    ends: np.ndarray,  # [num_hits]
    width: int,
    num_candidates: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows [num_kept] and continuations [num_kept, width] of each row's first num_candidates non-redundant hits.

    Whether a hit is redundant depends only on the hits ranked above it, so checking each row's top `limit` hits is
    exact for those; `limit` grows until every row has its candidates or has no hits left. Repetitive text can hold
    thousands of occurrences per row, nearly all of them beyond the few candidates needed.
    """
    num_rows = tokens.shape[0]
    num_hits = np.bincount(rows, minlength=num_rows)
    rank_in_row = np.arange(rows.size) - (np.cumsum(num_hits) - num_hits)[rows]
    limit = 4 * num_candidates
    while True:
        top = np.flatnonzero(rank_in_row < limit)
        top_rows, top_ends = rows[top], ends[top]
        continuations = _continuations(tokens, lengths, ks, top_rows, top_ends, width)
        is_short = top_ends + ks[top_rows] >= lengths[top_rows]
        kept = np.flatnonzero(~_is_redundant(top_rows, continuations, is_short, num_rows))
        num_kept = np.bincount(top_rows[kept], minlength=num_rows)
        if np.all((num_kept >= num_candidates) | (num_hits <= limit)):
            break
        limit *= 4
    kept_rows = top_rows[kept]
    kept = kept[np.arange(kept.size) - np.searchsorted(kept_rows, kept_rows) < num_candidates]
    return top_rows[kept], continuations[kept]


def _continuations(
    tokens: np.ndarray,  # [num_rows, T]
    lengths: np.ndarray,  # [num_rows]
    ks: np.ndarray,  # [num_rows]
    rows: np.ndarray,  # [num_hits]
    ends: np.ndarray,  # [num_hits]
    width: int,
) -> np.ndarray:
    """[num_hits, width] int64: the up to K tokens after each occurrence, -1 past K or past the sequence end."""
    offsets = np.arange(1, width + 1)
    positions = ends[:, None] + offsets
    valid = (positions < lengths[rows, None]) & (offsets <= ks[rows, None])
    gathered = tokens[rows[:, None], np.minimum(positions, tokens.shape[1] - 1)]
    return np.where(valid, gathered, -1)


def _is_redundant(
    rows: np.ndarray,  # [num_hits], sorted, each row's hits in rank order
    continuations: np.ndarray,  # [num_hits, width], -1 padded
    is_short: np.ndarray,  # [num_hits] bool, cut short by the sequence end (fewer than the row's K tokens)
    num_rows: int,
) -> np.ndarray:
    """[num_hits] bool: the continuation equals, or is a prefix of, the continuation of a hit ranked before it.

    Continuations of one row have K tokens except those cut short by the sequence end: only those can be a proper
    prefix, and a row has at most one of each length (its length fixes its position).
    """
    num_hits, width = continuations.shape
    ranks = np.arange(num_hits)  # within a row, a smaller index ranks higher
    # Equal continuations: sort by (row, tokens, rank); every hit equal to its predecessor is a repeat.
    order = np.lexsort((ranks, *continuations.T[::-1], rows))
    sorted_rows, sorted_conts = rows[order], continuations[order]
    repeats = (sorted_rows[1:] == sorted_rows[:-1]) & (sorted_conts[1:] == sorted_conts[:-1]).all(axis=1)
    redundant = np.zeros(num_hits, dtype=bool)
    redundant[order[1:]] = repeats
    # Proper prefixes: for each short length, test the row's one short continuation against the hits ranked before it.
    cont_lens = (continuations >= 0).sum(axis=1)
    for cut in range(1, width):
        short = np.flatnonzero(is_short & (cont_lens == cut))
        if short.size == 0:
            continue
        target = np.full((num_rows, cut), -2, dtype=np.int64)  # -2 matches no continuation
        target[rows[short]] = continuations[short, :cut]
        short_rank = np.full(num_rows, -1)
        short_rank[rows[short]] = short
        covers = (continuations[:, :cut] == target[rows]).all(axis=1) & (ranks < short_rank[rows])
        has_extension = np.zeros(num_rows, dtype=bool)
        has_extension[rows[covers]] = True
        redundant[short] |= has_extension[rows[short]]
    return redundant


class NgramAdapter(Proposer):
    """The n-gram proposer behind the engine's `Proposer` interface, over the host token history: chains, or token
    trees of up to `spec.num_candidates` continuations (no model, no per-row state)."""

    def __init__(self, spec: SpecConfig):
        self.ngram = NgramProposer(spec.num_speculative_tokens, *spec.prompt_lookup_range())
        self.num_candidates = spec.num_candidates

    def propose(self, batch: ProposalBatch) -> Drafts:
        num_tokens = torch.tensor(batch.num_tokens)
        asked = torch.tensor(batch.num_asked)
        if self.num_candidates == 1:
            drafts = self.ngram.propose(batch.token_ids, num_tokens, asked)
            return Drafts(drafts, (drafts >= 0).sum(dim=1).tolist())
        candidates = self.ngram.propose_candidates(batch.token_ids, num_tokens, asked, self.num_candidates)
        tokens, parents, counts = merge_candidates(candidates, batch.num_asked)
        return Drafts(tokens, counts, parents=parents)
