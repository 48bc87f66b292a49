"""The proposers as a calibration's timed steps see them: every row fed the width it was asked for.

A K policy's calibration times steps of every width on random text, where a suffix or n-gram proposer finds fewer
drafts than asked. `FillingProposers` wraps the generator's `ProposerSet` for those steps only: a row's missing drafts
are filled with its pending token (`filled_drafts`: the output stays exact, the fillers are mostly rejected), the
cascade is told whether its model-running proposers take part, and nothing learned from random text is kept.
"""

from __future__ import annotations

import torch

from specdec.proposers.base import Drafts, ProposalBatch, filled_drafts


class FillingProposers:
    """`proposers` (a `ProposerSet`) with every row's drafts filled up to the count asked (see the module docstring).

    Args:
        proposers: the generator's proposers.
        with_models: True, a cascade passes every row on to its proposers that run a model (a draft model); False,
            those sit the step out; None, the cascade's own rule.
    """

    def __init__(self, proposers, with_models: bool | None = None):
        self.inner = proposers
        self.with_models = with_models

    def propose(self, batch: ProposalBatch, requested: list[str | None] | None = None) -> tuple[Drafts, list]:
        drafts, served = self.inner.propose(batch, requested, self.with_models)
        num_tokens = torch.tensor(batch.num_tokens, dtype=torch.long)
        pending = batch.token_ids[torch.arange(len(num_tokens)), num_tokens - 1]  # each row's last token (host)
        return filled_drafts(drafts, torch.tensor(batch.num_asked, dtype=torch.long), pending), served

    def observe(self, num_accepted: list[int], seconds: float, emitted_ids) -> None:
        """Filled drafts on random text earn nothing real: the proposers learn nothing from a timed step."""

    def __getattr__(self, name: str):  # everything else is the proposers' own
        return getattr(self.inner, name)
