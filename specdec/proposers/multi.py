"""Several proposers in one decode step: each row takes the first proposer, in priority order, that drafts for it.

A row whose request names a proposer only asks that one. The others cascade: e.g. with ["ngram", "draft_model"] the
n-gram lookup drafts for the rows where it finds a match and the draft model for the rest. Which proposer serves a row
depends only on the row's history, never on the target's noise, so mixing them keeps verification lossless. Drafts of
every proposer go into one `Drafts`, verified in the same forward; rows of a proposer without draft probabilities get
one-hot q where another proposer has them (rejection sampling with a one-hot q is exactly the n-gram rule).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from specdec.proposers.base import Drafts, ProposalBatch, Proposer


class ProposerSet(Proposer):
    """Proposers by name, in priority order, behind the single-proposer interface."""

    def __init__(self, proposers: dict[str, Proposer]):
        assert proposers, "expected at least one proposer"
        self.proposers = proposers
        self.needs_prefill = any(p.needs_prefill for p in proposers.values())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.proposers)

    def prefill(self, row_start: int, prompts: list[list[int]], group_of: Tensor, states: list[dict]) -> None:
        for name, proposer in self.proposers.items():
            if proposer.needs_prefill:
                proposer.prefill(row_start, prompts, group_of, [s.setdefault(name, {}) for s in states])

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int) -> None:
        for proposer in self.proposers.values():
            proposer.copy_rows(src, dst, num_positions)

    def finish(self, rows: list[int], token_ids: Tensor, num_tokens: list[int]) -> None:
        for proposer in self.proposers.values():
            proposer.finish(rows, token_ids, num_tokens)

    def update(self, token_ids: Tensor, num_tokens: list[int]) -> None:
        for proposer in self.proposers.values():
            proposer.update(token_ids, num_tokens)

    def begin(self) -> None:
        for proposer in self.proposers.values():
            proposer.begin()

    def reset(self) -> None:
        for proposer in self.proposers.values():
            proposer.reset()

    def propose(self, batch: ProposalBatch, requested: list[str | None] | None = None) -> tuple[Drafts, list[str]]:
        """Drafts for every row, and per row the proposer that served it (or, if none had drafts, the last one
        asked). `requested[i]` names the only proposer row i may use; None cascades through all."""
        num_rows = len(batch.num_tokens)
        names = self.names
        only = torch.full((num_rows,), -1)  # per row: the index of the only proposer it may ask, -1 = any
        if requested is not None:
            only = torch.tensor([-1 if r is None else names.index(r) for r in requested], dtype=torch.long)
        num_asked = torch.tensor(batch.num_asked)
        served = torch.full((num_rows,), -1)  # per row: the index of the proposer whose drafts it takes
        tried = torch.zeros(num_rows, dtype=torch.long)  # per row: the last proposer asked
        results: dict[int, Drafts] = {}
        for index, (name, proposer) in enumerate(self.proposers.items()):
            asked = torch.where((served < 0) & ((only < 0) | (only == index)), num_asked, 0)
            if int(asked.max()) == 0:
                proposer.update(batch.token_ids, batch.num_tokens)  # it drafts for nobody, but may learn the text
                continue
            states = [s.setdefault(name, {}) for s in batch.states]
            drafts = proposer.propose(dataclasses.replace(batch, num_asked=asked.tolist(), states=states))
            results[index] = drafts
            tried = torch.where(asked > 0, index, tried)
            served = torch.where((asked > 0) & (torch.tensor(drafts.num_drafted) > 0), index, served)
        tried_names = [names[i] for i in tried.tolist()]
        if len(results) == 1:
            return next(iter(results.values())), tried_names
        return _combine(results, served), tried_names


def _combine(results: dict[int, Drafts], served: Tensor) -> Drafts:
    """One `Drafts` from several proposers' results (by proposer index): row i's drafts from proposer `served[i]`
    (`[rows]`, -1: none)."""
    assert all(d.parents is None for d in results.values()), "expected chains: token trees come from one proposer alone"
    num_rows = len(served)
    width = max(d.token_ids.shape[1] for d in results.values())
    device = next((d.token_ids.device for d in results.values() if d.probs is not None), torch.device("cpu"))
    token_ids = torch.full((num_rows, width), -1, dtype=torch.long, device=device)
    counts = torch.zeros(num_rows, dtype=torch.long)
    for index, drafts in results.items():
        rows = torch.nonzero(served == index)[:, 0]
        part = drafts.token_ids.to(device)[rows.to(device)]
        token_ids[rows.to(device), : part.shape[1]] = part
        counts[rows] = torch.tensor(drafts.num_drafted)[rows]
    with_probs = [d for d in results.values() if d.probs is not None]
    if not with_probs:
        return Drafts(token_ids, counts.tolist())
    vocab_size = with_probs[0].probs.shape[1]
    offsets = torch.cumsum(counts, 0) - counts  # each row's first position in the combined layout
    probs = torch.zeros(int(counts.sum()), vocab_size, dtype=with_probs[0].probs.dtype, device=device)
    for index, drafts in results.items():
        rows = torch.nonzero(served == index)[:, 0]
        position = torch.arange(int(counts[rows].max()) if len(rows) else 0)
        valid = position[None, :] < counts[rows][:, None]  # [served rows, most drafts]
        dst = (offsets[rows][:, None] + position)[valid].to(device)
        if drafts.probs is not None:
            own = torch.tensor(drafts.num_drafted)
            own_offsets = torch.cumsum(own, 0) - own  # the proposer's own layout: its asked rows back to back
            probs[dst] = drafts.probs[(own_offsets[rows][:, None] + position)[valid].to(device)]
        else:  # one-hot q: a draft without probabilities is the n-gram rule under rejection sampling
            tokens = drafts.token_ids.cpu()[rows][:, : position.numel()][valid]
            probs[dst, tokens.to(device)] = 1.0
    return Drafts(token_ids, counts.tolist(), probs)
