"""Dynamic K in the generator: every policy, several proposers at once and per-request settings stay lossless."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_prompts
from test_generator import teacher_forced_logprobs

from rollout import Generator, SamplingParams
from rollout.engine.step_timer import forced_steps
from specdec.auto_policy import AutoPolicy
from specdec.config import SpecConfig, SpecDecodeParams

BOTH = ["ngram", "draft_model"]


def prompts_with_and_without_matches():
    # repetitive prompts give the n-gram proposer matches; random ones mostly fall through to the draft model
    return [p * 3 for p in random_prompts(5, max_len=5, seed=3)] + random_prompts(5, seed=4)


def decode_steps(gen):
    return [r for r in gen.last_trace if r.kind == "decode"]


@pytest.mark.parametrize(
    "method,table",
    [
        ("draft_model", "auto"),
        ("ngram", "auto"),
        (BOTH, None),
        (BOTH, "auto"),
        (BOTH, [[1, 2, 4], [3, 6, 2]]),
    ],
    ids=["draft-auto", "ngram-auto", "both-static", "both-auto", "both-table"],
)
def test_greedy_with_every_policy_equals_plain_greedy(method, table):
    model = make_model("llama")
    draft = make_model("llama", seed=1, num_hidden_layers=1)
    prompts = prompts_with_and_without_matches()
    params = SamplingParams(temperature=0, max_new_tokens=24)
    plain = Generator(model, max_batch_size=6, max_seq_len=96).generate(prompts, params)
    model_arg = draft if "draft_model" in method else None
    spec = SpecConfig(
        method=method, model=model_arg, num_speculative_tokens=4, num_speculative_tokens_per_batch_size=table
    )
    gen = Generator(model, max_batch_size=6, max_seq_len=96, spec=spec)
    if table == "auto":
        gen.policy.explore_every = 0  # an exploration step may trail K = 0 by more than the hysteresis
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    if table == "auto":
        assert isinstance(gen.policy, AutoPolicy) and gen.warm_up_seconds > 0
        # a kept K may trail K = 0 by the hysteresis margin; a step climbing to measure a position may trail further
        floor = 1 / (1 + gen.policy.hysteresis) - 1e-9
        steps = decode_steps(gen)
        assert all(r.predicted_gain is not None for r in steps)
        assert all(r.predicted_gain >= floor for r in steps if not r.measuring)
    if method == BOTH and table is None:  # both proposers served rows, sharing verification forwards
        served = {m for r in decode_steps(gen) for m in r.rows_by_method}
        assert served == set(BOTH)
        assert any(len(r.rows_by_method) == 2 for r in decode_steps(gen))


def test_each_steps_routes_are_its_rows_as_they_come_and_go():
    """The rows' routes (their request's proposer, or the configured order) are worked out again only when rows are
    admitted or moved: at every step of a batch whose rows finish, move into the holes and are refilled from the
    queue with requests of other methods, the cached list must be what the rows hold."""
    model = make_model("qwen2")
    draft = make_model("qwen2", seed=1, num_hidden_layers=1)
    methods = [None, "ngram", "draft_model", None, "draft_model", "ngram", "ngram", None, "draft_model", None]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=4 + 3 * (i % 4), seed=i, spec=SpecDecodeParams(method=m))
        for i, m in enumerate(methods)
    ]
    gen = Generator(model, max_batch_size=4, max_seq_len=96, spec=SpecConfig(method=BOTH, model=draft))
    gen.add_requests(random_prompts(len(methods), seed=4), params)
    seen = set()
    while gen.has_unfinished:
        num_rows = gen.scheduler.num_active
        want = [seq.params.spec.method or "+".join(BOTH) for seq in gen.slots.sequences[:num_rows]]
        assert gen._routes(num_rows) == want
        seen.add(tuple(want))
        gen.step()
    assert len(seen) > 4, f"expected the rows to change many times, got {seen}"


def test_mixed_per_request_settings_in_one_batch_stay_exact():
    model = make_model("qwen2")
    draft = make_model("qwen2", seed=1, num_hidden_layers=1)
    prompts = prompts_with_and_without_matches()[:8]
    settings = [
        SpecDecodeParams(enabled=False),
        SpecDecodeParams(max_num_draft_tokens=1),
        SpecDecodeParams(method="ngram"),
        SpecDecodeParams(method="draft_model", max_num_draft_tokens=2),
        SpecDecodeParams(),
        SpecDecodeParams(enabled=False),
        SpecDecodeParams(method="ngram", max_num_draft_tokens=0),
        SpecDecodeParams(method="draft_model"),
    ]
    params = [SamplingParams(temperature=0, max_new_tokens=20, spec=s) for s in settings]
    plain = Generator(model, max_batch_size=8, max_seq_len=96).generate(prompts, params[0])
    spec = SpecConfig(method=BOTH, model=draft, num_speculative_tokens=4)
    gen = Generator(model, max_batch_size=8, max_seq_len=96, spec=spec)
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    steps = decode_steps(gen)
    # at most 5 of the 8 rows may draft (two are off, one capped at 0), and a capped row drafts at most its cap
    assert all(sum(r.rows_by_method.values()) <= 5 for r in steps)
    assert sum(r.num_drafted for r in steps) > 0


def test_per_request_caps_and_off_bound_the_drafts():
    model = make_model("llama")
    draft = make_model("llama", seed=1, num_hidden_layers=1)
    prompts = random_prompts(4, seed=2)
    spec = SpecConfig(method="draft_model", model=draft, num_speculative_tokens=4)
    gen = Generator(model, max_batch_size=4, max_seq_len=64, spec=spec)
    gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, spec=SpecDecodeParams(enabled=False)))
    assert sum(r.num_drafted for r in gen.last_trace) == 0
    gen.generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=12, spec=SpecDecodeParams(max_num_draft_tokens=1))
    )
    steps = decode_steps(gen)
    assert all(r.num_drafted <= r.batch_size for r in steps) and sum(r.num_drafted for r in steps) > 0


def test_logprobs_with_mixed_proposers_equal_teacher_forced_pass():
    """Sampling through one rejection pass where n-gram rows carry one-hot q next to draft-model rows."""
    model = make_model("llama")
    draft = make_model("llama", seed=1)
    prompts = prompts_with_and_without_matches()
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, n=2)
    # rejection verification: the draft model's q and the n-gram rows' one-hot q are combined into one pass (exact
    # verification, the default, takes no q at all)
    spec = SpecConfig(method=BOTH, model=draft, verification="rejection")
    gen = Generator(model, max_batch_size=8, max_seq_len=96, spec=spec)
    outs = gen.generate(prompts, params)
    assert any(len(r.rows_by_method) == 2 for r in decode_steps(gen))
    for out in outs:
        expected = teacher_forced_logprobs(model, prompts[out.prompt_index], out.token_ids, params)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=1e-9, rtol=0)


def test_bad_per_request_settings_are_named():
    model = make_model("llama")
    gen = Generator(model, max_batch_size=2, max_seq_len=32, spec=SpecConfig(method="ngram"))
    with pytest.raises(ValueError, match=r"params\[0\].spec.method \('draft_model'\) is not a configured proposer"):
        gen.generate([[1, 2, 3]], SamplingParams(spec=SpecDecodeParams(method="draft_model")))
    with pytest.raises(ValueError, match=r"max_num_draft_tokens \(-1\) must be an integer >= 0"):
        SpecDecodeParams(max_num_draft_tokens=-1)
    with pytest.raises(ValueError, match=r"method \('eagle'\)"):
        SpecDecodeParams(method="eagle")
    with pytest.raises(ValueError, match=r"one per prompt \(2\)"):
        gen.generate([[1, 2], [3, 4]], [SamplingParams()])
    with pytest.raises(ValueError, match=r"method \(\['ngram', 'ngram'\]\) must be one of"):
        SpecConfig(method=["ngram", "ngram"])


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_warm_up_profiles_each_batch_size_and_k_once_and_leaves_no_trace(method):
    # the suffix proposer drafts one token in the warm-up's random rows (its match in a fresh response is one token
    # long): the warm-up fills the rest, or it would time no width above 2 and price wide steps by extrapolation
    gen = Generator(
        make_model("llama"),
        max_batch_size=20,
        max_seq_len=64,
        spec=SpecConfig(method=method, num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto"),
    )
    assert gen.warm_up_seconds > 0
    profile = gen.policy.step_times.profile
    # B: powers of 4 and the slot count; context: 32 tokens and the longest that leaves room for K drafts and a bonus;
    # every other K at the second largest B
    contexts = (32, 64 - 4 - 3)
    grid = sorted(
        [(b, 1 + k, c) for b in (1, 4, 16, 20) for k in (0, 1, 2, 4) for c in contexts] + [(16, 4, 32), (16, 4, 57)]
    )
    timed = sorted((b, w, c) for (b, w, _), times in profile.items() for c in times)
    assert timed == grid  # the first pass not kept; a step timed twice is one entry
    assert all(t > 0 for times in profile.values() for t in times.values()) and gen.last_trace == []
    assert not gen.policy.step_times.measured.size  # nothing measured yet: the rollout's steps come next


@pytest.mark.parametrize("method", ["draft_model", ["suffix", "draft_model"]], ids=["draft", "cascade"])
def test_the_warm_up_survives_rows_that_accept_every_draft(method):
    """A draft model that agrees with the target on some rows, not all: a timed step accepts K drafts and the bonus
    there. The rows keep room for one more token, so none reaches its length cap and leaves the rows (the warm-up
    restores every row to its snapshot before each timed step; a released row moved the others, and it failed)."""
    model = make_model("qwen2", seed=2, vocab_size=23)
    draft = make_model("qwen2", seed=3, num_hidden_layers=1, vocab_size=23)
    spec = SpecConfig(
        method=method, model=draft, num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto"
    )
    gen = Generator(model, max_batch_size=4, max_seq_len=80, spec=spec, kv_layout="slots")
    assert gen.warm_up_seconds > 0 and gen.last_trace == [] and gen.num_active == 0


def test_each_decode_step_records_the_time_its_k_policy_took():
    """`policy_seconds`: the policy's choice (inside the step's `seconds`) and its learning from the step (after it),
    so that a run shows what the policy costs beside the forward (it once cost 1.8 ms a step after 4,000 steps)."""
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, num_speculative_tokens_per_batch_size="auto")
    gen = Generator(make_model("llama"), max_batch_size=4, max_seq_len=64, spec=spec)
    gen.generate(random_prompts(4, seed=2), SamplingParams(max_new_tokens=12))
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    assert decode and all(0 < r.policy_seconds for r in decode)
    assert sum(r.policy_seconds for r in decode) < sum(r.seconds for r in decode)
    plain = Generator(make_model("llama"), max_batch_size=4, max_seq_len=64)
    plain.generate(random_prompts(4, seed=2), SamplingParams(max_new_tokens=4))
    assert all(r.policy_seconds == 0.0 for r in plain.last_trace)  # no policy, no time


def test_the_warm_up_times_contexts_up_to_a_cap_not_the_length_cap():
    from rollout.engine.step_timer import WARM_UP_MAX_CONTEXT

    spec = SpecConfig(method="ngram", num_speculative_tokens=3, num_speculative_tokens_per_batch_size="auto")
    gen = Generator(make_model("llama"), max_batch_size=4, max_seq_len=4096, spec=spec)
    contexts = {c for times in gen.policy.step_times.profile.values() for c in times}
    assert max(contexts) == WARM_UP_MAX_CONTEXT - 3 - 3  # less K and a bonus's room
    assert gen.runner.cache.capacity < 2 * WARM_UP_MAX_CONTEXT  # the KV cache took that room, not 4096 positions
    # a longer context is priced along the two longest timed, never below the longest's time
    from specdec.step_time import _Table

    assert _Table._at_context(([32, 600], [1.0, 2.0]), 1168) == pytest.approx(3.0)
    assert _Table._at_context(([32, 600], [1.0, 2.0]), 10) == 1.0  # held below the shortest
    assert _Table._at_context(([32, 600], [2.0, 1.5]), 1200) == 1.5  # a noisy pair does not predict faster steps


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("num_candidates", [1, 2], ids=["chains", "trees"])
def test_filled_drafts_feed_every_row_its_k_and_stay_exact(num_candidates, temperature):
    """`forced_steps(gen, K)` forces K and tops each row's drafts up to it (the calibration's way to time a width):
    every row is fed K drafts, and the output is still what plain decoding gives (the same tokens for the same seed);
    the K policy and the proposers are the generator's own again after it."""
    model = make_model("llama")
    prompts = random_prompts(6, seed=5)
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3)
    plain = Generator(model, max_batch_size=6, max_seq_len=64).generate(prompts, params)
    gen = Generator(
        model, max_batch_size=6, max_seq_len=64, spec=SpecConfig(method="suffix", num_candidates=num_candidates)
    )
    gen.add_requests(prompts, params)
    done, records = [], []
    policy, proposers = gen.policy, gen.proposers
    with forced_steps(gen, 3) as forced:
        while gen.has_unfinished:
            out = gen.step()
            done += out.finished
            records.append(out.record)
            assert out.record.kind == "prefill" or forced.observation is out.observation
    assert gen.policy is policy and gen.proposers is proposers
    decode = [r for r in records if r.kind == "decode"]
    # rows still 4 or more tokens from their cap take all 3 drafts: the first steps feed every row 3 drafts
    assert decode[0].num_drafted == 3 * decode[0].batch_size
    assert all(r.num_drafted >= r.batch_size for r in decode[:8])
    assert sorted((c.prompt_index, c.token_ids) for c in done) == sorted((o.prompt_index, o.token_ids) for o in plain)
