"""Draft-model proposer: a small causal LM with its own slot cache drafts K tokens autoregressively.

The draft cache mirrors the generator's slots. Rather than being told what the target accepted, the proposer
reconciles at the start of every step: the draft tokens it cached last step stay valid exactly as long as they
match the committed history, so its cache length is the base plus that matching prefix (rollback = a lower length).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollout_kernels.device_io import host, upload
from rollout_kernels.race_logits import race_logits, race_logits_ref
from specdec.processing import RowSampling, keep_thresholds, processed_logprobs, target_probs
from specdec.proposers.base import Drafts, ModelRunnerProtocol, ProposalBatch, Proposer
from specdec.tree import host_longs
from specdec.verify import RaceKeys

VOCAB_PADDING = 0.01  # output vocabularies this close in size are taken as one tokenizer's, padded otherwise


class DraftModelProposer(Proposer):
    """Drafts with a model run through `runner` (the target's runner protocol, implemented in `rollout/`).

    Per-slot state in host tensors, rows as the generator's slots (`copy_rows` moves them): `cache_len` (tokens in
    the draft cache), `base` (position of the first token fed after the last proposal) and the draft tokens from there
    whose KV the cache holds (`cached`, `num_cached`). A row put back by the engine's restore (`rewind`) keeps its
    cache up to the token before its pending one, which the restore may have changed.
    """

    needs_prefill = True

    runs_model = True

    def __init__(self, runner: ModelRunnerProtocol, num_speculative_tokens: int, target_vocab_size: int):
        rows = runner.vocab_size
        if abs(rows - target_vocab_size) > VOCAB_PADDING * max(rows, target_vocab_size):
            raise ValueError(
                f"the draft model's vocabulary ({rows} tokens) differs from the target's ({target_vocab_size}) by "
                f"more than an embedding matrix's padding ({VOCAB_PADDING:.0%}): a draft must share the target's "
                "tokenizer"
            )
        # a pair sharing a tokenizer whose matrices are padded to other sizes (Qwen2.5's 0.5B has 151936 rows, its 7B
        # 152064): the draft's logits are fitted to the target's ids (those past its own never drafted, those past the
        # target's cut), and a target's id past the draft's embedding reaches the draft as id 0
        self.vocab_size = target_vocab_size
        embeddings = getattr(getattr(runner, "model", None), "get_input_embeddings", lambda: None)()
        self._input_rows = embeddings.weight.shape[0] if embeddings is not None else rows
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self._cache_len = torch.zeros(0, dtype=torch.long)  # [slots]
        self._base = torch.zeros(0, dtype=torch.long)  # [slots]
        self._num_cached = torch.zeros(0, dtype=torch.long)  # [slots]
        self._cached = torch.full((0, 1), -1, dtype=torch.long)  # [slots, >= K - 1]
        # on a GPU the step's cached drafts come back without waiting: (pinned copy, rows, width, copied event), landed
        # in `_cached` before anything reads it (by then the step's one read of the device has waited for the copy)
        self._landing: tuple[Tensor, int, int, torch.cuda.Event] | None = None

    def prefill(self, row_start: int, prompts: list[list[int]], group_of: Tensor, states: list[dict]) -> None:
        self._land()
        if self._input_rows < self.vocab_size and any(t >= self._input_rows for p in prompts for t in p):
            prompts = [[t if t < self._input_rows else 0 for t in p] for p in prompts]
        self.runner.prefill(row_start, prompts)
        if len(states) > len(prompts):
            dst = torch.arange(row_start, row_start + len(states))
            self.runner.copy_rows(row_start + group_of, dst, max(len(p) for p in prompts))
        rows = slice(row_start, row_start + len(states))
        self._reserve(rows.stop, 1)
        self._cache_len[rows] = host_longs([len(p) for p in prompts])[host(group_of)]
        self._base[rows] = 0
        self._num_cached[rows] = 0

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int) -> None:
        self._land()
        self.runner.copy_rows(src, dst, num_positions)
        src, dst = host(src), host(dst)  # the engine's row indices, on the host
        for field in (self._cache_len, self._base, self._num_cached, self._cached):
            field[dst] = field[src]

    def rewind(self, rows: list[int], num_tokens: list[int]) -> None:
        # the cache saw the rows' tokens as they were up to the pending one; past it, another text (and the cached
        # drafts with it): a step that does not run the draft model would otherwise leave it in the cache
        self._land()
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long)
        limit = torch.tensor(num_tokens, dtype=torch.long) - 1  # the pending token is never cached
        self._cache_len[index] = torch.minimum(self._cache_len[index], limit)
        self._num_cached[index] = 0

    def _reserve(self, num_slots: int, width: int) -> None:
        """Grow the per-slot state to `num_slots` rows and `width` cached drafts."""
        grow, widen = max(num_slots - len(self._cache_len), 0), max(width - self._cached.shape[1], 0)
        if grow:
            zeros = torch.zeros(grow, dtype=torch.long)
            self._cache_len, self._base = torch.cat([self._cache_len, zeros]), torch.cat([self._base, zeros])
            self._num_cached = torch.cat([self._num_cached, zeros])
        if grow or widen:
            cached = torch.full((len(self._cache_len), self._cached.shape[1] + widen), -1, dtype=torch.long)
            cached[: len(self._cached), : self._cached.shape[1]] = self._cached
            self._cached = cached

    def propose(self, batch: ProposalBatch) -> Drafts:
        num_rows = len(batch.num_tokens)
        max_k = max(batch.num_asked)
        device = self.runner.device
        num_tokens, asked = host_longs(batch.num_tokens), host_longs(batch.num_asked)
        # catch up: feed every row the committed tokens its draft cache lacks (the pending token at least)
        self._land()
        self._reserve(num_rows, max_k - 1)
        cache_lens = self._reconciled(batch.token_ids, num_tokens)
        num_inputs = num_tokens - cache_lens
        offsets = torch.arange(int(num_inputs.max()))
        columns = (cache_lens[:, None] + offsets).clamp(max=batch.token_ids.shape[1] - 1)
        input_ids = torch.where(offsets < num_inputs[:, None], batch.token_ids.gather(1, columns), 0)
        if self._input_rows < self.vocab_size:
            input_ids = input_ids.masked_fill(input_ids >= self._input_rows, 0)
        logits = self.runner.decode(0, input_ids, num_inputs, cache_lens)
        step_logits = self._fitted(logits[torch.arange(num_rows, device=device), upload(num_inputs - 1, device)])
        cache_lens = num_tokens.clone()
        draft_ids = torch.full((num_rows, max_k), -1, dtype=torch.long, device=device)
        draft_probs = []
        uniforms = upload(batch.draft_uniforms, device)
        for j in range(max_k):
            if batch.sampling.all_greedy:
                tokens = step_logits.argmax(dim=-1)
            elif batch.race is not None:  # the race the target draws with, over q
                tokens = _race_draft(step_logits, batch.sampling, batch.race, j)
            else:  # rejection sampling needs q at every draft
                probs = _draft_distribution(step_logits, batch.sampling)
                tokens = _sample(probs, uniforms[:, j], batch.sampling)
                draft_probs.append(probs)
            draft_ids[:, j] = torch.where(upload(asked > j, device), tokens, -1)
            if j + 1 < max_k:  # the last draft is never fed: verification decides whether it is kept
                feeding = (asked > j + 1).long()
                step_logits = self._fitted(self.runner.decode(0, tokens[:, None], feeding, cache_lens)[:, 0])
                cache_lens += feeding
        # one transfer: the next step reconciles against these on the host (the last draft was never fed)
        self._cache_len[:num_rows], self._base[:num_rows] = cache_lens, num_tokens
        self._num_cached[:num_rows] = (asked - 1).clamp(min=0)
        if max_k > 1:
            self._keep_cached(draft_ids[:, : max_k - 1])
        if batch.race is not None:  # exact verification: a draft is checked against the target's race, as one-hot
            return Drafts(draft_ids, list(batch.num_asked))
        # rows back to back, each row's positions j < K_i, matching the verifier's flattened layout
        stacked = torch.stack(draft_probs, dim=1) if draft_probs else None  # [rows, max_k, V]
        keep = upload(torch.arange(max_k)[None, :] < asked[:, None], device)
        flat_probs = stacked[keep] if stacked is not None else None
        return Drafts(draft_ids, list(batch.num_asked), flat_probs)

    def _fitted(self, logits: Tensor) -> Tensor:
        """`[rows, V_draft]` logits as `[rows, V_target]`: ids past the draft's own at -inf (never drafted), those past
        the target's left out."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[:, : self.vocab_size].contiguous()
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=-math.inf)
        return logits

    def _keep_cached(self, drafts: Tensor) -> None:
        """`_cached[:rows, :width] = drafts`: at once from host memory; from a GPU through a pinned buffer, landed
        by `_land` (the drafts are read on the host only at the next step, after the step's one device read)."""
        if not drafts.is_cuda:
            self._cached[: drafts.shape[0], : drafts.shape[1]] = drafts
            return
        pinned = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
        pinned.copy_(drafts, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._landing = (pinned, drafts.shape[0], drafts.shape[1], copied)

    def _land(self) -> None:
        """Put the last step's drafts, copied from the GPU, into `_cached`."""
        if self._landing is None:
            return
        pinned, num_rows, width, copied = self._landing
        self._landing = None
        if not copied.query():  # done already when the step's results were read
            copied.synchronize()
        self._cached[:num_rows, :width] = pinned

    def _reconciled(self, token_ids: Tensor, num_tokens: Tensor) -> Tensor:
        """`[rows]` each row's draft-cache length after reconciling: the cached draft tokens that match the committed
        history (`token_ids [rows, T]`, `num_tokens [rows]`, the pending token last) stay, the rest are dropped by a
        lower length, and never more than the committed tokens (a row rolled back has fewer than its cache saw). The
        cached drafts are consumed."""
        num_rows = len(num_tokens)
        lengths, previous = self._num_cached[:num_rows], self._cache_len[:num_rows]
        width = int(lengths.max()) if num_rows else 0
        # the pending token is never cached
        reconciled = torch.minimum(previous, num_tokens - 1)
        if width:
            bases, drafts = self._base[:num_rows], self._cached[:num_rows, :width]
            offsets = torch.arange(width)
            history = token_ids.gather(1, (bases[:, None] + offsets).clamp(max=token_ids.shape[1] - 1))
            # a cached draft counts while it is inside the committed tokens (before the pending one) and matches them
            comparable = offsets[None, :] < torch.minimum(lengths, num_tokens - 1 - bases)[:, None]
            matched = ((history == drafts) & comparable).long().cumprod(dim=1).sum(dim=1)
            reconciled = torch.where(lengths > 0, torch.minimum(bases + matched, num_tokens - 1), reconciled)
        self._num_cached[:num_rows] = 0
        return reconciled


def _draft_distribution(logits: Tensor, sampling: RowSampling) -> Tensor:
    """q: the draft's distribution processed like the target's (temperature, top-k, top-p; one-hot if greedy)."""
    return target_probs(logits, processed_logprobs(logits, sampling), sampling)


def _race_draft(logits: Tensor, sampling: RowSampling, race: RaceKeys, j: int) -> Tensor:
    """Draft j of each row (`logits [rows, V]`): the race the target draws with, over q, keyed by the draft's position.
    The same op as the target's (`race_logits`: the same noise, the same score, the same top-k / top-p thresholds), so
    wherever q's logits equal the target's the draft is the token the target draws, and otherwise the two differ only
    as far as the distributions do."""
    num_rows = logits.shape[0]
    device = logits.device
    keep = keep_thresholds(logits, sampling) if sampling.needs_filter else ()
    op = race_logits if logits.is_cuda else race_logits_ref
    tokens, _ = op(
        logits,
        torch.arange(num_rows, device=device),
        sampling.temperature.contiguous(),
        upload(race.seeds, device).contiguous(),
        upload(race.positions, device) + j,
        *keep,
    )
    return tokens


def _sample(probs: Tensor, uniforms: Tensor, sampling: RowSampling) -> Tensor:
    """Inverse-CDF sample per row with its uniform. Zero-probability tokens own an empty interval of the CDF, so
    `searchsorted(right=True)` never lands on one. (Drafts need a valid sample from q, not kernel-exact agreement.)"""
    if sampling.all_greedy:
        return probs.argmax(dim=-1)
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    targets = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
