"""Continuous-batching generator over a KV cache of slot rows (a paged pool on a GPU, a dense cache on a CPU).

Requests wait in a queue; a step either admits them (one prefill per prompt, shared by the prompt's n samples) or
decodes: one forward over the active rows only, which are kept packed at the front of the slots (a paged cache moves
block tables, a dense one KV rows). A decode step feeds every row its pending token plus up to K draft tokens and
commits the first m of them (K = 0 without speculation). The host drives scheduling; the device returns one small
packed tensor per step. Admission and release live in `rollout.engine.admission`, the decode step's stages in
`rollout.engine.decode_step`.

The public engine: `generate` (a whole call), or `add_requests`, then `step` until `has_unfinished` is False;
`snapshot`/`restore` save and roll back the rows in flight (the `auto` policy's calibration uses these).
"""

from __future__ import annotations

import collections
import gc
import itertools
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from rollout.engine.admission import Admission
from rollout.engine.decode_step import DecodeStep
from rollout.engine.memory_plan import check_kv_cache_fits, plan_kv_cache
from rollout.engine.model_runner import ModelRunner
from rollout.engine.policy_mode import eval_mode
from rollout.engine.requests import (
    check_generator_args,
    check_params,
    check_prompts,
    eos_token_ids,
    length_cap_note,
    make_sequences,
)
from rollout.engine.sampling import Completion, SamplingParams
from rollout.engine.sequence import Sequence
from rollout.engine.slots import RowSnapshot, SlotState
from rollout.engine.speculation import build_policy, build_proposers, default_route
from rollout.engine.step_timer import StepTimer
from rollout.engine.trace import StepRecord
from specdec.auto_policy import AutoPolicy, StepObservation
from specdec.config import SpecConfig
from specdec.proposers.suffix import SuffixProposer


@dataclass
class StepOutput:
    """What one `Generator.step` did."""

    record: StepRecord  # its trace record (also appended to `last_trace`)
    finished: list[Completion] = field(default_factory=list)  # samples that finished in this step
    observation: StepObservation | None = None  # decode steps: what a K policy learns from the step


WARM_UP_MAX_CONTEXT = 1024  # the auto policy's warm-up times contexts up to this many tokens


class Generator(Admission, DecodeStep):
    """Batched generation for a transformers causal LM.

    Args:
        model: the model to run (its current weights are used on every call: no copy is kept).
        max_batch_size: slots, i.e. sequences decoded at once.
        max_seq_len: prompt + completion tokens a sequence may hold.
        spec: speculative decoding settings; None decodes one token per step.
        max_prefill_tokens: cap on padded prompt tokens per prefill forward (bounds prefill memory).
        kv_layout: "auto" (paged on a GPU, slots on a CPU), "paged" (KV blocks that follow the tokens in flight,
            attention through the function registered with transformers) or "slots" (a dense cache and 4D masks);
            see `rollout.engine.model_runner`.
        kv_pool_blocks: paged: the pool's size in blocks of 16 tokens (default: planned from the free memory); a pool
            too small for every row at once admits fewer rows, and preempts the latest admitted when rows outgrow it.
        cuda_graphs: "auto" (on with the paged layout on a GPU), True or False: chain decode and verification
            forwards replay CUDA graphs captured here, one per padded row count and width
            (`rollout.engine.graph_runner`); token trees, prefills and autocast run eagerly.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        spec: SpecConfig | None = None,
        max_prefill_tokens: int = 16384,
        kv_layout: str = "auto",
        kv_pool_blocks: int | None = None,
        cuda_graphs: bool | str = "auto",
    ):
        check_generator_args(model, max_batch_size, max_seq_len, max_prefill_tokens, cuda_graphs, spec)
        if spec is not None and not spec.methods:  # method None: speculation off
            spec = None
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.spec = spec
        # tokens fed per row per decode step: the pending token plus the largest K
        self.max_width = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        num_positions = max_seq_len + self.max_width
        # planned before anything is allocated: the slot cache must fit, a paged pool is sized to what is free
        self.kv_cache_bytes, max_kv_blocks = plan_kv_cache(
            model, spec, max_batch_size, max_seq_len, kv_layout, kv_pool_blocks
        )
        self.runner = ModelRunner(model, max_batch_size, num_positions, kv_layout, max_kv_blocks)  # checks the model
        if max_kv_blocks is not None and not self.runner.paged:  # planned paged, but the model runs on slots
            self.kv_cache_bytes = check_kv_cache_fits(model, spec, max_batch_size, max_seq_len)
        self.device = self.runner.device
        if cuda_graphs is True and not (self.runner.paged and self.device.type == "cuda"):
            raise ValueError(
                f"cuda_graphs=True needs a CUDA device and the paged KV layout; this generator has {self.device} and "
                f"kv_layout {self.runner.kv_layout!r}: pass cuda_graphs='auto' or False"
            )
        if cuda_graphs is not False and self.runner.paged and self.device.type == "cuda":
            # before the auto policy's warm-up, so that it times the captured steps
            self.runner.use_graphs(self.max_width).capture_all(max_batch_size)
        # a draft model's runner takes the target's layout and graphs
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
        self._admissions = itertools.count()  # admission order: a paged cache short of blocks preempts the latest
        self.warm_up_seconds = 0.0
        self._graph_epoch = 0  # raised by `invalidate_graphs`
        self._closed = False  # `close` freed the caches
        self._policy_modules = list(model.modules())  # listed anew by every `generate` and `add_requests` call
        if isinstance(self.policy, AutoPolicy) and self.max_uniform_context < self.max_width + 4:
            cache = self.runner.cache
            raise ValueError(
                f"kv_pool_blocks ({cache.max_blocks}) holds {cache.max_blocks // max_batch_size} blocks of "
                f"{cache.block_size} tokens per slot: the auto policy's warm-up fills every slot at once and needs "
                f"more; raise kv_pool_blocks, lower max_batch_size, or give a static K or a table"
            )
        if self.policy is not None:  # the policy measures what it needs (auto: step times, as vLLM profiles)
            start = time.perf_counter()
            # contexts up to a cap: a longer one would fill every slot to it for a few steps (memory follows the
            # rollout, not the cap); the step-time table extends longer contexts along the two longest timed
            with StepTimer(self, spec.num_speculative_tokens, max_context=WARM_UP_MAX_CONTEXT) as timer:
                self.policy.calibrate(timer)
            self.proposers.reset()  # the calibration's random rows are no drafting material
            self.warm_up_seconds = time.perf_counter() - start

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def graph_runners(self) -> list:
        """The CUDA-graph runners of the target's and a draft model's model runners (empty: eager decoding)."""
        return [r.graphs for r in self._runners() if r.graphs is not None]

    @property
    def graph_seconds(self) -> float:
        """Seconds the CUDA graphs took to capture, the target's and a draft model's."""
        return sum(g.capture_seconds for g in self.graph_runners)

    @property
    def max_uniform_context(self) -> int:
        """The longest context every slot can hold at once, with room for a full-width step after it: `max_seq_len`,
        or less where a paged pool is smaller than every slot at full length (the auto policy's calibration fills
        every slot)."""
        if not self.runner.paged:
            return self.max_seq_len
        cache = self.runner.cache
        per_row = cache.max_blocks // self.max_batch_size - 2  # a step's new block and a copied shared one
        return max(1, min(self.max_seq_len, per_row * cache.block_size - self.max_width))

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
        self._policy_modules = list(self.model.modules())
        with torch.inference_mode(), eval_mode(self.model, self._policy_modules):
            self._refresh_graphs(full=True)  # once per call: the policy does not change under a call
            while self.has_unfinished:
                out = self._step()
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
        keep_in_flight: bool = False,
    ) -> list[Sequence]:
        """Check and queue `params.n` samples of every prompt (see `generate`); rows still in flight from an earlier,
        interrupted call are dropped first, unless `keep_in_flight`: then the new samples queue behind them and join
        the batch as slots free up (a server's continuous batching: `step()` until `has_unfinished` is False), their
        prompt indices numbered on from the highest queued or in flight (`Completion.prompt_index` tells them apart;
        `seed_indices` still seed them). Returns the queued sequences, prompt-major."""
        self._check_open()
        prompt_ids = check_prompts(prompt_ids, self.vocab_size, self.max_seq_len)
        if seed_indices is not None and len(seed_indices) != len(prompt_ids):
            raise ValueError(
                f"seed_indices holds {len(seed_indices)} values for {len(prompt_ids)} prompts: give one each"
            )
        per_prompt = check_params(params, len(prompt_ids), self._methods)
        max_k = self.spec.num_speculative_tokens if self.spec is not None else 0
        sequences = make_sequences(prompt_ids, per_prompt, self.eos_token_ids, self.max_seq_len, max_k, seed_indices)
        note = length_cap_note(prompt_ids, [p.max_new_tokens for p in per_prompt], self.max_seq_len)
        if note is not None:  # a silent cap looks like a model that stops early
            warnings.warn(note, stacklevel=3)
        if keep_in_flight:  # prompt indices never shared with rows already here: admission groups samples by them
            taken = [s.prompt_index for s in itertools.chain(self._queue, self.slots.sequences) if s is not None]
            for seq in sequences:
                seq.prompt_index += max(taken) + 1 if taken else 0
        else:
            self.abort()
            if self.proposers is not None:
                self.proposers.begin()
        # room for the longest request now, at admission, rather than by growing the caches mid-rollout
        longest = max(len(seq.prompt) + seq.max_new_tokens for seq in sequences) + self.max_width
        for runner in self._runners():
            runner.reserve_positions(min(longest, runner.num_positions))
        self._queue.extend(sequences)
        if not self._lock.locked():  # a server's new requests (`generate` checks in full itself)
            self._policy_modules = list(self.model.modules())
            with torch.inference_mode(), eval_mode(self.model, self._policy_modules):
                self._refresh_graphs(full=True)
        return sequences

    def _runners(self) -> list[ModelRunner]:
        """The target's model runner and a draft model's."""
        drafts = self.proposers.proposers.values() if self.proposers is not None else ()
        return [self.runner, *(p.runner for p in drafts if isinstance(getattr(p, "runner", None), ModelRunner))]

    @property
    def has_unfinished(self) -> bool:
        return bool(self._queue) or self.num_active > 0

    def abort(self) -> None:
        """Drop every request queued or in flight (their KV is garbage the next admission overwrites)."""
        self._queue.clear()
        if self._closed:
            return
        # every slot, not only those in flight: a restore to fewer rows left the others holding their blocks
        for runner in self._runners():
            runner.release_rows(0, self.max_batch_size)
        self.num_active = 0

    def step(self) -> StepOutput:
        """One step: admit queued requests while slots are free (a prefill), else decode every active row once, at the
        K its policy chooses (a calibration forces K through `rollout.engine.step_timer.forced_steps`). Finished rows
        are released before it returns. The step runs the policy in eval mode, whatever mode it is in (and hands it
        back in that mode)."""
        # as in `generate`: the state tensors are inference tensors; the modules listed by the last `add_requests`
        self._check_open()
        with torch.inference_mode(), eval_mode(self.model, self._policy_modules):
            self._refresh_graphs(full=False)
            return self._step()

    def close(self) -> None:
        """Give back the KV caches, the CUDA graphs and their memory pool now, the target's and a draft model's,
        whatever still refers to this generator (a trainer that rebuilds it plans the next one from the memory freed).
        Its drafting history stays readable (`draft_history`); every other call is refused after it."""
        if self._closed:
            return
        self.abort()
        for runner in self._runners():
            runner.close()
        self._closed = True
        gc.collect()  # a generator's parts refer to each other: their memory returns only once the cycles go
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Generator was closed (its KV cache and graphs are freed): build a new one")

    def invalidate_graphs(self) -> None:
        """Capture the CUDA graphs again at the next call. The graphs follow what they can see by themselves (weights
        or buffers replaced, KV pools reallocated, PEFT adapters disabled, merged, switched or rescaled, the autocast
        dtype, the training flag); call this after a change they cannot see: a module's forward patched, a Python
        number a forward reads changed (a custom adapter's scale), weights copied into other tensors that the model
        then reads through a hook. No effect without graphs."""
        self._graph_epoch += 1

    def _refresh_graphs(self, full: bool) -> None:
        """Drop the graphs captured from a policy that has changed since (`GraphRunner.refresh`): in full once per
        `generate` or `add_requests` call, the cheap part (training flag, adapters, autocast, pools) every step."""
        for graphs in self.graph_runners:
            graphs.refresh(self._graph_epoch, full)

    def _step(self) -> StepOutput:
        admissible = self._num_admissible() if self._queue else 0
        if admissible:
            record, observation = self._admit(admissible), None
        else:
            assert self.num_active > 0, "expected rows in flight: add_requests first"
            preempted = self._preempt_for_next_step() if self.runner.paged else 0
            record, observation = self._decode_step()
            record.num_preempted = preempted
        finished = self._release_finished()
        if self.runner.paged:
            usage = self.runner.cache.manager
            record.kv_blocks_used, record.kv_blocks_allocated = usage.num_used, usage.num_blocks
        self.last_trace.append(record)
        return StepOutput(record, finished, observation)

    def snapshot(self) -> list[RowSnapshot]:
        """The rows in flight, in row order, for `restore`."""
        return self.slots.snapshot(self.num_active)

    def restore(self, rows: list[RowSnapshot]) -> None:
        """Put rows back as a snapshot saw them, into rows `[0, len(rows))` (a prefix of a snapshot keeps fewer rows
        in flight). The KV cache keeps what the rows had (a step only writes past their lengths), so rolling back
        is lowering lengths."""
        with torch.inference_mode():
            self.slots.restore(rows)
        self.num_active = len(rows)
