"""SpecConfig and the per-batch-size table: valid configs work, invalid ones are errors naming the field or entry."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_model, random_prompts

from rollout import Generator, SamplingParams
from specdec.config import SpecConfig
from specdec.policies import StaticPolicy, TablePolicy


def test_ngram_defaults_and_vllm_field_names():
    spec = SpecConfig(**{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert spec.prompt_lookup_range() == (1, 4) and spec.prompt_lookup_min is None
    assert StaticPolicy(5).choose(300).num_draft_tokens == 5


def test_a_derived_default_is_derived_again_by_replace():
    """The longest match was stored when derived (4), so `replace(spec, prompt_lookup_min=6)` refused the 6 that the
    constructor takes (the longest then derives as 6)."""
    spec = SpecConfig(method="ngram")
    assert spec.prompt_lookup_range() == (1, 4) and spec.prompt_lookup_max is None
    assert dataclasses.replace(spec, prompt_lookup_min=6).prompt_lookup_range() == (6, 6)
    assert SpecConfig(method="ngram", prompt_lookup_min=6).prompt_lookup_range() == (6, 6)
    assert SpecConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=3).prompt_lookup_range() == (2, 3)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("verification", "Exact", r"verification \('Exact'\) must be one of exact, rejection"),  # ran rejection
        ("method", "bogus", r"method \('bogus'\) must be one of"),  # "spec.model must be a path ..."
        ("num_speculative_tokens", "3", r"num_speculative_tokens \('3'\) must be an integer >= 1"),
        ("num_speculative_tokens", -2, r"num_speculative_tokens \(-2\) must be an integer >= 1"),
        ("prompt_lookup_max", 0, r"prompt_lookup_max \(0\) must be an integer >= 1"),
    ],
)
def test_a_field_set_after_construction_is_checked_when_a_generator_is_built(field, value, match):
    """SpecConfig is a mutable dataclass checked only at construction: a field a trainer's config code set afterwards
    went into the Generator unchecked (verification='Exact' sampled by rejection, without a word)."""
    spec = SpecConfig(method="ngram", num_speculative_tokens=2)
    setattr(spec, field, value)
    with pytest.raises(ValueError, match=match):
        Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32, spec=spec)


def test_speculation_turned_off_after_construction_is_plain_decoding():
    spec = SpecConfig(method="ngram", num_speculative_tokens=2)
    spec.method = "none"  # the documented off value, set afterwards: it failed as "spec.model must be a path"
    gen = Generator(make_model("qwen2"), max_batch_size=2, max_seq_len=32, spec=spec)
    assert spec.method is None and gen.policy is None
    assert len(gen.generate([[1, 2]], SamplingParams(max_new_tokens=3, seed=0))[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"method": "eagle"}, r"method \('eagle'\) must be one of ngram, suffix, draft_model"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens \(0\) must be an integer >= 1"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, r"prompt_lookup_min \(3\) must be <= prompt_lookup_max"),
        ({"prompt_lookup_min": 0}, r"prompt_lookup_min \(0\)"),
        ({"method": "draft_model"}, "method 'draft_model' needs model"),
        ({"model": "tiny-draft"}, "add .draft_model. to method"),
    ],
)
def test_invalid_spec_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kwargs)


@pytest.mark.parametrize(
    "table,match",
    [
        ([[1, 64, 3], [60, 128, 1]], r"entries \[1, 64, 3\] and \[60, 128, 1\] overlap"),
        ([[1, 64, 3], [70, 128, 1]], r"leave a gap at 65"),
        ([[64, 1, 3]], r"entry \[64, 1, 3\] is reversed"),
        ([[1, 64, 9]], r"entry \[1, 64, 9\] has K=9 outside \[0, num_speculative_tokens=4\]"),
        ([[2, 64, 1]], r"leaves batch sizes 1..1 uncovered"),
        ([[1, 64]], r"must be three integers"),
        ([[1, 64, True], [65, 128, False]], r"entry \[1, 64, True\] must be three integers"),  # not K = 1 and 0
        ("fast", r"must be 'auto' or a list"),
    ],
)
def test_invalid_batch_size_tables_quote_the_entry(table, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(num_speculative_tokens=4, num_speculative_tokens_per_batch_size=table)


def test_valid_tables_in_every_shape_vllm_takes():
    """Pinned by a mutation review: a range of one batch size, entries out of order, tuples, and an empty table."""
    from specdec.policies import validate_batch_size_table

    assert validate_batch_size_table([[1, 1, 3], [2, 8, 0]], 4) == [(1, 1, 3), (2, 8, 0)]
    assert validate_batch_size_table([[65, 128, 1], [1, 64, 3]], 4) == [(1, 64, 3), (65, 128, 1)]
    assert validate_batch_size_table(((1, 64, 3), (65, 128, 0)), 4) == [(1, 64, 3), (65, 128, 0)]
    with pytest.raises(ValueError, match=r"must be 'auto' or a non-empty list"):
        validate_batch_size_table([], 4)
    with pytest.raises(ValueError, match="ends at batch size 127 but max_batch_size is 128"):
        TablePolicy([[1, 127, 3]], num_speculative_tokens=4, max_batch_size=128)  # a gap of one


def test_table_lookup_is_inclusive_and_must_cover_the_batch():
    table = [[1, 64, 3], [65, 128, 1], [129, 512, 0]]  # vLLM's documentation example
    policy = TablePolicy(table, num_speculative_tokens=3, max_batch_size=512)
    assert [policy.choose(b).num_draft_tokens for b in (1, 64, 65, 128, 129, 512)] == [3, 3, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="ends at batch size 128 but max_batch_size is 256"):
        TablePolicy(table[:2], num_speculative_tokens=3, max_batch_size=256)


def test_table_policy_in_the_generator_turns_drafts_off_for_large_batches():
    model = make_model("qwen2")
    table = [[1, 2, 3], [3, 8, 0]]
    spec = SpecConfig(
        method="draft_model", model=model, num_speculative_tokens=3, num_speculative_tokens_per_batch_size=table
    )
    gen = Generator(model, max_batch_size=8, max_seq_len=64, spec=spec)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
    for num_prompts, k in ((6, 0), (2, 3)):
        gen.generate([[5, 6, 7, 5, 6, 7, 5, 6]] * num_prompts, params)
        decode = [r for r in gen.last_trace if r.kind == "decode"]
        assert {r.batch_size for r in decode} == {num_prompts}
        # K comes from the table; near the length cap it is lowered further (no drafts past max_new_tokens)
        assert max(r.num_draft_tokens for r in decode) == k
        assert (sum(r.num_drafted for r in decode) > 0) == (k > 0)


def test_draft_with_another_vocabulary_is_refused():
    target = make_model("llama", vocab_size=97)
    draft = make_model("llama", vocab_size=101)
    with pytest.raises(
        ValueError, match=r"draft model's vocabulary \(101 tokens\) differs from the target's \(97\) by"
    ):
        Generator(target, spec=SpecConfig(method="draft_model", model=draft))


def test_a_draft_on_another_device_is_refused_when_built():
    """A loaded draft was taken as it was: one on another device failed later, mid-run (a draft on the meta device, its
    weights not loaded, in a bare RuntimeError from inside the engine)."""
    target = make_model("llama")
    draft = make_model("llama").to("meta")
    with pytest.raises(ValueError, match=r"^the draft model is on meta and the target on cpu: put the draft on"):
        Generator(target, spec=SpecConfig(method="draft_model", model=draft))


@pytest.mark.parametrize("target_rows, draft_rows", [(512, 508), (508, 512)])
@pytest.mark.parametrize("verification", ["exact", "rejection"])
def test_a_draft_whose_embeddings_are_padded_otherwise_drafts_and_changes_no_sample(
    target_rows, draft_rows, verification
):
    """From a helper's probe: a pair sharing a tokenizer, its matrices padded to other sizes (Qwen2.5's 0.5B has 151936
    rows, its 7B 152064), was refused. It drafts now: the target's ids past the draft's reach it as id 0, the draft's
    past the target's are never drafted; samples are those of no speculation (exact verification: the same tokens;
    rejection sampling: the same distribution, checked here at temperature 0)."""
    target = make_model("llama", vocab_size=target_rows)
    draft = make_model("qwen2", vocab_size=draft_rows, seed=1)
    prompts = random_prompts(6, vocab_size=508, seed=2) + [[target_rows - 1, target_rows - 3, 5]]  # (past 508: fed)
    temperature = 1.0 if verification == "exact" else 0.0
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=48, seed=4)
    spec = SpecConfig(method="draft_model", model=draft, num_speculative_tokens=3, verification=verification)
    drafted = Generator(target, max_batch_size=12, max_seq_len=64, spec=spec).generate(prompts, params)
    plain = Generator(target, max_batch_size=12, max_seq_len=64).generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    for a, b in zip(drafted, plain):
        assert a.logprobs == pytest.approx(b.logprobs, rel=0, abs=1e-9)
    assert target_rows < draft_rows or max(t for p in prompts for t in p) >= draft_rows
    emitted = [t for o in plain for t in o.token_ids]
    if temperature > 0 and target_rows > draft_rows:  # the draft met ids past its own embedding
        assert max(emitted) >= draft_rows
    if verification == "rejection":  # sampled: q over the target's ids (padded or cut), drafts accepted from it
        gen = Generator(target, max_batch_size=12, max_seq_len=64, spec=spec)
        sampled = gen.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=48, seed=4))
        assert all(len(o.token_ids) == len(o.logprobs) > 0 for o in sampled)
        assert sum(r.num_accepted for r in gen.last_trace) > 0


def test_rejection_sampling_under_the_auto_policy_warns_that_runs_will_differ():
    """Its uniforms are drawn by count, and auto's K follows measured times: the same seed gives other samples."""
    import warnings

    with pytest.warns(UserWarning, match="the same seed gives other samples from run to run"):
        SpecConfig(method="ngram", verification="rejection", num_speculative_tokens_per_batch_size="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpecConfig(method="ngram", verification="rejection")  # static K: reproducible
        SpecConfig(method="ngram", num_speculative_tokens_per_batch_size="auto")  # exact: reproducible
