"""Speculative decoding is lossless: exact greedy tokens, exact sampling distribution, exact log-probs."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from conftest import make_model, random_prompts
from scipy.stats import chisquare
from test_generator import teacher_forced_logprobs

import specdec.verify
from rollout import Generator, SamplingParams
from rollout_kernels.race_logits import race_logits_ref
from rollout_kernels.rejection_sample import rejection_sample_ref
from specdec.config import SpecConfig
from specdec.processing import RowSampling, processed_logprobs
from specdec.proposers.draft_model import _race_draft
from specdec.tree import layout_drafts
from specdec.verify import RaceKeys, verify_exact


def spec_for(method: str, k: int, draft=None, verification: str = "exact") -> SpecConfig:
    common = dict(num_speculative_tokens=k, verification=verification)
    if method == "ngram":
        return SpecConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3, **common)
    if method == "suffix":
        return SpecConfig(method="suffix", **common)
    return SpecConfig(method="draft_model", model=draft, **common)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_speculation_equals_plain_greedy(arch, method, k):
    model = make_model(arch)
    draft = make_model(arch, seed=1, num_hidden_layers=1)
    # repetitive prompts give the n-gram proposer matches at some steps and none at others
    prompts = [p * 3 for p in random_prompts(7, max_len=5, seed=3)] + random_prompts(4, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    plain = Generator(model, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    gen = Generator(model, max_batch_size=4, max_seq_len=96, spec=spec_for(method, k, draft))
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    assert sum(r.num_drafted for r in decode) > 0
    assert sum(r.num_accepted for r in decode) > 0 or method == "draft_model"
    if method == "ngram":  # some steps had rows without a draft
        assert any(r.num_drafted < r.batch_size * r.num_draft_tokens for r in decode)
    for r in decode:
        assert r.num_accepted <= r.num_drafted and r.num_emitted <= r.num_accepted + r.batch_size
        assert sum(r.drafted_per_position) == r.num_drafted and sum(r.accepted_per_position) == r.num_accepted


def test_self_draft_accepts_everything_under_greedy():
    model = make_model("qwen2")
    prompts = random_prompts(5, seed=5)
    gen = Generator(model, max_batch_size=8, max_seq_len=96, spec=spec_for("draft_model", 4, model))
    gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    assert sum(r.num_accepted for r in decode) == sum(r.num_drafted for r in decode) > 0


def test_a_self_draft_still_accepts_everything_after_a_restore_that_changes_the_pending_token():
    # a restore may change a row's pending token: the draft model's cache past it holds another text, and steps at
    # K = 0 (the table below turns drafting off at one row) must not carry it into the next drafts
    model = make_model("qwen2")
    prompts = random_prompts(3, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    spec = SpecConfig(
        method="draft_model", model=model, num_speculative_tokens=3,
        num_speculative_tokens_per_batch_size=[[1, 1, 0], [2, 4, 3]],
    )  # fmt: skip
    gen = Generator(model, max_batch_size=4, max_seq_len=96, spec=spec)
    gen.add_requests(prompts[:2], params)
    gen.step()  # the prefill
    saved = gen.snapshot()[0]
    for _ in range(5):
        gen.step()  # K = 3: the draft cache runs past the snapshot
    gen.restore([dataclasses.replace(saved, pending=(saved.pending + 1) % model.config.vocab_size)])
    for _ in range(8):
        gen.step()  # one row: K = 0, the draft model is not asked
    gen.add_requests([prompts[2]], params, keep_in_flight=True)
    gen.last_trace = []
    while gen.has_unfinished:
        gen.step()
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    assert sum(r.num_accepted for r in decode) == sum(r.num_drafted for r in decode) > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=20, seed=4, n=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=20, seed=5, n=2),
        SamplingParams(temperature=4.0, max_new_tokens=20, seed=6, n=2),  # flat: every token a candidate
    ],
    ids=["t1", "t0.7-topk-topp", "t4"],
)
def test_self_draft_accepts_everything_under_exact_sampling(params):
    """A draft model that is the target draws its drafts by the target's race at the same positions, so exact
    verification accepts every one: a draft keyed by the wrong position, or a winner picked wrongly among its
    candidates, is rejected here."""
    model = make_model("qwen2")
    prompts = random_prompts(5, seed=5)
    gen = Generator(model, max_batch_size=10, max_seq_len=96, spec=spec_for("draft_model", 4, model))
    gen.generate(prompts, params)
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    assert sum(r.num_accepted for r in decode) == sum(r.num_drafted for r in decode) > 0


def test_a_moved_row_keeps_its_draft_state():
    """The draft model's per-slot state (cache length, cached drafts) follows its row when the row moves into a hole.
    A long prompt with a short completion finishes first and the short prompt's row moves into its slot; a draft model
    that is the target accepts every draft (greedy) only if the moved row's draft cache length is its own: the
    finished row's would claim positions the moved row never fed its draft model."""
    model = make_model("qwen2")
    prompts = [random_prompts(1, max_len=3, seed=10)[0] * 14, random_prompts(1, max_len=3, seed=11)[0]]
    params = [SamplingParams(temperature=0, max_new_tokens=m) for m in (5, 40)]
    gen = Generator(model, max_batch_size=2, max_seq_len=128, spec=spec_for("draft_model", 3, model))
    proposer = gen.proposers.proposers["draft_model"]
    moves, copy_rows = [], proposer.copy_rows
    proposer.copy_rows = lambda src, dst, n: (moves.append(dst.tolist()), copy_rows(src, dst, n))
    gen.generate(prompts, params)
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    assert moves == [[0]]  # the second row moved into the first's slot once
    assert sum(r.num_accepted for r in decode) == sum(r.num_drafted for r in decode) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_draft_model_races_with_the_targets_code(dtype):
    """A draft model draws draft j by the target's own race (noise, score, top-k / top-p, greedy rows): given the
    target's logits, its draft is the token exact verification draws at that position, on every row."""
    generator = torch.Generator().manual_seed(6)
    num_rows, vocab_size = 60, 300
    logits = (3 * torch.randn(num_rows, vocab_size, generator=generator, dtype=torch.float64)).to(dtype)
    temperature = torch.tensor([1.0, 0.7, 1.5, 0.0] * (num_rows // 4), dtype=torch.float64)
    top_k = torch.tensor([0, 20, 0, 0, 5] * (num_rows // 5))
    top_p = torch.tensor([1.0, 1.0, 0.8] * (num_rows // 3), dtype=torch.float64)
    sampling = RowSampling(temperature, top_k, top_p, True, False, True)
    race = RaceKeys(torch.randint(0, 2**62, (num_rows,), generator=generator), torch.randint(0, 300, (num_rows,)))
    drafts = _race_draft(logits, sampling, race, 2)
    ahead = RaceKeys(race.seeds, race.positions + 2)
    layout = layout_drafts([0] * num_rows, None)
    target = verify_exact(logits, torch.zeros(num_rows, dtype=torch.long), layout, sampling, ahead)
    assert torch.equal(drafts, target.output_token_ids[:, 0])
    assert not torch.equal(drafts, _race_draft(logits, sampling, race, 3)), "the draft ignores its position"


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=1, n=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=16, seed=2),
    ],
    ids=["t1", "t0.7-topk-topp"],
)
def test_logprobs_with_speculation_equal_teacher_forced_pass(method, params):
    model = make_model("llama")
    draft = make_model("llama", seed=1)
    prompts = [p * 2 for p in random_prompts(5, max_len=6, seed=6)]
    gen = Generator(model, max_batch_size=4, max_seq_len=96, spec=spec_for(method, 3, draft))
    outs = gen.generate(prompts, params)
    assert sum(r.num_drafted for r in gen.last_trace) > 0
    for out in outs:
        expected = teacher_forced_logprobs(model, prompts[out.prompt_index], out.token_ids, params)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=1e-9, rtol=0)


# ---- the sampling distribution ------------------------------------------------------------------------------------

VOCAB = 8
NUM_SAMPLES = 6000


def wrong_residual_rejection_sample(draft_ids, cu, draft_probs, target_probs, accept_u, sample_u, max_k):
    """The negative control: correct acceptance, but a rejected draft is replaced by a sample from p itself
    instead of normalise(max(p - q, 0)) (or p without the draft, for n-gram drafts)."""
    out, num_emitted = rejection_sample_ref(draft_ids, cu, draft_probs, target_probs, accept_u, sample_u, max_k)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    for row in range(out.shape[0]):
        accepted = int(num_emitted[row]) - 1
        if accepted < int(cu[row] - starts[row]):  # this row rejected a draft: resample its last token from p
            p = target_probs[int(starts[row]) + row + accepted].double()
            cdf = torch.cumsum(p, 0)
            out[row, accepted] = int(torch.searchsorted(cdf, sample_u[row] * cdf[-1], right=True).clamp(max=len(p) - 1))
    return out, num_emitted


def pair_distribution(model, prompt, params):
    """Exact P(t1, t2) under the processed target distribution: the cells of the chi-square test."""
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1:]
        pairs = torch.cat([torch.tensor([prompt]).repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
        seconds = model(pairs).logits[:, -1]

    def probs(logits):
        rows = logits.shape[0]
        sampling = RowSampling(
            torch.full((rows,), float(params.temperature)),
            torch.full((rows,), params.top_k),
            torch.full((rows,), float(params.top_p)),
            needs_filter=True,
            all_greedy=False,
            any_greedy=False,
        )
        return processed_logprobs(logits, sampling).exp()

    return (probs(first)[0][:, None] * probs(seconds)).flatten()  # [VOCAB * VOCAB]


def sampled_pairs(model, prompt, params, spec):
    gen = Generator(model, max_batch_size=1024, max_seq_len=32, spec=spec)
    outs = gen.generate([prompt], params)
    drafted = sum(r.num_drafted for r in gen.last_trace)
    rejected = drafted - sum(r.num_accepted for r in gen.last_trace)
    counts = collections.Counter(o.token_ids[0] * VOCAB + o.token_ids[1] for o in outs)
    return torch.tensor([counts[c] for c in range(VOCAB * VOCAB)], dtype=torch.float64), drafted, rejected


def chi_square_p(observed, expected_probs):
    keep = expected_probs * observed.sum() >= 5  # merge rare cells into one so the test is valid
    obs = torch.cat([observed[keep], observed[~keep].sum()[None]])
    exp = torch.cat([expected_probs[keep], expected_probs[~keep].sum()[None]]) * observed.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs.numpy(), exp.numpy()).pvalue


def race_without_positions(logits, logit_rows, temperatures, seeds, positions, *keep):
    """The negative control of exact verification: every position of a sample races with the same noise."""
    return race_logits_ref(logits, logit_rows, temperatures, seeds, torch.zeros_like(positions), *keep)


@pytest.mark.slow
@pytest.mark.parametrize("verification", ["exact", "rejection"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 6, 0.95)])
def test_sampling_with_speculation_follows_the_target_distribution(
    method, temperature, top_k, top_p, verification, monkeypatch
):
    model = make_model("llama", vocab_size=VOCAB, seed=7)
    draft = make_model("llama", vocab_size=VOCAB, seed=8)
    prompt = [1, 2, 3, 1, 2, 3, 4, 5, 6, 7, 0, 4, 5]  # every token appears: the n-gram proposer always has a match
    params = SamplingParams(n=NUM_SAMPLES, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=3, seed=9)
    spec = spec_for(method, 1, draft, verification)
    expected = pair_distribution(model, prompt, params)

    observed, drafted, rejected = sampled_pairs(model, prompt, params, spec)
    assert drafted > NUM_SAMPLES // 2 and rejected > NUM_SAMPLES // 10, "the test needs drafts and rejections"
    assert chi_square_p(observed, expected) > 1e-3

    if verification == "exact":  # the same test catches noise that is not keyed by the token's position
        monkeypatch.setattr(specdec.verify, "race_logits_ref", race_without_positions)
    else:  # and a verifier that samples a rejected position from p instead of the residual
        monkeypatch.setattr(specdec.verify, "rejection_sample_ref", wrong_residual_rejection_sample)
    observed, _, _ = sampled_pairs(model, prompt, params, spec)
    assert chi_square_p(observed, expected) < 1e-6
