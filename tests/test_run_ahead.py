"""The host one step ahead (`Generator(async_scheduling=True)`, `rollout.engine.run_ahead`): a one-token decode step
is launched from the previous step's samples before the host reads them. The completions are those of the engine
in lockstep, token for token, log-probs to float64 rounding, finish reason for finish reason: on slots and paged
caches, the padded graph forward, a pool short enough to preempt, rows finishing on stop ids and length caps while a
step is in flight, requests added mid-flight. A decode step still reads the device once."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_prompts
from test_device_reads import CountingReads
from test_generator import teacher_forced_logprobs, use_frequent_token_as_eos

from rollout import Generator, SamplingParams
from rollout.engine import decode_step
from rollout.engine.run_ahead import LaunchedStep
from rollout.engine.step_timer import forced_steps
from specdec.config import SpecConfig


class Spy:
    """Counts the steps launched behind another and the rows released while a step was in flight; keeps, for each
    step launched ahead, the most drafts its K policy's choice let a row ask for (its K, under the rows' caps), and
    the width of every step launched."""

    def __init__(self, gen: Generator):
        self.ahead = self.moved = 0
        self.ahead_asked: list[int] = []
        self.widths: list[int] = []
        launch, moved = gen._launch_decode, LaunchedStep.rows_moved

        def spy_launch(after=None, ahead=None):
            self.ahead += after is not None
            caps = gen.slots.draft_caps(gen.scheduler.num_active)
            step = launch(after, ahead)
            if after is not None:
                self.ahead_asked.append(int(caps.clamp(max=step.decision.num_draft_tokens).max()))
            self.widths.append(step.layout.width)
            return step

        def spy_moved(step, num_active, leaving, movers, holes):
            self.moved += len(leaving)
            return moved(step, num_active, leaving, movers, holes)

        gen._launch_decode = spy_launch
        self._patch = pytest.MonkeyPatch()
        self._patch.setattr(LaunchedStep, "rows_moved", spy_moved)

    def close(self):
        self._patch.undo()


def generate_both(model, prompts, params, graphs: bool = False, **kwargs):
    runs = {}
    for ahead in (False, True):
        gen = Generator(model, async_scheduling=ahead, **kwargs)
        if graphs:
            gen.runner.use_graphs(gen.max_width, capture=False)  # the padded forward a CUDA graph replays
        spy = Spy(gen)
        try:
            outs = gen.generate(prompts, params)
        finally:
            spy.close()
        runs[ahead] = (outs, gen, spy)
    return runs


def assert_same(runs):
    (lockstep, *_), (ahead, *_) = runs[False], runs[True]
    assert [(o.prompt_index, o.sample_index) for o in ahead] == [(o.prompt_index, o.sample_index) for o in lockstep]
    for a, b in zip(ahead, lockstep):
        assert a.token_ids == b.token_ids, f"prompt {a.prompt_index} sample {a.sample_index}"
        assert a.finish_reason == b.finish_reason, f"prompt {a.prompt_index} sample {a.sample_index}"
        # float64: a row that finished rides one step further, so a batch's padded shapes (and its sums' rounding)
        # may differ; the tokens may not
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "kv_layout, graphs", [("slots", False), ("paged", False), ("paged", True)], ids=["slots", "paged", "padded-graph"]
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_running_ahead_samples_what_lockstep_samples(kv_layout, graphs, temperature):
    model = make_model("llama")
    prompts = random_prompts(7, min_len=3, max_len=12, seed=3)
    use_frequent_token_as_eos(model, prompts, 20)  # rows stop at different steps, some while a step is in flight
    params = [
        SamplingParams(n=2, temperature=temperature, max_new_tokens=8 + 3 * i, seed=5) for i in range(len(prompts))
    ]
    runs = generate_both(model, prompts, params, graphs, max_batch_size=5, max_seq_len=64, kv_layout=kv_layout)
    assert_same(runs)
    outs, gen, spy = runs[True]
    assert spy.ahead > 0, "no step was launched ahead: nothing was tested"
    assert spy.moved > 0, "no row was released while a step was in flight"
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    assert runs[False][2].ahead == 0
    if temperature > 0:  # the log-probs a trainer takes are the model's, not only the same as lockstep's
        for out in outs[:4]:
            expected = teacher_forced_logprobs(model, prompts[out.prompt_index], out.token_ids, params[0])
            torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)


def test_running_ahead_on_a_pool_that_preempts():
    model = make_model("qwen2")
    prompts = random_prompts(6, min_len=10, max_len=20, seed=7)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=0)
    runs = generate_both(model, prompts, params, max_batch_size=18, max_seq_len=64, kv_layout="paged",
                         kv_pool_blocks=16)  # fmt: skip
    assert_same(runs)
    trace = runs[True][1].last_trace
    assert sum(r.num_preempted for r in trace) > 0, "the pool never ran short: nothing was tested"
    assert runs[True][2].ahead > 0


def test_requests_added_while_a_step_is_in_flight_join_and_sample_the_same():
    model = make_model("llama")
    first, second = random_prompts(3, seed=1), random_prompts(2, seed=2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4)
    results = {}
    for ahead in (False, True):
        gen = Generator(model, max_batch_size=8, max_seq_len=48, async_scheduling=ahead)
        gen.add_requests(first, params, seed_indices=[0, 1, 2])
        done = []
        for _ in range(4):  # a prefill, then decode steps: one is in flight when the new requests come
            done += gen.step().finished
        assert not ahead or gen._ahead.in_flight is not None, "expected a step in flight"
        gen.add_requests(second, params, seed_indices=[3, 4], keep_in_flight=True)
        while gen.has_unfinished:
            done += gen.step().finished
        results[ahead] = sorted((c.prompt_index, c.sample_index, tuple(c.token_ids), c.finish_reason) for c in done)
    assert results[True] == results[False]
    assert len(results[True]) == 10


def test_a_step_in_flight_is_dropped_by_abort_and_refused_by_snapshot():
    model = make_model("llama")
    prompts = random_prompts(3, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=0)
    gen = Generator(model, max_batch_size=4, max_seq_len=48, async_scheduling=True)
    gen.add_requests(prompts, params)
    gen.step()
    gen.step()
    assert gen._ahead.in_flight is not None, "expected a step in flight"
    with pytest.raises(RuntimeError, match="in flight"):
        gen.snapshot()
    gen.abort()
    assert gen._ahead.in_flight is None and not gen.has_unfinished
    again = gen.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in Generator(model, 4, 48).generate(prompts, params)]


def test_a_step_that_fails_while_one_is_unread_stops_the_engine_until_abort():
    model = make_model("llama")
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, seed=0)
    reference = Generator(model, 4, 48).generate(prompts, params)
    gen = Generator(model, 4, 48, async_scheduling=True)
    decode, calls = gen.runner.decode, [0]

    def failing_once(*args, **kwargs):  # a forward that fails once mid-rollout (a CUDA out-of-memory, say)
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("out of memory")
        return decode(*args, **kwargs)

    gen.runner.decode = failing_once
    gen.add_requests(prompts, params)
    with pytest.raises(RuntimeError, match="out of memory"):
        while gen.has_unfinished:
            gen.step()
    with pytest.raises(RuntimeError, match="abort"):  # rows a step's tokens short are not stepped on
        gen.step()
    gen.abort()
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in reference]


def test_a_step_launched_ahead_still_reads_the_device_once():
    model = make_model("llama")
    gen = Generator(model, max_batch_size=6, max_seq_len=48, async_scheduling=True)
    gen.add_requests(random_prompts(3, seed=2), SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=0))
    launch, launched = gen._launch_decode, []

    def counting_launch(after=None, ahead=None):
        launched.append(after is not None)
        return launch(after, ahead)

    gen._launch_decode = counting_launch
    reads = 0
    while gen.has_unfinished:
        with CountingReads() as counter:
            gen.step()
        reads += counter.count
    # the prefill's read, then one a decode step, started when it is launched and waited for when it is read
    assert any(launched), "no step was launched ahead: nothing was tested"
    assert reads == 1 + len(launched), f"{reads} reads for a prefill and {len(launched)} decode steps"


# K = 0 while 4 or more rows decode, K = 2 below: the bulk runs ahead, the tail drafts in lockstep
TABLE = [[1, 3, 2], [4, 8, 0]]


@pytest.mark.parametrize(
    "method, table",
    [("suffix", TABLE), ("ngram", TABLE), (["suffix", "draft_model"], TABLE), ("suffix", "auto")],
    ids=["suffix-table", "ngram-table", "cascade-table", "suffix-auto"],
)
@pytest.mark.parametrize(
    "kv_layout, graphs", [("slots", False), ("paged", False), ("paged", True)], ids=["slots", "paged", "padded-graph"]
)
def test_speculation_runs_ahead_where_its_policy_drafts_nothing(method, table, kv_layout, graphs):
    model = make_model("llama")
    draft = make_model("llama", seed=1, num_hidden_layers=1)
    prompts = random_prompts(5, min_len=3, max_len=12, seed=3)
    use_frequent_token_as_eos(model, prompts, 24)  # rows stop at different steps, some while a step is in flight
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=10 + 4 * i, seed=5) for i in range(len(prompts))]
    plain = Generator(model, max_batch_size=8, max_seq_len=80).generate(prompts, params)
    spec = SpecConfig(
        method=method,
        model=draft if "draft_model" in method else None,
        num_speculative_tokens=2,
        num_speculative_tokens_per_batch_size=table,
    )
    runs = generate_both(
        model, prompts, params, graphs, max_batch_size=8, max_seq_len=80, kv_layout=kv_layout, spec=spec
    )
    assert_same(runs)
    outs, gen, spy = runs[True]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # pathwise: speculation on or off
    assert spy.ahead > 0, "no step was launched ahead: nothing was tested"
    assert set(spy.ahead_asked) == {0}, "a step launched ahead where its policy drafted"
    assert max(spy.widths) > 1, "no step drafted: the lockstep half was not tested"
    # the trace says which steps ran ahead (a step launched ahead whose rows had all finished is dropped unread); auto
    # K drafts at nearly every step here (drafts pay on this model): it tests the calibration's lockstep and exactness
    ran_ahead = sum(r.ran_ahead for r in gen.last_trace)
    assert ran_ahead <= spy.ahead and (ran_ahead > 0 or table == "auto")
    assert not any(r.ran_ahead and r.num_drafted for r in gen.last_trace)
    assert runs[False][2].ahead == 0
    # the proposers took in every token, those of the steps launched ahead too: a cached response is the completion
    if method == "suffix":
        responses = {tuple(r.tolist()) for _, r in gen.proposers.proposers["suffix"].history}
        assert {tuple(o.token_ids) for o in outs} <= responses


def test_async_scheduling_refuses_bad_values_and_is_off_on_a_cpu_by_default():
    model = make_model("llama")
    with pytest.raises(ValueError, match="async_scheduling"):
        Generator(model, 4, 48, async_scheduling="yes")
    assert not Generator(model, 4, 48).config.async_scheduling  # "auto": on a GPU only
    spec = SpecConfig(method="ngram", num_speculative_tokens=2)
    assert not Generator(model, 4, 48, spec=spec).config.async_scheduling
    assert Generator(model, 4, 48, spec=spec, async_scheduling=True).config.async_scheduling


class FrozenClock:
    """`time` for the decode step's module: `perf_counter` stands still until the test moves it."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("ahead", [False, True], ids=["lockstep", "ahead"])
def test_with_the_host_ahead_a_decode_step_counts_from_the_last_read(monkeypatch, ahead):
    # a step's seconds price it for the K policy: with the host ahead, a drafting step in lockstep must count the
    # bookkeeping and the caller's time since the last read, as the steps run ahead do, or drafting looks cheaper
    # than running ahead by that much; after a prefill a step counts from its own launch
    clock = FrozenClock()
    monkeypatch.setattr(decode_step, "time", clock)
    model = make_model("llama")
    spec = SpecConfig(method="suffix", num_speculative_tokens=2, num_speculative_tokens_per_batch_size=TABLE)
    gen = Generator(model, max_batch_size=8, max_seq_len=80, spec=spec, async_scheduling=ahead)
    prompts = random_prompts(5, min_len=3, max_len=12, seed=3)
    use_frequent_token_as_eos(model, prompts, 24)
    gen.add_requests(
        prompts, [SamplingParams(n=2, temperature=1.0, max_new_tokens=10 + 4 * i, seed=5) for i in range(5)]
    )
    records = []
    while gen.has_unfinished:
        records.append(gen.step().record)
        clock.now += 1.0  # the caller's work between two steps
    follows = [(prev.kind, r) for prev, r in zip(records, records[1:]) if r.kind == "decode"]
    assert any(kind == "prefill" for kind, _ in follows) and any(r.num_drafted for _, r in follows)
    if not ahead:  # each step from its own launch: the clock stood still inside every step
        assert all(r.seconds == 0.0 for _, r in follows)
        return
    for kind, r in follows:
        assert r.seconds == (0.0 if kind == "prefill" else 1.0), (kind, r)


def test_rejection_sampling_does_not_run_ahead_of_drafting():
    # a row's rejection uniforms are drawn by count (2K + 1 a step): a K chosen on rows a step behind would shift its
    # stream (the table's K = 0 at 4 or more rows, with rows finishing in flight still counted), so its samples would
    # differ from lockstep's
    model = make_model("llama")
    prompts = random_prompts(5, min_len=3, max_len=12, seed=3)
    use_frequent_token_as_eos(model, prompts, 24)
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=10 + 4 * i, seed=5) for i in range(len(prompts))]
    spec = SpecConfig(
        method="suffix", num_speculative_tokens=2, num_speculative_tokens_per_batch_size=TABLE, verification="rejection"
    )
    runs = generate_both(model, prompts, params, max_batch_size=8, max_seq_len=80, spec=spec)
    assert_same(runs)
    assert runs[True][2].ahead == 0
    assert max(runs[True][2].widths) > 1, "no step drafted: nothing was tested"


def test_a_calibration_is_timed_in_lockstep_and_takes_no_k_chosen_before_it(monkeypatch):
    # with the host ahead, a forced step (the warm-up's timing) counts from its own launch, not from the last step's
    # read; and a K the policy chose for a step that could not run ahead is not taken by a forced step after it
    clock = FrozenClock()
    monkeypatch.setattr(decode_step, "time", clock)
    model = make_model("llama")
    prompts = random_prompts(5, min_len=3, max_len=12, seed=3)
    use_frequent_token_as_eos(model, prompts, 24)
    spec = SpecConfig(method="suffix", num_speculative_tokens=2, num_speculative_tokens_per_batch_size=TABLE)
    gen = Generator(model, max_batch_size=8, max_seq_len=80, spec=spec, async_scheduling=True)
    gen.add_requests(
        prompts, [SamplingParams(n=2, temperature=1.0, max_new_tokens=10 + 4 * i, seed=5) for i in range(5)]
    )
    while gen._ahead.decision is None or gen._ahead.in_flight is not None:  # a K > 0 kept for the next launch
        assert gen.has_unfinished, "no K was kept for a launch: nothing was tested"
        gen.step()
        clock.now += 1.0
    with forced_steps(gen, 0):  # the kept K was the table's: the forced step takes the forced K
        record = gen.step().record
    assert (record.num_draft_tokens, record.num_drafted) == (0, 0), record
    rows = gen.snapshot()
    for _ in range(3):
        gen.restore(rows)
        with forced_steps(gen, 0):
            record = gen.step().record
        clock.now += 1.0  # what a calibration does between two timed steps
        assert (record.num_draft_tokens, record.num_drafted, record.seconds) == (0, 0, 0.0), record
