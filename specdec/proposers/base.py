"""What every proposer takes and returns, and the model-runner protocol the draft-model proposer runs through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from specdec.processing import RowSampling
from specdec.verify import RaceKeys


@dataclass
class ProposalBatch:
    """The active rows as a proposer sees them at the start of a decode step."""

    token_ids: Tensor  # [rows, T] int64 on the host: prompt + generated tokens, the pending token last
    num_tokens: list[int]  # valid tokens per row
    num_asked: list[int]  # drafts asked of each row (0 = no drafts for that row)
    sampling: RowSampling  # per row, for proposers that sample (their q must be processed like the target's p)
    draft_uniforms: Tensor  # [rows, max K] float64: one uniform per draft position, from each row's own stream
    states: list[dict] = field(default_factory=list)  # per-row proposer state that travels with the sequence
    # exact verification: each row's race keys (seed, completion position of the first draft); a proposer that
    # samples draws by the race with these keys, and returns no probabilities. None: rejection sampling
    race: RaceKeys | None = None


@dataclass
class Drafts:
    token_ids: Tensor  # [rows, max K] int64, -1 after each row's drafts (host or device)
    num_drafted: list[int]  # drafts actually proposed per row (host)
    probs: Tensor | None = None  # [sum(num_drafted), V] draft distribution, rows back to back; None = n-gram
    # token tree: [rows, max K] draft-local parent of each node (-1 = child of the pending token); None = chain
    parents: Tensor | None = None
    # [rows] float64: the proposer's own estimate of how many of each row's drafts will be accepted (the suffix
    # proposer's path probabilities summed); a cascade uses it to pass a row on to a later proposer. None = no estimate
    scores: Tensor | None = None


class ModelRunnerProtocol(Protocol):
    """What a draft-model proposer needs from a model runner (implemented in `rollout/`)."""

    device: object
    vocab_size: int

    def prefill(self, row_start: int, prompts: list[list[int]]) -> Tensor:
        """Prefill prompts into slots `[row_start, ...)`; return last-position logits `[rows, V]`."""
        ...

    def decode(
        self,
        row_start: int,
        input_ids: Tensor,
        num_inputs: list[int] | Tensor,
        cache_lens: list[int] | Tensor,
        depths: Tensor | None = None,
        ancestors: Tensor | None = None,
    ) -> Tensor:
        """Feed `num_inputs[i]` tokens of `input_ids [rows, S]` after `cache_lens[i]` cached ones.

        Returns logits `[rows, S, V]`."""
        ...

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int | None = None) -> None: ...


class Proposer:
    """Base class: hooks that keep a proposer's per-slot state in step with the generator's slots."""

    needs_prefill = False
    runs_model = False  # drafts by running a model (sequential forward passes)

    def prefill(self, row_start: int, prompts: list[list[int]], group_of: Tensor, states: list[dict]) -> None:
        """Prompts were admitted at slots `[row_start, row_start + len(prompts))`; the generator fans them out to
        `len(states)` rows, row i holding prompt `group_of[i]`, with `states[i]` that row's fresh proposer state."""

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int) -> None:
        """The generator moved rows `src` to `dst` (packing the active rows at the front)."""

    def finish(self, rows: list[int], token_ids: Tensor, num_tokens: list[int]) -> None:
        """Rows `rows` finished, holding `token_ids[row, :num_tokens[i]]` (`token_ids [slots, T]` on the host); their
        slots are freed next (and may be refilled by `copy_rows`)."""

    def drop(self, rows: list[int]) -> None:
        """Rows `rows` left flight unfinished (preempted, or left out by a restore): what they hold is text no row
        holds any more. Their slots are freed next (and may be refilled by `copy_rows` or `prefill`)."""

    def rewind(self, rows: list[int], num_tokens: list[int]) -> None:
        """Rows `rows` were rolled back (a restore) to hold `num_tokens[i]` tokens, the last of which (the pending
        token) may differ from the one they held there: what a proposer kept of their text from that token on is not
        theirs any more, whatever the rows go on to hold."""

    def update(self, token_ids: Tensor, num_tokens: list[int]) -> None:
        """A step without drafts: the rows hold `token_ids[i, :num_tokens[i]]` (`[rows, T]`, host), as `propose`
        would have seen them."""

    def begin(self) -> None:
        """A `generate` call starts: no row is in flight (any left by an interrupted call is gone)."""

    def reset(self) -> None:
        """Forget everything learned so far (the warm-up's synthetic rows)."""

    def wait(self) -> None:
        """Finish any work left running in the background (a suffix proposer taking tokens in): the generator calls it
        before it changes rows' tokens below their counts (rows removed or rolled back)."""

    def propose(self, batch: ProposalBatch) -> Drafts:
        raise NotImplementedError


def filled_drafts(drafts: Drafts, num_asked: Tensor, filler: Tensor) -> Drafts:
    """`drafts` with each row's missing drafts (up to `num_asked [rows]`) set to its `filler [rows]` token, chained
    under the row's last draft: every row is fed the width it was asked for. Drafts with probabilities (a draft
    model's, which drafts every token asked) are returned as they are."""
    if drafts.probs is not None:
        return drafts
    num_rows, width = len(drafts.num_drafted), int(num_asked.max()) if num_asked.numel() else 0
    num_drafted = torch.tensor(drafts.num_drafted)
    col = torch.arange(width)[None, :]
    fill = (col >= num_drafted[:, None]) & (col < num_asked[:, None])
    token_ids = torch.full((num_rows, width), -1, dtype=torch.long)
    given = min(width, drafts.token_ids.shape[1])
    token_ids[:, :given] = drafts.token_ids[:, :given].cpu()
    token_ids = torch.where(fill, filler[:, None], token_ids)
    parents = None
    if drafts.parents is not None:
        parents = torch.full((num_rows, width), -1, dtype=torch.long)
        parents[:, :given] = drafts.parents[:, :given].cpu()
        parents = torch.where(fill, col - 1, parents)  # a filler's parent is the draft before it
    return Drafts(token_ids, torch.maximum(num_drafted, num_asked).tolist(), parents=parents)
