"""On a GPU: replayed steps sample from the policy as it is now (eval mode whatever mode the trainer left it in, the
trainer's precision, the adapters as they are switched), and token trees and the cascade read the device once a step.
A CPU skips these; `tests/test_policy_state.py` and `tests/test_device_reads.py` test the same on its paths."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_prompts
from test_gpu import with_syncs
from test_policy_state import lora_policy, wrapped_in_autocast

from rollout import Generator, SamplingParams
from rollout.engine.step_batch import StepBatch
from specdec.config import SpecConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")


def equal_samples(a, b) -> int:
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b))


def test_a_dropout_policy_left_in_train_mode_replays_the_eval_mode_logits_bit_for_bit():
    """LoRA and attention dropout of 0.5, the policy in train mode when the graphs are captured and replayed: a replay
    computes exactly the eval-mode forward, bit for bit."""
    model = lora_policy(dropout=0.5, dtype=torch.float32, attention_dropout=0.5).cuda()
    model.train()
    gen = Generator(model, max_batch_size=8, max_seq_len=64, spec=SpecConfig(method="suffix", num_speculative_tokens=3))
    graphs = gen.runner.graphs
    assert graphs.graphs and graphs.error is None and model.training
    gen.add_requests(random_prompts(4, seed=3), SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=0))
    for _ in range(3):
        gen.step()
    assert model.training
    with torch.inference_mode():
        rows = gen.num_active
        lens = gen.slots.cache_len[:rows].clone()
        counts = torch.tensor([1 + i % 4 for i in range(rows)])
        ids = torch.randint(1, 97, (rows, 4), device="cuda")
        batch = StepBatch.build(0, ids, lens, torch.zeros_like(lens), counts)
        replayed = graphs.forward(batch).clone()
        graphs.capture = False
        model.eval()
        eager = graphs.forward(batch).clone()
        model.train()
        dropped = graphs.forward(batch).clone()
    graphs.capture = True
    assert torch.equal(replayed, eager)
    assert not torch.equal(dropped, eager), "the dropout under test is not live: nothing was tested"


def test_disable_adapter_inside_a_rollout_samples_the_base_model():
    """TRL computes its reference model with `disable_adapter()`: graphs captured with the adapters on must not be
    replayed for the base model, nor graphs of the base model once the adapters are back."""
    model = lora_policy(dtype=torch.float32).cuda()
    prompts = random_prompts(6, max_len=14, seed=5)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24)
    eager = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=False)
    with_lora = eager.generate(prompts, params)
    with model.disable_adapter():
        base = eager.generate(prompts, params)
    assert equal_samples(with_lora, base) < len(base) - 1, "the adapters change nothing: nothing was tested"
    gen = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=True)
    assert equal_samples(gen.generate(prompts, params), with_lora) >= len(base) - 1
    with model.disable_adapter():
        assert equal_samples(gen.generate(prompts, params), base) >= len(base) - 1
    assert equal_samples(gen.generate(prompts, params), with_lora) >= len(base) - 1
    assert gen.runner.graphs.recaptures == ["adapters", "adapters"] and gen.runner.graphs.graphs


def test_graphs_under_a_trainers_bf16_autocast_compute_in_bf16():
    """Float32 weights under accelerate's bf16 wrapper: the replayed decode steps compute in bf16, as the eager
    prefills do (they were float32 before: one sample, two precisions)."""
    model = wrapped_in_autocast(make_model("llama", dtype=torch.float32).cuda())
    prompts = random_prompts(6, max_len=14, seed=6)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=2)
    gen = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=True)
    graphs = gen.runner.graphs
    assert graphs.key.autocast == torch.bfloat16 and graphs.graphs and graphs.error is None
    replayed = gen.generate(prompts, params)
    assert graphs.recaptures == []
    eager = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=False).generate(prompts, params)
    assert equal_samples(replayed, eager) >= len(eager) - 1
    model.forward = model._original_forward  # the plain float32 forward samples otherwise
    plain = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=False).generate(prompts, params)
    assert [o.logprobs for o in plain] != [o.logprobs for o in eager]


def test_a_planned_pool_takes_the_blocks_a_bf16_autocast_frees_and_replays_after_it(monkeypatch):
    """Float32 weights, a pool planned from the free memory (made small here): a caller's bf16 autocast retypes the
    pool, allocated whole, to twice the blocks in the same bytes at once, and the graphs, captured for the old pool,
    are captured again and replay the same samples as a generator built for the autocast."""
    from rollout.engine import memory_plan

    model = make_model("llama", dtype=torch.float32).cuda()
    per_block = memory_plan.kv_bytes_per_token(model.config, 4) * memory_plan.DEFAULT_BLOCK_SIZE
    planned = 12 * per_block / memory_plan.USABLE_SHARE + 1  # 12 float32 blocks of the 16 slots' 80
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: int(planned))
    prompts = random_prompts(6, max_len=14, seed=6)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=2)
    gen = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=True)
    cache = gen.runner.cache
    assert cache.num_blocks == cache.max_blocks == 12 and cache.dtype == torch.float32
    with torch.autocast("cuda", dtype=torch.bfloat16):
        replayed = gen.generate(prompts, params)
    assert cache.num_blocks == cache.max_blocks == 24 and cache.dtype == torch.bfloat16
    assert gen.runner.graphs.graphs and gen.runner.graphs.error is None
    built = Generator(wrapped_in_autocast(model), max_batch_size=16, max_seq_len=64, cuda_graphs=True)
    assert built.runner.cache.max_blocks == 24 and built.kv_cache_bytes == 12 * per_block
    assert equal_samples(replayed, built.generate(prompts, params)) >= len(replayed) - 1


def test_graphs_dropped_by_a_change_are_captured_again_and_replayed():
    """A change of the policy drops the graphs; the steps after it capture them again, into a new memory pool (torch
    refuses to capture into one whose graphs are all gone: on torch 2.11 a capture there failed and decoding went on
    eagerly for good), and replay them: the same samples, no fallback."""
    model = make_model("llama", dtype=torch.float32).cuda()
    prompts = random_prompts(6, max_len=14, seed=6)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=3)
    gen = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=True)
    graphs = gen.runner.graphs
    first = gen.generate(prompts, params)
    pools = [graphs.pool]
    for _ in range(2):
        gen.invalidate_graphs()  # (any change does the same: adapters switched, autocast, weights replaced)
        again = gen.generate(prompts, params)
        assert graphs.error is None, f"the graphs were not captured again: {graphs.error}"
        assert graphs.graphs and graphs.pool not in pools
        assert equal_samples(first, again) >= len(first) - 1
        pools.append(graphs.pool)
    assert graphs.recaptures == ["epoch", "epoch"]


SPECS = {
    "ngram tree": lambda: SpecConfig(method="ngram", num_speculative_tokens=4, num_candidates=3, prompt_lookup_min=1),
    "suffix tree": lambda: SpecConfig(method="suffix", num_speculative_tokens=4, num_candidates=2),
    "cascade": lambda: SpecConfig(
        method=["suffix", "draft_model"],
        num_speculative_tokens=3,
        model=make_model("qwen2", seed=4, dtype=torch.float32).cuda(),
    ),
}


@pytest.mark.parametrize("kv_layout", ["paged", "slots"])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_a_tree_or_cascade_step_reads_the_device_once(spec, kv_layout):
    model = make_model("llama", dtype=torch.float32).cuda()
    spec = spec()
    gen = Generator(model, max_batch_size=8, max_seq_len=96, kv_layout=kv_layout, spec=spec)
    if len(spec.methods) > 1:  # the cascade: suffix drafts where it has some, the draft model's for the rest
        gen.proposers.pass_on = False
    prompts = [p * 3 for p in random_prompts(4, max_len=6, seed=2)]  # repeats: the drafts hit
    gen.add_requests(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=0))
    for _ in range(3):
        gen.step()
    torch.cuda.synchronize()
    steps = 4
    records, syncs = with_syncs(lambda: [gen.step().record for _ in range(steps)])
    assert all(r.kind == "decode" for r in records)
    assert any(r.num_drafted for r in records), "nothing was drafted: nothing was tested"
    if len(spec.methods) > 1:
        assert any(len(r.rows_by_method) > 1 for r in records), "no step combined two proposers: nothing was tested"
    assert len(syncs) <= steps, f"{len(syncs)} synchronisations in {steps} decode steps: {syncs[:4]}"
