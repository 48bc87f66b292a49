"""The veRL backend (`rollout.integrations.verl`) without a cluster, on the shipped tiny models.

The serving engine, the sampling-parameter mapping and the weight copy need no veRL and run everywhere; the server
actor, the trainer-side adapter and the registration need veRL 0.9.1 (`pip install '.[verl]'`) and skip without it.
The end-to-end `main_ppo` run is `tests/verl_e2e/` (`scripts/verl_e2e.sh`).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from rollout.engine.sampling import SamplingParams
from rollout.integrations.verl import EngineOptions, RequestLimits, ServingEngine, sampling_params_from_verl
from rollout.integrations.verl.engine import ABORTED
from rollout.integrations.verl.params import spec_config_from_dict
from rollout.models.zoo import load_model, model_path
from rollout.tasks import format_prompt, generate_problems
from specdec.config import SpecConfig

LIMITS = RequestLimits(prompt_length=160, response_length=48, max_model_len=208)


def prompts_of(tokenizer, num: int, seed: int = 0) -> list[list[int]]:
    return [tokenizer(format_prompt(p.problem))["input_ids"] for p in generate_problems(num, split="eval", seed=seed)]


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose weights are far from the model's (what veRL's `load_format=dummy` starts from)."""
    copied = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in copied.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype).to(param.device) * 0.5)
    return copied


def run_all(engine: ServingEngine, requests: list[tuple[list[int], SamplingParams]]):
    """Submit every request concurrently, as veRL's agent loop does, and wait for all."""

    async def main():
        return await asyncio.gather(*[engine.generate(ids, params) for ids, params in requests])

    return asyncio.run(main())


def wait_until_in_flight(engine: ServingEngine) -> None:
    """Until the engine's generator has rows in flight (30 s at most)."""
    deadline = time.monotonic() + 30
    while (engine.generator is None or engine.generator.num_active == 0) and time.monotonic() < deadline:
        time.sleep(0.001)


def verl_params(sampling_params: dict, prompt_ids: list[int]) -> SamplingParams:
    return sampling_params_from_verl(sampling_params, len(prompt_ids), LIMITS)[0]


@pytest.fixture(scope="module")
def tiny64():
    return load_model("tiny-target", torch.float64)


@pytest.fixture(scope="module")
def tiny32():
    return load_model("tiny-target", torch.float32)


def test_update_weights_then_greedy_equals_model_generate(tiny64):
    model, tokenizer = tiny64
    prompts = prompts_of(tokenizer, 6)
    engine = ServingEngine(perturbed(model), max_batch_size=4, max_seq_len=LIMITS.max_model_len)  # 6 requests, 4 slots
    try:
        greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True}
        requests = [(ids, verl_params(greedy, ids)) for ids in prompts]
        before = run_all(engine, requests)
        copied = engine.update_weights(model.state_dict().items(), strict=True)
        after = run_all(engine, requests)
    finally:
        engine.close()
    assert copied == len(model.state_dict())
    num_new = LIMITS.response_length
    expected = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=num_new, do_sample=False, pad_token_id=1)
        expected.append(out[0, len(ids) :].tolist())
    assert [c.token_ids for c in after] == expected
    assert [c.token_ids for c in before] != expected  # the perturbed weights were in use until the update
    for completion in after:
        assert completion.finish_reason == ("stop" if completion.token_ids[-1] == 0 else "length")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_weights_land_under_captured_graphs_and_sleep_gives_the_memory_back():
    """The paged cache and CUDA graphs: weights copied in place after the graphs were captured are what the replayed
    steps compute with; sleep (the server also moves the weights to the CPU) frees the cache and graphs, and after
    waking up with the weights moved back the graphs captured anew give the same tokens."""
    model, tokenizer = load_model("tiny-target", torch.float32, device="cuda")
    prompts = prompts_of(tokenizer, 6)
    engine = ServingEngine(perturbed(model), max_batch_size=8, max_seq_len=LIMITS.max_model_len)
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    requests = [(ids, verl_params(greedy, ids)) for ids in prompts]
    try:
        before = run_all(engine, requests)
        assert engine.generator.runner.paged and engine.generator.graph_runners  # captured with the old weights
        engine.update_weights(model.state_dict().items(), strict=True)
        after = run_all(engine, requests)
        torch.cuda.synchronize()
        generating = torch.cuda.memory_allocated()
        engine.sleep()
        engine.model.to("cpu")
        torch.cuda.empty_cache()
        asleep = torch.cuda.memory_allocated()
        engine.model.to("cuda")
        engine.wake_up()
        again = run_all(engine, requests)
    finally:
        engine.close()
    expected = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=LIMITS.response_length, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    assert [c.token_ids for c in after] == expected
    assert [c.token_ids for c in before] != expected
    assert [c.token_ids for c in again] == expected
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(
        f"GPU memory: {generating / 2**20:.1f} MiB generating, {asleep / 2**20:.1f} MiB asleep (the test's own "
        f"reference model, {weights / 2**20:.1f} MiB, stays on the GPU in both)"
    )
    assert asleep < generating - weights  # the engine's weights and more (its KV cache, graphs) left the GPU


def test_update_weights_refuses_unknown_names_and_shapes(tiny32):
    model, _ = tiny32
    engine = ServingEngine(copy.deepcopy(model), max_batch_size=2, max_seq_len=64)
    try:
        with pytest.raises(ValueError, match="does not have"):
            engine.update_weights([("model.not_a_layer.weight", torch.zeros(3))])
        name, tensor = next(iter(model.state_dict().items()))
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights([(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]))])
        with pytest.raises(ValueError, match="unset"):
            engine.update_weights([(name, tensor)], strict=True)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(method="suffix", num_speculative_tokens=4),
        SpecConfig(method="ngram", num_speculative_tokens=3),
        SpecConfig(method="draft_model", model="tiny-draft", num_speculative_tokens=3),
    ],
    ids=["suffix", "ngram", "draft_model"],
)
def test_sampling_with_speculation_equals_plain_sampling(tiny32, spec):
    """Pathwise exactness behind veRL's interface: the same seed and arrival order give the same tokens with and
    without drafts (four samples per prompt, as a GRPO group arrives)."""
    model, tokenizer = tiny32
    prompts = prompts_of(tokenizer, 4, seed=1)
    sampled = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    requests = [(ids, verl_params(sampled, ids)) for ids in prompts for _ in range(4)]
    results = {}
    for name, config in (("plain", None), ("spec", spec)):
        engine = ServingEngine(model, max_batch_size=8, max_seq_len=LIMITS.max_model_len, spec=config, seed=123)
        try:
            results[name] = run_all(engine, requests)
            if name == "spec":
                drafted = engine.totals["num_drafted"]
        finally:
            engine.close()
    assert [c.token_ids for c in results["spec"]] == [c.token_ids for c in results["plain"]]
    for plain, spec_out in zip(results["plain"], results["spec"]):
        assert spec_out.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert drafted > 0  # speculation really ran
    groups = [tuple(c.token_ids) for c in results["plain"]]
    assert len(set(groups)) > len(prompts)  # a group's samples are not copies of each other


@pytest.mark.parametrize("settings", [{"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 0}])
def test_logprobs_equal_a_teacher_forced_forward(tiny32, settings):
    model, tokenizer = tiny32
    prompts = prompts_of(tokenizer, 3, seed=2)
    engine = ServingEngine(model, max_batch_size=4, max_seq_len=LIMITS.max_model_len, seed=5)
    try:
        params = {"top_k": -1, "top_p": 1.0, "logprobs": True, **settings}
        outs = run_all(engine, [(ids, verl_params(params, ids)) for ids in prompts])
    finally:
        engine.close()
    temperature = settings["temperature"] or 1.0  # greedy: the model's plain log-softmax
    for ids, completion in zip(prompts, outs):
        sequence = torch.tensor([ids + completion.token_ids])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(ids) - 1 : -1].double() / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        assert len(completion.logprobs) == len(completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs, dtype=torch.float64), expected, atol=1e-4)


def test_a_request_joins_the_batch_in_flight(tiny64):
    """Continuous batching: a short request sent while a long one decodes finishes first, with the tokens it gets
    alone."""
    model, tokenizer = tiny64
    long_prompt, short_prompt = prompts_of(tokenizer, 2, seed=3)
    long_params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    short_params = SamplingParams(temperature=0, max_new_tokens=3)
    engine = ServingEngine(model, max_batch_size=4, max_seq_len=LIMITS.max_model_len)
    try:
        long_future = engine.submit(long_prompt, long_params)
        wait_until_in_flight(engine)
        short_future = engine.submit(short_prompt, short_params)
        short = short_future.result(timeout=60)
        assert not long_future.done()  # the short one did not wait for the long one
        long = long_future.result(timeout=60)
        alone = run_all(engine, [(short_prompt, short_params)])[0]
    finally:
        engine.close()
    assert len(long.token_ids) == 40 and long.finish_reason == "length"
    assert short.token_ids == alone.token_ids


def test_sleep_frees_the_cache_keeps_the_history_and_holds_requests(tiny32):
    model, tokenizer = tiny32
    prompts = prompts_of(tokenizer, 2, seed=4)
    spec = SpecConfig(method="suffix", num_speculative_tokens=4)
    engine = ServingEngine(model, max_batch_size=4, max_seq_len=LIMITS.max_model_len, spec=spec, seed=0)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=32)
        run_all(engine, [(ids, params) for ids in prompts])
        responses = len(engine.generator.draft_history.history)
        engine.sleep()
        assert engine.generator is None  # KV cache (and graphs) gone
        held = engine.submit(prompts[0], params)
        time.sleep(0.2)
        assert not held.done()  # asleep: the request waits
        engine.wake_up()
        assert engine.generator is not None
        assert len(engine.generator.draft_history.history) == responses > 0
        assert held.result(timeout=60).finish_reason in ("stop", "length")
    finally:
        engine.close()


def test_a_history_kept_over_a_sleep_drafts_as_if_the_engine_never_slept(tiny32):
    """The tries move to the woken generator as they are (no save and rebuild, seconds for a large history): an
    engine that slept between two calls drafts the second exactly as one that did not."""
    model, tokenizer = tiny32
    prompts = prompts_of(tokenizer, 3, seed=5)
    spec = SpecConfig(method="suffix", num_speculative_tokens=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=3)
    traces = []
    for slept in (False, True):
        engine = ServingEngine(model, max_batch_size=4, max_seq_len=LIMITS.max_model_len, spec=spec, seed=0)
        try:
            run_all(engine, [(ids, params) for ids in prompts])
            if slept:
                kept = engine.generator.draft_history
                engine.sleep()
                engine.wake_up()
                assert engine.generator.draft_history is not kept and kept.stats()["responses"] == 0  # moved over
            stats = engine.generator.draft_history.stats()
            before = dict(engine.totals)
            second = run_all(engine, [(ids, params) for ids in prompts])
            drafting = {key: engine.totals[key] - before[key] for key in ("steps", "num_drafted", "num_accepted")}
            traces.append((stats, [c.token_ids for c in second], drafting))
        finally:
            engine.close()
    assert traces[0] == traces[1] and traces[0][0]["responses"] == 3
    assert traces[0][2]["num_drafted"] > 0  # (the second call drafted from the history)


def test_abort_all_answers_aborted_and_resume_serves_again(tiny32):
    model, tokenizer = tiny32
    prompt = prompts_of(tokenizer, 1, seed=5)[0]
    engine = ServingEngine(model, max_batch_size=2, max_seq_len=LIMITS.max_model_len)
    try:
        long = SamplingParams(max_new_tokens=LIMITS.max_model_len - len(prompt), ignore_eos=True)
        futures = [engine.submit(prompt, long) for _ in range(4)]  # two in flight, two queued
        wait_until_in_flight(engine)
        assert engine.abort_all() == 4
        aborted = [f.result(timeout=10) for f in futures]
        assert all(c.finish_reason == ABORTED and c.token_ids == [] for c in aborted)
        held = engine.submit(prompt, SamplingParams(max_new_tokens=4))
        time.sleep(0.2)
        assert not held.done()  # paused until resume
        engine.resume()
        assert len(held.result(timeout=60).token_ids) <= 4
        engine.abort_all(reject=True)
        assert engine.submit(prompt, SamplingParams(max_new_tokens=4)).result(timeout=10).finish_reason == ABORTED
    finally:
        engine.close()


def test_a_bad_request_fails_alone(tiny32):
    model, tokenizer = tiny32
    prompt = prompts_of(tokenizer, 1)[0]
    engine = ServingEngine(model, max_batch_size=2, max_seq_len=LIMITS.max_model_len)
    try:
        bad = engine.submit([10_000], SamplingParams(max_new_tokens=4))
        good = engine.submit(prompt, SamplingParams(max_new_tokens=4))
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            bad.result(timeout=60)
        assert len(good.result(timeout=60).token_ids) <= 4
    finally:
        engine.close()


def test_a_caller_that_gives_up_on_its_request_leaves_the_others_served(tiny32):
    # asyncio.wait_for cancels the future of a request it timed out: resolving it later must not fail the requests
    # that finish with it, nor stop abort_all halfway
    model, tokenizer = tiny32
    prompts = prompts_of(tokenizer, 3, seed=6)
    engine = ServingEngine(model, max_batch_size=2, max_seq_len=LIMITS.max_model_len)
    try:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        given_up = engine.submit(prompts[0], params)
        kept = engine.submit(prompts[1], params)
        assert given_up.cancel()
        assert len(kept.result(timeout=60).token_ids) == 8  # it finishes in the step that finishes the cancelled one
        long = SamplingParams(max_new_tokens=LIMITS.max_model_len - max(map(len, prompts)), ignore_eos=True)
        futures = [engine.submit(prompt, long) for prompt in prompts]
        assert futures[0].cancel()
        assert engine.abort_all() == 3
        assert all(f.result(timeout=10).finish_reason == ABORTED for f in futures[1:])
    finally:
        engine.close()


def test_a_request_its_caller_cancelled_leaves_its_row_at_the_next_step(tiny32):
    """A cancelled request (`asyncio.wait_for`'s timeout cancels the future) ran on to its last token, holding its row
    (and blocks) from the requests queued behind it. The next step drops it; the others sample as they would have."""
    model, tokenizer = tiny32
    prompts = prompts_of(tokenizer, 3, seed=7)
    long = SamplingParams(
        temperature=1.0, max_new_tokens=LIMITS.max_model_len - max(map(len, prompts)), ignore_eos=True
    )
    requests = [(prompt, replace(long, seed=i)) for i, prompt in enumerate(prompts)]
    expected = [c.token_ids for c in run_all(ServingEngine(model, max_batch_size=3, max_seq_len=208), requests)]
    engine = ServingEngine(model, max_batch_size=2, max_seq_len=LIMITS.max_model_len)
    try:
        futures = [engine.submit(ids, params) for ids, params in requests]  # two in flight, one queued
        wait_until_in_flight(engine)
        assert futures[0].cancel()
        assert [f.result(timeout=120).token_ids for f in futures[1:]] == expected[1:]
        assert engine.wait_idle(timeout=10) and engine.num_in_flight == 0
        # the cancelled one emitted a few tokens of its max_new_tokens, then its row went to the queued request
        assert engine.totals["num_emitted"] < len(expected[1]) + len(expected[2]) + long.max_new_tokens // 2
        assert engine.generator.num_active == 0 and not engine.generator.has_unfinished
    finally:
        engine.close()


def test_a_request_cancelled_before_the_engine_takes_it_moves_no_other_requests_stream(tiny32):
    """From a helper's probe: a request without a seed took its arrival index only when the engine's thread queued it,
    so one its caller cancelled before that took none, and every later request sampled from the next one's stream
    (other samples for the same requests in the same order, by timing). The index is given at submission now."""
    model, tokenizer = tiny32
    prompts = prompts_of(tokenizer, 2, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    requests = [(prompts[0], params)] * 4 + [(prompts[1], params)]  # a group of 4 and one more, no seeds

    def run(cancelled: int | None) -> list:
        engine = ServingEngine(model, max_batch_size=8, max_seq_len=LIMITS.max_model_len, seed=0)
        try:
            engine.sleep()  # submitted requests wait: the cancel comes before the engine takes them
            futures = [engine.submit(ids, p) for ids, p in requests]
            if cancelled is not None:
                assert futures[cancelled].cancel()
            engine.wake_up()
            return [None if f.cancelled() else f.result(timeout=120).token_ids for f in futures]
        finally:
            engine.close()

    expected = run(None)
    for cancelled in (0, 1):
        got = run(cancelled)
        assert got[cancelled] is None
        assert [t for i, t in enumerate(got) if i != cancelled] == [t for i, t in enumerate(expected) if i != cancelled]


def test_close_fails_the_requests_it_leaves_unfinished_and_closes_the_generator(tiny32):
    model, tokenizer = tiny32
    prompt = prompts_of(tokenizer, 1, seed=5)[0]
    engine = ServingEngine(model, max_batch_size=2, max_seq_len=LIMITS.max_model_len)
    long = SamplingParams(max_new_tokens=LIMITS.max_model_len - len(prompt), ignore_eos=True)
    futures = [engine.submit(prompt, long) for _ in range(3)]  # two in flight, one queued
    wait_until_in_flight(engine)
    generator = engine.generator
    waiting = threading.Thread(target=engine.wait_idle, daemon=True)  # (a caller waiting for the engine to go idle)
    waiting.start()
    engine.close()
    waiting.join(timeout=10)
    assert not waiting.is_alive()  # woken when close resolved everything
    for future in futures:
        with pytest.raises(RuntimeError, match="closed"):
            future.result(timeout=10)
    assert engine.generator is None and generator._closed  # its KV cache freed


def test_sleep_and_wait_idle_count_a_request_the_engine_is_still_queueing(tiny32):
    # the engine builds its generator with the first request (auto K's warm-up: a second or more here): a request
    # taken from the queue and not yet in flight is one that sleep waits for and wait_idle counts
    model, tokenizer = tiny32
    prompt = prompts_of(tokenizer, 1, seed=7)[0]
    spec = SpecConfig(method="suffix", num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto")
    engine = ServingEngine(model, max_batch_size=4, max_seq_len=LIMITS.max_model_len, spec=spec, seed=0)
    try:
        future = engine.submit(prompt, SamplingParams(max_new_tokens=8))
        deadline = time.monotonic() + 30
        while engine._incoming and time.monotonic() < deadline:  # until the engine's thread has taken it
            time.sleep(0.001)
        assert engine.num_in_flight == 1 and not engine.wait_idle(timeout=0)
        engine.sleep()
        assert future.result(timeout=60).finish_reason in ("stop", "length")
        assert engine.generator is None
    finally:
        engine.close()


def test_verl_sampling_params_map_onto_the_library():
    greedy, wants = sampling_params_from_verl(
        {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}, 100, LIMITS
    )
    assert (greedy.temperature, greedy.top_k, greedy.top_p, wants) == (0.0, 0, 1.0, False)
    # veRL's cap without max_tokens: min(response_length, prompt_length + response_length - prompt tokens)
    assert greedy.max_new_tokens == 48
    assert sampling_params_from_verl({}, 190, LIMITS)[0].max_new_tokens == 18
    sampled, wants = sampling_params_from_verl(
        {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "logprobs": 1}, 10, LIMITS
    )
    assert (sampled.temperature, sampled.top_k, sampled.top_p, wants) == (0.8, 20, 0.9, True)
    assert sampling_params_from_verl({"max_tokens": 500}, 10, LIMITS)[0].max_new_tokens == 198  # max_model_len cap
    assert sampling_params_from_verl({"max_new_tokens": 7, "seed": 3}, 10, LIMITS)[0].seed == 3
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_params_from_verl({"repetition_penalty": 1.1}, 10, LIMITS)
    with pytest.raises(ValueError, match="best_of"):
        sampling_params_from_verl({"best_of": 2}, 10, LIMITS)
    with pytest.raises(ValueError, match="no room"):
        sampling_params_from_verl({}, 208, LIMITS)
    assert sampling_params_from_verl({"temperature": None}, 10, LIMITS)[0].temperature == 1.0  # None: the default
    assert sampling_params_from_verl({"seed": 2**60 + 1}, 10, LIMITS)[0].seed == 2**60 + 1  # an int as it is
    assert sampling_params_from_verl({"stop_token_ids": np.array([3, 4])}, 10, LIMITS)[0].stop_token_ids == [3, 4]
    # ignore_eos None is the rollout config's default, as an absent key is (it was False whatever the config said)
    eos_default = RequestLimits(prompt_length=160, response_length=48, max_model_len=208, ignore_eos=True)
    assert sampling_params_from_verl({"ignore_eos": None}, 10, eos_default)[0].ignore_eos is True
    assert sampling_params_from_verl({"ignore_eos": np.False_}, 10, eos_default)[0].ignore_eos is False
    for bad, message in [
        ({"temperature": "hot"}, r"\['temperature'\] \('hot'\) must be a number"),
        ({"seed": 1.5}, r"\['seed'\] \(1.5\) must be an integer"),
        ({"stop_token_ids": 5}, r"\['stop_token_ids'\] \(5\) must be a list"),
        ({"stop_token_ids": [2.5]}, r"\['stop_token_ids'\] \(2.5\) must be an integer"),
        ({"top_k": -2}, r"\['top_k'\] \(-2\) must be -1 \(off\)"),
        ({"max_tokens": "32"}, r"\['max_tokens'\] \('32'\) must be an integer"),
        # the settings taken only when off are numbers too (they failed in float()'s words, not naming the key)
        ({"repetition_penalty": "abc"}, r"\['repetition_penalty'\] \('abc'\) must be a number"),
        ({"min_p": [0.0]}, r"\['min_p'\] \(\[0.0\]\) must be a number"),
        # a cap below 1 became 1 and a string flag True (bool("false")), without a word
        ({"max_tokens": 0}, r"\['max_tokens'\] \(0\) must be at least 1"),
        ({"max_new_tokens": -5}, r"\['max_new_tokens'\] \(-5\) must be at least 1"),
        ({"ignore_eos": "false"}, r"\['ignore_eos'\] \('false'\) must be true or false"),
        ({"ignore_eos": 1}, r"\['ignore_eos'\] \(1\) must be true or false"),
    ]:
        with pytest.raises(ValueError, match=message):
            sampling_params_from_verl(bad, 10, LIMITS)


def test_a_prompt_is_taken_in_the_forms_verls_servers_take_and_only_as_integer_ids(tiny32):
    """A tokenizer's output (a BatchEncoding under transformers 5), a batch of one, a tensor or an array give the same
    ids as the plain list; ids that are not integers reach the engine's check as they are and are refused naming the
    value (`int()` on each id took 5.7 as 5 and True as 1, and failed on a BatchEncoding in Python's words)."""
    from rollout.integrations.verl.params import prompt_token_ids

    model, tokenizer = tiny32
    encoded = tokenizer("12 + 7 =")
    ids = encoded["input_ids"]
    zero_dim = [list(torch.tensor(ids)), list(np.array(ids))]  # 0-dim tensors or arrays, as veRL's own servers take
    for form in (encoded, {"input_ids": ids}, [ids], tuple(ids), torch.tensor([ids]), np.array(ids), *zero_dim):
        taken = prompt_token_ids(form)
        assert taken == ids and all(type(t) is int for t in taken), type(form)
    for text in ("12 + 7 =", 5, None):
        with pytest.raises(ValueError, match="prompt_ids must be the prompt's token ids"):
            prompt_token_ids(text)
    engine = ServingEngine(model, max_batch_size=2, max_seq_len=64)
    try:
        for bad, shown in (
            ([5.7, 6.2], r"5\.7 \(float\)"),
            ([True, 6], r"True \(bool\)"),
            ([[1, 2], [3]], r"\[1, 2\] \(list\)"),
        ):
            with pytest.raises(ValueError, match=shown + ": token ids are integers"):
                asyncio.run(engine.generate(prompt_token_ids(bad), SamplingParams(max_new_tokens=2)))
    finally:
        engine.close()


def test_a_vllm_speculative_config_carries_over():
    vllm_style = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24}
    spec = spec_config_from_dict(vllm_style)
    assert (spec.method, spec.num_speculative_tokens) == ("suffix", 8)
    assert spec_config_from_dict({"method": "none"}) is None and spec_config_from_dict({}) is None
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        spec_config_from_dict({"method": "draft_model", "model": "tiny-draft", "draft_tensor_parallel_size": 1})
    options = EngineOptions.from_dict({"max_batch_size": 16}, fallback_spec={"method": "ngram"})
    assert options.spec.method == "ngram" and options.max_batch_size == 16
    own = EngineOptions.from_dict({"speculative_config": {"method": "suffix"}}, fallback_spec={"method": "ngram"})
    assert own.spec.method == "suffix"  # engine_kwargs.rollout wins over engine_kwargs.vllm
    off = EngineOptions.from_dict({"speculative_config": None}, fallback_spec={"method": "ngram"})
    assert off.spec is None  # set to None: no drafts, whatever engine_kwargs.vllm says
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineOptions.from_dict({"max_num_batched_tokens": 8})
    # a bad speculative setting is named under the key the veRL user set, and where it came from
    with pytest.raises(
        ValueError, match=r"^engine_kwargs.vllm.speculative_config \(taken where .*\): method \('eagle3'\)"
    ):
        EngineOptions.from_dict({}, fallback_spec={"method": "eagle3", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"^engine_kwargs.rollout.speculative_config: num_speculative_tokens"):
        EngineOptions.from_dict({"speculative_config": {"method": "suffix", "num_speculative_tokens": "four"}})


# ---- with veRL installed ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl():
    return pytest.importorskip("verl", reason="veRL is not installed (pip install '.[verl]')")


def rollout_config(verl, **overrides):
    from verl.workers.config import RolloutConfig

    settings = dict(
        name="rollout",
        tensor_model_parallel_size=1,
        prompt_length=LIMITS.prompt_length,
        response_length=LIMITS.response_length,
        dtype="float32",
        max_num_seqs=8,
        load_format="dummy",
        calculate_log_probs=True,
        engine_kwargs={"rollout": {"speculative_config": {"method": "suffix", "num_speculative_tokens": 4}}},
    )
    settings.update(overrides)
    return RolloutConfig(**settings)


def test_the_plugin_registers_both_halves(verl):
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    import rollout.integrations.verl.plugin  # noqa: F401
    from rollout.integrations.verl.adapter import RolloutAdapter
    from rollout.integrations.verl.server import Replica

    assert get_rollout_class("rollout", "async") is RolloutAdapter
    assert get_rollout_replica_class("rollout") is Replica


def test_the_adapter_sends_weights_to_the_server_actor_then_greedy_equals_generate(verl, tiny32, monkeypatch):
    """The whole weight path on a local Ray: the server starts from random weights (`load_format=dummy`), the
    trainer-side adapter streams the true ones in buckets, and the server's greedy answer is `model.generate`'s."""
    import ray
    from verl.workers.config import HFModelConfig

    from rollout.integrations.verl.adapter import RolloutAdapter
    from rollout.integrations.verl.server import RolloutServer, server_name

    model, tokenizer = tiny32
    prompt = prompts_of(tokenizer, 1, seed=6)[0]
    monkeypatch.setenv("RANK", "0")
    from verl.workers.config import CheckpointEngineConfig

    # several buckets for a 3 MB model
    config = rollout_config(verl, checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=1))
    model_config = HFModelConfig(path=str(model_path("tiny-target")))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        server = ray.remote(RolloutServer).options(name=server_name(0)).remote(config, model_config, 0)
        adapter = RolloutAdapter(config, model_config, None)
        greedy = {"temperature": 0, "top_k": -1, "top_p": 1.0, "logprobs": True, "max_tokens": 24}

        async def main():
            await adapter.release()
            await adapter.resume(["weights"])
            await adapter.update_weights(iter(model.state_dict().items()), global_steps=3)
            await adapter.resume(["kv_cache"])
            return await server.generate.remote(prompt_ids=prompt, sampling_params=greedy, request_id="a")

        output = asyncio.run(main())
    finally:
        ray.shutdown()
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=1)
    assert output.token_ids == expected[0, len(prompt) :].tolist()
    assert output.stop_reason == "completed" and output.extra_fields["global_steps"] == 3
    assert len(output.log_probs) == len(output.token_ids)


def test_the_server_refuses_a_position_table_shorter_than_its_sequences_at_start(verl, tmp_path):
    """A learned position table (GPT-2's) shorter than prompt_length + response_length is refused when the server
    starts, in veRL's names (it failed at the first request, naming the library's max_seq_len)."""
    import shutil

    from transformers import GPT2Config, GPT2LMHeadModel
    from verl.workers.config import HFModelConfig

    from rollout.integrations.verl.server import RolloutServer

    path = tmp_path / "gpt2"
    shutil.copytree(model_path("tiny-target"), path)
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    config = GPT2Config(vocab_size=476, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    config = rollout_config(verl, prompt_length=60, response_length=32, load_format="auto")
    with pytest.raises(
        ValueError, match=r"fewer than rollout.max_model_len \(or prompt_length \+ response_length\) \(92\)"
    ):
        RolloutServer(config, HFModelConfig(path=str(path)))


def test_the_server_refuses_a_rope_scaled_past_its_sequences_at_start(verl, tmp_path):
    """A policy whose dynamic rope rescales past max_position_embeddings is refused when the server starts, in
    veRL's names (it was refused at the first request or wake-up)."""
    import json
    import shutil

    from verl.workers.config import HFModelConfig

    from rollout.integrations.verl.server import RolloutServer

    path = tmp_path / "dynamic"
    shutil.copytree(model_path("tiny-target"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps(config))
    settings = rollout_config(verl, prompt_length=60, response_length=32)
    with pytest.raises(ValueError, match=r"Keep rollout.max_model_len \(or prompt_length \+ response_length\) at 64"):
        RolloutServer(settings, HFModelConfig(path=str(path)))


def test_full_determinism_seeds_every_request_as_veRLs_vllm_server_does(verl):
    """`rollout.full_determinism`: a request without a seed of its own takes `replica_rank + rollout.seed`, so its
    sample depends on its prompt alone, not on the order requests arrive in (it was accepted and did nothing)."""
    from verl.workers.config import HFModelConfig

    from rollout.integrations.verl.server import RolloutServer

    model_config = HFModelConfig(path=str(model_path("tiny-target")))
    params = {"temperature": 1.0, "max_tokens": 12}
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    answers = []
    for order in (prompts, prompts[::-1]):
        server = RolloutServer(rollout_config(verl, full_determinism=True, seed=3, load_format="auto"), model_config)
        try:
            answers.append({tuple(p): asyncio.run(server.generate(p, params, "r")).token_ids for p in order})
        finally:
            server.engine.close()
    assert answers[0] == answers[1]
    seeded = verl_params({**params, "seed": 3}, prompts[0])
    engine = ServingEngine(load_model("tiny-target")[0], max_batch_size=2, max_seq_len=64)
    try:
        assert asyncio.run(engine.generate(prompts[0], seeded)).token_ids == answers[0][tuple(prompts[0])]
    finally:
        engine.close()


def test_the_server_builds_the_policy_from_the_trainers_config(verl):
    """`model.override_config` changes the actor's config: the server's policy is built from the same config, with
    attention the generator runs (veRL's config asks flash-attn), and the trainer's config object is left as it is."""
    from verl.workers.config import HFModelConfig

    from rollout.integrations.verl.server import RolloutServer

    overrides = {"max_position_embeddings": 4096, "attn_implementation": "eager"}
    model_config = HFModelConfig(path=str(model_path("tiny-target")), override_config=overrides)
    server = RolloutServer(rollout_config(verl), model_config)
    try:
        assert server.model.config.max_position_embeddings == 4096
        assert server.model.config._attn_implementation == "eager"
    finally:
        server.engine.close()
    plain = HFModelConfig(path=str(model_path("tiny-target")))
    assert plain.hf_config._attn_implementation == "flash_attention_2"
    server = RolloutServer(rollout_config(verl), plain)
    try:
        assert server.model.config._attn_implementation == "sdpa"
        assert plain.hf_config._attn_implementation == "flash_attention_2"  # the trainer's own config unchanged
        output = asyncio.run(server.generate([5, 6, 7], {"temperature": 0, "max_tokens": 4}, "r"))
        assert len(output.token_ids) == 4
    finally:
        server.engine.close()


@pytest.mark.parametrize("load_format", ["dummy", "auto"])
@pytest.mark.parametrize("with_generation_config", [True, False])
def test_the_servers_policy_stops_at_the_checkpoints_stop_ids(verl, tmp_path, load_format, with_generation_config):
    """veRL's config holds the tokenizer's one EOS; the policy stops where the checkpoint says (several ids), loaded
    or built from its config (`load_format=dummy`), with or without a generation_config.json."""
    import json
    import shutil

    from verl.workers.config import HFModelConfig

    from rollout.engine.requests import eos_token_ids
    from rollout.integrations.verl.server import RolloutServer

    path = tmp_path / "model"
    shutil.copytree(model_path("tiny-target"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [0, 5]}))
    generation = path / "generation_config.json"
    if with_generation_config:
        generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": [0, 5]}))
    else:
        generation.unlink()
    server = RolloutServer(rollout_config(verl, load_format=load_format), HFModelConfig(path=str(path)))
    try:
        assert sorted(eos_token_ids(server.model)) == [0, 5]
    finally:
        server.engine.close()


def test_the_server_refuses_what_it_cannot_do(verl):
    from verl.workers.config import HFModelConfig

    from rollout.integrations.verl.server import RolloutServer

    model_config = HFModelConfig(path=str(model_path("tiny-target")))
    with pytest.raises(ValueError, match="SpecConfig fields"):
        RolloutServer(
            rollout_config(verl, engine_kwargs={"rollout": {"speculative_config": {"gamma": 3}}}), model_config
        )
    with pytest.raises(
        ValueError, match=r"logprobs_mode \('raw_logprobs'\) is not supported .* returns processed_logprobs"
    ):
        RolloutServer(rollout_config(verl, logprobs_mode="raw_logprobs"), model_config)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.max_num_seqs \(0\) must be a positive integer"):
        RolloutServer(rollout_config(verl, max_num_seqs=0), model_config)
    # at start, in veRL's keys, not at every request after it
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"engine_kwargs.rollout.cuda_graphs=true needs a CUDA device"):
            RolloutServer(rollout_config(verl, engine_kwargs={"rollout": {"cuda_graphs": True}}), model_config)
    small = {"rollout": {"kv_layout": "paged", "kv_pool_blocks": 1, "speculative_config": None}}
    with pytest.raises(ValueError, match=r"kv_pool_blocks \(1\) must be at least 14: one sequence of rollout.max"):
        RolloutServer(rollout_config(verl, engine_kwargs=small), model_config)  # 208 positions and a bonus token
    slots = {"rollout": {"kv_layout": "slots", "kv_pool_blocks": 64}}
    with pytest.raises(ValueError, match=r"kv_pool_blocks sizes a paged KV pool, and kv_layout slots has none"):
        RolloutServer(rollout_config(verl, engine_kwargs=slots), model_config)
    missing = {"rollout": {"speculative_config": {"method": "draft_model", "model": "/nonexistent/draft"}}}
    with pytest.raises(ValueError, match=r"engine_kwargs.rollout.speculative_config.model: spec.model \('/nonex"):
        RolloutServer(rollout_config(verl, engine_kwargs=missing), model_config)
    server = RolloutServer(rollout_config(verl), model_config)
    try:
        with pytest.raises(ValueError, match="multimodal"):
            asyncio.run(server.generate([5, 6], {}, "r", image_data=["x"]))
        with pytest.raises(ValueError, match=r"prompt 0 holds 5.7 \(float\): token ids are integers"):
            asyncio.run(server.generate([5.7, 6.2], {}, "r"))  # (it was cut to [5, 6], and generated)
        batch_of_one = asyncio.run(server.generate([[5, 6, 7]], {"temperature": 0, "max_tokens": 3}, "r"))
        plain = asyncio.run(server.generate([5, 6, 7], {"temperature": 0, "max_tokens": 3}, "r"))
        assert batch_of_one.token_ids == plain.token_ids and len(plain.token_ids) == 3
    finally:
        server.engine.close()
    from verl.workers.config import CheckpointEngineConfig

    from rollout.integrations.verl.server import Replica

    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        Replica(0, rollout_config(verl, tensor_model_parallel_size=2), model_config)
    nccl = rollout_config(verl, checkpoint_engine=CheckpointEngineConfig(backend="nccl"))
    with pytest.raises(ValueError, match="backend=naive"):
        asyncio.run(Replica(0, nccl, model_config).launch_servers())
