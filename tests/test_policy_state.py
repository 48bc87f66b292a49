"""Generation samples from the policy as it is now: eval mode whatever mode the trainer left it in, the trainer's
precision, the adapters as they are switched (`rollout.engine.graph_key`, `rollout.engine.graph_runner`).

A CPU cannot capture graphs; it runs the graph runner's padded forward (`capture=False`), which is what a graph
replays, and checks the key that decides when graphs are captured again. The replay itself: `tests/test_gpu.py`."""

from __future__ import annotations

import functools
from types import MethodType

import numpy as np
import pytest
import torch
from conftest import make_model, random_prompts
from test_graphs import padded_generator

from rollout import Generator, SamplingParams
from specdec.config import SpecConfig


def lora_policy(dropout: float = 0.0, dtype: torch.dtype = torch.float64, **overrides):
    """A Llama with live LoRA adapters (random B: a fresh LoRA is the identity) on q and v."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=dropout, init_lora_weights=False)
    return get_peft_model(make_model("llama", dtype=dtype, **overrides), config)


def wrapped_in_autocast(model, dtype=torch.bfloat16):
    """`model` with its forward wrapped as accelerate's `prepare` wraps a trainer's policy for mixed precision: the
    plain forward kept as `_original_forward`, the new one under autocast with float32 outputs."""
    from accelerate.utils import convert_outputs_to_fp32

    model._original_forward = model.forward
    device_type = next(model.parameters()).device.type
    autocast_forward = torch.autocast(device_type, dtype=dtype)(model.forward.__func__)
    model.forward = MethodType(convert_outputs_to_fp32(autocast_forward), model)
    return model


def samples(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.token_ids, o.logprobs) for o in outs]


def assert_same_samples(outs, expected) -> None:
    """The same tokens, and float64 log-probs equal to rounding (a batch of other widths rounds differently)."""
    got = samples(outs)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, logprobs), (_, want) in zip(got, expected):
        assert logprobs == pytest.approx(want, rel=0, abs=1e-9)


# ---- dropout: a policy left in train mode ---------------------------------------------------------------------------


def test_the_dropout_under_test_is_live_in_train_mode():
    """What the tests below rely on: this policy's forwards in train mode differ from each other (else equality with
    eval mode would prove nothing)."""
    model = lora_policy(dropout=0.5, attention_dropout=0.5)
    ids = torch.tensor([random_prompts(1, min_len=8, max_len=8, seed=1)[0]])
    model.train()
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    model.eval()
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


SPECS = {
    "none": None,
    "suffix": SpecConfig(method="suffix", num_speculative_tokens=3),
    "ngram tree": SpecConfig(method="ngram", num_speculative_tokens=4, num_candidates=3, prompt_lookup_min=1),
}
LAYOUTS = {
    "slots": functools.partial(Generator, kv_layout="slots"),
    "paged": functools.partial(Generator, kv_layout="paged"),
    "padded": functools.partial(padded_generator, graphs=True),  # what a graph replays
}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_policy_left_in_train_mode_samples_what_it_samples_in_eval_mode(layout, spec):
    """Attention dropout and LoRA dropout of 0.5, the policy in train mode (as TRL leaves it): `generate` and the
    public engine (`add_requests`, then `step`, as a server drives it) sample exactly what the eval-mode policy
    samples, and hand the policy back in train mode."""
    model = lora_policy(dropout=0.5, attention_dropout=0.5)
    prompts = random_prompts(5, max_len=12, seed=4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=3)
    model.eval()
    expected = samples(layout(model, max_batch_size=4, max_seq_len=48, spec=spec).generate(prompts, params))
    model.train()
    gen = layout(model, max_batch_size=4, max_seq_len=48, spec=spec)
    assert_same_samples(gen.generate(prompts, params), expected)
    assert model.training
    sequences = gen.add_requests(prompts, params)  # drafts now from the first call's history too: other widths
    while gen.has_unfinished:
        gen.step()
    assert_same_samples([seq.completion() for seq in sequences], expected)
    assert model.training


def test_two_generators_over_one_policy_on_two_threads_both_sample_in_eval_mode():
    """Each call took the policy's modes down when it began and handed them back when it ended: with two generators
    over one policy in train mode on two threads (as the refusal of a second thread advises), B began while A held
    the policy in eval mode (nothing to switch), then A's end put it back in train mode under B's steps, which then
    sampled with dropout, without a word. Here A ends while B is between two steps, every time: B's forwards all run
    in eval mode, its samples are the eval-mode policy's, and the policy is handed back in train mode."""
    import threading

    model = lora_policy(dropout=0.5, attention_dropout=0.5)
    prompts = random_prompts(3, max_len=12, seed=5)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7)
    model.eval()
    expected = samples(Generator(model, max_batch_size=6, max_seq_len=48).generate(prompts, params))
    model.train()
    first, second = (Generator(model, max_batch_size=6, max_seq_len=48) for _ in range(2))
    b_stepping, a_done = threading.Event(), threading.Event()
    modes, result = [], {}
    model.register_forward_pre_hook(lambda module, args: modes.append(module.training) if a_done.is_set() else None)

    def b_step(*_):
        b_stepping.set()
        assert a_done.wait(60), "expected A's call to end"

    def run_b():
        result["b"] = second.generate(prompts, params, on_step=b_step)

    def a_step(*_):
        if not b_stepping.is_set():
            thread.start()
            assert b_stepping.wait(60), "expected B's call to begin"

    thread = threading.Thread(target=run_b)
    first.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0), on_step=a_step)
    a_done.set()
    thread.join(60)
    assert modes and not any(modes), "expected B's forwards after A's end in eval mode"
    assert_same_samples(result["b"], expected)
    assert model.training and all(m.training for m in model.modules())


def test_generation_hands_every_module_back_in_its_own_mode():
    """A trainer may keep part of a policy in train mode frozen in eval (model.train() then a submodule's .eval()):
    generation must not switch it back to train mode."""
    model = lora_policy(dropout=0.5)
    model.train()
    frozen = model.get_output_embeddings()
    frozen.eval()
    gen = Generator(model, max_batch_size=2, max_seq_len=32)
    gen.generate(random_prompts(2, seed=1), SamplingParams(temperature=0, max_new_tokens=4))
    gen.add_requests(random_prompts(1, seed=2), SamplingParams(temperature=0, max_new_tokens=2))
    while gen.has_unfinished:
        gen.step()
    assert model.training and not frozen.training
    assert all(m.training for m in model.modules() if m is not frozen)


def test_a_draft_model_in_train_mode_drafts_in_eval_mode_and_is_handed_back_as_found():
    """`SpecConfig(model=...)` takes a model its owner may be training (or the policy itself, as a self-draft): building
    the generator leaves it in its mode, and each call drafts in eval mode and hands it back."""
    target = make_model("llama")
    draft = make_model("llama", attention_dropout=0.5)  # the target's weights: in eval mode, every draft accepted
    draft.train()
    spec = SpecConfig(method="draft_model", num_speculative_tokens=3, model=draft)
    gen = Generator(target, max_batch_size=4, max_seq_len=48, spec=spec)
    assert draft.training
    gen.generate(random_prompts(3, max_len=10, seed=6), SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=2))
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    assert sum(r.num_accepted for r in decode) == sum(r.num_drafted for r in decode) > 0
    assert all(m.training for m in draft.modules())
    policy = make_model("llama")
    policy.train()  # a self-draft: the trainer's policy
    Generator(policy, max_batch_size=2, max_seq_len=48, spec=SpecConfig(method="draft_model", model=policy))
    assert policy.training


# ---- precision: a trainer's autocast around the policy's forward ----------------------------------------------------


@pytest.mark.parametrize("change", ["cast to float64", "caller's autocast"])
def test_the_slot_cache_follows_the_policys_precision_from_call_to_call(change):
    """The slot layout's buffers take the dtype they were first written in; a policy cast after the generator was
    built, or a caller's autocast after a call without, failed in index_put ("dtypes match"): each call now
    generates what a generator built for the policy as it is generates."""
    model = make_model("llama", dtype=torch.float32)
    prompts = random_prompts(4, max_len=12, seed=7)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1)
    gen = Generator(model, max_batch_size=8, max_seq_len=48, kv_layout="slots")
    gen.generate(prompts, params)
    if change == "cast to float64":
        model.to(torch.float64)
        expected = samples(
            Generator(model, max_batch_size=8, max_seq_len=48, kv_layout="slots").generate(prompts, params)
        )
        assert samples(gen.generate(prompts, params)) == expected
        return
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = Generator(model, max_batch_size=8, max_seq_len=48, kv_layout="slots")
        expected = samples(fresh.generate(prompts, params))
        assert samples(gen.generate(prompts, params)) == expected
    assert samples(gen.generate(prompts, params)) == samples(fresh.generate(prompts, params))  # and back


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_the_paged_pool_follows_a_policy_cast_after_the_generator_was_built(dtype, graphs):
    """The paged pool kept the dtype it was made in: after `model.to(torch.bfloat16)` a float32 pool attended in
    float32, and the samples were not those of a generator built for the bf16 policy (tokens changed, log-probs off
    by up to 7 on the shipped model); after a cast to float64 it attended in float32 (off by 1e-5). The pool now
    follows the policy, its keys and values converted, and the graphs of the old pools are dropped."""
    model = make_model("llama", dtype=torch.float32)
    prompts = random_prompts(4, max_len=12, seed=7)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1)
    gen = padded_generator(model, graphs, max_batch_size=8, max_seq_len=48)
    gen.generate(prompts, params)
    model.to(dtype)
    expected = samples(padded_generator(model, graphs, max_batch_size=8, max_seq_len=48).generate(prompts, params))
    assert samples(gen.generate(prompts, params)) == expected
    assert gen.runner.cache.dtype == dtype and gen.runner.cache.v_pools[-1].dtype == dtype


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_policy_cast_between_two_steps_is_followed_by_the_padded_forward(temperature):
    """The step API with the host one step ahead: a cast between two `step()` calls (a trainer's, mid-serving) left the
    graph runner's buffers in the old dtype, and its greedy steps, whose LM head runs after the replay, failed
    ("expected m1 and m2 to have the same dtype"). They now read the policy again and sample what the eager paged
    forward samples through the same cast."""

    def served(graphs: bool) -> list:
        model = make_model("llama", dtype=torch.float32)
        gen = padded_generator(model, graphs, max_batch_size=8, max_seq_len=48, async_scheduling=True)
        params = SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=1)
        gen.add_requests(random_prompts(4, max_len=12, seed=7), params)
        finished = gen.step().finished + gen.step().finished + gen.step().finished
        model.to(torch.float64)
        while gen.has_unfinished:
            finished += gen.step().finished
        assert gen.runner.cache.dtype == torch.float64
        return sorted((o.prompt_index, o.sample_index, o.token_ids) for o in finished)

    expected = served(graphs=False)
    assert len(expected) == 8 and served(graphs=True) == expected


def test_invalidate_graphs_has_the_pool_follow_an_autocast_the_policy_enters_unseen():
    """A change only `invalidate_graphs` reveals (here the policy's class swapped for one whose forward enters a bf16
    autocast): the graphs observed the new autocast, the paged pool kept float32; both follow it now."""
    model = make_model("llama", dtype=torch.float32)
    gen = padded_generator(model, True, max_batch_size=8, max_seq_len=48)
    prompts, params = random_prompts(3, max_len=12, seed=7), SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    gen.generate(prompts, params)
    base = type(model)
    model.__class__ = type("Autocast" + base.__name__, (base,), {"forward": torch.autocast("cpu")(base.forward)})
    gen.invalidate_graphs()
    gen.generate(prompts, params)
    assert gen.runner.graphs.key.autocast == torch.bfloat16 and gen.runner.cache.dtype == torch.bfloat16


def test_the_paged_pool_holds_keys_in_the_dtype_an_autocast_attends_in():
    """Float32 weights under a bf16 autocast (a trainer's, around the call or wrapped around the policy's forward):
    sdpa attends in bf16, and so does the paged pool now, at half a float32 pool's memory (it held float32, the
    keys and values cast up). A call without the autocast holds float32 again, and samples as before."""
    model = make_model("llama", dtype=torch.float32)
    prompts = random_prompts(4, max_len=12, seed=7)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1)
    gen = padded_generator(model, False, max_batch_size=8, max_seq_len=48)
    plain = samples(gen.generate(prompts, params))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = samples(gen.generate(prompts, params))
        assert gen.runner.cache.dtype == torch.bfloat16
        fresh = padded_generator(model, False, max_batch_size=8, max_seq_len=48)
        assert fresh.runner.cache.dtype == torch.bfloat16 and samples(fresh.generate(prompts, params)) == under
    assert samples(gen.generate(prompts, params)) == plain != under
    assert gen.runner.cache.dtype == torch.float32
    wrapped_in_autocast(model)  # accelerate's wrapper, put on after the generator was built
    assert samples(gen.generate(prompts, params)) == under and gen.runner.cache.dtype == torch.bfloat16


def test_the_padded_forward_computes_in_the_policys_own_autocast():
    """Float32 weights under accelerate's bf16 wrapper (TRL's `bf16=True`): prefills run through the wrapped forward in
    bf16, and the decode steps a graph replays (which call the decoder and LM head directly) must compute in bf16 too,
    not in the weights' float32: the same samples and log-probs as the eager paged forward."""
    model = wrapped_in_autocast(make_model("llama", dtype=torch.float32))
    prompts = random_prompts(5, max_len=12, seed=6)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=2)
    eager = padded_generator(model, False, max_batch_size=4, max_seq_len=48)
    padded = padded_generator(model, True, max_batch_size=4, max_seq_len=48)
    assert padded.runner.forward_autocast == torch.bfloat16 and padded.runner.graphs.key.autocast == torch.bfloat16
    expected = samples(eager.generate(prompts, params))
    assert samples(padded.generate(prompts, params)) == expected
    assert not padded.runner.graphs.head_in_graph  # float32 weights under bf16: the head ran eagerly, in bf16
    # the wrapper is what made them bf16: the plain float32 forward gives other log-probs
    model.forward = model._original_forward
    plain = padded_generator(model, True, max_batch_size=4, max_seq_len=48)
    assert plain.runner.forward_autocast is None
    assert [lp for _, lp in samples(plain.generate(prompts, params))] != [lp for _, lp in expected]


def test_the_padded_forward_follows_an_autocast_wrapper_put_on_or_taken_off_after_it_was_built():
    """`accelerator.prepare(model)` after the generator exists wraps the policy's forward in autocast, and
    `unwrap_model(..., keep_fp32_wrapper=False)` takes the wrapper off: the graphs observe the forward's autocast
    again and compute as the eager paged forward does, either way."""
    model = make_model("llama", dtype=torch.float32)
    prompts = random_prompts(4, max_len=12, seed=6)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=2)
    eager = padded_generator(model, False, max_batch_size=4, max_seq_len=48)
    padded = padded_generator(model, True, max_batch_size=4, max_seq_len=48)
    wrapped_in_autocast(model)
    expected = samples(eager.generate(prompts, params))
    assert samples(padded.generate(prompts, params)) == expected
    assert padded.runner.graphs.key.autocast == torch.bfloat16
    model.forward = MethodType(model._original_forward.__func__, model)  # as accelerate's unwrap does
    expected_plain = samples(eager.generate(prompts, params))
    assert samples(padded.generate(prompts, params)) == expected_plain != expected
    assert padded.runner.graphs.key.autocast is None


def test_the_padded_forward_calls_the_lm_head_the_policy_holds_now():
    """An LM head replaced after the generator was built (`set_output_embeddings`; PEFT's `modules_to_save` puts a
    trained copy in a wrapper): the graphs run the new one."""
    model = make_model("llama")
    prompts = random_prompts(3, max_len=12, seed=8)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    padded = padded_generator(model, True, max_batch_size=4, max_seq_len=48)
    padded.generate(prompts, params)
    head = model.get_output_embeddings()
    replaced = torch.nn.Linear(head.in_features, head.out_features, bias=False, dtype=head.weight.dtype)
    torch.nn.init.normal_(replaced.weight, generator=torch.Generator().manual_seed(0))
    model.set_output_embeddings(replaced)
    expected = samples(Generator(model, max_batch_size=4, max_seq_len=48).generate(prompts, params))
    assert_same_samples(padded.generate(prompts, params), expected)
    assert padded.runner.graphs.lm_head is replaced


def test_the_padded_forward_computes_in_the_callers_autocast():
    """A caller that generates under autocast itself: decode steps in its dtype, as the eager steps."""
    model = make_model("llama", dtype=torch.float32)
    prompts = random_prompts(4, max_len=12, seed=7)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1)
    eager = padded_generator(model, False, max_batch_size=4, max_seq_len=48)
    padded = padded_generator(model, True, max_batch_size=4, max_seq_len=48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = samples(eager.generate(prompts, params))
        assert samples(padded.generate(prompts, params)) == expected
    assert padded.runner.graphs.key.autocast == torch.bfloat16
    assert samples(padded.generate(prompts, params)) != expected  # and float32 again outside it
    assert padded.runner.graphs.key.autocast is None


# ---- the graph key: each change asks for a recapture, nothing else does ----------------------------------------------


def test_each_change_of_the_policy_asks_for_a_recapture_and_nothing_else_does():
    model = lora_policy()
    gen = padded_generator(model, True, max_batch_size=4, max_seq_len=256, kv_pool_blocks=64)  # room to grow
    graphs = gen.runner.graphs
    lora = next(m for m in model.modules() if hasattr(m, "merged_adapters"))
    prompts = random_prompts(3, max_len=10, seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=6)

    def refresh() -> list[str]:
        return graphs.refresh(gen._graph_epoch)

    # nothing: calls, steps, weights trained in place (an optimizer step), the policy left in train mode by a trainer
    gen.generate(prompts, params)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    gen.generate(prompts, params)
    model.train()
    gen.generate(prompts, params)
    model.eval()
    assert refresh() == [] and graphs.recaptures == []

    changes = []

    def change(name: str, before, after) -> None:
        before()
        changes.append((name, refresh()))
        after()
        changes.append((name, refresh()))

    change("training", model.train, model.eval)  # a step run in train mode (here: not through the Generator)
    disabled = model.disable_adapter()  # how TRL computes its reference model
    change("adapters", disabled.__enter__, lambda: disabled.__exit__(None, None, None))
    change("adapters", model.merge_adapter, model.unmerge_adapter)
    change("adapters", lambda: lora.scale_layer(0.5), lambda: lora.unscale_layer(0.5))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    change("autocast", autocast.__enter__, lambda: autocast.__exit__(None, None, None))
    weight = model.get_output_embeddings().weight
    swapped = torch.nn.Parameter(weight.detach().clone())
    change("tensors", lambda: setattr(model.get_output_embeddings(), "weight", swapped),
           lambda: setattr(model.get_output_embeddings(), "weight", weight))  # fmt: skip
    change("pools", lambda: gen.runner.cache._grow(gen.runner.cache.num_blocks + 1), lambda: None)
    gen.invalidate_graphs()
    changes.append(("epoch", refresh()))
    assert all(changed == [name] or (name == "pools" and changed == []) for name, changed in changes), changes
    assert changes[-3] == ("pools", ["pools"])  # a reallocated pool is seen at once; nothing to undo after it
    assert graphs.recaptures == [name for name, changed in changes if changed]
    assert refresh() == []
    # and the policy, back as it was, still generates through the padded forward what the eager one generates (the LM
    # head in the graph multiplies padded rows too: a GEMM of another height may round the last bit otherwise)
    eager = padded_generator(model, False, max_batch_size=4, max_seq_len=48)
    replayed, expected = samples(gen.generate(prompts, params)), samples(eager.generate(prompts, params))
    assert [tokens for tokens, _ in replayed] == [tokens for tokens, _ in expected]
    for (_, a), (_, b) in zip(replayed, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-12, rtol=0)


def test_a_step_checks_the_cheap_part_of_the_key_and_new_requests_the_whole_key():
    """The public engine's `step()` (a server's loop) checks the training flag, adapters, autocast and pools every
    step, and the tensors' addresses (a walk over every parameter: milliseconds for a large policy) at each
    `add_requests`, as `generate` does once per call."""
    model = lora_policy()
    gen = padded_generator(model, True, max_batch_size=4, max_seq_len=48)
    graphs = gen.runner.graphs
    params = SamplingParams(temperature=0, max_new_tokens=8)
    gen.add_requests(random_prompts(2, max_len=10, seed=3), params)
    gen.step()
    head = model.get_output_embeddings()
    weight = head.weight
    head.weight = torch.nn.Parameter(weight.detach().clone())  # replaced mid-rollout: seen at the next add_requests
    gen.step()
    assert graphs.recaptures == []
    with model.disable_adapter():
        gen.step()  # an adapter switch is seen at once
    assert graphs.recaptures == ["adapters"]
    gen.add_requests(random_prompts(1, max_len=10, seed=4), params, keep_in_flight=True)
    assert graphs.recaptures == ["adapters", "adapters, tensors"]
    while gen.has_unfinished:
        gen.step()


def test_the_draft_models_graphs_follow_their_own_model():
    """A draft model's runner keys its graphs on the draft model, not the target."""
    spec = SpecConfig(method="draft_model", num_speculative_tokens=2, model=make_model("qwen2", seed=4))
    gen = padded_generator(make_model("llama"), True, max_batch_size=2, max_seq_len=32, spec=spec)
    target, draft = gen.graph_runners
    assert draft.model is spec.model and target.model is not spec.model
    spec.model.get_output_embeddings().weight = torch.nn.Parameter(spec.model.get_output_embeddings().weight.clone())
    with gen._serving(full=True):
        pass
    assert target.recaptures == [] and draft.recaptures == ["tensors"]


def test_a_pool_planned_from_the_free_memory_holds_blocks_in_the_dtype_its_keys_take():
    """Float32 weights under a bf16 autocast: the pool holds bf16 keys, and was planned in float32's, so it held half
    the blocks its planned bytes hold (a GPU's pool, allocated whole, used half its share). It is sized in the dtype
    it holds now: at build under accelerate's wrapper, and when a call's autocast retypes it; a `kv_pool_blocks` a
    user set stays as set. The header's bytes are what the pool takes."""
    from rollout.engine import memory_plan

    model = make_model("llama", dtype=torch.float32)
    per_block = memory_plan.kv_bytes_per_token(model.config, 4) * memory_plan.DEFAULT_BLOCK_SIZE
    free = int(12 * per_block / memory_plan.CPU_PAGED_SHARE) + 1  # 12 float32 blocks planned (8 slots hold 32)
    prompts = random_prompts(6, max_len=12, seed=3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory_plan, "free_memory", lambda device: free)
        plain = padded_generator(model, False, max_batch_size=8, max_seq_len=48)
        pinned = padded_generator(model, False, max_batch_size=8, max_seq_len=48, kv_pool_blocks=12)
        wrapped = padded_generator(wrapped_in_autocast(model), False, max_batch_size=8, max_seq_len=48)
    assert plain.runner.cache.max_blocks == 12 and plain.kv_cache_bytes == 12 * per_block
    assert wrapped.runner.cache.dtype == torch.bfloat16 and wrapped.runner.cache.max_blocks == 24
    assert wrapped.kv_cache_bytes == 12 * per_block  # the same bytes, twice the blocks
    expected = samples(wrapped.generate(prompts, params))
    model.forward = model._original_forward
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's autocast retypes the plain one's pool: 24 too
        assert samples(plain.generate(prompts, params)) == expected and plain.runner.cache.max_blocks == 24
        assert samples(pinned.generate(prompts, params)) == expected and pinned.runner.cache.max_blocks == 12
    assert pinned.kv_cache_bytes == 12 * per_block
    # back in float32 the plain pool holds what its bytes hold there again: 12 blocks (no row held more)
    plain.generate(prompts, params)
    assert plain.runner.cache.dtype == torch.float32 and plain.runner.cache.max_blocks == 12
    assert plain.runner.cache.num_blocks <= 12


def test_a_pool_allocated_whole_takes_the_blocks_a_narrower_dtype_frees_at_once():
    """A GPU's pool is allocated whole at its planned size: retyped to a narrower dtype, the blocks its bytes now hold
    are allocated at once (the pool's addresses change anyway), never beyond every slot's; the keys held are kept.
    From a review: retyped back to the wider dtype, it kept twice the blocks planned, in twice the memory (a GPU's
    float32 -> bf16 -> float32 round trip ran out of memory); the blocks past the last one a row holds go first now."""
    from rollout.engine.paged_cache import PagedKVCache

    def pool(budget_blocks: int, num_slots: int) -> PagedKVCache:  # (rows of 64 positions: 4 blocks of 16 each)
        cache = PagedKVCache(2, 2, 8, torch.float32, torch.device("cpu"), num_slots, 64, max_blocks=budget_blocks)
        return PagedKVCache(
            2, 2, 8, torch.float32, torch.device("cpu"), num_slots, 64, max_blocks=budget_blocks,
            byte_budget=budget_blocks * cache.block_bytes(torch.float32),
        )  # fmt: skip

    cache = pool(6, 4)  # every slot's: 16 blocks
    assert cache.num_blocks == cache.max_blocks == 6
    cache.k_pools[1][5] = 1.5
    generation = cache.generation
    cache.retype(torch.bfloat16)
    assert cache.num_blocks == cache.max_blocks == 12 and cache.generation > generation
    assert cache.k_pools[1].dtype == torch.bfloat16 and bool((cache.k_pools[1][5] == 1.5).all())
    # wider again: the blocks rows hold are kept, those past them go (the memory planned, not twice it)
    cache.reserve(np.array([0, 1, 2]), np.array([64, 64, 64]))  # 3 rows of 4 blocks: all 12 held
    cache.retype(torch.float32)
    assert cache.num_blocks == cache.max_blocks == 12 and cache.dtype == torch.float32
    cache.retype(torch.bfloat16)
    cache.release_rows(0, 2)  # row 2 holds 4 blocks; the planned 6 past the last of them go
    held = cache.manager.tables[2, :4].copy()
    cache.k_pools[0][held] = 2.5
    cache.retype(torch.float32)
    assert cache.num_blocks == cache.max_blocks == max(6, int(held.max()) + 1) < 12
    assert bool((cache.k_pools[0][held] == 2.5).all()) and cache.manager.num_used == 4
    cache.release_rows(2, 3)
    cache.retype(torch.bfloat16), cache.retype(torch.float32)  # no block held: the planned 6
    assert cache.num_blocks == cache.max_blocks == 6 and bool((cache.k_pools[1][5] == 1.5).all())
    capped = pool(6, 2)  # every slot's: 8 blocks
    capped.retype(torch.bfloat16)
    assert capped.num_blocks == capped.max_blocks == 8
