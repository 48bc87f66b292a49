"""Continuous-batching generator: a step is schedule -> execute -> postprocess.

`Scheduler.schedule()` (`rollout.engine.scheduler`) decides: admit queued samples (a prefill per prompt, shared by
its samples) or decode every row in flight, after giving up rows a paged pool cannot hold. The step executes it:
`rollout.engine.admission` runs a prefill, `rollout.engine.decode_step` a decode (K, drafts, one forward over the rows
in flight, verification, the commit, the step's one read of the device). Postprocessing releases the finished rows,
keeping those in flight packed at the front of the slots, and records the step.

The public engine: `generate` (a whole call), or `add_requests`, then `step` until `has_unfinished` is False;
`snapshot`/`restore` save and roll back the rows in flight (the `auto` policy's calibration uses these).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from rollout.engine.admission import Admission
from rollout.engine.decode_step import DecodeStep
from rollout.engine.engine_config import resolve_engine
from rollout.engine.model_runner import ModelRunner
from rollout.engine.policy_mode import eval_mode
from rollout.engine.requests import (
    check_generator_args,
    checked_sequences,
    eos_token_ids,
)
from rollout.engine.run_ahead import RunAhead
from rollout.engine.sampling import Completion, SamplingParams
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import PromptGroups, Sequence
from rollout.engine.slots import SlotState
from rollout.engine.speculation import build_policy, build_proposers, default_route
from rollout.engine.step_timer import warm_up
from rollout.engine.trace import StepOutput, StepRecord
from specdec.config import SpecConfig
from specdec.proposers.suffix import SuffixProposer
from specdec.tree import DraftLayout

DEFAULT_PREFILL_TOKENS = 16384  # padded prompt tokens a prefill forward takes at most, unless max_seq_len is more


class Generator(Admission, DecodeStep):
    """Batched generation for a transformers causal LM.

    Args:
        model: the model to run (its current weights are used on every call: no copy is kept).
        max_batch_size: slots, i.e. sequences decoded at once.
        max_seq_len: prompt + completion tokens a sequence may hold.
        spec: speculative decoding settings; None decodes one token per step.
        max_prefill_tokens: cap on padded prompt tokens per prefill forward (bounds prefill memory); at least
            max_seq_len (a prompt goes in one prefill). None: 16384, or max_seq_len where that is larger.
        kv_layout: "auto" (paged on a GPU, slots on a CPU), "paged" (KV blocks that follow the tokens in flight,
            attention through the function registered with transformers) or "slots" (a dense cache and 4D masks);
            see `rollout.engine.model_runner`.
        kv_pool_blocks: paged: the pool's size in blocks of 16 tokens (default: planned from the free memory); a pool
            too small for every row at once admits fewer rows, and preempts the latest admitted when rows outgrow it.
        cuda_graphs: "auto" (on with the paged layout on a GPU), True or False: chain decode and verification
            forwards replay CUDA graphs captured here, one per padded row count and width
            (`rollout.engine.graph_runner`), under the policy's autocast; token trees and prefills run eagerly.
        async_scheduling: "auto" (on a GPU), True or False: the host one step ahead of the device, a one-token
            decode step launched from the last step's samples before it reads them, so that its bookkeeping overlaps
            the device's work (`rollout.engine.run_ahead`); the same samples either way. With speculation, only the
            steps its K policy drafts nothing for run ahead (drafts follow the tokens the host has read), and none
            under rejection sampling (its uniforms are drawn by count).
        compile_forward: the CUDA graphs capture the decoder's forward compiled by `torch.compile` (small kernels
            fused; `rollout.engine.compiled_forward`); needs graphs. A model it cannot compile runs as without.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        spec: SpecConfig | None = None,
        max_prefill_tokens: int | None = None,
        kv_layout: str = "auto",
        kv_pool_blocks: int | None = None,
        cuda_graphs: bool | str = "auto",
        async_scheduling: bool | str = "auto",
        compile_forward: bool = False,
    ):
        check_generator_args(
            model, max_batch_size, max_seq_len, max_prefill_tokens, cuda_graphs, spec, async_scheduling, compile_forward
        )
        if max_prefill_tokens is None:
            max_prefill_tokens = max(DEFAULT_PREFILL_TOKENS, max_seq_len)
        if spec is not None and not spec.methods:  # method None: speculation off
            spec = None
        self.model = model
        self.spec = spec
        self.config, self.runner = resolve_engine(
            model, spec, max_batch_size, max_seq_len, max_prefill_tokens, kv_layout, kv_pool_blocks, cuda_graphs,
            async_scheduling, compile_forward,
        )  # fmt: skip
        self.max_batch_size, self.max_seq_len, self.max_width = max_batch_size, max_seq_len, self.config.max_width
        self.kv_cache_bytes = self.config.kv_cache_bytes
        self.device = self.runner.device
        num_positions = self.config.num_positions
        # a draft model's runner takes the target's layout and graphs
        self.proposers = build_proposers(spec, self.runner, max_batch_size, num_positions) if spec else None
        self._release_propose_seconds = 0.0  # the proposers' part of releasing rows, for the step's record
        self._methods = spec.methods if spec else ()
        self._default_route = default_route(spec) if spec else ""
        self._routes_cache: tuple[int, list[str]] | None = None  # (slots' version, the rows' routes): `_routes`
        self._plain_layouts: dict[int, DraftLayout] = {}  # a step without drafts' layout, by rows (`_plain_layout`)
        # plain steps launched ahead of a device (`_decision_ahead`) overlap its work: on a CPU there is none to overlap
        plain_ahead = self.config.async_scheduling and self.config.exact and self.device.type == "cuda"
        self.policy = build_policy(spec, max_batch_size, self.proposers, plain_ahead) if spec else None
        # every sampled token is the exponential race's at its position, unless rejection sampling was asked for
        self.exact = self.config.exact
        # every row's tokens, lengths, settings and random stream; proposers read the tokens without a transfer
        self.slots = SlotState(max_batch_size, num_positions)
        # the queue, the rows in flight and their blocks: what each step runs
        self.scheduler = Scheduler(self.slots, self.runner, max_batch_size, self.max_width, max_prefill_tokens)
        self.eos_token_ids = eos_token_ids(model)
        self.last_trace: list[StepRecord] = []
        self._lock = threading.Lock()  # one public call at a time (`_one_call`)
        self._owner: int | None = None  # the thread whose call holds it
        self._generating = False  # a `generate` call is stepping its rows (its callbacks run inside it)
        self._graph_epoch = 0  # raised by `invalidate_graphs`
        self._closed = False  # `close` freed the caches
        self._ahead = RunAhead()  # the host one step ahead: the step in flight (`rollout.engine.run_ahead`)
        self._policy_modules = list(model.modules())  # listed anew by every `generate` and `add_requests` call
        if self.draft_history is not None:  # the history's own calls hold the generator too: never beside a step
            self.draft_history.guard = _history_guard(self)
        self._draft_modules = self._list_draft_modules()  # a draft model's, the same way
        # the policy measures what it needs (auto: step times, as vLLM profiles)
        self.warm_up_seconds = warm_up(self) if self.policy is not None else 0.0

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
        return self.scheduler.max_uniform_context()

    @property
    def num_active(self) -> int:
        """Rows in flight (rows `[0, num_active)` of the slots)."""
        return self.scheduler.num_active

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

        The callbacks run in the inference and grad modes the call was made in, not in the call's inference mode
        (tensors they make are ordinary ones unless the caller's are not), with the policy in eval mode (handed back
        in its own mode when the call returns).

        Returns:
            `params.n` completions per prompt, prompt-major (all samples of prompt 0 first).
        """
        for name, callback in (("on_step", on_step), ("on_group", on_group)):
            if callback is not None and not callable(callback):
                raise TypeError(f"{name} must be a function or None, got {type(callback).__name__}")
        with self._one_call():
            self._check_not_generating("generate")
            return self._generate(prompt_ids, params, on_step, on_group, seed_indices)

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a Generator cannot be pickled or copied: it holds the model's KV caches, its steps' state and a lock; "
            "send its results (Completion lists) to another process, and build a Generator there"
        )

    @contextlib.contextmanager
    def _one_call(self, through: str = ""):
        """Hold the generator for a public call (`generate`, `add_requests`, `step`, `abort`, `snapshot`, `restore`,
        `close`, and its drafting history's, `through` it): one from another thread while it is held is refused, never
        mixed in; a call inside this thread's own (`generate`'s steps, a callback's) goes through. Yields whether
        this call took it (the outermost)."""
        me = threading.get_ident()
        if self._owner == me:
            yield False
            return
        if not self._lock.acquire(blocking=False):
            via = f" through {through}" if through else ""
            raise RuntimeError(
                f"this Generator is already generating (a call{via} from another thread): one Generator serves one "
                "call at a time; give each thread its own Generator, or make the calls one after another (a callback "
                "of the call, on its thread, may call it)"
            )
        self._owner = me
        try:
            yield True
        finally:
            self._owner = None
            self._lock.release()

    def _generate(self, prompt_ids, params, on_step, on_group, seed_indices) -> list[Completion]:
        sequences = self.add_requests(prompt_ids, params, seed_indices)
        self.last_trace = []
        groups = PromptGroups(sequences)
        num_finished = 0
        self._generating = True
        # the callbacks are the caller's code (a reward, a trainer's loss inputs): in the caller's inference and grad
        # modes, not the call's; tensors they made in its inference mode failed in a later backward
        callers = functools.partial(_callers_code, torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        try:
            with self._serving(full=True):  # checked in full once per call: the policy does not change under a call
                while self.has_unfinished:
                    out = self._step()
                    num_finished += len(out.finished)
                    if on_step is not None:
                        with callers():
                            on_step(out.record, num_finished, len(sequences))
                    for done in out.finished:
                        group = groups.finish(done.prompt_index)
                        if on_group is not None and group is not None:
                            with callers():
                                on_group(group)
        finally:
            self._generating = False
        return [seq.completion() for seq in sequences]

    def _check_not_generating(self, call: str) -> None:
        """Refuse a call from inside `generate` (its callbacks, or what they call) that would drop, step or roll back
        its rows: `abort` and `close` cancel it instead, deliberately, and `snapshot` only reads."""
        if self._generating:
            raise RuntimeError(
                f"{call} was called while this Generator's generate call runs (from its on_step or on_group callback, "
                f"or a reward it calls): it would drop, step or roll back that call's rows; use another Generator"
            )

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
        prompt indices numbered on from the highest so far, queued, in flight or handed back (`Completion.prompt_index`
        tells them apart; `seed_indices` still seed them). Returns the queued sequences, prompt-major."""
        with self._one_call() as outermost:
            return self._add_requests(prompt_ids, params, seed_indices, keep_in_flight, outermost)

    def _add_requests(self, prompt_ids, params, seed_indices, keep_in_flight: bool, outermost: bool) -> list[Sequence]:
        self._check_open()
        self._check_not_generating("add_requests")
        if not isinstance(keep_in_flight, bool):
            raise ValueError(f"keep_in_flight ({keep_in_flight!r}) must be True or False")
        max_k, eos = self.max_width - 1, self.eos_token_ids
        sequences = checked_sequences(
            prompt_ids, params, seed_indices, self.vocab_size, self.max_seq_len, self._methods, eos, max_k
        )
        if not keep_in_flight:
            self.abort()
            if self.proposers is not None:
                self.proposers.begin()
        # room for the longest request now, at admission, rather than by growing the caches mid-rollout
        longest = max(len(seq.prompt) + seq.max_new_tokens for seq in sequences) + self.max_width
        for runner in self._runners():
            runner.reserve_positions(min(longest, runner.num_positions))
        self.scheduler.add(sequences, behind_those_here=keep_in_flight)
        if outermost:  # a server's new requests (`generate` checks in full itself)
            with self._serving(full=True):
                pass
        return sequences

    def _runners(self) -> list[ModelRunner]:
        """The target's model runner and a draft model's."""
        drafts = self.proposers.proposers.values() if self.proposers is not None else ()
        return [self.runner, *(p.runner for p in drafts if isinstance(getattr(p, "runner", None), ModelRunner))]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        """One step: admit queued requests while slots are free (a prefill), else decode every active row once, at the
        K its policy chooses (a calibration forces K through `rollout.engine.step_timer.forced_steps`). Finished rows
        are released before it returns. The step runs the policy in eval mode, whatever mode it is in (and hands it
        back in that mode). With `async_scheduling` the record and completions returned are those of the step the
        last call launched, and the next step is left running on the device."""
        with self._one_call():
            self._check_open()
            self._check_not_generating("step")
            if not self.has_unfinished and self._ahead.in_flight is None:
                raise RuntimeError("step() with nothing queued or in flight: add_requests first")
            with self._serving(full=False):  # the modules as the last `add_requests` listed them
                return self._step()

    def invalidate_graphs(self) -> None:
        """Capture the CUDA graphs again at the next call. The graphs follow what they can see by themselves (weights
        or buffers replaced, KV pools reallocated, PEFT adapters disabled, merged, switched or rescaled, the autocast
        dtype, the training flag, the policy's own `forward` set or taken back as accelerate does, the decoder or LM
        head replaced); call this after a change they cannot see (its autocast is observed again then): a submodule's
        forward patched, a Python number a forward reads changed (a custom adapter's scale), weights copied into other
        tensors that the model then reads through a hook. No effect without graphs."""
        self._graph_epoch += 1

    @contextlib.contextmanager
    def _serving(self, full: bool):
        """Inference and eval mode, the graphs of a policy changed since dropped (`GraphRunner.refresh`): in `full`
        (the modules listed anew) once per call, the cheap part (training flag, adapters, autocast, pools) a step."""
        if full:
            self._policy_modules = list(self.model.modules())
            self._draft_modules = self._list_draft_modules()
        with contextlib.ExitStack() as modes:
            modes.enter_context(torch.inference_mode())
            modes.enter_context(eval_mode(self.model, self._policy_modules))
            for draft, modules in self._draft_modules:  # a draft model passed in may be trained too (or the policy)
                modes.enter_context(eval_mode(draft, modules))
            cast = False
            for runner in self._runners():  # a policy cast, or under another autocast, since the last step
                cast |= runner.follow_policy_dtype(self._graph_epoch, full)
            for graphs in self.graph_runners:  # (a cast between two steps: the modules read again, as in a call)
                graphs.refresh(self._graph_epoch, full or cast)
            yield

    def _list_draft_modules(self) -> list[tuple[torch.nn.Module, list[torch.nn.Module]]]:
        """Each draft model's runner's model with its modules listed (`eval_mode` switches them per call)."""
        return [(runner.model, list(runner.model.modules())) for runner in self._runners()[1:]]

    def _step(self) -> StepOutput:
        """schedule -> execute -> postprocess: the scheduler decides (admit, or decode after preempting rows), the
        prefill or the decode step runs it, then the finished rows are released."""
        with self._ahead.guarded():
            ahead, self._ahead.in_flight = self._ahead.in_flight, None
            if ahead is not None:  # launched by the last call: launch the next behind it, then read it
                choice = self._decision_ahead()
                if choice is not None:
                    self._ahead.in_flight = self._launch_decode(after=ahead, ahead=choice)
                return self._postprocess(*self._finish_decode(ahead))
            return self._schedule_and_run()

    def _schedule_and_run(self) -> StepOutput:
        scheduled = self.scheduler.schedule()
        if scheduled.is_prefill:
            self._ahead.decision = None  # a K chosen for a decode step that a prefill came before
            return self._postprocess(self._admit(scheduled.prefill_chunks), None)
        discarded = 0
        if scheduled.preempted:
            rows = scheduled.preempted
            discarded = int((self.slots.num_tokens[rows] - self.slots.prompt_len[rows]).sum())  # (host tensors)
            self._preempt(rows)
        launched = self._launch_decode()
        choice = self._decision_ahead() if launched.advanced else None
        if choice is not None:  # the host one step ahead
            self._ahead.in_flight = self._launch_decode(after=launched, ahead=choice)
        record, observation = self._finish_decode(launched)
        record.num_preempted, record.num_discarded = len(scheduled.preempted), discarded
        return self._postprocess(record, observation)


def _history_guard(generator: Generator) -> Callable[[], contextlib.AbstractContextManager]:
    """What the drafting history's own calls hold: `generator`'s `_one_call`. Through a weak reference: a bound method
    made a cycle (generator -> history -> generator), so a dropped generator kept its caches until the garbage
    collector ran; a history kept past its generator holds nothing."""
    owner = weakref.ref(generator)

    def guard() -> contextlib.AbstractContextManager:
        held = owner()
        return contextlib.nullcontext() if held is None else held._one_call("its drafting history")

    return guard


@contextlib.contextmanager
def _callers_code(inference: bool, grad_enabled: bool):
    """A callback inside a call: the inference and grad modes the caller called in."""
    with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
        yield
