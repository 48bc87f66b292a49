"""On a GPU: the paged layout with its compiled kernels, CUDA graphs, and the device reads a decode step makes. A CPU
skips these (the kernels' own tests run there under the Triton interpreter; the graph runner's padded forward runs
there uncaptured, `tests/test_graphs.py`)."""

from __future__ import annotations

import pathlib
import traceback
import warnings

import pytest
import torch
from conftest import make_model, random_prompts

from rollout import Generator, SamplingParams
from rollout.engine.graph_runner import row_buckets
from rollout.engine.step_batch import StepBatch
from specdec.config import SpecConfig
from specdec.verify import RaceKeys

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)")


def test_paged_on_a_gpu_samples_what_the_slot_layout_samples():
    model = make_model("qwen2", dtype=torch.float32).cuda()
    prompts = random_prompts(6, max_len=14, seed=1)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=0)
    slots = Generator(model, max_batch_size=8, max_seq_len=64, kv_layout="slots").generate(prompts, params)
    gen = Generator(model, max_batch_size=8, max_seq_len=64, kv_layout="paged")
    assert gen.runner.kv_layout == "paged"
    paged = gen.generate(prompts, params)
    # float32 on a GPU: the two attention paths round differently, so a rare near-tie may flip a token; log-probs of
    # the shared prefix agree to float32 rounding
    same = sum(a.token_ids == b.token_ids for a, b in zip(slots, paged))
    assert same >= len(slots) - 1, f"{same} of {len(slots)} samples equal"
    for a, b in zip(slots, paged):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        torch.testing.assert_close(torch.tensor(a.logprobs[:n]), torch.tensor(b.logprobs[:n]), rtol=0, atol=1e-4)


def with_syncs(fn):
    """`fn()`, and where each synchronising CUDA call it made came from (the Python frames, innermost first): what
    torch's sync-debug mode warns of, and the waits it does not see (`Event.synchronize`, `torch.cuda.synchronize`,
    through which the engine's one read a step waits)."""
    syncs = []

    def where() -> str:
        frames = traceback.extract_stack()[-9:-1][::-1]
        return " <- ".join(f"{pathlib.Path(f.filename).name}:{f.lineno}" for f in frames)

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            syncs.append(where())

    event_wait, device_wait = torch.cuda.Event.synchronize, torch.cuda.synchronize

    def counted_event_wait(event):
        syncs.append(where())
        return event_wait(event)

    def counted_device_wait(*args, **kwargs):
        syncs.append(where())
        return device_wait(*args, **kwargs)

    with warnings.catch_warnings():  # the first switch to "warn" in a process warns once itself: not the engine's
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize, torch.cuda.synchronize = counted_event_wait, counted_device_wait
        try:
            result = fn()
        finally:
            torch.cuda.Event.synchronize, torch.cuda.synchronize = event_wait, device_wait
            torch.cuda.set_sync_debug_mode("default")
    return result, syncs


@pytest.mark.parametrize(
    "kv_layout, cuda_graphs, spec",
    [
        ("paged", True, None),
        ("paged", False, None),
        ("slots", False, None),
        ("paged", True, SpecConfig(method="suffix", num_speculative_tokens=3)),
        ("paged", True, SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)),
        ("paged", True, "draft"),
    ],
    ids=["paged-graphs", "paged-eager", "slots", "suffix-graphs", "ngram-graphs", "draft-graphs"],
)
def test_a_decode_step_reads_the_device_once(kv_layout, cuda_graphs, spec):
    """One synchronisation per decode step: the packed copy of the emitted tokens the scheduler needs."""
    model = make_model("llama", dtype=torch.float32).cuda()
    if spec == "draft":  # a draft model's runner: paged and graphed like the target's
        draft = make_model("qwen2", seed=4, dtype=torch.float32).cuda()
        spec = SpecConfig(method="draft_model", num_speculative_tokens=3, model=draft)
    gen = Generator(model, max_batch_size=8, max_seq_len=96, kv_layout=kv_layout, cuda_graphs=cuda_graphs, spec=spec)
    gen.add_requests(random_prompts(4, seed=2), SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=0))
    for _ in range(3):  # the prefill, and decode steps that compile the kernels
        gen.step()
    torch.cuda.synchronize()
    steps = 4
    records, syncs = with_syncs(lambda: [gen.step().record for _ in range(steps)])
    assert all(r.kind == "decode" for r in records)
    assert len(syncs) <= steps, f"{len(syncs)} synchronisations in {steps} decode steps: {syncs[:4]}"


def test_a_replayed_graph_computes_what_the_eager_forward_computes():
    """The captured forward and the same forward run eagerly, on the same buffers: equal bit for bit (bf16), and so
    are a verifying graph's results (tokens, counts, log-probs) and the same verification run eagerly."""
    model = make_model("llama", dtype=torch.bfloat16).cuda()
    gen = Generator(
        model, max_batch_size=12, max_seq_len=64, spec=SpecConfig(method="suffix", num_speculative_tokens=3)
    )
    graphs = gen.runner.graphs
    assert graphs is not None and graphs.error is None
    assert len(graphs.graphs) == len(row_buckets(12)) * 4  # every bucket at widths 1 to 4
    assert all(verifying for _, _, verifying in graphs.graphs), "exact verification: graphs that verify too"
    assert graphs.memory_bytes > 0
    gen.add_requests(random_prompts(5, seed=3), SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=0))
    with torch.inference_mode():
        for _ in range(4):
            gen.step()
        rows = gen.num_active
        lens = gen.slots.cache_len[:rows].clone()
        counts = torch.tensor([1 + i % 4 for i in range(rows)])  # rows of 0-3 drafts, width 4
        ids = torch.randint(1, 97, (rows, 4), device="cuda")
        batch = StepBatch.build(0, ids, lens, torch.zeros_like(lens), counts)
        logits, verified = [], []
        race = RaceKeys(torch.randint(0, 2**40, (rows,)), torch.arange(rows) + 5)
        temperatures = torch.tensor([0.7, 0.0, 1.3])[torch.arange(rows) % 3]  # greedy rows among sampled ones
        for capture in (True, False):
            graphs.capture = capture
            logits.append(graphs.forward(batch).clone())
            verified.append(graphs.forward_verified(batch, race, temperatures).packed.clone())
    graphs.capture = True
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(verified[0], verified[1]), "the replayed verification differs from the eager one"


@pytest.mark.parametrize(
    "spec", [None, SpecConfig(method="suffix", num_speculative_tokens=4), "draft"], ids=["none", "suffix", "draft"]
)
def test_graphs_sample_what_the_eager_engine_samples(spec):
    model = make_model("qwen2", dtype=torch.float32).cuda()
    if spec == "draft":
        draft = make_model("llama", seed=4, dtype=torch.float32).cuda()
        spec = SpecConfig(method="draft_model", num_speculative_tokens=3, model=draft)
    prompts = random_prompts(7, max_len=14, seed=4)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=32, seed=1)
    outs = [
        Generator(model, max_batch_size=16, max_seq_len=64, spec=spec, cuda_graphs=graphs).generate(prompts, params)
        for graphs in (False, True)
    ]
    # float32 on a GPU: a padded batch may round differently, so a rare near-tie may flip a token
    same = sum(a.token_ids == b.token_ids for a, b in zip(*outs))
    assert same >= len(outs[0]) - 1, f"{same} of {len(outs[0])} samples equal"


def test_graphs_captured_from_a_policy_in_train_mode_replay_it_without_dropout():
    """A trainer builds the generator with its policy in train mode (a LoRA with dropout here): the captured decode
    steps must be the eval-mode policy's, as the eager steps are, and the trainer gets its mode back."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5, init_lora_weights=False)
    model = get_peft_model(make_model("llama", dtype=torch.float32), config).cuda()  # random LoRA B: adapters count
    prompts = random_prompts(6, max_len=14, seed=8)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24)
    model.eval()
    eager = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=False).generate(prompts, params)
    model.train()
    gen = Generator(model, max_batch_size=16, max_seq_len=64, cuda_graphs=True)
    assert gen.runner.graphs.graphs and gen.runner.graphs.error is None, "the decode steps must be captured"
    assert model.training
    replayed = gen.generate(prompts, params)
    assert model.training
    same = sum(a.token_ids == b.token_ids for a, b in zip(eager, replayed))
    assert same >= len(eager) - 1, f"{same} of {len(eager)} greedy samples equal"  # a near-tie may flip one


def test_race_kernels_are_their_references_bit_for_bit_on_a_gpu():
    """Compiled without FMA contraction, the race's noise is the CPU reference's to the bit, and `race_sample` and
    `race_logits` draw the references' tokens on every row, near-ties included (flat rows, where the last bit of a score
    decides more often)."""
    from rollout_kernels.race_logits import race_log_noise, race_log_noise_ref, race_logits, race_logits_ref
    from rollout_kernels.race_sample import race_sample, race_sample_ref

    generator = torch.Generator().manual_seed(0)
    num_rows, vocab_size = 64, 151936
    seeds = torch.randint(0, 2**62, (num_rows,), generator=generator)
    positions = torch.randint(0, 2**32, (num_rows,), generator=generator)
    log_noise = race_log_noise(seeds.cuda(), positions.cuda(), vocab_size)
    expected = race_log_noise_ref(seeds, positions, torch.arange(vocab_size))
    assert torch.equal(log_noise.cpu().view(torch.int64), expected.view(torch.int64)), "the noise's bits differ"

    logits = torch.randn(num_rows, vocab_size, generator=generator, dtype=torch.float64)
    logits[: num_rows // 2] *= 0.01  # nearly flat
    probs = torch.softmax(logits, dim=-1).float()
    assert torch.equal(
        race_sample(probs.cuda(), seeds.cuda(), positions.cuda()).cpu(), race_sample_ref(probs, seeds, positions)
    )
    temperatures = torch.rand(num_rows, generator=generator) + 0.3
    temperatures[::7] = 0.0  # greedy rows
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        case = dict(
            logits=(3 * logits).to(dtype),
            logit_rows=torch.arange(num_rows).flip(0).contiguous(),
            temperatures=temperatures,
            seeds=seeds,
            positions=positions,
        )
        ref_ids, ref_logprobs = race_logits_ref(**case)
        token_ids, logprobs = race_logits(**{name: tensor.cuda() for name, tensor in case.items()})
        assert torch.equal(token_ids.cpu(), ref_ids), f"{dtype}: the kernel drew other tokens than the reference"
        torch.testing.assert_close(logprobs.cpu(), ref_logprobs, rtol=0, atol=1e-4 if dtype != torch.float64 else 1e-10)
