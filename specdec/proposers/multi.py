"""Several proposers in one decode step: each row takes the first proposer, in priority order, that drafts for it.

A row whose request names a proposer only asks that one. The others cascade: e.g. with ["ngram", "draft_model"] the
n-gram lookup drafts for the rows where it finds a match and the draft model for the rest. A proposer that scores its
drafts (`Drafts.scores`, the suffix proposer's expected accepted tokens) passes rows on to the next proposer of the
cascade only where that one is expected to earn more, and only in a step where what they gain pays for running it:
a row expects `1 + f * score` tokens from its own draft (`f`: how the scores have turned out so far, accepted over
scored) and `E_next(k)` (bonus token included) from the next proposer's (its measured per-position acceptance); the
rows where `E_next(k)` is larger are passed on if the step's expected tokens then grow by more than the next
proposer's time relative to the rest of the step (`1 + rho`, measured whenever it runs: a draft model's passes cost
about the same whatever the rows asked); otherwise the next proposer does not run, and a row without a draft of the
first one goes undrafted. With ["suffix", "draft_model"], suffix serves the rows where it has a confident draft and
the draft model the rest, or suffix alone the steps where the draft model would not pay.

Which proposer serves a row depends on the row's history and on earlier steps' outcomes, never on this step's noise,
so mixing them keeps verification lossless. Drafts of every proposer go into one `Drafts`, verified in the same
forward; rows of a proposer without draft probabilities get one-hot q where another proposer has them (rejection
sampling with a one-hot q is exactly the n-gram rule).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from torch import Tensor

from rollout_kernels.device_io import host, upload
from specdec.auto_policy import AcceptanceStats
from specdec.proposers.base import Drafts, ProposalBatch, Proposer


class ProposerSet(Proposer):
    """Proposers by name, in priority order, behind the single-proposer interface.

    Args:
        proposers: name -> proposer, in priority order.
        max_k: the most drafts a row is asked for (`num_speculative_tokens`): the depth of the acceptance measured for
            each proposer.
    """

    def __init__(self, proposers: dict[str, Proposer], max_k: int = 1):
        assert proposers, "expected at least one proposer"
        self.proposers = proposers
        self.needs_prefill = any(p.needs_prefill for p in proposers.values())
        self.max_k = max_k
        self.pass_on = True  # False: the first proposer that drafts for a row serves it, whatever its score
        self._forget()

    def _forget(self) -> None:
        # per proposer: its acceptance on the rows it was asked and served (or had nothing for), its time relative to
        # the rest of the step's, and for a proposer that scores its drafts, how its scores turned out
        self.acceptance = [AcceptanceStats(self.max_k) for _ in self.proposers]
        self.relative_cost = [RelativeCost() for _ in self.proposers]
        self.calibration = [ScoreCalibration() for _ in self.proposers]
        self._last_step: tuple[Tensor, list[Tensor], list[Tensor], dict, list[float]] | None = None

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

    def drop(self, rows: list[int]) -> None:
        for proposer in self.proposers.values():
            proposer.drop(rows)

    def rewind(self, rows: list[int], num_tokens: list[int]) -> None:
        for proposer in self.proposers.values():
            proposer.rewind(rows, num_tokens)

    def update(self, token_ids: Tensor, num_tokens: list[int]) -> None:
        for proposer in self.proposers.values():
            proposer.update(token_ids, num_tokens)

    def begin(self) -> None:
        for proposer in self.proposers.values():
            proposer.begin()

    def wait(self) -> None:
        for proposer in self.proposers.values():
            proposer.wait()

    def reset(self) -> None:
        for proposer in self.proposers.values():
            proposer.reset()
        self._forget()

    def observe(self, num_accepted: list[int], seconds: float, emitted_ids: Tensor) -> None:
        """The drafts of the last `propose` were verified: `num_accepted[i]` of row i's were accepted, row i emitted
        `emitted_ids[i, :num_accepted[i] + 1]` (`[rows, W]`, host), and the step took `seconds` in all (drafting
        included). Updates each proposer's measured acceptance, relative cost and score calibration: a scoring
        proposer's drafts count on every row it drafted for, served or passed on, as the prefix that matches the
        tokens emitted (plain decoding's tokens, or tokens distributed as those under rejection sampling): where it
        served, exactly its accepted drafts; elsewhere what it would have had accepted, cut at the tokens emitted."""
        if self._last_step is None or len(self.proposers) == 1:  # nothing to choose between
            return
        served, asked_of, counted_of, scored_drafts, spent = self._last_step
        self._last_step = None
        accepted = torch.tensor(num_accepted)
        rest = max(seconds - sum(spent), 1e-9)
        for index, (asked, counted) in enumerate(zip(asked_of, counted_of)):
            if bool((asked > 0).any()):
                self.relative_cost[index].update(spent[index] / rest)
            if bool(counted.any()):
                mine = torch.where(served == index, accepted, 0)
                self.acceptance[index].update(asked[counted].tolist(), mine[counted].tolist())
            if index in scored_drafts:
                token_ids, num_drafted, scores = scored_drafts[index]
                width = min(token_ids.shape[1], emitted_ids.shape[1])
                valid = torch.arange(width)[None, :] <= accepted[:, None]  # the emitted tokens of each row
                same = (token_ids[:, :width] == emitted_ids[:, :width]) & valid
                matched = torch.minimum(same.long().cumprod(dim=1).sum(dim=1), num_drafted)
                drafted = num_drafted > 0
                if bool(drafted.any()):
                    self.calibration[index].update(scores[drafted], matched[drafted])

    def propose(
        self, batch: ProposalBatch, requested: list[str | None] | None = None, with_models: bool | None = None
    ) -> tuple[Drafts, list[str]]:
        """Drafts for every row, and per row the proposer that served it (or, if none had drafts, the last one
        asked). `requested[i]` names the only proposer row i may use; None cascades through all. `with_models` (a
        calibration times a cascade's steps both ways): True, a proposer that scores its drafts passes every row on
        to the next one; False, proposers that run a model are asked for nothing; None, the rule of the module
        docstring."""
        num_rows = len(batch.num_tokens)
        names = self.names
        if len(names) == 1 and not (self.proposers[names[0]].runs_model and with_models is False):
            # one proposer, asked what the rows ask (a request can only name this one): nothing to route
            return self._ask(names[0], batch, batch.num_asked), [names[0]] * num_rows
        only = torch.full((num_rows,), -1)  # per row: the index of the only proposer it may ask, -1 = any
        if requested is not None:
            only = torch.tensor([-1 if r is None else names.index(r) for r in requested], dtype=torch.long)
        num_asked = torch.tensor(batch.num_asked)
        served = torch.full((num_rows,), -1)  # per row: the index of the proposer whose drafts it takes
        stopped = torch.zeros(num_rows, dtype=torch.bool)  # per row: its cascade ends here, drafts or not
        tried = torch.zeros(num_rows, dtype=torch.long)  # per row: the last proposer asked
        scored_drafts: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # per scoring proposer: tokens, counts, scores
        spent = [0.0] * len(self.proposers)  # per proposer: seconds in `propose`
        asked_of: list[Tensor] = []  # per proposer: the drafts asked of each row
        counted_of: list[Tensor] = []  # per proposer: the rows its acceptance counts (served, or nothing drafted)
        results: dict[int, Drafts] = {}
        for index, (name, proposer) in enumerate(self.proposers.items()):
            asked = torch.where((served < 0) & ~stopped & ((only < 0) | (only == index)), num_asked, 0)
            if proposer.runs_model and with_models is False:
                asked = torch.zeros_like(asked)
            asked_of.append(asked)
            counted_of.append(asked > 0)
            if int(asked.max()) == 0:
                proposer.update(batch.token_ids, batch.num_tokens)  # it drafts for nobody, but may learn the text
                continue
            start = time.perf_counter()
            drafts = self._ask(name, batch, asked.tolist())
            spent[index] = time.perf_counter() - start
            results[index] = drafts
            tried = torch.where(asked > 0, index, tried)
            num_drafted = torch.tensor(drafts.num_drafted)
            drafted = (asked > 0) & (num_drafted > 0)
            takes = drafted
            if drafts.scores is not None and self.pass_on:
                keeps, stops = self._keeps(index, drafts.scores, asked, only, with_models)
                takes, stopped = drafted & keeps, stopped | stops
                scored_drafts[index] = (
                    host(drafts.token_ids),  # a scoring proposer drafts on the host
                    torch.where(asked > 0, num_drafted, 0),
                    drafts.scores.to(torch.float64),
                )
                counted_of[-1] = counted_of[-1] & ~(drafted & ~takes)  # passed on: not this proposer's outcome
            served = torch.where(takes, index, served)
        self._last_step = (served, asked_of, counted_of, scored_drafts, spent)
        tried_names = [names[i] for i in tried.tolist()]
        if not results:  # every proposer asked for nothing (its model-running ones sat the step out)
            return Drafts(torch.full((num_rows, 1), -1), [0] * num_rows), tried_names
        if len(results) == 1:
            return next(iter(results.values())), tried_names
        return _combine(results, served), tried_names

    def _ask(self, name: str, batch: ProposalBatch, num_asked: list[int]) -> Drafts:
        """Proposer `name`'s drafts for `batch` with `num_asked` per row, each row's state its own under `name`."""
        states = [s.setdefault(name, {}) for s in batch.states]
        return self.proposers[name].propose(dataclasses.replace(batch, num_asked=num_asked, states=states))

    def _keeps(
        self, index: int, scores: Tensor, asked: Tensor, only: Tensor, with_models: bool | None
    ) -> tuple[Tensor, Tensor]:
        """For scoring proposer `index`: `[rows]` the rows whose drafts it keeps, and `[rows]` the rows whose cascade
        ends with it this step (drafted or not)."""
        everyone = torch.ones(len(scores), dtype=torch.bool)
        if index + 1 == len(self.proposers) or with_models is False:
            return everyone, ~everyone
        if with_models:  # a calibration's step with the model: every row that may cascade goes on
            return only == index, ~everyone
        own, rival = self._expected(index, scores, asked, only)
        if self._pays(index + 1, own, rival):  # the next one runs for the rows where it earns more
            return torch.from_numpy(rival <= own), ~everyone
        return everyone, (asked > 0) & (only < 0)  # it does not run: no row goes on, not even one without a draft

    def _expected(self, index: int, scores: Tensor, asked: Tensor, only: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """`[rows]` tokens each row expects this step from proposer `index`'s draft (1 + its calibrated score; 1 for a
        row asked nothing) and from the next proposer's, where the row may cascade to it (else the same)."""
        own = np.where(asked.numpy() > 0, 1.0 + self.calibration[index].factor() * scores.double().numpy(), 1.0)
        rival = self.acceptance[index + 1].expected_emitted()[asked.clamp(max=self.max_k).numpy()]
        return own, np.where(((only < 0) & (asked > 0)).numpy(), rival, own)

    def _pays(self, index: int, own: np.ndarray, rival: np.ndarray) -> bool:
        """Whether running proposer `index` for the rows where it expects more (`rival`) than their own drafts (`own`)
        raises the step's expected tokens by more than its time relative to the rest of the step."""
        return float(np.maximum(own, rival).sum() / own.sum()) > 1.0 + self.relative_cost[index].ratio()


class RelativeCost:
    """A proposer's drafting time over the rest of its step's time (everything but the proposers): decayed by `decay`
    per step in which it drafted; 0 until measured."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.weighted = 0.0
        self.weight = 0.0

    def update(self, ratio: float) -> None:
        self.weighted = self.decay * self.weighted + ratio
        self.weight = self.decay * self.weight + 1.0

    def ratio(self) -> float:
        return self.weighted / self.weight if self.weight else 0.0


class ScoreCalibration:
    """How a proposer's scores (its own estimate of the drafts a row will have accepted) turn out: `factor()` is the
    accepted drafts over the scores of the rows it drafted for, each step weighing 1 once `rows_per_step` rows were
    scored, decayed by `decay` per step; `prior_weight` steps' worth of a factor of 1 stand behind it."""

    def __init__(self, decay: float = 0.8, prior_weight: float = 0.1, rows_per_step: int = 16):
        self.decay, self.prior_weight, self.rows_per_step = decay, prior_weight, rows_per_step
        self.accepted = 0.0
        self.scored = 0.0

    def update(self, scores: Tensor, num_accepted: Tensor) -> None:
        """One step: the scores of the rows drafted for and the drafts each had (or would have had) accepted."""
        weight = min(len(scores) / self.rows_per_step, 1.0) / len(scores)
        self.accepted = self.decay * self.accepted + weight * float(num_accepted.sum())
        self.scored = self.decay * self.scored + weight * float(scores.sum())

    def factor(self) -> float:
        return (self.accepted + self.prior_weight) / (self.scored + self.prior_weight)


def _combine(results: dict[int, Drafts], served: Tensor) -> Drafts:
    """One `Drafts` from several proposers' results (by proposer index): row i's drafts from proposer `served[i]`
    (`[rows]`, -1: none)."""
    assert all(d.parents is None for d in results.values()), "expected chains: token trees come from one proposer alone"
    num_rows = len(served)
    width = max(d.token_ids.shape[1] for d in results.values())
    # on the device where any proposer drafted (a draft model's ids stay there, with or without probabilities)
    device = next((d.token_ids.device for d in results.values() if d.token_ids.is_cuda), torch.device("cpu"))
    token_ids = torch.full((num_rows, width), -1, dtype=torch.long, device=device)
    counts = torch.zeros(num_rows, dtype=torch.long)
    # index tensors are built on the host and uploaded without waiting (`upload`): a plain `.to(device)` of a host
    # tensor waits for the device's queue
    for index, drafts in results.items():
        rows = torch.nonzero(served == index)[:, 0]  # served is on the host
        on_device = upload(rows, device)
        part = upload(drafts.token_ids, device)[on_device]
        token_ids[on_device, : part.shape[1]] = part
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
        dst = upload((offsets[rows][:, None] + position)[valid], device)
        if drafts.probs is not None:
            own = torch.tensor(drafts.num_drafted)
            own_offsets = torch.cumsum(own, 0) - own  # the proposer's own layout: its asked rows back to back
            probs[dst] = drafts.probs[upload((own_offsets[rows][:, None] + position)[valid], device)]
        else:  # one-hot q: a draft without probabilities is the n-gram rule under rejection sampling
            tokens = drafts.token_ids[rows][:, : position.numel()][valid]  # a proposer without probabilities: host
            probs[dst, upload(tokens, device)] = 1.0
    return Drafts(token_ids, counts.tolist(), probs)
