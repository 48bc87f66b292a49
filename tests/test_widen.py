"""Widened models (`rollout.models.widen`): the shipped tiny models' function at a large Llama's cost.

The default tests widen into small shapes of the same construction (seconds on a CPU); the full shapes are checked
on the meta device, and the full `tiny-target-1b` is built once by a slow test (`scripts/check_widened.py` compares
it on more prompts).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from rollout import Generator, SamplingParams
from rollout.cli import sources
from rollout.models import zoo
from rollout.models.widen import DRAFT_150M, LLAMA_3_2_1B, WIDENED, WideShape, layer_positions, wide_config, widen
from rollout.tasks.arithmetic import format_completion, format_prompt, generate_problems
from specdec import SpecConfig

# The construction at test size: hidden 4x the shipped one (so the norm rescaling is exact), head_dim 2x, extra
# query heads, extra layers and MLP units, and one vocabulary for both (a draft must share the target's).
SMALL = {
    "tiny-target": WideShape(512, 6, 8, 4, 64, 640, 2048),
    "tiny-draft": WideShape(192, 3, 8, 2, 48, 256, 2048),
}
# Largest |log-prob difference| of the emitted tokens, widened vs shipped in the same dtype. The target agrees to
# float64 rounding. The draft agrees to float32 rounding only, even in float64: HF's RMSNorm sums squares in float32
# whatever the model's dtype, and torch sums 48 numbers in another order than the same 48 among 192 (it sums 128
# numbers and 128 among 512 or 2048 alike).
TOLERANCE = {
    ("tiny-target", torch.float64): 1e-9,
    ("tiny-target", torch.float32): 1e-4,
    ("tiny-draft", torch.float64): 1e-4,
    ("tiny-draft", torch.float32): 1e-4,
}


@pytest.fixture(scope="module")
def models():
    """`get(name, dtype)` -> (shipped model, its small widening, tokenizer), built once per module."""
    cache = {}

    def get(name: str, dtype: torch.dtype):
        if (name, dtype) not in cache:
            small, tokenizer = zoo.load_model(name, dtype=dtype)
            cache[name, dtype] = small, widen(small, SMALL[name], dtype=dtype), tokenizer
        return cache[name, dtype]

    return get


@pytest.fixture(scope="module")
def problems():
    return generate_problems(6, split="eval", seed=123)


@pytest.fixture(scope="module")
def texts(problems):
    """Held-out prompts followed by their reference solutions (teacher-forced, every position is a next token)."""
    return [format_prompt(p.problem) + format_completion(p.solution) for p in problems]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", ["tiny-target", "tiny-draft"])
def test_widened_model_computes_the_shipped_models_tokens_and_log_probs(models, texts, name, dtype):
    small, wide, tokenizer = models(name, dtype)
    vocab = small.config.vocab_size
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            small_logprobs = small(ids).logits.double().log_softmax(-1)
            wide_logprobs = wide(ids).logits.double().log_softmax(-1)
        if dtype == torch.float64:  # rounding cannot flip an argmax here: the greedy token at every position
            assert torch.equal(wide_logprobs.argmax(-1), small_logprobs.argmax(-1))
        emitted = ids[:, 1:, None]
        diff = (wide_logprobs[:, :-1, :vocab].gather(-1, emitted) - small_logprobs[:, :-1].gather(-1, emitted)).abs()
        assert diff.max().item() <= TOLERANCE[name, dtype], f"{name} {dtype}: log-probs differ by {diff.max():.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_added_vocabulary_rows_have_probability_exactly_zero(models, texts, dtype):
    for name in ("tiny-target", "tiny-draft"):
        small, wide, tokenizer = models(name, dtype)
        ids = tokenizer(texts[:3], return_tensors="pt", padding=True)
        with torch.no_grad():
            logits = wide(**ids).logits  # [3, T, 2048], in `dtype`
        for probs in (logits.softmax(-1), logits.float().softmax(-1)):
            assert probs.shape[-1] > small.config.vocab_size
            assert (probs[..., small.config.vocab_size :] == 0).all(), f"{name} {dtype}: an added row is sampled"
            assert (probs[..., : small.config.vocab_size].sum(-1) > 0.98).all()


def test_generator_greedy_with_widened_target_and_draft_gives_the_shipped_completions(models, problems):
    small, wide, tokenizer = models("tiny-target", torch.float64)
    wide_draft = models("tiny-draft", torch.float64)[1]
    prompt_ids = [tokenizer(format_prompt(p.problem))["input_ids"] for p in problems[:4]]
    params = SamplingParams(temperature=0.0, max_new_tokens=96)
    expected = Generator(small, max_batch_size=4, max_seq_len=512).generate(prompt_ids, params)
    spec = SpecConfig("draft_model", 4, model=wide_draft)
    for generator in (
        Generator(wide, max_batch_size=4, max_seq_len=512),
        Generator(wide, max_batch_size=4, max_seq_len=512, spec=spec),
    ):
        got = generator.generate(prompt_ids, params)
        for want, have in zip(expected, got):
            assert have.token_ids == want.token_ids
            assert max(abs(a - b) for a, b in zip(have.logprobs, want.logprobs)) <= 1e-9
    assert any(c.finish_reason == "stop" for c in expected), "some completions must end on EOS"


def test_the_padding_is_random_where_the_function_allows_and_zero_where_it_must(models, texts):
    small, wide, tokenizer = models("tiny-target", torch.float32)
    config, shape = small.config, SMALL["tiny-target"]
    n, d, units = config.hidden_size, config.head_dim, config.intermediate_size
    real = layer_positions(config.num_hidden_layers, shape.num_hidden_layers)
    added = next(i for i in range(shape.num_hidden_layers) if i not in real)
    inputs = {}
    hooks = [
        wide.model.layers[i]
        .get_submodule(proj)
        .register_forward_pre_hook(lambda module, args, key=(i, proj): inputs.__setitem__(key, args[0]))
        for i in (real[0], added)
        for proj in ("self_attn.o_proj", "mlp.down_proj")
    ]
    with torch.no_grad():
        wide(tokenizer(texts[0], return_tensors="pt")["input_ids"])
    for hook in hooks:
        hook.remove()
    heads = inputs[real[0], "self_attn.o_proj"].unflatten(-1, (shape.num_attention_heads, shape.head_dim))
    # real work on random weights: extra query heads, the unused value dims of real heads, extra MLP units, added layers
    assert heads[..., 1, :].std() > 1e-3 and heads[..., 0, d:].std() > 1e-3
    assert inputs[real[0], "mlp.down_proj"][..., units:].std() > 1e-3
    assert inputs[added, "self_attn.o_proj"].std() > 1e-3 and inputs[added, "mlp.down_proj"].std() > 1e-3
    layer = wide.model.layers[real[0]]
    keys = layer.self_attn.k_proj.weight.unflatten(0, (shape.num_key_value_heads, shape.head_dim))
    assert keys[:, 1::2, :n].std() > 1e-3  # key dims the query ignores
    assert wide.model.embed_tokens.weight[config.vocab_size :, :n].std() > 1e-3  # the LM head's added rows
    # writes into the residual stream: only the shipped block is non-zero, and added layers write nothing
    assert (layer.self_attn.o_proj.weight[n:] == 0).all() and (layer.mlp.down_proj.weight[n:] == 0).all()
    assert (layer.mlp.down_proj.weight[:, units:] == 0).all()
    assert (wide.model.layers[added].self_attn.o_proj.weight == 0).all()
    assert (wide.model.layers[added].mlp.down_proj.weight == 0).all()


def test_full_shapes_are_llama_3_2_1b_and_a_150m_draft():
    counts = {}
    for name, (base, shape) in WIDENED.items():
        config = wide_config(AutoConfig.from_pretrained(zoo.model_path(base)), shape)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.tie_weights()  # transformers 5.0 ties at loading, not at construction
        counts[name] = model.num_parameters()
        assert counts[name] == shape.num_parameters()
        assert config.tie_word_embeddings and config.vocab_size == 128256
    target = wide_config(AutoConfig.from_pretrained(zoo.model_path("tiny-target")), LLAMA_3_2_1B)
    llama_3_2_1b = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8)
    assert {key: getattr(target, key) for key in llama_3_2_1b} == llama_3_2_1b
    assert (target.head_dim, target.intermediate_size) == (64, 8192)
    assert counts["tiny-target-1b"] == 1_235_814_400  # Llama-3.2-1B's count (tied embeddings)
    assert LLAMA_3_2_1B.kv_bytes_per_token(2) == 32 * 1024
    assert 100e6 <= counts["tiny-draft-150m"] <= 150e6 and DRAFT_150M.vocab_size == LLAMA_3_2_1B.vocab_size


def test_zoo_names_and_errors():
    assert zoo.WIDENED_NAMES == ("tiny-target-1b", "tiny-draft-150m")
    with pytest.raises(ValueError, match="valid names: tiny-target, tiny-draft, tiny-target-1b, tiny-draft-150m"):
        zoo.model_path("tiny-gpt")
    with pytest.raises(ValueError, match="built at load time from 'tiny-target'"):
        zoo.model_path("tiny-target-1b")
    small, _ = zoo.load_model("tiny-draft")
    with pytest.raises(ValueError, match="float16"):
        widen(small, SMALL["tiny-draft"], dtype=torch.float16)
    with pytest.raises(ValueError, match=r"head_dim \(64\) must be a multiple of 24"):
        widen(small, WideShape(192, 3, 8, 2, 64, 256, 2048))
    with pytest.raises(ValueError, match=r"hidden_size \(48\) must be more than 48"):
        widen(small, WideShape(48, 3, 8, 2, 48, 256, 2048))


def test_recipe_names_resolve_to_widened_models():
    draft = sources.draft_model_spec("tiny-draft-150m", "float32", "cpu")
    assert isinstance(draft, LlamaForCausalLM) and draft.num_parameters() == DRAFT_150M.num_parameters()
    assert sources.draft_model_spec("tiny-draft", "float32", "cpu") == "tiny-draft"  # the generator loads it
    with pytest.raises(ValueError, match="tiny-target-1b"):
        sources.load_model("tiny-gpt")


@pytest.mark.slow
def test_tiny_target_1b_builds_from_a_recipe_name_and_predicts_the_shipped_tokens():
    wide, tokenizer = sources.load_model("tiny-target-1b", "bfloat16")
    small, _ = zoo.load_model("tiny-target", dtype=torch.float32)
    assert wide.num_parameters() == 1_235_814_400 and len(tokenizer) == small.config.vocab_size
    problem = generate_problems(1, split="eval", seed=123)[0]
    ids = tokenizer(format_prompt(problem.problem) + format_completion(problem.solution), return_tensors="pt")
    with torch.no_grad():
        wide_logits = wide(ids["input_ids"][:, :64]).logits.float()
        small_logits = small(ids["input_ids"][:, :64]).logits
    assert (wide_logits.softmax(-1)[..., small.config.vocab_size :] == 0).all()
    agree = (wide_logits.argmax(-1) == small_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"bf16 1B agrees with the float32 shipped model on {agree:.2f} of greedy tokens"
