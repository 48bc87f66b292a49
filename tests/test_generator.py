"""The generator's contract: exact greedy, exact log-probs, reproducible sampling, filters respected, clear errors."""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from dataclasses import replace

import pytest
import torch
from conftest import make_model, model_from_config, random_prompts

from rollout import Generator, SamplingParams
from specdec.config import SpecConfig, SpecDecodeParams
from specdec.processing import RowSampling, processed_logprobs


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`model.generate` one sequence at a time, no padding: the reference for greedy decoding."""
    eos = model.generation_config.eos_token_id
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def use_frequent_token_as_eos(model, prompts, max_new_tokens):
    """Make the model's most frequent greedy token its EOS, so completions stop at different lengths."""
    counts = collections.Counter()
    for prompt in prompts:
        counts.update(hf_greedy(model, prompt, max_new_tokens))
    eos = counts.most_common(1)[0][0]
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    return eos


def teacher_forced_logprobs(model, prompt, completion, params: SamplingParams) -> torch.Tensor:
    """Log-probs of `completion` under one forward over prompt + completion, processed like the generator does."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    rows = logits.shape[0]
    sampling = RowSampling(
        temperature=torch.full((rows,), float(params.temperature)),
        top_k=torch.full((rows,), params.top_k),
        top_p=torch.full((rows,), float(params.top_p)),
        needs_filter=params.top_k > 0 or params.top_p < 1,
        all_greedy=params.temperature == 0,
        any_greedy=params.temperature == 0,
    )
    logprobs = processed_logprobs(logits, sampling)
    return logprobs[torch.arange(rows), torch.tensor(completion)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_equals_model_generate(arch, attn):
    model = make_model(arch, attn)
    prompts = random_prompts(9, max_len=14, seed=1)  # ragged; 9 prompts through 4 slots: slots refill mid-run
    max_new = 16
    eos = use_frequent_token_as_eos(model, prompts, max_new)
    outs = Generator(model, max_batch_size=4, max_seq_len=64).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=max_new)
    )
    assert [o.prompt_index for o in outs] == list(range(len(prompts)))
    lengths = set()
    for out in outs:
        expected = hf_greedy(model, prompts[out.prompt_index], max_new)
        assert out.token_ids == expected, f"prompt {out.prompt_index}"
        stopped = expected[-1] == eos
        assert out.finish_reason == ("stop" if stopped else "length")
        lengths.add(len(out.token_ids))
    assert len(lengths) > 1, "the test needs completions of different lengths (some stopping early)"


def test_sliding_window_layers_mixed_with_full_attention():
    # Qwen2 with a window on its upper layers: the two layer types get different masks through the mask mapping
    model = make_model("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert set(model.config.layer_types) == {"full_attention", "sliding_attention"}
    prompts = random_prompts(5, min_len=6, max_len=12, seed=2)
    outs = Generator(model, max_batch_size=3, max_seq_len=64).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=12)
    )
    for out in outs:
        assert out.token_ids == hf_greedy(model, prompts[out.prompt_index], 12)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_new_tokens=12),
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=3),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=12, seed=4, n=2),
    ],
    ids=["greedy", "t1", "t0.7-topk-topp-n2"],
)
def test_logprobs_equal_teacher_forced_pass(params):
    model = make_model("llama")
    prompts = random_prompts(5, seed=5)
    outs = Generator(model, max_batch_size=3, max_seq_len=64).generate(prompts, params)
    assert len(outs) == len(prompts) * params.n
    for out in outs:
        assert len(out.logprobs) == len(out.token_ids)
        expected = teacher_forced_logprobs(model, prompts[out.prompt_index], out.token_ids, params)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=1e-9, rtol=0)


def test_seeded_sampling_is_reproducible_and_independent_of_batching():
    model = make_model("qwen2")
    prompts = random_prompts(6, seed=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11, n=3)
    first = Generator(model, max_batch_size=4, max_seq_len=64).generate(prompts, params)
    again = Generator(model, max_batch_size=4, max_seq_len=64).generate(prompts, params)
    other_batching = Generator(model, max_batch_size=16, max_seq_len=64).generate(prompts, params)
    other_seed = Generator(model, max_batch_size=4, max_seq_len=64).generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seed=12, n=3)
    )
    tokens = [o.token_ids for o in first]
    assert tokens == [o.token_ids for o in again]
    assert tokens == [o.token_ids for o in other_batching]  # each sample has its own random stream
    assert tokens != [o.token_ids for o in other_seed]
    # the n samples of one prompt differ from each other (they share the prefill, not the randomness)
    assert len({tuple(o.token_ids) for o in first[:3]}) > 1


def test_numpy_and_torch_integer_ids_are_token_ids():
    import numpy as np

    gen = Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32)
    prompt = [5, 9, 3]
    params = SamplingParams(temperature=0, max_new_tokens=4)
    expected = gen.generate([prompt], params)[0].token_ids
    for given in (np.array(prompt), torch.tensor(prompt), [np.int64(t) for t in prompt]):
        assert gen.generate([given], params)[0].token_ids == expected


def test_a_name_or_path_is_not_a_model():
    with pytest.raises(TypeError, match="not the name or path 'tiny-target'.*rollout.models.zoo.load_model"):
        Generator("tiny-target")
    wrapped = torch.nn.DataParallel(make_model("qwen2"))  # (DistributedDataParallel wraps a model the same way)
    with pytest.raises(TypeError, match="got it wrapped in DataParallel: pass model.module"):
        Generator(wrapped, max_batch_size=2, max_seq_len=32)


def test_a_call_from_inside_a_generate_call_is_refused_and_an_abort_cancels_it():
    """A callback (or a reward it calls) that generates with the same Generator would drop the outer call's rows and
    return its samples empty: refused, as a step or a restore from there (a snapshot only reads: it goes through, see
    the test below); `abort` cancels the call."""
    gen = Generator(make_model("qwen2"), max_batch_size=4, max_seq_len=32)
    prompts, params = random_prompts(3, seed=2), SamplingParams(temperature=0, max_new_tokens=4)
    expected = [o.token_ids for o in gen.generate(prompts, params)]
    calls = {
        "generate": lambda: gen.generate(prompts[:1], params),
        "add_requests": lambda: gen.add_requests(prompts[:1], params, keep_in_flight=True),
        "step": gen.step,
        "restore": lambda: gen.restore([]),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name} was called while this Generator's generate call runs"):
            gen.generate(prompts, params, on_group=lambda group, call=call: call())
        assert [o.token_ids for o in gen.generate(prompts, params)] == expected  # usable after
    cancelled = gen.generate(prompts, params, on_step=lambda record, done, total: gen.abort())
    assert all(o.finish_reason == "" and o.token_ids == [] for o in cancelled)
    assert [o.token_ids for o in gen.generate(prompts, params)] == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_that_raised_part_way_is_refused_until_an_abort(async_scheduling):
    """An exception (Ctrl-C) after a step committed its tokens and before it released the finished rows leaves a
    stopped row in flight: stepping on would decode it past its stop. The next step is refused, one line saying to
    abort; after `abort` (or a new `add_requests`) the generator samples as before."""
    model = make_model("llama", eos_token_id=None)
    prompts = random_prompts(3, min_len=3, max_len=8, seed=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[68])
    spec = SpecConfig(method="ngram", num_speculative_tokens=2) if async_scheduling else None
    gen = Generator(model, 4, 48, async_scheduling=async_scheduling, spec=spec)
    expected = [(o.token_ids, o.finish_reason) for o in gen.generate(prompts, params)]
    assert any(reason == "stop" for _, reason in expected), "no row stopped: nothing was tested"
    release, raised = gen._release_finished, []

    def interrupted():
        if gen.slots.finished[: gen.num_active].any() and not raised:
            raised.append(True)
            raise KeyboardInterrupt  # lands after the commit, before the release
        return release()

    gen._release_finished = interrupted
    gen.add_requests(prompts, params)
    with pytest.raises(KeyboardInterrupt):
        while gen.has_unfinished:
            gen.step()
    with pytest.raises(RuntimeError, match=r"a step raised \(or was interrupted\) part-way.*call abort\(\)"):
        gen.step()
    gen.abort()
    assert [(o.token_ids, o.finish_reason) for o in gen.generate(prompts, params)] == expected
    with pytest.raises(RuntimeError, match=r"step\(\) with nothing queued or in flight: add_requests first"):
        gen.step()


def test_concurrent_calls_are_refused_never_mixed():
    import threading

    model = make_model("qwen2", dtype=torch.float32)
    gen = Generator(model, max_batch_size=4, max_seq_len=32)
    prompts = {name: random_prompts(2, seed=seed) for name, seed in (("a", 1), ("b", 2))}
    params = SamplingParams(temperature=0, max_new_tokens=3)
    expected = {name: [o.token_ids for o in gen.generate(p, params)] for name, p in prompts.items()}
    outcomes = {"done": 0, "refused": 0, "mixed": 0, "other": []}
    start = threading.Barrier(2)

    def call(name):
        start.wait()
        try:
            got = [o.token_ids for o in gen.generate(prompts[name], params)]
        except RuntimeError as err:
            if "already generating" not in str(err):
                outcomes["other"].append(repr(err))
            outcomes["refused"] += 1
            return
        except Exception as err:  # anything else is a failure, reported below (threads cannot fail the test)
            outcomes["other"].append(repr(err))
            return
        outcomes["done" if got == expected[name] else "mixed"] += 1

    for _ in range(500):  # 1000 calls
        threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert outcomes["mixed"] == 0 and outcomes["other"] == []
    assert outcomes["done"] + outcomes["refused"] == 1000 and outcomes["done"] >= 500
    assert outcomes["refused"] > 0  # the calls did overlap


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (4, 0.6)])
def test_sampled_tokens_stay_inside_top_k_top_p(top_k, top_p):
    model = make_model("qwen3")
    prompts = random_prompts(4, seed=7)
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=8, n=4)
    outs = Generator(model, max_batch_size=8, max_seq_len=64).generate(prompts, params)
    for out in outs:
        prompt = prompts[out.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        probs = torch.softmax(logits / params.temperature, dim=-1)
        for step, token in enumerate(out.token_ids):
            ranked = probs[step].sort(descending=True, stable=True)
            allowed_by_k = ranked.indices[:top_k].tolist() if top_k else ranked.indices.tolist()
            mass_before = torch.cumsum(ranked.values, 0) - ranked.values
            allowed_by_p = ranked.indices[(mass_before < top_p)].tolist()
            assert token in allowed_by_k and token in allowed_by_p, f"step {step}: token {token} outside the set"


def test_stop_token_ids_and_n_share_one_prefill():
    model = make_model("qwen2")
    prompts = random_prompts(3, seed=9)
    reference = [hf_greedy(model, p, 10) for p in prompts]
    stop = reference[0][3]  # the 4th greedy token of prompt 0
    gen = Generator(model, max_batch_size=8, max_seq_len=64)
    outs = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[stop], n=2))
    assert outs[0].token_ids == reference[0][: reference[0].index(stop) + 1]
    assert outs[0].finish_reason == "stop"
    assert outs[0].token_ids == outs[1].token_ids  # greedy samples of one prompt agree
    prefill = [r for r in gen.last_trace if r.kind == "prefill"]
    assert sum(r.batch_size for r in prefill) == len(prompts)  # 3 prefilled rows for 6 samples


def test_trace_counts_add_up():
    model = make_model("llama")
    prompts = random_prompts(7, seed=10)
    gen = Generator(model, max_batch_size=3, max_seq_len=64)
    outs = gen.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=9, seed=0))
    trace = gen.last_trace
    assert sum(r.num_emitted for r in trace) == sum(len(o.token_ids) for o in outs)
    assert all(r.batch_size <= 3 for r in trace)
    assert {r.kind for r in trace} == {"prefill", "decode"}
    assert all(r.seconds > 0 for r in trace)


def test_a_steps_proposer_time_includes_releasing_and_moving_its_rows():
    """`propose_seconds` counts the proposers' part of releasing the step's finished rows (finishing them, moving the
    last rows into their holes), not only drafting: the proposer's share of a rollout is all of its host time."""
    model = make_model("llama")
    gen = Generator(model, max_batch_size=6, max_seq_len=64, spec=SpecConfig(method="suffix", num_speculative_tokens=2))
    pause, calls = 0.02, collections.Counter()
    for hook in ("finish", "copy_rows"):  # the real calls, each made slower by a known pause, and counted
        real = getattr(gen.proposers, hook)

        def slowed(*args, real=real, hook=hook):
            calls[hook] += 1
            time.sleep(pause)
            return real(*args)

        setattr(gen.proposers, hook, slowed)
    params = [SamplingParams(n=2, max_new_tokens=m, seed=0) for m in (3, 5, 8)]
    gen.add_requests(random_prompts(3, seed=12), params)
    steps = []
    while gen.has_unfinished:
        before = sum(calls.values())
        record = gen.step().record
        steps.append((sum(calls.values()) - before, record.propose_seconds))
    # rows of the shorter requests finish first and the last rows move into their holes
    assert calls["finish"] >= 2 and calls["copy_rows"] >= 1, calls
    assert all(seconds >= num_calls * pause for num_calls, seconds in steps), steps


def test_max_seq_len_caps_completions_and_says_so():
    model = make_model("qwen2")
    prompt = random_prompts(1, min_len=10, max_len=10, seed=11)[0]
    with pytest.warns(UserWarning, match="max_new_tokens 50 does not fit in max_seq_len 14 .* stop at 4 new tokens"):
        outs = Generator(model, max_batch_size=2, max_seq_len=14).generate(
            [prompt], SamplingParams(temperature=0, max_new_tokens=50)
        )
    assert len(outs[0].token_ids) == 4 and outs[0].finish_reason == "length"


def test_requests_added_mid_flight_join_the_batch_and_draw_what_they_would_alone():
    model = make_model("qwen2")
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, n=2)
    alone = Generator(model, max_batch_size=8, max_seq_len=64).generate(prompts, params)
    gen = Generator(model, max_batch_size=8, max_seq_len=64)
    gen.add_requests(prompts[:2], params, seed_indices=[0, 1])
    finished = []
    for _ in range(3):
        finished += gen.step().finished
    gen.add_requests(prompts[2:], params, seed_indices=[2, 3], keep_in_flight=True)  # the first two keep going
    while gen.has_unfinished:
        finished += gen.step().finished
    # every sample is the one a single call draws (its seed index, not its batch, decides), none lost or repeated
    assert sorted(tuple(o.token_ids) for o in finished) == sorted(tuple(o.token_ids) for o in alone)
    assert len({tuple(o.token_ids) for o in alone}) == 8
    assert sorted((o.prompt_index, o.sample_index) for o in finished) == [(p, s) for p in range(4) for s in range(2)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"kv_layout": "paged"},
        {"kv_layout": "paged", "async_scheduling": True},
        {"spec": "suffix"},
        {"spec": "draft"},
    ],
    ids=["slots", "paged", "paged-ahead", "suffix", "draft"],
)
def test_abort_drops_the_requests_named_and_the_others_draw_what_they_would_alone(options):
    """`abort(requests)` (a serving loop's cancelled request; `abort()` dropped every request): the named ones,
    queued or in flight, never come back, their rows and blocks are freed, and every other sample is the one a single
    call draws."""
    options = dict(options)
    model = make_model("qwen2")
    if options.get("spec") == "suffix":
        options["spec"] = SpecConfig(method="suffix", num_speculative_tokens=3)
    elif options.get("spec") == "draft":
        options["spec"] = SpecConfig(method="draft_model", num_speculative_tokens=3, model=make_model("qwen2"))
    prompts = random_prompts(5, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, n=2)
    alone = Generator(model, max_batch_size=4, max_seq_len=64).generate(prompts, params)
    gen = Generator(model, max_batch_size=4, max_seq_len=64, **options)
    requests = gen.add_requests(prompts, params)  # 10 samples, 4 slots: 6 queued
    finished = gen.step().finished + gen.step().finished + gen.step().finished
    in_flight = [seq for seq in gen.slots.sequences[: gen.num_active]]
    queued = list(gen.scheduler.queue)
    assert len(in_flight) == 4 and len(queued) == 6 and not finished
    dropped = [in_flight[1], in_flight[2], queued[0], queued[-1]]
    gen.abort(dropped)
    assert gen.num_active == 2 and len(gen.scheduler.queue) == 4
    elsewhere = Generator(model, max_batch_size=2, max_seq_len=64).add_requests(prompts[:1], params)
    gen.abort([in_flight[1], elsewhere[0]])  # gone already, and another generator's: passed over
    while gen.has_unfinished:
        finished += gen.step().finished
    kept = [(seq.prompt_index, seq.sample_index) for seq in requests if seq not in dropped]
    assert sorted((o.prompt_index, o.sample_index) for o in finished) == sorted(kept)
    by_index = {(o.prompt_index, o.sample_index): o for o in alone}
    for o in finished:
        want = by_index[(o.prompt_index, o.sample_index)]
        assert o.token_ids == want.token_ids and o.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    if gen.runner.paged:
        assert gen.runner.cache.manager.num_free == gen.runner.cache.num_blocks
    with pytest.raises(ValueError, match="abort takes a list of the requests add_requests returned"):
        gen.abort([0, 1])


@pytest.mark.parametrize(
    "options",
    [
        {"at_call": 1},
        {"at_call": 4},
        {"at_call": 4, "kv_layout": "paged"},
        {"at_call": 4, "spec": SpecConfig(method="suffix", num_speculative_tokens=3)},
        {"at_call": 4, "spec": SpecConfig(method="ngram", num_speculative_tokens=2, verification="rejection")},
    ],
    ids=["prefill", "decode", "paged", "suffix", "rejection"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_logits_that_turn_nan_are_refused_in_one_line_and_the_generator_serves_again(options, temperature):
    """A policy whose logits go NaN mid-rollout (a diverged update, a float16 overflow): sampled rows failed on an
    index past the vocabulary in the reference race (the kernel drew a finite token), greedy rows emitted token 0 with
    log-probability NaN as a normal stop. Now one line names the sample, and the next call samples as before."""
    options = dict(options)
    at_call = options.pop("at_call")
    model = make_model("llama")
    prompts = random_prompts(3, seed=4)
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=10, seed=1)
    fresh = Generator(model, max_batch_size=8, max_seq_len=48, **options)  # (rejection: samples follow the drafts)
    expected = [o.token_ids for o in fresh.generate(prompts, params)]
    gen = Generator(model, max_batch_size=8, max_seq_len=48, **options)
    calls = []

    def poison(module, args, output):  # the final norm's output of the first row, from the `at_call`-th forward on
        calls.append(1)
        if len(calls) >= at_call:
            output[0] = float("nan")
        return output

    hook = model.get_decoder().norm.register_forward_hook(poison)
    try:
        with pytest.raises(
            FloatingPointError, match=r"logits are not finite \(NaN or inf\) at completion token \d+ of"
        ):
            gen.generate(prompts, params)
    finally:
        hook.remove()
    assert [o.token_ids for o in gen.generate(prompts, params)] == expected


def test_a_prompt_added_mid_flight_never_shares_the_prefill_of_one_still_queued():
    """Two slots, four samples of prompt A (two of them still queued), then prompt B: B's samples must be prefilled
    from B, although both calls number their first prompt 0."""
    model = make_model("qwen2")
    first, second = random_prompts(2, min_len=6, max_len=12, seed=9)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=2)
    alone_a = Generator(model, max_batch_size=2, max_seq_len=64).generate([first], replace(params, n=4))
    alone_b = Generator(model, max_batch_size=2, max_seq_len=64).generate([second], replace(params, n=2))
    gen = Generator(model, max_batch_size=2, max_seq_len=64)
    gen.add_requests([first], replace(params, n=4))
    finished = list(gen.step().finished)  # the first two samples admitted; two wait
    gen.add_requests([second], replace(params, n=2), keep_in_flight=True)
    while gen.has_unfinished:
        finished += gen.step().finished
    by_prompt = {p: sorted(tuple(o.token_ids) for o in finished if o.prompt_index == p) for p in (0, 1)}
    assert by_prompt[0] == sorted(tuple(o.token_ids) for o in alone_a)
    assert by_prompt[1] == sorted(tuple(o.token_ids) for o in alone_b)


def test_the_public_engine_refuses_a_call_from_another_thread_during_a_call():
    """While a call runs, `add_requests`, `step`, `abort`, `snapshot`, `restore` and `close` from another thread are
    refused (they used to go through: `add_requests` or `abort` emptied the running call's completions); the call's
    own steps and its callbacks' calls on its thread go through, and after it the other thread may call."""
    import threading

    model = make_model("qwen2", dtype=torch.float32)
    gen = Generator(model, max_batch_size=4, max_seq_len=32)
    prompts, params = random_prompts(3, seed=1), SamplingParams(temperature=0, max_new_tokens=6)
    expected = [o.token_ids for o in gen.generate(prompts, params)]
    calls = {
        "add_requests": lambda: gen.add_requests(prompts, params, keep_in_flight=True),
        "step": gen.step,
        "abort": gen.abort,
        "snapshot": gen.snapshot,
        "restore": lambda: gen.restore([]),
        "close": gen.close,
    }
    outcomes = {}
    from_another_thread = _calling_from_another_thread(calls, outcomes, gen.snapshot)  # (its own call: goes through)
    assert [o.token_ids for o in gen.generate(prompts, params, on_step=from_another_thread)] == expected
    assert outcomes == dict.fromkeys(calls, "refused")
    finished = threading.Thread(target=lambda: outcomes.__setitem__("after", _outcome(gen.abort)))
    finished.start()
    finished.join()
    assert outcomes["after"] == "done"


def test_the_drafting_history_refuses_a_call_from_another_thread_during_a_call():
    """`draft_history.stats()` from another thread while `generate` ran crashed the process (a segmentation fault: its
    insertion ran beside the step's), and `clear()` or `load()` there broke the call (KeyError). The history's calls
    hold its generator as the engine's do: refused from another thread during a call, taken from its callbacks."""
    import io

    model = make_model("qwen2", dtype=torch.float32)
    spec = SpecConfig(method="suffix", num_speculative_tokens=3)
    gen = Generator(model, max_batch_size=4, max_seq_len=48, spec=spec)
    prompts, params = random_prompts(3, seed=1), SamplingParams(temperature=0, max_new_tokens=12)
    expected = [o.token_ids for o in gen.generate(prompts, params)]
    history, saved = gen.draft_history, io.BytesIO()
    history.save(saved)
    other = Generator(model, max_batch_size=4, max_seq_len=48, spec=spec).draft_history
    calls = {
        "stats": history.stats,
        "clear": history.clear,
        "save": lambda: history.save(io.BytesIO()),
        "load": lambda: history.load(io.BytesIO(saved.getvalue())),
        "add_responses": lambda: history.add_responses([[1, 2]], [[3, 4]]),
        "adopt": lambda: other.adopt(history),
    }
    outcomes = {}
    from_another_thread = _calling_from_another_thread(calls, outcomes, history.stats)  # (its own: goes through)
    assert [o.token_ids for o in gen.generate(prompts, params, on_step=from_another_thread)] == expected
    assert outcomes == dict.fromkeys(calls, "refused")
    assert history.stats()["responses"] == 6


def _calling_from_another_thread(calls: dict, outcomes: dict, own_call):
    """An `on_step` callback that, at the first step, makes each of `calls` from a thread of its own (each outcome into
    `outcomes` by name), then `own_call` on the call's thread."""
    import threading

    def from_another_thread(record, finished, total):
        if not outcomes:
            for name, call in calls.items():
                thread = threading.Thread(target=lambda n=name, c=call: outcomes.__setitem__(n, _outcome(c)))
                thread.start()
                thread.join()
            own_call()

    return from_another_thread


def _outcome(call) -> str:
    try:
        call()
    except RuntimeError as err:
        return (
            "refused"
            if re.search(r"already generating \(a call( through .*)? from another thread\)", str(err))
            else repr(err)
        )
    return "done"


@pytest.mark.parametrize(
    "prompts,kwargs,match",
    [
        ([], {}, "prompt_ids must be a non-empty list of prompts"),
        ("1 2 3", {}, "prompt_ids must be a non-empty list of prompts"),
        (["1 + 1 ="], {}, "prompt 0 is a string .'1 \\+ 1 ='.: pass token ids"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1, 2.5]], {}, "prompt 0 holds 2.5 .float.: token ids are integers"),
        ([[1, 500]], {}, "prompt 0 has token id 500 outside"),
        ([[1, -1]], {}, "token id -1 outside"),
        ([[1] * 40], {}, "prompt 0 has 40 tokens but max_seq_len is 32"),
        ([5, 6, 7], {}, r"prompt 0 is the token id 5: .* goes in a list of its own \(\[\[5, 6, 7\]\]\)"),
        (torch.tensor([5, 6, 7]), {}, r"prompt 0 is the token id 5: prompt_ids is a list of prompts"),
    ],
)
def test_bad_prompts_are_clear_errors(prompts, kwargs, match):
    gen = Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32)
    with pytest.raises(ValueError, match=match):
        gen.generate(prompts, SamplingParams(**kwargs))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n": 0}, r"n \(0\) must be an integer >= 1"),
        ({"temperature": -0.5}, r"temperature \(-0.5\) must be 0 \(greedy decoding\) or a finite number >= 1e-05"),
        ({"temperature": float("nan")}, r"temperature \(nan\) must be 0 .* or a finite number >= 1e-05"),
        ({"temperature": 1e-38}, r"temperature \(1e-38\) must be 0 .* >= 1e-05 \(logits divided by less overflow"),
        ({"top_p": 0.0}, r"top_p \(0.0\) must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p \(1.5\) must be in \(0, 1\]"),
        ({"top_k": -1}, r"top_k \(-1\)"),
        ({"max_new_tokens": 0}, r"max_new_tokens \(0\)"),
        ({"n": True}, r"n \(True\) must be an integer"),
        # a bool is a number to Python: False decoded greedily, True kept every token, without a word
        ({"temperature": False}, r"temperature \(False\) must be a number"),
        ({"top_p": True}, r"top_p \(True\) must be a number"),
        ({"ignore_eos": "no"}, r"ignore_eos \('no'\) must be True or False"),
        ({"stop_token_ids": 5}, r"stop_token_ids \(5\) must be a list of non-negative token ids, e\.g\. \[5\]"),
        ({"seed": 1.5}, r"seed \(1\.5\) must be an integer or None"),
    ],
)
def test_bad_sampling_params_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("temperature", -1.0, r"temperature \(-1.0\) must be 0"),  # it sampled the least likely tokens
        ("max_new_tokens", -5, r"max_new_tokens \(-5\)"),  # it handed back the slot's stale tokens
        ("n", 0, r"n \(0\) must be an integer >= 1"),  # max() of an empty sequence
        ("stop_token_ids", 5, r"stop_token_ids \(5\) must be a list"),  # 'int' object is not iterable
        ("spec", "off", r"spec \('off'\) must be a specdec.config.SpecDecodeParams"),
    ],
)
def test_sampling_params_set_after_construction_are_checked_by_the_call(field, value, match):
    """SamplingParams is a mutable dataclass, and its checks ran only at construction: a field set afterwards went
    into the engine unchecked. Each call checks its params again."""
    gen = Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32)
    params = SamplingParams(max_new_tokens=3, seed=0)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=match):
        gen.generate([[1, 2]], params)
    params = SamplingParams(max_new_tokens=3, seed=0)
    params.spec = None  # the default settings, as at construction
    assert len(gen.generate([[1, 2]], [params])[0].token_ids) == 3


def test_a_top_k_past_int64_is_off_as_any_past_the_vocabulary():
    """top_k = 2^63 passed the check and failed in the engine's admission after the prompt's forward, in torch's
    words (an overflow unpacking a long); a top-k past every vocabulary keeps every token, as one past this one's."""
    gen = Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32)
    huge, off = (gen.generate([[1, 2]], SamplingParams(max_new_tokens=4, seed=3, top_k=k)) for k in (2**63, 0))
    assert huge[0].token_ids == off[0].token_ids and huge[0].logprobs == off[0].logprobs


def test_numpy_numbers_are_taken_as_sampling_params():
    """Settings read from numpy (a config built with it) were refused as 'must be an integer >= 1' (np.int64(4)
    is one); they are taken as Python's numbers."""
    import numpy as np

    params = SamplingParams(n=np.int64(2), top_k=np.int32(5), max_new_tokens=np.int64(3), temperature=np.float32(0.5))
    assert (params.n, params.top_k, params.max_new_tokens) == (2, 5, 3) and type(params.n) is int
    assert type(params.temperature) is float and params.temperature == pytest.approx(0.5)
    # np.float64 is a float, and still numpy's (OmegaConf, which the recipes go through, refuses it)
    other = SamplingParams(top_p=np.float64(0.9), stop_token_ids=[np.int64(3)], max_new_tokens=3)
    assert type(other.top_p) is float and other.stop_token_ids == [3] and type(other.stop_token_ids[0]) is int
    gen = Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32)
    assert len(gen.generate([[1, 2]], params)) == 2
    assert SamplingParams(ignore_eos=np.bool_(True)).ignore_eos is True  # (what `array[i] > 0` gives)
    # a request's own speculation settings the same way (they were refused: "must be an integer", "True or False")
    spec = SpecDecodeParams(max_num_draft_tokens=np.int64(2), enabled=np.bool_(False))
    assert (spec.max_num_draft_tokens, spec.enabled) == (2, False) and type(spec.max_num_draft_tokens) is int


def test_sampling_params_round_trip_through_asdict():
    """`spec` None is stored as `SpecDecodeParams()`, which `asdict` makes a dict: `SamplingParams(**asdict(p))` (a
    trainer's config copy, OmegaConf's `to_container`) was refused. A dict of its fields is taken."""
    params = SamplingParams(n=2, max_new_tokens=5, seed=3, spec=SpecDecodeParams(max_num_draft_tokens=1))
    assert SamplingParams(**dataclasses.asdict(params)) == params
    assert SamplingParams(spec={"enabled": False}).spec == SpecDecodeParams(enabled=False)
    with pytest.raises(ValueError, match=r"spec has no field 'enable': SpecDecodeParams takes enabled, "):
        SamplingParams(spec={"enable": False})
    with pytest.raises(ValueError, match=r"max_num_draft_tokens \(-1\) must be an integer >= 0"):
        SamplingParams(spec={"max_num_draft_tokens": -1})


def test_a_sequence_longer_than_the_default_prefill_cap_is_generated():
    """max_prefill_tokens defaults to 16384 or max_seq_len where that is larger (a Rollout, the command line and
    TRL's adapter, which do not pass it, refused max_seq_len above 16384 in a message naming it); one set below
    max_seq_len is still refused."""
    model = make_model("qwen2")
    gen = Generator(model, max_batch_size=1, max_seq_len=20000)
    assert gen.scheduler.max_prefill_tokens == 20000
    assert Generator(model, max_batch_size=1, max_seq_len=64).scheduler.max_prefill_tokens == 16384
    out = gen.generate([list(range(1, 40))], SamplingParams(max_new_tokens=3, seed=0))
    assert len(out[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"max_prefill_tokens \(64\) must be an integer >= max_seq_len \(128\)"):
        Generator(model, max_batch_size=1, max_seq_len=128, max_prefill_tokens=64)


def test_a_draft_model_that_is_no_model_is_named_by_its_type():
    """A tokenizer passed as the draft model was refused with its whole repr (pages of special tokens)."""
    spec = SpecConfig(method="draft_model", num_speculative_tokens=2, model=["tiny-draft"])
    with pytest.raises(ValueError, match=r"^spec\.model must be a path, .* causal LM\), got a list$"):
        Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32, spec=spec)


def test_stop_ids_outside_the_vocabulary_are_refused():
    """A stop id the model cannot sample would never stop anything: the request would run to its length cap."""
    gen = Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32)
    with pytest.raises(ValueError, match=r"params\[0\]\.stop_token_ids holds 500, outside the model's vocabulary"):
        gen.generate([[1, 2]], SamplingParams(stop_token_ids=[3, 500]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_batch_size": True}, r"max_batch_size \(True\) must be a positive integer"),
        # built, it refused every prompt at the first call ("prompt 0 has 1 tokens but max_seq_len is 1")
        ({"max_seq_len": 1}, r"max_seq_len \(1\) must be >= 2: a prompt token and a completion token"),
        (
            {"max_seq_len": 64, "spec": SpecConfig(method="suffix", num_speculative_tokens=10**6)},
            r"num_speculative_tokens \(1000000\) must be below max_seq_len \(64\)",
        ),
        (
            {
                "max_seq_len": 8,
                "spec": SpecConfig(
                    method="suffix", num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto"
                ),
            },
            r"max_seq_len \(8\) is too short for the auto K policy's warm-up.* raise max_seq_len to 9",
        ),
    ],
    ids=["bool", "one-position", "huge-k", "auto-short"],
)
def test_bad_generator_arguments_are_clear_errors(kwargs, match):
    """Refused before anything is allocated (a K of a million sized the KV cache for a million drafts a row)."""
    with pytest.raises(ValueError, match=match):
        Generator(make_model("qwen2"), **kwargs)


def test_unsupported_models_are_refused_at_construction():
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*load it with"):
        Generator(model)
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4))
    with pytest.raises(ValueError, match="slot KV cache"):
        Generator(mamba)


def test_gpt_neo_local_attention_is_refused_at_construction():
    # its local layers place their window as if every row were the batch's longest: shorter rows went wrong
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    config = GPTNeoConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global",
                          "local"], 1]], max_position_embeddings=512, bos_token_id=None, eos_token_id=None)  # fmt: skip
    neo = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float64).eval()
    with pytest.raises(ValueError, match=r"GPTNeoForCausalLM .* has local attention layers .* the wrong keys"):
        Generator(neo, max_batch_size=2, max_seq_len=64)


@pytest.mark.parametrize("name", ["bloom", "falcon"])
def test_alibi_models_are_refused_by_name(name):
    # (the model's own error said "too many values to unpack (expected 2)")
    from transformers import AutoModelForCausalLM, BloomConfig, FalconConfig

    if name == "bloom":
        config = BloomConfig(vocab_size=97, hidden_size=64, n_layer=2, n_head=4)
    else:
        config = FalconConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float64).eval()
    with pytest.raises(ValueError, match=r"ForCausalLM .* uses ALiBi position biases"):
        Generator(model, max_batch_size=2, max_seq_len=32)


def test_a_model_that_fails_in_its_own_forward_is_refused_as_such():
    """A float64 mixture of experts fails in transformers' grouped_mm experts, with or without this library's cache:
    the refusal blamed the slot cache and 4D masks, and named no fix."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64).eval()
    with pytest.raises(ValueError, match=r"fails in its own forward, .* load it with experts_implementation='eager'"):
        Generator(model, max_batch_size=2, max_seq_len=32)
    model.config._experts_implementation = "eager"
    assert Generator(model, max_batch_size=2, max_seq_len=32).generate([[1, 2]], SamplingParams(max_new_tokens=2))


def rope_scaled_model(kind: str):
    """A float64 model whose rotary frequencies follow the longest position of a forward: past 48 positions."""
    from transformers import LlamaConfig, Phi3Config

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=None, eos_token_id=None)  # fmt: skip
    if kind == "longrope":  # Phi-3-128k's: short factors up to original_max_position_embeddings, long ones past it
        scaling = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
        config = Phi3Config(**common, max_position_embeddings=128, original_max_position_embeddings=48,
                            rope_scaling=scaling)  # fmt: skip
    else:
        config = LlamaConfig(**common, max_position_embeddings=48, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    return model_from_config(config)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_rope_scaled_by_the_longest_position_is_refused_past_its_unscaled_length(kind):
    """Past 48 positions every row's rotation followed the batch's longest row and the drafts verified ahead: a row's
    greedy tokens changed beside a long prompt and with speculation (the first token, for longrope). Up to it they
    are the model's own whatever the batch, the speculation and the host running ahead, which feed no position past
    max_seq_len - 1."""
    model = rope_scaled_model(kind)
    spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(ValueError, match=rf"uses rope_type '{kind}'.* Keep max_seq_len at 48 or less"):
        Generator(model, max_batch_size=2, max_seq_len=49)
    rotary = next(m for m in model.modules() if hasattr(m, "original_max_seq_len"))
    highest = []  # the highest position of each forward

    def record(module, args, kwargs):
        highest.append(int(kwargs.get("position_ids", args[1] if len(args) > 1 else None).max()))

    handle = rotary.register_forward_pre_hook(record, with_kwargs=True)
    prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0, max_new_tokens=40)
    try:
        plain = Generator(model, max_batch_size=2, max_seq_len=48).generate([prompt], greedy)[0].token_ids
        for options in ({"spec": spec}, {"spec": spec, "async_scheduling": True}, {"async_scheduling": True}):
            drafted = Generator(model, max_batch_size=2, max_seq_len=48, **options).generate([prompt], greedy)
            assert drafted[0].token_ids == plain, options
        beside = Generator(model, max_batch_size=2, max_seq_len=48).generate([prompt, list(range(1, 40))], greedy)
    finally:
        handle.remove()
    assert len(plain) == 40 and beside[0].token_ids == plain
    assert max(highest) == 47  # the bound is reached, and not passed


def test_a_model_whose_layers_keep_the_keywords_to_themselves_runs_on_slots_and_says_why():
    from transformers import AutoModelForCausalLM, StableLmConfig

    config = StableLmConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64).eval()
    with pytest.warns(UserWarning, match=r"runs on the slot KV cache: its attention layers do not pass the forward's"):
        assert Generator(model, max_batch_size=2, max_seq_len=32, kv_layout="paged").runner.kv_layout == "slots"


def test_a_learned_position_table_shorter_than_max_seq_len_is_refused_at_construction():
    """GPT-2's `wpe` holds `n_positions` positions: a longer sequence would index outside it mid-call (the target's
    or a draft model's table); up to it, rows run to the length cap."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=None)
    gpt2 = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64).eval()
    with pytest.raises(ValueError, match=r"learned position table of 16 positions \(transformer.wpe\), fewer than ma"):
        Generator(gpt2, max_batch_size=2, max_seq_len=64)
    spec = SpecConfig(method="draft_model", model=gpt2, num_speculative_tokens=3)
    with pytest.raises(ValueError, match=r"the draft model \(GPT2LMHeadModel\) has a learned position table of 16"):
        Generator(make_model("llama", vocab_size=97), max_batch_size=2, max_seq_len=64, spec=spec)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=0)
    outs = Generator(gpt2, max_batch_size=2, max_seq_len=16, spec=spec).generate([[5, 6, 7], [8, 9]], params)
    assert [len(o.token_ids) for o in outs] == [13, 14]  # to the cap, never outside the table
    # a vision tower's patch positions are not the language model's: not the reason a model is refused
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299)
    multimodal = Gemma3ForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    with pytest.raises(ValueError) as refused:
        Generator(multimodal, max_batch_size=2, max_seq_len=64)
    assert "position table" not in str(refused.value)


@pytest.mark.parametrize("kv_layout", ["paged", "slots"])
def test_close_frees_the_caches_while_the_generator_is_still_referenced(kv_layout):
    """A trainer rebuilding its generator plans the next one from the memory the old one held: `close()` gives the
    KV caches back (the target's and a draft model's) even while something still refers to the generator, keeps the
    drafting history readable, and refuses calls after it."""
    import weakref

    spec = SpecConfig(method=["suffix", "draft_model"], num_speculative_tokens=2, model=make_model("qwen2", seed=4))
    gen = Generator(make_model("llama"), max_batch_size=4, max_seq_len=32, kv_layout=kv_layout, spec=spec)
    gen.generate(random_prompts(2, seed=3), SamplingParams(n=2, max_new_tokens=6, seed=0))
    caches = [weakref.ref(runner.cache) for runner in gen._runners()]
    assert len(caches) == 2 and all(cache() is not None for cache in caches)
    gen.close()
    assert [cache() for cache in caches] == [None, None]
    assert gen.draft_history.stats()["responses"] == 4
    with pytest.raises(RuntimeError, match="this Generator was closed"):
        gen.generate(random_prompts(1, seed=1), SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="this Generator was closed"):
        gen.step()
    for call in (gen.snapshot, lambda: gen.restore([])):
        with pytest.raises(RuntimeError, match="this Generator was closed"):
            call()
    gen.close()  # twice: nothing more to free
    gen.abort()


def test_a_dropped_generator_that_drafts_from_a_history_is_freed_without_the_garbage_collector():
    """Its drafting history held the generator's bound method (a guard for its calls): a cycle, so a trainer that
    rebuilt its generator kept the old one's caches until the garbage collector ran (RSS grew 160 MB over 30 rebuilds
    of a tiny model); plain decoding and the other proposers were freed at once."""
    import gc
    import weakref

    model = make_model("llama")
    spec = SpecConfig(method="suffix", num_speculative_tokens=2)
    Generator(model, max_batch_size=2, max_seq_len=32, spec=spec).generate([[1, 2]], SamplingParams(max_new_tokens=4))
    gc.collect()  # (the kernels' first compilation leaves cycles of its own: gone before the check)
    gc.disable()
    try:
        gen = Generator(model, max_batch_size=2, max_seq_len=32, spec=spec)
        gen.generate([[1, 2]], SamplingParams(max_new_tokens=4, seed=0))
        history, freed = gen.draft_history, weakref.ref(gen)
        del gen
        assert freed() is None
    finally:
        gc.enable()
    assert history.stats()["responses"] == 1  # a history kept past its generator still answers


def test_a_generator_or_rollout_refuses_pickling_and_copying_in_one_line():
    """Pickled or deep-copied, a generator failed deep inside ("cannot pickle '_thread.lock' object", or 'module'
    with a suffix history, after 11-21 frames of copy's), naming neither the object nor what to do instead."""
    import copy
    import pickle

    from rollout.loop import Rollout
    from rollout.models.zoo import load_model

    gen = Generator(make_model("llama"), max_batch_size=2, max_seq_len=32)
    model, tokenizer = load_model("tiny-target")
    rollout = Rollout(model, tokenizer, max_batch_size=2, max_seq_len=64)
    for obj, name in ((gen, "a Generator"), (rollout, "a Rollout")):
        for act in (pickle.dumps, copy.deepcopy, copy.copy):
            with pytest.raises(TypeError, match=f"^{name} cannot be pickled or copied: .* build .* there$"):
                act(obj)


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_a_snapshot_is_not_restored_over_rows_that_finished_or_were_admitted_since(layout):
    """A helper's probe: a row that finished since the snapshot was put back and handed back twice (on the paged
    layout with wrong tokens: its blocks were free again, and suffix drafting failed an assertion), and rows admitted
    since the snapshot were dropped unfinished. Both are refused now, changing nothing."""
    model = make_model("llama")
    params = SamplingParams(n=3, max_new_tokens=10, seed=3, ignore_eos=True)
    gen = Generator(model, max_batch_size=8, max_seq_len=48, kv_layout=layout)
    gen.add_requests([[5, 9, 13, 2]], params)
    gen.step(), gen.step()  # a prefill, one decode
    gen.add_requests([[60, 61, 62]], params, keep_in_flight=True)  # queued: the next step admits it
    snap = gen.snapshot()
    gen.step()
    with pytest.raises(ValueError, match="3 rows in flight were admitted after this snapshot"):
        gen.restore(snap)
    done = []
    while gen.has_unfinished:
        done += gen.step().finished
    assert sorted((c.prompt_index, c.sample_index) for c in done) == [(p, s) for p in (0, 1) for s in range(3)]
    alone = Generator(model, max_batch_size=8, max_seq_len=48, kv_layout=layout).generate([[60, 61, 62]], params)
    assert [c.token_ids for c in sorted(done, key=lambda c: c.sample_index) if c.prompt_index == 1] == [
        o.token_ids for o in alone
    ]

    short = SamplingParams(n=1, max_new_tokens=3, seed=4, ignore_eos=True)
    gen.add_requests([[7, 8]], short)
    gen.step()  # the prefill: its first token
    snap = gen.snapshot()
    finished = []
    while gen.has_unfinished:
        finished += gen.step().finished
    with pytest.raises(ValueError, match="row 0 no longer holds the sequence this snapshot saw"):
        gen.restore(snap)
    assert len(finished) == 1 and not gen.has_unfinished
    with pytest.raises(ValueError, match="restore takes a list that snapshot"):
        gen.restore(None)


def test_a_snapshot_is_not_restored_over_a_row_preempted_and_admitted_again_since():
    """From a helper's probe: a row of the snapshot's prefix that a full pool preempted after the snapshot, and that
    was admitted again into the same row, passed the restore's checks (the same sequence there): the restore set it
    back to the snapshot's length over tokens and KV it no longer held, and its sample came back wrong from its second
    token, without a word. Refused now, changing nothing; and an empty snapshot with rows in flight (it cannot say
    which rows came since) is refused too, where it dropped every row."""
    model = make_model("llama")
    prompts = [[5, 9], [60, 61], [11, 12], [40, 41]]
    params = [SamplingParams(n=1, max_new_tokens=m, seed=7, ignore_eos=True) for m in (120, 3, 70, 120)]
    gen = Generator(model, max_batch_size=8, max_seq_len=128, kv_layout="paged", kv_pool_blocks=12)
    gen.add_requests(prompts, params)
    done = []
    for _ in range(10):
        done += gen.step().finished
    snap = gen.snapshot()
    assert [saved.sequence.prompt_index for saved in snap] == [0, 3, 2]  # prompt 1 finished; 3 moved into its row
    again = None
    while gen.has_unfinished and again is None:
        done += gen.step().finished
        seq = gen.slots.sequences[1]
        if seq is snap[1].sequence and seq.admitted_at >= snap[1].num_admitted:  # preempted, admitted again
            again = int(gen.slots.num_tokens[1])
    assert again is not None and again < snap[1].num_tokens, "no preemption and re-admission: nothing was tested"
    with pytest.raises(ValueError, match="^row 1's sample was preempted and admitted again after this snapshot"):
        gen.restore(snap[:2])
    assert int(gen.slots.num_tokens[1]) == again  # nothing changed
    with pytest.raises(ValueError, match=r"^an empty snapshot \(or prefix\) would drop all 2 rows in flight"):
        gen.restore(snap[:0])
    while gen.has_unfinished:
        done += gen.step().finished
    alone = Generator(model, max_batch_size=8, max_seq_len=128, kv_layout="slots").generate(prompts, params)
    assert sorted((c.prompt_index, c.token_ids) for c in done) == [(i, alone[i].token_ids) for i in range(4)]
    # a row that finished and another sample admitted into it since: named as such (a review found it named as
    # preempted and admitted again)
    one = Generator(model, max_batch_size=1, max_seq_len=48)
    one.add_requests([[5, 9]], SamplingParams(n=1, max_new_tokens=2, seed=1, ignore_eos=True))
    one.step()
    snap = one.snapshot()
    one.add_requests([[7, 8]], SamplingParams(n=1, max_new_tokens=4, seed=1, ignore_eos=True), keep_in_flight=True)
    while one.slots.sequences[0] is snap[0].sequence or one.num_active == 0:
        one.step()
    with pytest.raises(ValueError, match="^row 0 no longer holds the sequence this snapshot saw there"):
        one.restore(snap)


def test_params_changed_after_a_request_was_added_leave_it_as_it_was_added():
    """A serving loop that reuses one params object: a request still queued took the fields set after it was added
    (and unchecked: `check` had run at adding)."""
    model = make_model("llama")
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    gen = Generator(model, max_batch_size=1, max_seq_len=48)
    gen.add_requests([[5, 6, 7]], params)
    gen.add_requests([[8, 9, 10]], params, keep_in_flight=True)  # waits for the one slot
    params.temperature, params.top_k = 1.0, 3
    done = []
    while gen.has_unfinished:
        done += gen.step().finished
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    alone = Generator(model, max_batch_size=1, max_seq_len=48).generate([[8, 9, 10]], greedy)[0].token_ids
    assert next(c.token_ids for c in done if c.prompt_index == 1) == alone
    with pytest.raises(ValueError, match=r"keep_in_flight \('yes'\) must be True or False"):
        gen.add_requests([[5]], greedy, keep_in_flight="yes")


def test_generator_restores_training_mode_and_uses_current_weights():
    model = make_model("qwen2")
    model.train()
    gen = Generator(model, max_batch_size=2, max_seq_len=32)
    prompts = random_prompts(2, seed=12)
    before = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    assert model.training
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # a "training step": the next call must see the new weights
    after = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    assert [o.token_ids for o in after] == [hf_greedy(model.eval(), p, 6) for p in prompts]
    assert [o.token_ids for o in before] != [o.token_ids for o in after]


def test_a_model_in_train_mode_with_gradient_checkpointing_is_served():
    # TRL's defaults: the policy sits in train mode with gradient checkpointing, which turns the cache off there
    model = make_model("llama")
    model.gradient_checkpointing_enable()
    model.train()
    gen = Generator(model, max_batch_size=2, max_seq_len=32)
    prompts = random_prompts(2, seed=13)
    outs = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    assert model.training
    assert [o.token_ids for o in outs] == [hf_greedy(model.eval(), p, 6) for p in prompts]


def test_on_step_reports_every_step_and_the_finished_count():
    model = make_model("llama", "sdpa", torch.float32, eos_token_id=3)
    gen = Generator(model, max_batch_size=3, max_seq_len=48)
    calls = []
    outs = gen.generate(
        random_prompts(5, min_len=4, max_len=9, seed=1),
        SamplingParams(n=2, max_new_tokens=12, seed=0),
        on_step=lambda record, done, total: calls.append((record, done, total)),
    )
    assert [c[0] for c in calls] == gen.last_trace
    assert all(total == len(outs) == 10 for _, _, total in calls)
    done = [c[1] for c in calls]
    assert done == sorted(done) and done[-1] == 10 and done[0] < 10


def test_the_kv_cache_is_planned_before_it_is_allocated():
    model = make_model("qwen2", dtype=torch.float32)
    gen = Generator(model, max_batch_size=3, max_seq_len=20)
    gen.generate(random_prompts(2, seed=4), SamplingParams(temperature=0, max_new_tokens=3))
    allocated = sum(layer.keys.nbytes + layer.values.nbytes for layer in gen.runner.cache.layers)
    assert gen.kv_cache_bytes == allocated
    with pytest.raises(
        ValueError, match=r"the KV cache needs .* GiB \(10000000 slots .* largest max_batch_size that fits is \d+"
    ):
        Generator(model, max_batch_size=10**7, max_seq_len=2000)


def test_a_draft_model_named_by_path_loads_with_the_attention_transformers_picks_for_it(tmp_path):
    """From a helper's probe: a draft named by path was loaded with sdpa forced, so an eager-only model (Gemma2 here)
    could not draft by path, though it could as a target or as a loaded draft; and a model this library refuses
    (ALiBi) was refused in transformers' words about sdpa instead of its own line."""
    from transformers import BloomConfig, Gemma2Config

    from specdec.config import SpecConfig

    target = make_model("llama")
    config = Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model_from_config(config, attn="eager").save_pretrained(tmp_path / "gemma2")
    prompts, params = random_prompts(3, seed=4), SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)
    spec = SpecConfig(method="draft_model", model=str(tmp_path / "gemma2"), num_speculative_tokens=3)
    drafted = Generator(target, max_batch_size=6, max_seq_len=40, spec=spec)
    assert drafted.proposers.proposers["draft_model"].runner.model.config._attn_implementation == "eager"
    plain = Generator(target, max_batch_size=6, max_seq_len=40).generate(prompts, params)
    assert [o.token_ids for o in drafted.generate(prompts, params)] == [o.token_ids for o in plain]
    bloom = BloomConfig(vocab_size=97, hidden_size=32, n_layer=1, n_head=2)
    model_from_config(bloom, attn="eager").save_pretrained(tmp_path / "bloom")
    with pytest.raises(ValueError, match=r"^BloomForCausalLM \(model_type='bloom'\) uses ALiBi position biases"):
        Generator(
            target,
            max_batch_size=2,
            max_seq_len=40,
            spec=SpecConfig(method="draft_model", model=str(tmp_path / "bloom")),
        )


def test_a_draft_model_named_by_path_is_planned_from_its_config(tmp_path, monkeypatch):
    import rollout.engine.memory_plan as memory_plan
    from rollout.engine.memory_plan import check_kv_cache_fits, fitting_batch_size
    from specdec.config import SpecConfig

    target = make_model("qwen2", dtype=torch.float32)
    make_model("llama", dtype=torch.float32, num_hidden_layers=1, seed=1).save_pretrained(tmp_path / "draft")
    spec = SpecConfig(method="draft_model", model=str(tmp_path / "draft"), num_speculative_tokens=2)
    gen = Generator(target, max_batch_size=3, max_seq_len=20, spec=spec)
    gen.generate(random_prompts(2, seed=4), SamplingParams(temperature=0, max_new_tokens=3))
    draft_cache = gen.proposers.proposers["draft_model"].runner.cache
    caches = [gen.runner.cache, draft_cache]
    allocated = sum(layer.keys.nbytes + layer.values.nbytes for cache in caches for layer in cache.layers)
    assert all(layer.is_initialized for layer in draft_cache.layers)
    assert gen.kv_cache_bytes == allocated
    # the largest size that fits is accepted, one more slot is refused; a small wish is kept as is (the free memory
    # held still: other processes change the machine's between two reads)
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 3 * 2**30)
    fits = fitting_batch_size(target, spec, 2000, 10**9)
    assert 1 <= fits < 10**9
    assert check_kv_cache_fits(target, spec, fits, 2000) > 0
    with pytest.raises(ValueError, match=f"largest max_batch_size that fits is {fits};"):
        check_kv_cache_fits(target, spec, fits + 1, 2000)
    assert fitting_batch_size(target, spec, 20, 5) == 5
    # not one slot fits: the length is what to lower, and how long one slot may be
    too_long = 100 * 3 * 2**30 * 2000 // check_kv_cache_fits(target, spec, 1, 2000)
    with pytest.raises(ValueError, match=r"not one slot fits; lower max_seq_len \(at most \d+ fit one slot\)") as e:
        check_kv_cache_fits(target, spec, 4, too_long)
    fitting = int(str(e.value).split("at most ")[1].split()[0])
    assert check_kv_cache_fits(target, spec, 1, fitting) > 0
    with pytest.raises(ValueError):
        check_kv_cache_fits(target, spec, 1, fitting + 1)
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 2**10)  # not even a step's positions
    with pytest.raises(
        ValueError, match=r"not one slot fits, whatever max_seq_len: a step's positions alone take more"
    ):
        check_kv_cache_fits(target, spec, 1, 2000)


@pytest.mark.parametrize(
    "src,dst",
    [
        ([4, 4, 4, 5, 5, 6], [4, 5, 6, 7, 8, 9]),  # prompts fanned out to their samples, sources among destinations
        ([9, 8, 5], [1, 2, 3]),  # rows packed into holes
        ([6, 7, 8, 2], [0, 1, 2, 3]),  # consecutive sources, and one that is a destination of the same call
        ([3], [3]),
    ],
    ids=["fan-out", "pack", "blocks", "self"],
)
def test_copy_rows_reads_every_source_before_writing(src, dst):
    from rollout.engine.kv_cache import SlotKVCache

    cache = SlotKVCache(num_layers=2, num_slots=10, num_positions=6)
    generator = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        states = torch.randn(10, 2, 7, 3, generator=generator)
        layer.lazy_initialization(states, states)
        layer.keys.copy_(states)
        layer.values.copy_(-states)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    cache.copy_rows(torch.tensor(src), torch.tensor(dst), num_positions=4)
    for (keys, values), layer in zip(before, cache.layers):
        for old, new in ((keys, layer.keys), (values, layer.values)):
            expected = old.clone()
            expected[dst, :, :4] = old[src, :, :4]  # every source as it was before the call
            assert torch.equal(new, expected)


def test_a_chain_mask_is_the_general_mask_with_causal_ancestors():
    """The chain shortcut of `build_attention_mask` (one compare) equals the general builder given the causal
    ancestor relation, for decode blocks after ragged prefixes and for a left-padded prefill."""
    from rollout.engine.attention_mask import build_attention_mask

    generator = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 20, (7,), generator=generator)
    num_inputs = torch.randint(1, 6, (7,), generator=generator)
    offsets = torch.arange(5)
    valid = offsets[None, :] < num_inputs[:, None]
    decode = (lens, torch.where(valid, lens[:, None] + offsets, 30), valid, int((lens + num_inputs).max()))
    prompt_lens = torch.tensor([5, 2, 1])
    pad = 5 - prompt_lens
    valid = offsets[None, :] >= pad[:, None]
    prefill = (torch.zeros(3, dtype=torch.long), torch.where(valid, offsets - pad[:, None], 30), valid, 5)
    for prefix, write_positions, valid, kv_len in (decode, prefill):
        positions = torch.where(valid, write_positions, 0)
        causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(len(prefix), -1, -1)
        general = build_attention_mask(prefix, write_positions, valid, positions, kv_len, causal)
        assert torch.equal(build_attention_mask(prefix, write_positions, valid, positions, kv_len), general)


def test_the_public_engine_steps_outside_inference_mode_after_a_generate_call():
    model = make_model("llama")
    prompts = random_prompts(3, seed=12)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    gen = Generator(model, max_batch_size=4, max_seq_len=32)
    expected = [o.token_ids for o in gen.generate(prompts, params)]  # its state tensors now came from inference mode
    sequences = gen.add_requests(prompts, params)
    while gen.has_unfinished:
        out = gen.step()
        gen.restore(gen.snapshot())
    assert out.record.kind == "decode"
    assert [s.completion().token_ids for s in sequences] == expected
