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
        requested = [None] * num_rows if requested is None else requested
        served: list[str | None] = [None] * num_rows
        tried: list[str] = [self.names[0]] * num_rows
        results: dict[str, Drafts] = {}
        for name, proposer in self.proposers.items():
            asked = [
                k if served[i] is None and requested[i] in (None, name) else 0 for i, k in enumerate(batch.num_asked)
            ]
            if max(asked, default=0) == 0:
                proposer.update(batch.token_ids, batch.num_tokens)  # it drafts for nobody, but may learn the text
                continue
            states = [s.setdefault(name, {}) for s in batch.states]
            drafts = proposer.propose(dataclasses.replace(batch, num_asked=asked, states=states))
            results[name] = drafts
            for i, (k, n) in enumerate(zip(asked, drafts.num_drafted)):
                if k > 0:
                    tried[i] = name
                    if n > 0:
                        served[i] = name
        if len(results) == 1:
            return next(iter(results.values())), tried
        return _combine(results, served, num_rows), tried


def _combine(results: dict[str, Drafts], served: list[str | None], num_rows: int) -> Drafts:
    """One `Drafts` from several proposers' results: row i's drafts from `served[i]`."""
    assert all(d.parents is None for d in results.values()), "expected chains: token trees come from one proposer alone"
    width = max(d.token_ids.shape[1] for d in results.values())
    device = next((d.token_ids.device for d in results.values() if d.probs is not None), torch.device("cpu"))
    token_ids = torch.full((num_rows, width), -1, dtype=torch.long, device=device)
    counts = [0] * num_rows
    for name, drafts in results.items():
        rows = [i for i in range(num_rows) if served[i] == name]
        if rows:
            index = torch.tensor(rows, device=device)
            part = drafts.token_ids.to(device)[index]
            token_ids[index, : part.shape[1]] = part
            for i in rows:
                counts[i] = drafts.num_drafted[i]
    with_probs = [d for d in results.values() if d.probs is not None]
    if not with_probs:
        return Drafts(token_ids, counts)
    vocab_size = with_probs[0].probs.shape[1]
    offsets = torch.tensor([0] + counts).cumsum(0).tolist()  # each row's first position in the combined layout
    probs = torch.zeros(offsets[-1], vocab_size, dtype=with_probs[0].probs.dtype, device=device)
    one_hot_rows, one_hot_tokens = [], []
    for name, drafts in results.items():
        own = [0] + list(drafts.num_drafted)
        own_offsets = torch.tensor(own).cumsum(0).tolist()  # the proposer's own layout: its asked rows back to back
        src, dst = [], []
        host_ids = drafts.token_ids.cpu() if drafts.probs is None else None  # n-gram drafts live on the host
        for i in range(num_rows):
            if served[i] != name:
                continue
            if drafts.probs is not None:
                src.extend(range(own_offsets[i], own_offsets[i] + counts[i]))
                dst.extend(range(offsets[i], offsets[i] + counts[i]))
            else:
                one_hot_rows.extend(range(offsets[i], offsets[i] + counts[i]))
                one_hot_tokens.extend(host_ids[i, : counts[i]].tolist())
        if src:
            probs[torch.tensor(dst, device=device)] = drafts.probs[torch.tensor(src, device=device)]
    if one_hot_rows:
        probs[torch.tensor(one_hot_rows, device=device), torch.tensor(one_hot_tokens, device=device)] = 1.0
    return Drafts(token_ids, counts, probs)
