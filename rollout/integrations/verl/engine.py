"""One `Generator` behind many concurrent callers: requests submitted from any thread or event loop join the batch
in flight at the next step (continuous batching), weights are copied into the model in place, and sleep / wake drop
and rebuild the KV cache (and CUDA graphs).

A thread of its own drives the generator: it takes the requests that arrived since its last step, queues them
behind the rows in flight, runs one step, and resolves the futures of the samples that finished. Requests that
arrive together with the same prompt and settings (veRL sends a GRPO group as `n` requests of one prompt) share one
prefill and are one group for suffix drafting. Plain Python and torch: nothing here imports veRL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import random
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from rollout.engine.generator import Generator
from rollout.engine.requests import check_params, check_prompts
from rollout.engine.sampling import Completion, SamplingParams
from rollout.engine.sequence import Sequence
from rollout.integrations.verl.weights import copy_weights
from specdec.config import SpecConfig

if TYPE_CHECKING:
    from specdec.proposers.suffix_tries import SuffixTries

logger = logging.getLogger(__name__)

ABORTED = "aborted"  # a Completion's finish_reason when abort_all dropped it


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    arrival: int = -1  # a request without a seed of its own: its arrival index, given when submitted


class ServingEngine:
    """Continuous batching over one `Generator` for callers that each ask for one completion.

    Args:
        model: the causal LM to generate with (kept, never copied: `update_weights` writes into it).
        max_batch_size: generator slots.
        max_seq_len: prompt + completion tokens a sequence may hold.
        spec: speculative decoding settings; None decodes without drafts.
        kv_layout, kv_pool_blocks, cuda_graphs, max_prefill_tokens: passed to `Generator`.
        seed: a request without a seed of its own samples from the stream `(seed, seed_offset, its arrival index)`:
            the same requests arriving in the same order give the same samples, however they were batched; a request
            with `params.seed` samples from that seed alone. None draws a fresh seed.
        seed_offset: tells engines with the same seed apart (veRL's replicas).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch_size: int,
        max_seq_len: int,
        spec: SpecConfig | None = None,
        kv_layout: str = "auto",
        kv_pool_blocks: int | None = None,
        cuda_graphs: bool | str = "auto",
        max_prefill_tokens: int | None = None,
        seed: int | None = None,
        seed_offset: int = 0,
    ):
        self.model = model.eval()  # the engine's own model: generation never trains it
        self.device = next(model.parameters()).device
        self._generator_kwargs = dict(
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            spec=spec,
            kv_layout=kv_layout,
            kv_pool_blocks=kv_pool_blocks,
            cuda_graphs=cuda_graphs,
            max_prefill_tokens=max(max_prefill_tokens or 16384, max_seq_len),
        )
        self.max_seq_len = max_seq_len
        self.generator: Generator | None = None  # None while asleep (and before the first request)
        # steps taken, draft tokens proposed / accepted, tokens emitted, seconds by step kind, over the engine's life
        self.totals: dict[str, float] = {"steps": 0, "num_drafted": 0, "num_accepted": 0, "num_emitted": 0}
        self._history: SuffixTries | None = None  # the suffix drafter's history kept over a sleep (host memory)
        self._incoming: list[_Request] = []
        self._num_admitting = 0  # requests the engine's thread took from `_incoming` and has not yet queued
        self._futures: dict[tuple[int, int], concurrent.futures.Future] = {}  # (prompt_index, sample_index) in flight
        self._sequences: dict[tuple[int, int], Sequence] = {}  # and the generator's request of each, for `abort`
        self._given_up: list[tuple[int, int]] = []  # requests whose callers cancelled their futures, to drop
        self._num_groups = 0  # groups queued so far: the next group's prompt index
        self._num_requests = 0  # requests without a seed submitted so far: the next one's arrival index
        self._seed = random.SystemRandom().getrandbits(62) if seed is None else int(seed)
        self._seed_offset = int(seed_offset)
        self._asleep = False
        self._paused = False  # abort_all(...) without resume: new requests wait (or are refused)
        self._rejecting = False
        self._closed = False
        self._aborting = False  # abort_all waits for the step lock: the engine's thread takes no new step meanwhile
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held by a step; weights and sleep change only between steps
        self._thread = threading.Thread(target=self._run, name="rollout-serving-engine", daemon=True)
        self._thread.start()

    # ---- callers ---------------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        """Queue one completion of `prompt_ids` (`params.n` must be 1); the future resolves to its `Completion`
        (finish_reason "aborted" with no tokens if `abort_all` dropped it), or to the ValueError that refused it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if params.n != 1:
            future.set_exception(ValueError(f"params.n ({params.n}) must be 1: submit one request per sample"))
            return future
        with self._cond:
            if self._closed:
                future.set_exception(RuntimeError("this ServingEngine is closed"))
            elif self._rejecting:
                future.set_result(Completion(0, 0, [], [], ABORTED))
            else:
                # the arrival index now, not when the engine's thread takes the request: one cancelled before that
                # took no index, and every later request sampled from the next one's stream
                arrival = -1
                if params.seed is None:
                    arrival, self._num_requests = self._num_requests, self._num_requests + 1
                self._incoming.append(_Request(list(prompt_ids), params, future, arrival))
                self._cond.notify_all()
        return future

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """`submit` for a coroutine: awaits the completion without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(prompt_ids, params))

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet resolved."""
        with self._cond:
            return len(self._incoming) + self._num_admitting + len(self._futures)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted request is resolved (or paused ones are all that is left); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._futures and not self._num_admitting and (not self._incoming or self._paused), timeout
            )

    def update_weights(self, named_tensors, strict: bool = False) -> int:
        """`copy_weights` into the model between two steps (see `rollout.integrations.verl.weights`)."""
        with self._step_lock:
            return copy_weights(self.model, named_tensors, strict)

    def sleep(self) -> None:
        """Wait for the requests in flight, then drop the generator: its KV cache, CUDA graphs and a draft model's
        cache are freed (the suffix drafter's history is kept for `wake_up`). Requests submitted while asleep wait."""
        with self._cond:
            self._asleep = True  # nothing new is admitted; rows in flight (and requests being queued) finish first
            self._cond.wait_for(lambda: not self._futures and not self._num_admitting)
        with self._step_lock:
            self._drop_generator()

    def wake_up(self, build: bool = True) -> None:
        """Leave sleep; with `build`, allocate the KV cache (and capture graphs) now rather than at the first
        request."""
        if build:
            with self._step_lock:
                self._ensure_generator()
        with self._cond:
            self._asleep = False
            self._cond.notify_all()

    def clear(self) -> None:
        """Forget the suffix drafter's history (responses of earlier weights stay useful drafts; this is for a
        caller that wants none)."""
        with self._step_lock:
            self._history = None
            if self.generator is not None and self.generator.draft_history is not None:
                self.generator.draft_history.clear()

    def abort_all(self, reject: bool = False) -> int:
        """Drop every request queued or in flight (each resolves to an "aborted" completion) and hold new ones until
        `resume`; with `reject`, new ones resolve to "aborted" at once. Returns the number dropped."""
        with self._cond:  # a lock is not fair: the engine's thread, stepping in a loop, could keep taking it first
            self._aborting = True
        try:
            with self._step_lock, self._cond:
                self._paused, self._rejecting = True, reject
                dropped = list(self._futures.values()) + [r.future for r in self._incoming]
                self._futures.clear()
                self._sequences.clear()
                self._incoming.clear()
                if self.generator is not None:
                    self.generator.abort()
        finally:
            with self._cond:
                self._aborting = False
                self._cond.notify_all()
        for future in dropped:
            _settle(future, Completion(0, 0, [], [], ABORTED))
        return len(dropped)

    def resume(self) -> None:
        """Admit requests again after `abort_all`."""
        with self._cond:
            self._paused = self._rejecting = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the engine's thread: requests not finished (queued or in flight) resolve to RuntimeError, and the
        generator is closed (its KV cache and graphs freed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    # ---- the engine's thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._closed:
                    break
            with self._step_lock:
                # taken under the step lock: `abort_all` (which takes it too) sees every request either still
                # incoming or queued with its future in `_futures`, never one in between
                with self._cond:
                    admit = not (self._asleep or self._paused)
                    batch, self._incoming = (self._incoming, []) if admit else ([], self._incoming)
                    self._num_admitting = len(batch)  # in flight for `sleep` and `wait_idle` until queued
                try:
                    self._queue(batch)
                    self._admitted()
                    self._step()
                except Exception as error:  # a failed step fails the requests in flight, not the engine
                    logger.exception("rollout serving engine: a step failed")
                    self._fail_all(error, batch)
                    self._admitted()  # (after: until then the batch's requests were still unresolved)
        with self._step_lock, self._cond:
            unfinished = [r.future for r in self._incoming] + list(self._futures.values())
            self._incoming.clear()
            self._futures.clear()
            self._sequences.clear()
            gen, self.generator = self.generator, None
            self._cond.notify_all()  # `wait_idle` and `sleep` see nothing left
        try:
            if gen is not None:
                gen.close()
        finally:
            for future in unfinished:
                _settle(future, error=RuntimeError("the ServingEngine was closed"))

    def _admitted(self) -> None:
        """The batch taken from `_incoming` is queued (or failed): no request is between the two any more."""
        with self._cond:
            self._num_admitting = 0
            self._cond.notify_all()

    def _has_work(self) -> bool:
        if self._aborting:
            return self._closed
        admit = bool(self._incoming) and not (self._asleep or self._paused)
        return self._closed or admit or bool(self._futures)

    def _queue(self, batch: list[_Request]) -> None:
        """Check each request on its own (a bad one fails alone), then queue runs of equal requests as groups."""
        if not batch:
            return
        gen = self._ensure_generator()
        valid = []
        for request in batch:
            if request.future.cancelled():  # its caller gave up on it before it was queued
                continue
            try:
                check_prompts([request.prompt_ids], gen.vocab_size, gen.max_seq_len)
                check_params(request.params, 1, gen.spec.methods if gen.spec is not None else (), gen.vocab_size)
            except ValueError as error:
                _settle(request.future, error=error)
                continue
            valid.append(request)
        groups: list[list[_Request]] = []
        for request in valid:
            if groups and groups[-1][0].prompt_ids == request.prompt_ids and groups[-1][0].params == request.params:
                groups[-1].append(request)
            else:
                groups.append([request])
        if not groups:
            return
        prompts = [group[0].prompt_ids for group in groups]
        params = [replace(group[0].params, n=len(group)) for group in groups]
        first = self._num_groups
        sequences = gen.add_requests(prompts, params, keep_in_flight=gen.has_unfinished)
        position = 0
        for g, group in enumerate(groups):
            for sample, request in enumerate(group):
                seq = sequences[position]
                # unique over the engine's life: admission shares one prefill between neighbours of one prompt index
                seq.prompt_index = first + g
                seq.seed = self._request_seed(request)
                key = (seq.prompt_index, sample)
                self._futures[key], self._sequences[key] = request.future, seq
                # a caller that gives up on its request (`asyncio.wait_for`'s timeout cancels it) frees its row
                request.future.add_done_callback(functools.partial(self._cancelled, key))
                position += 1
        self._num_groups += len(groups)

    def _request_seed(self, request: _Request) -> int:
        """A sample's random stream: its own seed's, else the engine's at its arrival index (never its batch's)."""
        if request.params.seed is not None:
            return _mix_seed("request", request.params.seed)
        return _mix_seed("engine", self._seed, self._seed_offset, request.arrival)

    def _cancelled(self, key: tuple[int, int], future: concurrent.futures.Future) -> None:
        """A request's future is done: if its caller cancelled it, the engine's next step drops the request."""
        if future.cancelled():
            with self._cond:
                self._given_up.append(key)

    def _drop_given_up(self) -> None:
        """Drop the requests whose callers cancelled them, queued or in flight (their rows and blocks go free)."""
        with self._cond:
            keys, self._given_up = self._given_up, []
        dropped = [self._sequences.pop(key) for key in keys if key in self._sequences]
        for key in keys:
            self._futures.pop(key, None)
        if dropped and self.generator is not None:
            self.generator.abort(dropped)
        with self._cond:
            self._cond.notify_all()  # `wait_idle` and `sleep` may wait for nothing else

    def _step(self) -> None:
        if self._given_up:
            self._drop_given_up()
        gen = self.generator
        if gen is None or not gen.has_unfinished:
            if self._futures:  # never expected: waiting requests with nothing in flight would spin this thread
                self._fail_all(RuntimeError(f"{len(self._futures)} requests wait with no rows in flight"), [])
            return
        out = gen.step()
        gen.last_trace.clear()  # a server steps for ever: the record is counted here instead of kept
        record = out.record
        totals = self.totals
        totals["steps"] += 1
        totals[f"{record.kind}_seconds"] = totals.get(f"{record.kind}_seconds", 0.0) + record.seconds
        for key in ("num_drafted", "num_accepted", "num_emitted"):
            totals[key] += getattr(record, key)
        for completion in out.finished:
            key = (completion.prompt_index, completion.sample_index)
            future = self._futures.pop(key, None)
            self._sequences.pop(key, None)
            if future is not None:  # None: dropped by abort_all meanwhile
                _settle(future, completion)
        if out.finished:
            with self._cond:
                self._cond.notify_all()

    def _fail_all(self, error: Exception, batch: list[_Request]) -> None:
        futures = set(self._futures.values()) | {r.future for r in batch if not r.future.done()}
        self._futures.clear()
        self._sequences.clear()
        if self.generator is not None:
            self.generator.abort()
        for future in futures:
            _settle(future, error=error)
        with self._cond:
            self._cond.notify_all()

    def _ensure_generator(self) -> Generator:
        if self.generator is None:
            self.generator = Generator(self.model, **self._generator_kwargs)
            if self._history is not None and self.generator.draft_history is not None:
                self.generator.draft_history.adopt(self._history)  # as it was: no rebuild (seconds for a large one)
            self._history = None
        return self.generator

    def _drop_generator(self) -> None:
        gen, self.generator = self.generator, None
        if gen is None:
            return
        gen.close()
        self._history = gen.draft_history  # the tries stay in host memory until the next generator adopts them


def _settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Resolve `future` unless its caller already gave up on it (cancelled it, e.g. through `asyncio.wait_for`):
    one caller's cancel must not fail the others' requests."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled meanwhile


def _mix_seed(*parts) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
