"""Continuous-batching generator over a slot KV cache.

Requests wait in a queue; a step either admits them (one prefill per prompt, its KV copied to the prompt's n
samples) or decodes: one forward over the active rows only, which are kept packed at the front of the slots. A decode
step feeds every row its pending token plus up to K draft tokens and commits the first m of them (K = 0 without
speculation). The host drives scheduling; the device returns one small packed tensor per step.

The public engine: `generate` (a whole call), or `add_requests`, then `step` until `has_unfinished` is False;
`snapshot`/`restore` save and roll back the rows in flight (the `auto` policy's calibration uses these).
"""

from __future__ import annotations

import collections
import copy
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rollout.engine.memory_plan import check_kv_cache_fits
from rollout.engine.model_runner import ModelRunner, eval_mode
from rollout.engine.requests import check_params, check_prompts, eos_token_ids, make_sequences
from rollout.engine.sampling import Completion, SamplingParams
from rollout.engine.sequence import Sequence
from rollout.engine.slots import SlotState
from rollout.engine.speculation import build_policy, build_proposers, default_route
from rollout.engine.step_timer import StepTimer
from rollout.engine.trace import StepRecord
from specdec.auto_policy import StepObservation
from specdec.config import SpecConfig
from specdec.policies import Decision
from specdec.proposers.base import Drafts, ProposalBatch, filled_drafts
from specdec.proposers.suffix import SuffixProposer
from specdec.tree import DraftLayout, layout_drafts
from specdec.verify import RaceKeys, VerifyResult, verify


@dataclass
class StepOutput:
    """What one `Generator.step` did."""

    record: StepRecord  # its trace record (also appended to `last_trace`)
    finished: list[Completion] = field(default_factory=list)  # samples that finished in this step
    observation: StepObservation | None = None  # decode steps: what a K policy learns from the step


@dataclass
class RowSnapshot:
    """One row in flight, as `Generator.snapshot` saw it."""

    sequence: Sequence
    num_tokens: int
    cache_len: int
    num_draws: int
    pending: int  # its last token: not in the KV cache yet, so a restore may change it
    proposer_state: dict


class Generator:
    """Batched generation for a transformers causal LM.

    Args:
        model: the model to run (its current weights are used on every call: no copy is kept).
        max_batch_size: slots, i.e. sequences decoded at once.
        max_seq_len: prompt + completion tokens a sequence may hold.
        spec: speculative decoding settings; None decodes one token per step.
        max_prefill_tokens: cap on padded prompt tokens per prefill forward (bounds prefill memory).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        spec: SpecConfig | None = None,
        max_prefill_tokens: int = 16384,
    ):
        if isinstance(model, (str, os.PathLike)):
            raise TypeError(
                f"Generator takes a loaded model, not the name or path {str(model)!r}: load it first with "
                "rollout.models.zoo.load_model(name) (shipped models) or "
                "transformers.AutoModelForCausalLM.from_pretrained"
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Generator takes a transformers causal LM (a torch.nn.Module), got {type(model).__name__}")
        for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        if not isinstance(max_prefill_tokens, int) or max_prefill_tokens < max_seq_len:
            raise ValueError(
                f"max_prefill_tokens ({max_prefill_tokens!r}) must be an integer >= max_seq_len ({max_seq_len}) "
                "so that the longest prompt fits one prefill"
            )
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ValueError(f"spec must be a specdec.SpecConfig or None, got {type(spec).__name__}")
        if spec is not None and not spec.methods:  # method None: speculation off
            spec = None
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.spec = spec
        # tokens fed per row per decode step: the pending token plus the largest K
        self.max_block = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        num_positions = max_seq_len + self.max_block
        self.runner = ModelRunner(model, num_slots=max_batch_size, num_positions=num_positions)  # checks the model
        self.kv_cache_bytes = check_kv_cache_fits(model, spec, max_batch_size, max_seq_len)  # allocated lazily
        self.device = self.runner.device
        self.proposers = build_proposers(spec, self.runner, max_batch_size, num_positions) if spec else None
        self._methods = spec.methods if spec else ()
        self._default_route = default_route(spec) if spec else ""
        self.policy = build_policy(spec, max_batch_size, self.proposers) if spec else None
        # every sampled token is the exponential race's at its position, unless rejection sampling was asked for
        self.exact = spec is None or spec.verification == "exact"
        # every row's tokens, lengths, settings and random stream; proposers read the tokens without a transfer
        self.slots = SlotState(max_batch_size, num_positions)
        self.eos_token_ids = eos_token_ids(model)
        self.last_trace: list[StepRecord] = []
        self._queue: deque[Sequence] = deque()
        self.num_active = 0  # rows [0, num_active) are in flight
        self._lock = threading.Lock()  # one generate call at a time
        self.warm_up_seconds = 0.0
        if self.policy is not None:  # the policy measures what it needs (auto: step times, as vLLM profiles)
            start = time.perf_counter()
            with StepTimer(self, spec.num_speculative_tokens) as timer:
                self.policy.calibrate(timer)
            self.proposers.reset()  # the calibration's random rows are no drafting material
            self.warm_up_seconds = time.perf_counter() - start

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def draft_history(self) -> SuffixProposer | None:
        """The suffix proposer's history of earlier responses (`clear()`, `save(path)`, `load(path)`, `stats()`), kept
        across `generate` calls; None without `method="suffix"`."""
        return self.proposers.proposers.get("suffix") if self.proposers is not None else None

    # ---- a whole call -----------------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_step: Callable[[StepRecord, int, int], None] | None = None,
        on_group: Callable[[list[Completion]], None] | None = None,
        seed_indices: list[int] | None = None,
    ) -> list[Completion]:
        """Sample `params.n` completions for every prompt.

        Args:
            prompt_ids: token ids of each prompt.
            params: sampling settings shared by all prompts, or one per prompt (a batch may mix them, speculation
                settings included: `SamplingParams(spec=SpecDecodeParams(enabled=False))` turns drafts off for one).
            on_step: called after every step with (its trace record, samples finished so far, samples in total),
                e.g. for a progress display.
            on_group: called with a prompt's completions as soon as its last sample finishes (to stream results:
                what it has received is kept whatever stops the call later).
            seed_indices: the index that seeds each prompt's samples with the params' seed (default: its position
                in this call); a caller that resumes a run passes each prompt's index in the whole run, so a
                prompt's samples do not depend on which other prompts share the call.
        Returns:
            `params.n` completions per prompt, prompt-major (all samples of prompt 0 first).
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "this Generator is already generating (a call from another thread): one Generator serves one call at "
                "a time; give each thread its own Generator"
            )
        try:
            return self._generate(prompt_ids, params, on_step, on_group, seed_indices)
        finally:
            self._lock.release()

    def _generate(self, prompt_ids, params, on_step, on_group, seed_indices) -> list[Completion]:
        sequences = self.add_requests(prompt_ids, params, seed_indices)
        self.last_trace = []
        unfinished = collections.Counter(seq.prompt_index for seq in sequences)  # samples of each prompt running
        by_prompt: dict[int, list[Sequence]] = collections.defaultdict(list)
        for seq in sequences:
            by_prompt[seq.prompt_index].append(seq)
        num_finished = 0
        with torch.inference_mode(), eval_mode(self.model):
            while self.has_unfinished:
                out = self.step()
                num_finished += len(out.finished)
                if on_step is not None:
                    on_step(out.record, num_finished, len(sequences))
                for done in out.finished:
                    unfinished[done.prompt_index] -= 1
                    if on_group is not None and unfinished[done.prompt_index] == 0:
                        on_group([s.completion() for s in by_prompt[done.prompt_index]])
        return [seq.completion() for seq in sequences]

    # ---- the public engine ---------------------------------------------------------------------------------------

    def add_requests(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        seed_indices: list[int] | None = None,
    ) -> list[Sequence]:
        """Check and queue `params.n` samples of every prompt (see `generate`); rows still in flight from an earlier,
        interrupted call are dropped first. Returns the queued sequences, prompt-major."""
        prompt_ids = check_prompts(prompt_ids, self.vocab_size, self.max_seq_len)
        if seed_indices is not None and len(seed_indices) != len(prompt_ids):
            raise ValueError(
                f"seed_indices holds {len(seed_indices)} values for {len(prompt_ids)} prompts: give one each"
            )
        per_prompt = check_params(params, len(prompt_ids), self._methods)
        max_k = self.spec.num_speculative_tokens if self.spec is not None else 0
        sequences = make_sequences(prompt_ids, per_prompt, self.eos_token_ids, self.max_seq_len, max_k, seed_indices)
        self.abort()
        if self.proposers is not None:
            self.proposers.begin()
        self._queue.extend(sequences)
        return sequences

    @property
    def has_unfinished(self) -> bool:
        return bool(self._queue) or self.num_active > 0

    def abort(self) -> None:
        """Drop every request queued or in flight (their KV is garbage the next admission overwrites)."""
        self._queue.clear()
        self.num_active = 0

    def step(
        self, num_draft_tokens: int | None = None, fill_drafts: bool = False, with_models: bool | None = None
    ) -> StepOutput:
        """One step: admit queued requests while slots are free (a prefill), else decode every active row once.
        `num_draft_tokens` overrides the K policy for a decode step (such a step is not reported to the policy: its
        observation is returned for the caller to use). `fill_drafts`: a row the proposers gave fewer drafts than
        asked is filled up with copies of its pending token, so that the step is fed the width it was asked for (a
        calibration times every width this way; the output stays exact, only the fillers are mostly rejected).
        `with_models` (a cascade's calibration): True, every row is passed on to the proposers that run a model (a
        draft model); False, those sit the step out; None, the cascade's own rule. Finished rows are released before
        it returns."""
        if self._queue and self.num_active < self.max_batch_size:
            record, observation = self._admit(), None
        else:
            assert self.num_active > 0, "expected rows in flight: add_requests first"
            record, observation = self._decode_step(num_draft_tokens, fill_drafts, with_models)
        self.last_trace.append(record)
        return StepOutput(record, self._release_finished(), observation)

    def snapshot(self) -> list[RowSnapshot]:
        """The rows in flight, in row order, for `restore`."""
        s = self.slots
        return [
            RowSnapshot(
                s.sequences[row],
                int(s.num_tokens[row]),
                int(s.cache_len[row]),
                int(s.num_draws[row]),
                int(s.token_ids[row, s.num_tokens[row] - 1]),
                copy.deepcopy(s.sequences[row].proposer_state),
            )
            for row in range(self.num_active)
        ]

    def restore(self, rows: list[RowSnapshot]) -> None:
        """Put rows back as a snapshot saw them, into rows `[0, len(rows))` (a prefix of a snapshot keeps fewer rows
        in flight). The KV cache keeps what the rows had (a step only writes past their lengths), so rolling back
        is lowering lengths."""
        s = self.slots
        for row, saved in enumerate(rows):
            assert s.sequences[row] is saved.sequence, f"expected row {row} to hold its snapshot's sequence"
            s.num_tokens[row], s.cache_len[row], s.num_draws[row] = saved.num_tokens, saved.cache_len, saved.num_draws
            s.token_ids[row, saved.num_tokens - 1] = saved.pending
            s.finished[row] = s.stopped[row] = False
            saved.sequence.proposer_state = copy.deepcopy(saved.proposer_state)
        self.num_active = len(rows)

    # ---- admit ---------------------------------------------------------------------------------------------------

    def _admit(self) -> StepRecord:
        """Move queued sequences into free slots; one left-padded prefill per chunk of distinct prompts."""
        start = time.perf_counter()
        free = self.max_batch_size - self.num_active
        admitted = [self._queue.popleft() for _ in range(min(free, len(self._queue)))]
        groups: list[list[Sequence]] = []
        for seq in admitted:  # samples of one prompt are consecutive in the queue
            if groups and groups[-1][0].prompt_index == seq.prompt_index:
                groups[-1].append(seq)
            else:
                groups.append([seq])
        chunk: list[list[Sequence]] = []
        num_emitted = num_prompts = 0
        for group in groups:
            longest = max([len(g[0].prompt) for g in chunk] + [len(group[0].prompt)])
            if chunk and longest * (len(chunk) + 1) > self.max_prefill_tokens:
                num_emitted += self._prefill(chunk)
                num_prompts += len(chunk)
                chunk = []
            chunk.append(group)
        if chunk:
            num_emitted += self._prefill(chunk)
            num_prompts += len(chunk)
        return StepRecord("prefill", num_prompts, 0, 0, 0, num_emitted, time.perf_counter() - start)

    def _prefill(self, groups: list[list[Sequence]]) -> int:
        """One forward over the groups' prompts; sample each sequence's first token. Returns the tokens kept."""
        prompts = [group[0].prompt for group in groups]
        row_start = self.num_active
        logits = self.runner.prefill(row_start, prompts)
        sequences = [seq for group in groups for seq in group]
        group_of = torch.tensor([g for g, group in enumerate(groups) for _ in group], device=self.device)
        width = max(len(p) for p in prompts)
        if len(sequences) > len(groups):  # fan each prompt's KV out to its samples' slots
            dst = torch.arange(row_start, row_start + len(sequences), device=self.device)
            self.runner.copy_rows(row_start + group_of, dst, num_positions=width)
        if self.proposers is not None and self.proposers.needs_prefill:
            self.proposers.prefill(row_start, prompts, group_of, [seq.proposer_state for seq in sequences])
        self.slots.admit(row_start, sequences)
        self.num_active += len(sequences)
        rows = slice(row_start, row_start + len(sequences))
        uniforms = self._uniforms(rows, torch.zeros(len(sequences), dtype=torch.long))
        result = verify(
            logits[group_of],
            torch.zeros(len(sequences), dtype=torch.long, device=self.device),
            layout_drafts([0] * len(sequences), None),
            None,
            self.slots.row_sampling(rows, self.device),
            uniforms[:, 0].to(self.device),
            uniforms[:, -1].contiguous().to(self.device),
            self._race_keys(rows),
        )
        kept, _, _ = self._commit(rows, result, in_cache=False)
        return kept

    # ---- one decode step: schedule, propose, forward, verify, commit --------------------------------------------

    def _decode_step(
        self, num_draft_tokens: int | None, fill_drafts: bool = False, with_models: bool | None = None
    ) -> tuple[StepRecord, StepObservation | None]:
        """Feed each active row its pending token plus its drafts (a tree rooted at the pending token; a chain is the
        one-child tree), verify them all in the same forward, commit the accepted path."""
        start = time.perf_counter()
        num_rows = self.num_active
        context = int(self.slots.cache_len[:num_rows].max())  # rows attend over the longest row's cache (padded)
        observed = self.policy is not None or num_draft_tokens is not None  # a policy learns from the step
        routes = [self._route(seq) for seq in self.slots.sequences[:num_rows]] if observed else []
        decision, asked = self._schedule(num_rows, num_draft_tokens, context, routes)
        uniforms = self._uniforms(slice(0, num_rows), asked)
        sampling = self.slots.row_sampling(slice(0, num_rows), self.device)  # shared by the proposers and the verifier
        race = self._race_keys(slice(0, num_rows))  # shared by the draft model and the verifier
        drafts, served = self._propose(num_rows, asked, sampling, uniforms, race, with_models)
        if fill_drafts and drafts is not None:
            drafts = filled_drafts(drafts, asked, self.slots.pending(num_rows))
        layout = layout_drafts(
            drafts.num_drafted if drafts is not None else [0] * num_rows,
            drafts.parents if drafts is not None else None,
        )
        input_ids, logits = self._forward(num_rows, drafts, layout)
        result = self._verify(num_rows, input_ids, logits, layout, drafts, sampling, uniforms, race)
        if not layout.is_chain:  # move accepted paths next to their roots (a chain's path is in place already)
            rows = torch.arange(num_rows, device=self.device)
            lens = self.slots.cache_len[:num_rows].to(self.device)
            self.runner.cache.compact_paths(rows, lens, result.accepted_nodes.to(self.device))
        num_emitted, accepted_per_row, emitted_ids = self._commit(slice(0, num_rows), result, in_cache=True)
        accepted = accepted_per_row.tolist()
        seconds = time.perf_counter() - start
        if drafts is not None and not fill_drafts:  # a calibration's filled drafts on random text earn nothing real
            # a cascade learns which proposer earns what, at what cost
            self.proposers.observe(accepted, seconds, emitted_ids)
        asked_list = asked.tolist()
        drafting = [k > 0 for k in asked_list]
        observation = None
        if observed:
            observation = self._observation(asked_list, drafting, routes, served, accepted, layout, seconds, context)
            if num_draft_tokens is None:
                self.policy.observe(observation)
        depths = layout.node_counts - 1 if layout.is_chain else torch.tensor(layout.row_depths)
        position = torch.arange(layout.max_depth)
        record = StepRecord(
            "decode",
            num_rows,
            decision.num_draft_tokens,
            sum(layout.num_nodes) - num_rows,
            sum(accepted),
            num_emitted,
            seconds,
            drafted_per_position=(depths[:, None] > position).sum(0).tolist(),
            accepted_per_position=(accepted_per_row[:, None] > position).sum(0).tolist(),
            predicted_gain=decision.predicted_gain,
            measuring=decision.measuring,
            rows_by_method=_count_by(served, drafting),
        )
        return record, observation

    def _schedule(
        self, num_rows: int, num_draft_tokens: int | None, context: int, routes: list[str]
    ) -> tuple[Decision, Tensor]:
        """The step's K (the policy's, given each row's route, or the caller's) and `[rows]` the drafts asked of
        each row under its caps."""
        caps = self.slots.draft_caps(num_rows)
        decision = Decision(0)
        if num_draft_tokens is not None:
            decision = Decision(num_draft_tokens)
        elif self.policy is not None:
            decision = self.policy.choose(num_rows, caps.tolist(), routes, context)
        return decision, caps.clamp(0, decision.num_draft_tokens)

    def _propose(
        self,
        num_rows: int,
        asked: Tensor,
        sampling,
        uniforms: Tensor,
        race: RaceKeys | None,
        with_models: bool | None = None,
    ) -> tuple[Drafts | None, list]:
        """The proposers' drafts for rows asked for some (None if none were); what each row was served by."""
        if self.proposers is None:
            return None, [None] * num_rows
        num_tokens = self.slots.num_tokens[:num_rows].tolist()
        sequences = self.slots.sequences[:num_rows]
        if int(asked.max()) == 0:  # no drafts this step: proposers that learn from the text still take it in
            self.proposers.update(self.slots.token_ids[:num_rows], num_tokens)
            return None, [None] * num_rows
        batch = ProposalBatch(
            token_ids=self.slots.token_ids[:num_rows],
            num_tokens=num_tokens,
            num_asked=asked.tolist(),
            sampling=sampling,
            draft_uniforms=uniforms[:, : int(asked.max())],
            race=race,
            states=[seq.proposer_state for seq in sequences],
        )
        return self.proposers.propose(batch, [seq.params.spec.method for seq in sequences], with_models)

    def _forward(self, num_rows: int, drafts: Drafts | None, layout: DraftLayout) -> tuple[Tensor, Tensor]:
        """The pending tokens and the drafts `[rows, width]` through the model: logits `[rows, width, V]`."""
        input_ids = self.slots.pending(num_rows)[:, None].to(self.device)
        if layout.width > 1:  # drafts stay where the proposer made them (a draft model's on the device): no round trip
            draft_ids = drafts.token_ids[:, : layout.width - 1].to(self.device).clamp(min=0)
            input_ids = torch.cat([input_ids, draft_ids], dim=1)
        cache_lens = self.slots.cache_len[:num_rows]
        logits = self.runner.decode(0, input_ids, layout.node_counts, cache_lens, layout.depths, layout.ancestors)
        return input_ids, logits

    def _verify(
        self, num_rows, input_ids, logits, layout: DraftLayout, drafts, sampling, uniforms, race: RaceKeys | None
    ) -> VerifyResult:
        """Verify in the verifier's layout: row i's nodes, pending token first, rows back to back (the logits stay the
        model's padded output, each node's row named by `logit_rows` when some row is narrower than the widest)."""
        fed = torch.arange(layout.width)[None, :] < layout.node_counts[:, None]
        node_ids, logit_rows = input_ids.reshape(-1), None
        if sum(layout.num_nodes) < num_rows * layout.width:  # rows of fewer nodes (a full batch is back to back)
            logit_rows = (torch.arange(num_rows)[:, None] * layout.width + torch.arange(layout.width))[fed]
            logit_rows = logit_rows.to(self.device)
            node_ids = node_ids[logit_rows]
        half = uniforms.shape[1] // 2  # node j > 0 takes the row's accept uniform j - 1
        node_uniforms = torch.cat([torch.zeros(num_rows, 1, dtype=torch.float64), uniforms[:, half : 2 * half]], 1)
        return verify(
            logits.reshape(num_rows * layout.width, -1),  # a view: verification reads the nodes it needs
            node_ids,
            layout,
            drafts.probs if drafts is not None else None,
            sampling,
            node_uniforms[:, : layout.width][fed].to(self.device),
            uniforms[:, -1].contiguous().to(self.device),
            race,
            logit_rows,
        )

    def _uniforms(self, rows: slice, asked: Tensor) -> Tensor:
        """`[rows, 2K + 1]` the rows' uniforms for rejection sampling (`SlotState.uniforms`); zeros under exact
        verification, whose randomness is the race's, keyed by position, so that the rows' streams are not drawn."""
        if self.exact:
            max_k = int(asked.max()) if asked.numel() else 0
            return torch.zeros(rows.stop - rows.start, 2 * max_k + 1, dtype=torch.float64)
        return self.slots.uniforms(rows, asked)

    def _race_keys(self, rows: slice) -> RaceKeys | None:
        """Each row's sample seed and the completion position of the token its root draws (None: rejection)."""
        if not self.exact:
            return None
        s = self.slots
        return RaceKeys(s.seed[rows, 0], s.num_tokens[rows] - s.prompt_len[rows])

    def _commit(self, rows: slice, result: VerifyResult, in_cache: bool) -> tuple[int, Tensor, Tensor]:
        """Bring the step's result to the host in ONE transfer and append it to the rows.

        Returns the tokens kept (after stops and length caps), the drafts accepted per row `[rows]` and the emitted
        tokens `[rows, max depth + 1]`, both on the host (row i's first `accepted[i] + 1` are its own).
        """
        packed = torch.cat(
            [result.num_emitted[:, None], result.output_token_ids, result.logprobs.view(torch.long)], dim=1
        ).cpu()
        width = result.output_token_ids.shape[1]
        num_emitted = packed[:, 0]
        tokens = packed[:, 1 : 1 + width]
        logprobs = packed[:, 1 + width :].contiguous().view(torch.float64)
        kept = self.slots.commit(rows.start, num_emitted, tokens, logprobs, in_cache)
        return int(kept.sum()), num_emitted - 1, tokens

    def _route(self, seq: Sequence) -> str:
        """Where a row's drafts come from: the proposer its request names, or the configured cascade."""
        return seq.params.spec.method or self._default_route

    def _observation(self, asked, drafting, routes, served, accepted, layout, seconds, context: int) -> StepObservation:
        """What the step cost and what each route's drafts earned (`drafting[i]`: row i was asked for drafts,
        `routes[i]` its route)."""
        num_asked: dict[str, tuple[list[int], list[int]]] = {}
        distinct = _distinct(routes)
        for route in distinct:
            rows = drafting if len(distinct) == 1 else [d and r == route for d, r in zip(drafting, routes)]
            if any(rows):
                num_asked[route] = (list(itertools.compress(asked, rows)), list(itertools.compress(accepted, rows)))
        passes = 0
        if "draft_model" in served:
            passes = max((k for k, s in zip(asked, served) if k > 0 and s == "draft_model"), default=0)
        return StepObservation(len(asked), layout.width, passes, seconds, num_asked, context)

    # ---- release -------------------------------------------------------------------------------------------------

    def _release_finished(self) -> list[Completion]:
        """Hand back the finished rows' completions and keep the active rows packed at the front: the last rows move
        into the holes."""
        s = self.slots
        finished = torch.nonzero(s.finished[: self.num_active])[:, 0].tolist()
        if not finished:
            return []
        done = []
        for row in finished:
            seq = s.sequences[row]
            seq.token_ids, seq.logprobs = s.completion_of(row)
            seq.finish_reason = "stop" if bool(s.stopped[row]) else "length"
            done.append(seq.completion())
        if self.proposers is not None:
            self.proposers.finish(finished, s.token_ids, s.num_tokens[finished].tolist())
        remaining = self.num_active - len(finished)
        holes = [i for i in finished if i < remaining]
        movers = [i for i in range(remaining, self.num_active) if not bool(s.finished[i])]
        assert len(holes) == len(movers), f"expected as many holes as movers, got {len(holes)} and {len(movers)}"
        if movers:
            longest = min(int(s.num_tokens[movers].max()) + 1, self.runner.cache.num_positions)
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            self.runner.copy_rows(src, dst, num_positions=longest)
            if self.proposers is not None:
                self.proposers.copy_rows(src, dst, longest)
            s.move(movers, holes, longest)
        self.num_active = remaining
        return done


def _distinct(values: list) -> list:
    """The distinct values in first-seen order (one pass in C when they are all the same)."""
    if values and values.count(values[0]) == len(values):
        return [values[0]]
    return list(dict.fromkeys(values))


def _count_by(values: list, keep: list[bool]) -> dict:
    """How many kept entries hold each value, in first-seen order (the step record's rows by proposer)."""
    kept = list(itertools.compress(values, keep))
    return {value: kept.count(value) for value in _distinct(kept)}
