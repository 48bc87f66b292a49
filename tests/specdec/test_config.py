"""SpecConfig and the per-batch-size table: valid configs work, invalid ones are errors naming the field or entry."""

from __future__ import annotations

import pytest
from conftest import make_model

from rollout import Generator, SamplingParams
from specdec.config import SpecConfig
from specdec.policies import StaticPolicy, TablePolicy


def test_ngram_defaults_and_vllm_field_names():
    spec = SpecConfig(**{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 4)
    assert StaticPolicy(5).choose(300).num_draft_tokens == 5


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
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(101 tokens\) differs from the target's \(97\)"):
        Generator(target, spec=SpecConfig(method="draft_model", model=draft))


def test_rejection_sampling_under_the_auto_policy_warns_that_runs_will_differ():
    """Its uniforms are drawn by count, and auto's K follows measured times: the same seed gives other samples."""
    import warnings

    with pytest.warns(UserWarning, match="the same seed gives other samples from run to run"):
        SpecConfig(method="ngram", verification="rejection", num_speculative_tokens_per_batch_size="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpecConfig(method="ngram", verification="rejection")  # static K: reproducible
        SpecConfig(method="ngram", num_speculative_tokens_per_batch_size="auto")  # exact: reproducible
