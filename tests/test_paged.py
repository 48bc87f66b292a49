"""The paged KV layout: attention through the function registered with transformers, blocks shared by a prompt's
samples, rows preempted when the pool runs short. Every exactness guarantee of the slot layout holds through it:
greedy equal to HF generate, log-probs equal to a teacher-forced pass, the same samples for the same seed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import make_model, model_from_config, random_prompts
from test_generator import hf_greedy, teacher_forced_logprobs, use_frequent_token_as_eos

from rollout import Generator, SamplingParams
from rollout.engine.block_manager import BlockManager, OutOfBlocks
from specdec.config import SpecConfig


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_paged_greedy_equals_model_generate(arch, attn):
    model = make_model(arch, attn)
    prompts = random_prompts(9, max_len=14, seed=1)  # 9 prompts through 4 slots: rows finish and refill mid-run
    eos = use_frequent_token_as_eos(model, prompts, 16)
    gen = Generator(model, max_batch_size=4, max_seq_len=64, kv_layout="paged")
    assert gen.runner.kv_layout == "paged"
    outs = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16))
    assert model.config._attn_implementation == attn  # the model's own attention is back after the call
    for out in outs:
        expected = hf_greedy(model, prompts[out.prompt_index], 16)
        assert out.token_ids == expected, f"prompt {out.prompt_index}"
        assert out.finish_reason == ("stop" if expected[-1] == eos else "length")
    assert gen.runner.cache.manager.num_used == 0  # every block back in the pool


def test_paged_sliding_window_layers_mixed_with_full_attention():
    model = make_model("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    prompts = random_prompts(5, min_len=6, max_len=12, seed=2)
    gen = Generator(model, max_batch_size=3, max_seq_len=64, kv_layout="paged")
    for out in gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12)):
        assert out.token_ids == hf_greedy(model, prompts[out.prompt_index], 12)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=20, seed=3),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=20, seed=4, n=3),
    ],
    ids=["t1", "t0.7-topk-topp-n3"],
)
def test_paged_logprobs_equal_teacher_forced_pass(params):
    model = make_model("llama")
    prompts = random_prompts(5, seed=5)
    outs = Generator(model, max_batch_size=4, max_seq_len=64, kv_layout="paged").generate(prompts, params)
    for out in outs:
        expected = teacher_forced_logprobs(model, prompts[out.prompt_index], out.token_ids, params)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=1e-9, rtol=0)


SPECS = {
    "none": None,
    "ngram K=3": SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1),
    "ngram tree": SpecConfig(method="ngram", num_speculative_tokens=6, num_candidates=3, prompt_lookup_min=1),
    "suffix auto": SpecConfig(method="suffix", num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto"),
    "draft K=3": "draft",
}


@pytest.mark.parametrize("name", list(SPECS))
def test_paged_samples_are_the_slot_layouts_whatever_the_speculation(name):
    """Pathwise: the same seed gives the same tokens and log-probs on both layouts, with every proposer (a tree's
    accepted path is compacted within its row's blocks)."""
    model = make_model("qwen2", seed=2, vocab_size=23)
    spec = SPECS[name]
    if spec == "draft":
        spec = SpecConfig(
            method="draft_model", num_speculative_tokens=3, model=make_model("qwen2", seed=3, vocab_size=23)
        )
    prompts = [p * 3 for p in random_prompts(3, vocab_size=23, max_len=4, seed=5)] + random_prompts(2, 23, seed=6)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=11)
    slots = Generator(model, max_batch_size=7, max_seq_len=80).generate(prompts, params)
    gen = Generator(model, max_batch_size=7, max_seq_len=80, spec=spec, kv_layout="paged")
    paged = gen.generate(prompts, params)
    for a, b in zip(slots, paged):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-9)
    if spec is not None:
        assert sum(r.num_accepted for r in gen.last_trace) > 0, "no draft accepted: the comparison tested nothing"


def test_a_draft_model_takes_the_targets_paged_layout_and_drafts_what_it_drafts_on_slots():
    """The draft model's runner follows the target's layout; on either, the draft proposes the same tokens (the same
    acceptance step by step), and a paged draft's blocks go back to its pool as rows finish."""
    model, draft = make_model("qwen2", seed=2, vocab_size=23), make_model("llama", seed=3, vocab_size=23)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=3, model=draft)
    prompts = random_prompts(9, vocab_size=23, max_len=10, seed=7)  # 18 samples through 6 slots: rows move and refill
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=3)
    runs = {}
    for layout in ("slots", "paged"):
        gen = Generator(model, max_batch_size=6, max_seq_len=48, spec=spec, kv_layout=layout)
        runner = gen.proposers.proposers["draft_model"].runner
        assert runner.kv_layout == layout
        outs = gen.generate(prompts, params)
        runs[layout] = (outs, [(r.num_drafted, r.num_accepted) for r in gen.last_trace])
        if layout == "paged":
            assert runner.cache.manager.num_used == 0, "expected every draft block back in its pool"
    assert [o.token_ids for o in runs["paged"][0]] == [o.token_ids for o in runs["slots"][0]]
    assert runs["paged"][1] == runs["slots"][1]
    assert sum(accepted for _, accepted in runs["paged"][1]) > 0, "no draft accepted: the comparison tested nothing"


def test_a_groups_samples_share_their_prompts_blocks_until_they_write():
    model = make_model("llama")
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks of 16 and a partial one
    gen = Generator(model, max_batch_size=8, max_seq_len=80, kv_layout="paged")
    gen.add_requests([prompt], SamplingParams(n=8, temperature=1.0, max_new_tokens=10, seed=0))
    gen.step()  # the prefill: one prompt's blocks, held by all 8 samples
    assert gen.runner.cache.manager.num_used == 3
    assert (gen.runner.cache.manager.refs[gen.runner.cache.manager.tables[0, :3]] == 8).all()
    gen.step()  # the first decode writes into the partial block: each sample copies it, the full ones stay shared
    assert gen.runner.cache.manager.num_used == 2 + 8
    assert (gen.runner.cache.manager.refs[gen.runner.cache.manager.tables[0, :2]] == 8).all()


def test_a_short_pool_preempts_the_latest_rows_and_they_come_out_the_same():
    model = make_model("qwen2")
    prompts = random_prompts(6, min_len=10, max_len=20, seed=7)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=0)
    reference = Generator(model, max_batch_size=18, max_seq_len=64).generate(prompts, params)
    gen = Generator(model, max_batch_size=18, max_seq_len=64, kv_layout="paged", kv_pool_blocks=16)
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert sum(r.num_preempted for r in gen.last_trace) > 0, "the pool never ran short: nothing was tested"
    # what the preempted rows had emitted is counted as discarded: the tokens kept are the completions'
    assert sum(r.num_discarded for r in gen.last_trace) > 0
    assert sum(r.num_emitted - r.num_discarded for r in gen.last_trace) == sum(len(o.token_ids) for o in outs)
    assert max(r.kv_blocks_used for r in gen.last_trace) <= 16
    assert max(r.batch_size for r in gen.last_trace if r.kind == "decode") < 18  # admission held rows back
    assert gen.runner.cache.manager.num_used == 0


def test_paged_memory_follows_the_tokens_not_the_length_cap():
    model = make_model("llama")
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0)
    peaks = []
    for max_seq_len in (512, 8192):
        gen = Generator(model, max_batch_size=8, max_seq_len=max_seq_len, kv_layout="paged")
        gen.generate(prompts, params)
        peaks.append(gen.runner.cache.num_blocks)
        assert gen.runner.cache.max_blocks == 8 * -(-(max_seq_len + 1) // 16)  # planned for the cap
    assert peaks[0] == peaks[1]  # allocated for what the rows held
    # the slot layout's capacity grows with the longest row, too
    sizes = []
    for max_seq_len in (512, 8192):
        gen = Generator(model, max_batch_size=8, max_seq_len=max_seq_len, kv_layout="slots")
        gen.generate(prompts, params)
        sizes.append(sum(layer.keys.nbytes for layer in gen.runner.cache.layers))
    assert sizes[0] == sizes[1]


def test_a_layer_outside_the_attention_interface_keeps_the_slot_layout_with_a_warning():
    model = make_model("llama")
    # this layer reads a config of its own: switching the model's attention does not reach it
    attention = model.model.layers[1].self_attn
    attention.config = type(model.config).from_dict(model.config.to_dict())
    attention.config._attn_implementation = "sdpa"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = Generator(model, max_batch_size=2, max_seq_len=32, kv_layout="paged")
    assert gen.runner.kv_layout == "slots"
    assert any("1 of its 2 attention layers" in str(w.message) for w in caught)
    prompts = random_prompts(2, seed=9)
    outs = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 6) for p in prompts]


def test_bad_layout_settings_are_refused_with_the_fix():
    model = make_model("llama")
    with pytest.raises(ValueError, match="kv_layout .* must be one of auto, paged, slots"):
        Generator(model, max_batch_size=2, max_seq_len=32, kv_layout="dense")
    with pytest.raises(ValueError, match=r"kv_pool_blocks \(1\) must be an integer >= 3"):
        Generator(model, max_batch_size=2, max_seq_len=32, kv_layout="paged", kv_pool_blocks=1)
    assert Generator(model, 2, 32, kv_layout="paged", kv_pool_blocks=np.int64(5)).runner.cache.max_blocks == 5
    # more than every slot at full length can hold: the pool holds that much, said; more than the free memory holds:
    # refused before anything is allocated, naming how many blocks fit
    with pytest.warns(UserWarning, match=r"kv_pool_blocks \(8\) is more than 2 slots of max_seq_len 32 can hold \(6 b"):
        assert Generator(model, 2, 32, kv_layout="paged", kv_pool_blocks=8).runner.cache.max_blocks == 6
    import rollout.engine.memory_plan as memory_plan

    free = memory_plan.free_memory
    try:
        memory_plan.free_memory = lambda device: 2**10  # 1 KiB free
        with pytest.raises(ValueError, match=r"kv_pool_blocks 6 takes .* GiB free: at most \d+ blocks fit; lower"):
            Generator(model, 2, 32, kv_layout="paged", kv_pool_blocks=6)
        # more than the slots use, and more than fits: one refusal naming the value passed, no warning before it
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=r"^kv_pool_blocks 1000000000 \(of which 2 slots use 6\) takes"):
                Generator(model, 2, 32, kv_layout="paged", kv_pool_blocks=10**9)
    finally:
        memory_plan.free_memory = free
    # whatever the layout: a bad size is refused, and a size the layout will not use is said
    for bad in (-7, 0, "lots", 2.5, True):
        with pytest.raises(ValueError, match=r"kv_pool_blocks \(.*\) must be a positive integer"):
            Generator(model, max_batch_size=2, max_seq_len=32, kv_pool_blocks=bad)
    with pytest.raises(ValueError, match=r"kv_pool_blocks \(8\) sizes a paged KV pool, and kv_layout='slots' has none"):
        Generator(model, max_batch_size=2, max_seq_len=32, kv_layout="slots", kv_pool_blocks=8)
    with pytest.warns(UserWarning, match=r"kv_pool_blocks \(8\) is not used: kv_layout='auto' keeps slots on cpu"):
        Generator(model, max_batch_size=2, max_seq_len=32, kv_pool_blocks=8)
    # the auto policy's warm-up fills every slot: a pool too small for it names what to raise, the pool where it
    # was given smaller than the slots, the rows where the pool holds every slot at full length
    auto = SpecConfig(method="ngram", num_speculative_tokens=3, num_speculative_tokens_per_batch_size="auto")
    with pytest.raises(ValueError, match=r"kv_pool_blocks \(8\) holds 2 blocks of 16 tokens per slot: .* raise kv_p"):
        Generator(model, max_batch_size=4, max_seq_len=64, kv_layout="paged", kv_pool_blocks=8, spec=auto)
    with pytest.raises(ValueError, match=r"max_seq_len \(24\) is too short for the auto policy's warm-up on the pag"):
        Generator(model, max_batch_size=4, max_seq_len=24, kv_layout="paged", spec=auto)
    # the length it names, the shortest that passes at each K (whole blocks: not the same order as K; none was named)
    for k, shortest in ((1, 31), (3, 29), (4, 28), (6, 42)):
        spec = SpecConfig(method="ngram", num_speculative_tokens=k, num_speculative_tokens_per_batch_size="auto")
        with pytest.raises(ValueError, match=rf"raise max_seq_len to at least {shortest} \(whole blocks"):
            Generator(model, max_batch_size=4, max_seq_len=shortest - 1, kv_layout="paged", spec=spec)
        Generator(model, max_batch_size=4, max_seq_len=shortest, kv_layout="paged", spec=spec)


def test_block_manager_shares_copies_on_write_and_frees():
    manager = BlockManager(num_blocks=6, block_size=4, num_slots=4, max_blocks_per_row=3)
    manager.allocate(np.array([0]), np.array([6]))  # 2 blocks
    manager.share(np.array([0, 0, 0]), np.array([0, 1, 2]))  # a prompt fanned out to 3 rows, itself included
    assert manager.num_used == 2 and list(manager.refs[manager.tables[0, :2]]) == [3, 3]
    sources, targets = manager.writable(np.array([1, 2]), np.array([6, 6]), np.array([8, 8]))  # into block 1
    assert list(sources) == [manager.tables[0, 1]] * 2 and len(set(targets)) == 2
    assert manager.refs[manager.tables[0, 1]] == 1 and manager.num_used == 4
    assert manager.needed(np.array([0, 1]), np.array([9, 9]), np.array([8, 8])) == 2  # one new block each
    with pytest.raises(OutOfBlocks):
        manager.allocate(np.array([0, 1, 2]), np.array([12, 12, 12]))  # 3 more blocks, 2 free: nothing changes
    assert manager.num_used == 4
    manager.release(np.array([0, 1, 2]))
    assert manager.num_used == 0 and manager.num_free == 6
    manager.allocate(np.array([0, 1]), np.array([12, 12]))  # every block in use, then a grown pool
    manager.grow(9)
    manager.allocate(np.array([2]), np.array([12]))
    manager.release(np.array([0, 1, 2]))  # every block back, those from before the growth too
    assert manager.num_free == 9 and sorted(manager.free) == list(range(9))
    slots = manager.slots(np.array([3]), np.array([[-1, 0]]))
    assert slots[0, 0] == -1


def test_a_cpu_pool_grows_as_rows_need_blocks_and_gets_every_block_back():
    model = make_model("llama")
    prompts = random_prompts(4, min_len=20, max_len=30, seed=10)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=100, seed=0)
    reference = Generator(model, max_batch_size=16, max_seq_len=140).generate(prompts, params)
    gen = Generator(model, max_batch_size=16, max_seq_len=140, kv_layout="paged")
    first = gen.runner.cache.num_blocks
    outs = gen.generate(prompts, params)
    assert gen.runner.cache.num_blocks > first, "the pool never grew: nothing was tested"
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert gen.runner.cache.manager.num_free == gen.runner.cache.num_blocks
    assert gen.generate(prompts, params)[0].token_ids == reference[0].token_ids  # and serves the next call


def test_paged_runs_under_a_trainers_bf16_autocast():
    """A trainer (TRL's default bf16) may generate under autocast: the projections then come in bfloat16 over the
    model's float32 weights; the pool holds the autocast's dtype, which the attention stores and reads in."""
    model = make_model("llama", dtype=torch.float32)
    prompts = random_prompts(3, seed=11)
    gen = Generator(model, max_batch_size=4, max_seq_len=32, kv_layout="paged")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = gen.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0))
    assert all(len(o.token_ids) == 8 and all(-1e4 < lp <= 0 for lp in o.logprobs) for o in outs)
    assert gen.runner.cache.k_pools[0].dtype == torch.bfloat16


def test_paged_serves_a_lora_policy_in_train_mode():
    """A trainer's PEFT-wrapped policy, adapters live and the model in train mode: the paged attention reaches its
    layers through the wrapper, and greedy matches HF generate."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)  # adapters that change the outputs (a fresh LoRA is the identity)
    prompts = random_prompts(3, seed=12)
    model.eval()
    expected = [hf_greedy(model, p, 8) for p in prompts]
    model.train()
    gen = Generator(model, max_batch_size=4, max_seq_len=32, kv_layout="paged")
    assert gen.runner.kv_layout == "paged"
    outs = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    assert [o.token_ids for o in outs] == expected and model.training


def test_a_paged_plan_charges_what_the_pools_take_a_draft_models_included():
    """Every slot filled to max_seq_len: the plan's bytes are the pools' tensors, the target's and a paged draft
    model's (whole blocks each)."""
    target = make_model("llama", dtype=torch.float32)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=3, model=make_model("qwen2", dtype=torch.float32))
    gen = Generator(target, max_batch_size=4, max_seq_len=40, spec=spec, kv_layout="paged")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=0, ignore_eos=True)
    gen.generate([list(range(5, 35)), list(range(7, 37))], params)
    runners = gen._runners()
    assert len(runners) == 2 and all(r.paged and r.cache.num_blocks == r.cache.max_blocks for r in runners)
    pools = [t for r in runners for t in (*r.cache.k_pools, *r.cache.v_pools)]
    assert gen.kv_cache_bytes == sum(t.numel() * t.element_size() for t in pools)


def _moe_or_diff(config_class, **extra):
    config = config_class(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        **extra,
    )  # fmt: skip
    options = {"experts_implementation": "eager"} if "num_experts_per_tok" in extra else {}  # (float64 experts)
    return model_from_config(config, **options)


@pytest.mark.parametrize("name", ["phimoe", "qwen2_moe"])
def test_a_window_applied_through_the_mask_only_holds_on_the_paged_layout(name):
    """PhiMoE and Qwen2-MoE apply their sliding window through the mask and pass none to the attention: the paged
    attention takes the layer's window from the config, as the slot layout's masks do (it attended to every key)."""
    from transformers import PhimoeConfig, Qwen2MoeConfig

    moe = dict(sliding_window=6, num_experts_per_tok=2)
    if name == "phimoe":
        model = _moe_or_diff(PhimoeConfig, num_local_experts=4, **moe)
    else:
        model = _moe_or_diff(
            Qwen2MoeConfig, use_sliding_window=True, max_window_layers=2, num_experts=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, **moe,
        )  # fmt: skip
    prompts, params = (
        [[5, 17, 42, 8, 63, 29, 11, 70, 3, 44], [9, 2, 31]],
        SamplingParams(n=2, max_new_tokens=12, seed=0),
    )
    slots = Generator(model, max_batch_size=4, max_seq_len=64, kv_layout="slots").generate(prompts, params)
    paged = Generator(model, max_batch_size=4, max_seq_len=64, kv_layout="paged")
    assert paged.runner.kv_layout == "paged"
    assert [o.token_ids for o in paged.generate(prompts, params)] == [o.token_ids for o in slots]


def test_the_paged_probe_counts_attention_calls_not_what_they_stored():
    """The probe that decides whether a model can run paged fed token 0 and looked for keys in the pools: a model
    whose pad token is 0 has a zero embedding row there (nn.Embedding's padding_idx), so zero keys and values, and it
    fell back to slots with a warning that its layers bypass the attention interface. It counts the layers that call
    the paged attention now: such a model runs paged, and one whose layer does bypass it still falls back."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    assert bool((model.model.embed_tokens.weight[0] == 0).all())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen = Generator(model, max_batch_size=2, max_seq_len=32, kv_layout="paged")
    assert gen.runner.kv_layout == "paged"
    # a layer that reads a config of its own, so that its attention never reaches the registered paged function
    model.model.layers[1].self_attn.config = copy.copy(model.config)
    with pytest.warns(UserWarning, match=r"runs on the slot KV cache: 1 of its 2 attention layers do not call"):
        gen = Generator(model, max_batch_size=2, max_seq_len=32, kv_layout="paged")
    assert gen.runner.kv_layout == "slots"


@pytest.mark.parametrize("arch", ["falcon", "mpt"])
def test_a_model_computing_attention_itself_runs_on_slots_and_the_warning_says_why(arch):
    """Falcon and MPT compute attention in their own code, never through transformers' attention interface: the paged
    forward fails there, and the warning named only that failure ("TypeError: unsupported operand type(s) for +").
    It says why now, and the model samples on slots what it samples there."""
    from transformers import AutoModelForCausalLM, FalconConfig, MptConfig

    config = (
        FalconConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=False)
        if arch == "falcon"
        else MptConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4)
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    prompts, params = [[5, 17, 42, 8], [9, 2, 31]], SamplingParams(n=2, max_new_tokens=8, seed=0)
    slots = Generator(model, max_batch_size=4, max_seq_len=32, kv_layout="slots").generate(prompts, params)
    with pytest.warns(
        UserWarning, match=r"runs on the slot KV cache: its attention layers compute attention themselves"
    ):
        gen = Generator(model, max_batch_size=4, max_seq_len=32, kv_layout="paged")
    assert gen.runner.kv_layout == "slots"
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in slots]


def test_a_model_calling_its_attention_twice_a_layer_runs_on_slots():
    """DiffLlama's differential attention calls the attention twice a layer: the paged cache would keep the second
    call's values only, so the model runs on the slot layout, with a warning, and samples what it samples there."""
    from transformers import DiffLlamaConfig

    model = _moe_or_diff(DiffLlamaConfig)
    prompts, params = [[5, 17, 42, 8], [9, 2, 31]], SamplingParams(n=2, max_new_tokens=12, seed=0)
    slots = Generator(model, max_batch_size=4, max_seq_len=64, kv_layout="slots").generate(prompts, params)
    with pytest.warns(UserWarning, match=r"DiffLlamaForCausalLM runs on the slot KV cache: its layers \[0, 1\] call"):
        gen = Generator(model, max_batch_size=4, max_seq_len=64, kv_layout="paged")
    assert gen.runner.kv_layout == "slots"
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in slots]
