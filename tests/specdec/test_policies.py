"""K policies: the auto policy's choices on synthetic step times, its acceptance estimate and step-time table,
and the one-hot q that lets n-gram rows share a rejection-sampling pass with draft-model rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_kernels.rejection_sample import rejection_sample_ref
from specdec.auto_policy import AcceptanceStats, AutoPolicy, StepObservation
from specdec.step_time import StepTimeTable

MAX_K = 8


def profiled(step_seconds) -> StepTimeTable:
    """A step-time model whose warm-up profile is `step_seconds(B, W, P)` on the usual grid."""
    model = StepTimeTable()
    for batch_size in (1, 4, 16, 64, 256):
        for k in (0, 1, 4, 8):
            model.add(batch_size, k + 1, k, step_seconds(batch_size, k + 1, k), profiled=True)
    return model


def policy_with(step_seconds, acceptance: float, hysteresis: float = 0.03) -> AutoPolicy:
    """An auto policy for one draft-model route whose measured per-position acceptance is `acceptance`."""
    policy = AutoPolicy(MAX_K, {"draft_model": True}, profiled(step_seconds), hysteresis=hysteresis)
    rng = np.random.default_rng(0)
    for _ in range(200):  # 200 steps of 16 rows asked for 8 drafts: accepted prefix lengths ~ geometric
        accepted = [int(np.argmin(np.append(rng.random(MAX_K) < acceptance, False))) for _ in range(16)]
        policy.stats["draft_model"].update([MAX_K] * 16, accepted)
    return policy


def overhead_then_compute(batch_size, width, passes):
    """A forward costs 2 ms of overhead plus 0.02 ms per token fed; a draft pass 0.1 ms plus 0.002 ms per row."""
    return 2e-3 + 2e-5 * batch_size * width + passes * (1e-4 + 2e-6 * batch_size)


def test_acceptance_stats_measure_per_position_rates():
    stats = AcceptanceStats(3, prior_weight=1e-9)
    # 4 rows asked for 3 drafts: accepted 0, 1, 3, 3 -> position 1: 3/4, position 2: 2/3, position 3: 2/2
    stats.update([3, 3, 3, 3], [0, 1, 3, 3])
    np.testing.assert_allclose(stats.rates(), [0.75, 2 / 3, 1.0], rtol=1e-6)
    np.testing.assert_allclose(stats.expected_emitted(), [1, 1.75, 2.25, 2.75], rtol=1e-6)
    # a position no row reached inherits the rate before it
    fresh = AcceptanceStats(3, prior_rate=0.5)
    fresh.update([1, 1], [1, 1])
    assert fresh.rates()[2] == pytest.approx(fresh.rates()[1]) == pytest.approx(fresh.rates()[0])


def test_auto_raises_k_as_the_batch_shrinks():
    policy = policy_with(overhead_then_compute, acceptance=0.8)
    ks = {}
    for batch_size in (256, 128, 64, 32, 16, 8, 4, 2, 1):  # a rollout's batch only ever shrinks
        ks[batch_size] = policy.choose(batch_size).num_draft_tokens
    assert list(ks.values()) == sorted(ks.values()), ks
    assert ks[256] <= 1 and ks[1] >= 6, ks


def test_auto_picks_zero_when_step_time_grows_faster_than_acceptance_pays():
    # every token fed costs as much as a whole plain step: K drafts cost (1 + K) x, earning < 1 + K tokens
    policy = policy_with(lambda b, w, p: 1e-3 * w + 1e-3 * p, acceptance=0.9)
    for batch_size in (1, 8, 64):
        decision = policy.choose(batch_size)
        assert decision.num_draft_tokens == 0
        assert decision.predicted_gain == pytest.approx(1.0)
    # the same acceptance with nearly free tokens: speculation, and a predicted gain above 1
    cheap = policy_with(lambda b, w, p: 1e-3 + 1e-6 * w, acceptance=0.9)
    decision = cheap.choose(8)
    assert decision.num_draft_tokens == MAX_K and decision.predicted_gain > 3


def test_measured_steps_refit_the_level_and_can_turn_speculation_off():
    # the profile says tokens are nearly free; the run then measures drafted steps costing far more than profiled
    policy = policy_with(lambda b, w, p: 1e-3 + 1e-6 * w, acceptance=0.5)
    assert policy.choose(16).num_draft_tokens > 0
    no_profile = AutoPolicy(MAX_K, {"draft_model": True}, StepTimeTable(), hysteresis=0.0)
    no_profile.stats = policy.stats
    for k in (0, 1, 2, 4, 8) * 20:  # measured only: each draft token costs a full step
        no_profile.observe(StepObservation(16, k + 1, k, 1e-3 * (1 + 2 * k), {}))
    assert no_profile.choose(16).num_draft_tokens == 0


def test_hysteresis_keeps_k_at_a_boundary():
    policy = policy_with(overhead_then_compute, acceptance=0.8, hysteresis=0.05)
    plain = policy_with(overhead_then_compute, acceptance=0.8, hysteresis=0.0)
    policy.explore_every = plain.explore_every = 0  # exploration steps are not flips
    sizes = [b for b in range(40, 400, 4)]
    boundary = next(b for b in sizes if plain.choose(b).num_draft_tokens != plain.choose(sizes[0]).num_draft_tokens)
    flips = {"hysteresis": 0, "none": 0}
    for name, p in (("hysteresis", policy), ("none", plain)):
        last = None
        for step in range(40):  # the batch wobbles around the boundary
            k = p.choose(boundary + (4 if step % 2 else -4)).num_draft_tokens
            flips[name] += last is not None and k != last
            last = k
    assert flips["none"] > 10 and flips["hysteresis"] <= 1, flips


def test_exploration_drafts_one_token_more_and_one_fewer_every_explore_every_steps():
    policy = policy_with(overhead_then_compute, acceptance=0.8)
    policy.explore_every = 5
    chosen = policy.choose(64).num_draft_tokens
    assert 0 < chosen < MAX_K
    ks = [chosen] + [policy.choose(64).num_draft_tokens for _ in range(9)]
    up, down = chosen + 1, chosen - 1  # one more every 5 steps (steps 5, 10), one fewer halfway (steps 2, 7)
    assert ks == [chosen, down, chosen, chosen, up, chosen, down, chosen, chosen, up], ks
    assert policy.current == chosen  # the exploration step does not become the choice
    # the next position's acceptance is then measured: a collapsed rate there is learnt, and K never moves past it
    for _ in range(100):  # every row's extra draft rejected
        policy.stats["draft_model"].update([chosen + 1] * 64, [chosen] * 64)
    assert policy.stats["draft_model"].rates()[chosen] < 0.1
    assert all(policy.choose(64).num_draft_tokens <= chosen + 1 for _ in range(10))
    # no exploration while speculation is off: every token costs a full step here, so K stays 0
    off = policy_with(lambda b, w, p: 1e-3 * w + 1e-3 * p, acceptance=0.9)
    off.explore_every = 2
    assert [off.choose(8).num_draft_tokens for _ in range(6)] == [0] * 6


def test_k_climbs_one_unmeasured_position_at_a_time():
    # tokens nearly free: the optimistic prior alone would bet on K = 8 at once
    policy = AutoPolicy(MAX_K, {"draft_model": True}, profiled(lambda b, w, p: 1e-3 + 1e-6 * w), explore_every=0)
    ks, measuring = [], []
    for _ in range(MAX_K + 2):
        decision = policy.choose(16)
        k = decision.num_draft_tokens
        ks.append(k)
        measuring.append(decision.measuring)
        policy.observe(StepObservation(16, k + 1, k, 1e-3, {"draft_model": ([k] * 16, [k] * 16)}))  # all accepted
    assert ks == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8], ks
    assert measuring == [True] * 7 + [False] * 3  # a climb step is marked: it was capped below the best K
    # an exploration step (a draft more) too: never more than one past the positions measured before it
    exploring = AutoPolicy(MAX_K, {"draft_model": True}, profiled(lambda b, w, p: 1e-3 + 1e-6 * w), explore_every=2)
    for _ in range(MAX_K + 2):
        depth = exploring.stats["draft_model"].measured_depth()
        k = exploring.choose(16).num_draft_tokens
        assert k <= depth + 1, (k, depth)
        exploring.observe(StepObservation(16, k + 1, k, 1e-3, {"draft_model": ([k] * 16, [k] * 16)}))


def kv_read_bound(batch_size, width, passes, context):
    """Reading the KV cache costs every step the same whatever its width; tokens fed add compute and attention; the
    first draft adds a fixed cost (catch-up and verifier), each draft pass its own."""
    per_row = 2e-6 + 4e-8 * context + width * (1e-6 + 1e-9 * context) + (width > 1) * 5e-6
    return 1e-3 + batch_size * per_row + passes * (1e-4 + batch_size * (1e-7 + 1e-9 * context))


def profiled_with_context(step_seconds) -> StepTimeTable:
    """A step-time model profiled like the warm-up: the usual grid at a short and a long context."""
    model = StepTimeTable()
    for batch_size in (1, 4, 16, 64, 256, 1024):
        for k in (0, 1, 4, 8):
            for context in (32, 600):
                model.add(
                    batch_size, k + 1, k, step_seconds(batch_size, k + 1, k, context), profiled=True, context=context
                )
    return model


def test_step_time_table_interpolates_to_an_untimed_context_width_and_batch_size():
    model = profiled_with_context(kv_read_bound)
    ks = np.arange(MAX_K + 1)
    for batch_size, context in ((200, 300), (700, 450), (3, 100)):
        predicted = model.predict(batch_size, ks + 1, ks, context)
        truth = np.array([kv_read_bound(batch_size, k + 1, k, context) for k in ks])
        np.testing.assert_allclose(predicted, truth, rtol=0.05)


class SyntheticTimer:
    """A step timer whose steps take `step_seconds(B, W, P, context)`, the `stalls` listed (B, K, context) once
    20 times as long; it records every step it was asked to time."""

    def __init__(self, step_seconds, max_batch_size=1024, max_context=600, stalls=()):
        self.step_seconds, self.max_batch_size, self.max_context = step_seconds, max_batch_size, max_context
        self.stalls = set(stalls)
        self.context = 0
        self.timed: list[tuple[int, int, int]] = []
        self.modes: list[bool | None] = []  # `with_models` of each timed step

    def fill(self, context: int) -> None:
        self.context = context

    def time_step(self, num_rows: int, num_draft_tokens: int, with_models: bool | None = None) -> StepObservation:
        key = (num_rows, num_draft_tokens, self.context)
        self.timed.append(key)
        self.modes.append(with_models)
        passes = 0 if with_models is False else num_draft_tokens
        seconds = self.step_seconds(num_rows, num_draft_tokens + 1, passes, self.context)
        if key in self.stalls:
            self.stalls.discard(key)
            seconds *= 20
        return StepObservation(num_rows, num_draft_tokens + 1, passes, seconds, {}, self.context)


def test_calibration_times_a_stalled_step_again():
    # one warm-up step took 20x its time (a pause of the process): slower than the same K with more rows, or than
    # more drafts at the largest batch size, so it is timed again and the table keeps the faster timing
    for stall in ((256, 0, 32), (1024, 4, 600), (16, 8, 600)):
        timer = SyntheticTimer(kv_read_bound, stalls=[stall])
        policy = AutoPolicy(MAX_K, {"draft_model": True})
        policy.calibrate(timer)
        assert timer.timed.count(stall) == 2, stall  # the stalled step and its second timing
        ks = np.arange(MAX_K + 1)
        for batch_size, context in ((stall[0], 32), (stall[0], 300), (stall[0], 600)):
            truth = np.array([kv_read_bound(batch_size, k + 1, k, context) for k in ks])
            predicted = policy.step_times.predict(batch_size, ks + 1, ks, context)
            np.testing.assert_allclose(predicted, truth, rtol=0.05)
    # without a stall nothing is timed twice (but the untimed first pass)
    timer = SyntheticTimer(kv_read_bound)
    AutoPolicy(MAX_K, {"draft_model": True}).calibrate(timer)
    kept = timer.timed[5:]
    assert len(kept) == len(set(kept)) == 2 * (6 * 4 + 5)


def costly_passes(batch_size, width, passes, context):
    """`kv_read_bound` with draft passes that each cost half a plain step."""
    return kv_read_bound(batch_size, width, 0, context) + passes * 0.5 * kv_read_bound(batch_size, 1, 0, context)


def test_a_cascade_that_runs_its_draft_model_in_some_steps_is_priced_by_how_often_it_does():
    route = "suffix+draft_model"
    timer = SyntheticTimer(costly_passes)
    policy = AutoPolicy(MAX_K, {route: True}, optional_passes=frozenset([route]), hysteresis=0.0, explore_every=0)
    policy.calibrate(timer)
    assert {True, False} <= set(timer.modes)  # its steps timed with the draft passes and without
    accepted = [0] * 6 + [1] * 4 + [2] * 2 + [3] * 2 + [4] * 2  # about 0.6 per position
    for _ in range(100):  # in steps that ran the draft model: a pass costs more than its drafts earn
        policy.observe(StepObservation(256, 5, 4, costly_passes(256, 5, 4, 300), {route: ([4] * 16, accepted)}, 300))
    assert policy.choose(256, context=300).num_draft_tokens == 0
    for _ in range(30):  # the same acceptance, now in steps where the first proposer served every row
        policy.observe(StepObservation(256, 5, 0, costly_passes(256, 5, 0, 300), {route: ([4] * 16, accepted)}, 300))
    assert policy.pass_share[route] < 0.01
    assert policy.choose(256, context=300).num_draft_tokens >= 3
    # a route that always runs its draft model is priced with its passes whatever it observes
    always = AutoPolicy(MAX_K, {"draft_model": True})
    always.observe(StepObservation(256, 5, 0, 0.0, {"draft_model": ([4] * 16, [2] * 16)}, 300))
    assert always.pass_share["draft_model"] == 1.0


def test_one_stalled_step_does_not_reprice_its_width():
    model = profiled(overhead_then_compute)
    for step in range(20):  # measured steps of 64 rows at K = 3, as profiled, one of them stalled 4x
        stall = 4.0 if step == 5 else 1.0
        model.add(64, 4, 3, overhead_then_compute(64, 4, 3) * stall)
    predicted = model.predict(64, np.array([3, 4, 5]), np.array([2, 3, 4]))
    truth = [overhead_then_compute(64, w, w - 1) for w in (3, 4, 5)]
    np.testing.assert_allclose(predicted, truth, rtol=0.05)


def test_auto_drafts_more_where_the_context_is_long():
    # a step reading a long KV cache costs the same whatever its width: extra tokens are cheap next to it
    policy = AutoPolicy(MAX_K, {"draft_model": True}, profiled_with_context(kv_read_bound), hysteresis=0.0)
    policy.stats = policy_with(overhead_then_compute, acceptance=0.7).stats
    # at 32 tokens a plain step is cheap and two drafts cost more than they earn; at 600 the cache read dominates
    assert policy.choose(1024, context=32).num_draft_tokens == 0
    assert policy.choose(1024, context=600).num_draft_tokens >= 3


def test_row_caps_bound_the_choice():
    policy = policy_with(overhead_then_compute, acceptance=0.9)
    assert policy.choose(4, caps=[0, 0, 0, 0]).num_draft_tokens == 0
    assert policy.choose(4, caps=[2, 2, 1, 0]).num_draft_tokens <= 2


def test_one_hot_draft_probs_verify_exactly_like_ngram_drafts():
    """Rows of n-gram drafts get one-hot q when they share a pass with draft-model rows: accept iff u < p(x), and a
    rejection samples p with x removed, exactly the n-gram rule, for the same uniforms."""
    counts, vocab_size = [3, 0, 5, 1, 8], 37
    generator = torch.Generator().manual_seed(0)
    num_drafts, num_rows = sum(counts), len(counts)
    # peaked target rows, drafts their argmax 80% of the time: some drafts are accepted, some rejected
    target_probs = torch.softmax(4 * torch.randn(num_drafts + num_rows, vocab_size, generator=generator), -1).double()
    verifying = torch.arange(num_drafts) + torch.repeat_interleave(torch.arange(num_rows), torch.tensor(counts))
    likely = target_probs[verifying].argmax(dim=-1)
    random_ids = torch.randint(0, vocab_size, (num_drafts,), generator=generator)
    case = dict(
        draft_token_ids=torch.where(torch.rand(num_drafts, generator=generator) < 0.8, likely, random_ids),
        cu_num_draft_tokens=torch.tensor(counts).cumsum(0),
        draft_probs=None,
        target_probs=target_probs,
        accept_uniforms=torch.rand(num_drafts, generator=generator, dtype=torch.float64),
        sample_uniforms=torch.rand(num_rows, generator=generator, dtype=torch.float64),
        max_num_draft_tokens=max(counts),
    )
    ngram = rejection_sample_ref(**case)
    one_hot = torch.nn.functional.one_hot(case["draft_token_ids"], vocab_size).to(torch.float64)
    as_draft = rejection_sample_ref(**{**case, "draft_probs": one_hot})
    assert torch.equal(ngram[0], as_draft[0]) and torch.equal(ngram[1], as_draft[1])
    assert 0 < int(ngram[1].sum()) - 5 < 17, "the case must accept some drafts and reject others"


def test_a_rate_measured_long_ago_is_measured_again():
    # drafting pays from an acceptance of ~0.3 here; the first steps saw none accepted, so K dropped to 0
    policy = policy_with(overhead_then_compute, acceptance=0.0)
    policy.explore_every = 0
    assert policy.choose(64).num_draft_tokens == 0
    ks = []
    for _ in range(200):  # steps without drafts: the old evidence fades toward the prior, K climbs to re-measure it
        k = policy.choose(64).num_draft_tokens
        ks.append(k)
        asked = {"draft_model": ([k] * 64, [0] * 64)} if k else {}
        policy.observe(StepObservation(64, 1 + k, k, overhead_then_compute(64, 1 + k, k), asked))
    first = ks.index(1)
    assert 20 < first < 100, ks  # not at once: a measured rate holds for a while
    assert ks[first + 1] == 0 and sum(ks) < len(ks) / 10  # measured again at 0: back to plain decoding, mostly


def test_acceptance_estimate_follows_a_rate_that_drifts_within_the_rollout():
    # the rows left in flight change as the fast ones finish: here the rate falls from 0.9 to 0.5 over 60 steps
    def estimate_after_drift(stats: AcceptanceStats) -> float:
        for rate in np.linspace(0.9, 0.5, 60):
            hits = int(round(100 * rate))
            stats.update([1] * 100, [1] * hits + [0] * (100 - hits))
        return float(stats.rates()[0])

    assert estimate_after_drift(AcceptanceStats(1)) == pytest.approx(0.5, abs=0.04)
    # the old defaults (slow decay, a prior worth a whole step) lagged: they overestimated every draft's worth
    assert estimate_after_drift(AcceptanceStats(1, prior_weight=1.0, decay=0.95)) > 0.6


def test_the_live_correction_keeps_sums_not_steps_and_follows_stalls_and_shifts():
    """The correction is decayed sums per batch-size bin: what a prediction reads does not grow with the steps measured
    (recomputing every kept step's weight cost 1.8 ms a step at 4,000 steps); a stalled first step is judged against
    the warm-up's own timing and does not reprice its width; a lasting change of the machine's speed is followed."""
    model = profiled(overhead_then_compute)
    truth = overhead_then_compute(64, 4, 3)
    rng = np.random.default_rng(0)
    model.add(64, 4, 3, 8 * truth)  # the run's first step stalled 8x
    for _ in range(5):
        model.add(64, 4, 3, truth * rng.uniform(0.95, 1.05))
    assert model.predict(64, [4], [3])[0] == pytest.approx(truth, rel=0.1)
    for _ in range(200):
        model.add(64, 4, 3, truth * rng.uniform(0.95, 1.05))
    shapes = (model.correction.sums.shape, model.correction.recent.shape)
    for _ in range(20_000):
        model.add(64, 4, 3, truth * rng.uniform(0.95, 1.05))
    assert (model.correction.sums.shape, model.correction.recent.shape) == shapes  # nothing grows with the steps
    assert model.measured.size <= model.measured.capacity
    assert model.predict(64, [4], [3])[0] == pytest.approx(truth, rel=0.03)
    for _ in range(600):  # three half-lives of steps 1.5x slower
        model.add(64, 4, 3, 1.5 * truth * rng.uniform(0.95, 1.05))
    assert model.predict(64, [4], [3])[0] == pytest.approx(1.5 * truth, rel=0.06)
    assert model.predict(64, [5], [4])[0] > 1.3 * overhead_then_compute(64, 5, 4)  # other widths follow the level


def test_a_step_in_which_no_row_had_a_draft_is_no_evidence_against_drafting():
    """Rows asked for drafts that no proposer had (a suffix proposer's first step of a rollout): the step fed one token
    a row and cost a plain step's time, so it does not count as drafts rejected, as a step whose drafts were."""
    rates = {}
    for name, width in (("before", None), ("nothing drafted", 1), ("drafted, all rejected", 4)):
        policy = policy_with(overhead_then_compute, acceptance=0.8)
        if width is not None:
            policy.observe(StepObservation(64, width, 0, 3e-3, {"draft_model": ([3] * 64, [0] * 64)}))
        rates[name] = policy.stats["draft_model"].rates()[0]
    # no evidence: the estimate only fades a little toward the prior; rejected drafts: it falls
    assert rates["before"] <= rates["nothing drafted"] < rates["before"] + 0.02, rates
    assert rates["drafted, all rejected"] < rates["before"] - 0.1, rates


def test_k_zero_is_tried_again_every_explore_every_steps_where_one_draft_could_pay():
    """At K = 0 acceptance is not measured, so evidence against drafting can go stale (a rollout's first drafts accept
    little, later ones more): every `explore_every` steps one step drafts one token, where a draft accepted at the
    prior's rate would pay; never where it could not (`test_exploration_...` checks that side)."""
    policy = policy_with(overhead_then_compute, acceptance=0.0)
    policy.explore_every = 5
    decisions = [policy.choose(64) for _ in range(10)]
    assert [d.num_draft_tokens for d in decisions] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert all(d.measuring for d in decisions if d.num_draft_tokens)
    assert policy.current == 0  # the trial step does not become the choice


# A GPU's decode step, shaped on an H200's (tiny-target-1b, bf16, CUDA graphs): the host spends 3 ms on a step, the
# device 2.2 ms plus what the tokens fed cost. The warm-up times every step in lockstep (host, then device); in the run
# a plain step is launched while the previous one computes and costs the longer of the two, a drafting step waits for
# the tokens its drafts follow and costs both, and so does the first plain step after it (nothing was launched ahead).
GPU_HOST = 3e-3


def gpu_device(batch_size, width):
    return 2.2e-3 + 3e-6 * batch_size + 6e-6 * max(0, batch_size * width - 256)


def gpu_lockstep(batch_size, width, passes=0):
    return GPU_HOST + gpu_device(batch_size, width)


def gpu_live(batch_size, width, after_drafting=False):
    if width == 1 and not after_drafting:
        return max(GPU_HOST, gpu_device(batch_size, 1))
    return gpu_lockstep(batch_size, width)


def gpu_calibrated(plain_prior: float) -> AutoPolicy:
    policy = AutoPolicy(4, {"suffix": False}, StepTimeTable(plain_prior=plain_prior))

    class Timer:  # the warm-up's steps, in lockstep
        max_batch_size, max_context = 512, 1024

        def fill(self, context):
            pass

        def time_step(self, batch_size, k, with_models=None):
            return StepObservation(batch_size, k + 1, 0, gpu_lockstep(batch_size, k + 1), {}, 0)

    policy.calibrate(Timer())
    return policy


def test_plain_steps_run_ahead_and_drafting_steps_are_priced_apart():
    """On an H200 a plain step, launched ahead of the device, measured 0.5-0.8x its warm-up time and a drafting step
    about 1x; the drafting widths were priced at the plain steps' ratio (a drafting step 2x the recent level was judged
    a stall, and widths without steps followed all widths' ratio), so auto drafted at a predicted gain of 1.1-1.4 and
    ran at 0.77-0.84x of no speculation. Each group (plain, drafting) now follows its own measured steps."""
    policy = gpu_calibrated(plain_prior=1.0)
    for _ in range(40):  # plain steps launched ahead
        policy.observe(StepObservation(128, 1, 0, gpu_live(128, 1), {}, 0))
    for width in (2, 3, 2, 3):  # a few drafting steps (exploration, a climb)
        policy.observe(StepObservation(128, width, 0, gpu_live(128, width), {}, 0))
    predicted = policy.step_times.predict(128, np.array([1, 2, 3, 4, 5]), np.zeros(5))
    truth = [gpu_live(128, w) for w in (1, 2, 3, 4, 5)]
    np.testing.assert_allclose(predicted[:3], truth[:3], rtol=0.03)  # the widths measured
    np.testing.assert_allclose(predicted[3:], truth[3:], rtol=0.07)  # the others: the table, at the drafting ratio
    assert truth[0] < 0.6 * gpu_lockstep(128, 1)  # the plain step's run-ahead discount, which the drafting ones lack


def test_an_unmeasured_plain_step_is_priced_at_the_plain_prior():
    """Where plain steps may run ahead of the device, a plain step never measured near a batch size is priced at half
    its warm-up time (the least it can cost), the drafting widths at theirs; measured steps then set both."""
    policy = gpu_calibrated(plain_prior=0.5)
    predicted = policy.step_times.predict(64, np.array([1, 3]), np.zeros(2))
    np.testing.assert_allclose(predicted, [0.5 * gpu_lockstep(64, 1), gpu_lockstep(64, 3)], rtol=1e-6)
    for _ in range(10):
        policy.observe(StepObservation(64, 1, 0, 0.8 * gpu_lockstep(64, 1), {}, 0))
    assert policy.step_times.predict(64, [1], [0])[0] == pytest.approx(0.8 * gpu_lockstep(64, 1), rel=0.03)
    # one run, 1.0 where plain steps run as the warm-up's (a CPU): the warm-up's own timing
    assert gpu_calibrated(1.0).step_times.predict(64, [1], [0])[0] == pytest.approx(gpu_lockstep(64, 1))


def simulated_rollout_seconds(policy: AutoPolicy | None, acceptance: float, seed: int = 0, rows: int = 256) -> float:
    """Seconds of a rollout of `rows` rows of random lengths (median 300 tokens) decoded at the policy's K (None: no
    speculation) on the GPU-shaped steps above, each draft accepted with probability `acceptance`."""
    rng = np.random.default_rng(seed)
    left = np.minimum(np.exp(rng.normal(np.log(300), 0.6, rows)).astype(int) + 1, 1024)
    seconds, last_k = 0.0, 0
    while (left > 0).any():
        active = left > 0
        batch_size = int(active.sum())
        k = policy.choose(batch_size, [4] * batch_size, ["suffix"] * batch_size).num_draft_tokens if policy else 0
        accepted = np.zeros(batch_size, dtype=np.int64)
        if k:
            hits = rng.random((batch_size, k)) < acceptance
            accepted = np.where(hits.all(1), k, hits.argmin(1))
        step = gpu_live(batch_size, k + 1, after_drafting=last_k > 0) * float(np.exp(0.03 * rng.standard_normal()))
        seconds, last_k = seconds + step, k
        left[active] -= np.minimum(1 + accepted, left[active])
        if policy is not None:
            policy.observe(
                StepObservation(batch_size, k + 1, 0, step, {"suffix": ([k] * batch_size, accepted.tolist())})
            )
    return seconds


@pytest.mark.parametrize(("acceptance", "least_speedup"), [(0.3, 0.95), (0.85, 1.15)])
def test_auto_does_not_lose_to_plain_steps_that_run_ahead(acceptance, least_speedup):
    """Whole rollouts on the GPU-shaped steps: where drafts accept little, auto stays within a few percent of no
    speculation (before: 0.90x); where they accept well, it drafts where that pays (1.27x; before: 1.09x, priced the
    plain steps at their lockstep time, never measured once it drafted)."""
    plain = simulated_rollout_seconds(None, acceptance)
    speedup = plain / simulated_rollout_seconds(gpu_calibrated(plain_prior=0.5), acceptance)
    assert speedup >= least_speedup, speedup
