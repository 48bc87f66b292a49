"""On a GPU: the paged layout with its compiled kernels, inside the engine, and the device reads a decode step makes.
A CPU skips these (the kernels' own tests run there under the Triton interpreter)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_model, random_prompts

from rollout import Generator, SamplingParams

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


@pytest.mark.parametrize("kv_layout", ["paged", "slots"])
def test_a_decode_step_reads_the_device_once(kv_layout):
    """One synchronisation per plain decode step: the packed copy of the emitted tokens the scheduler needs."""
    model = make_model("llama", dtype=torch.float32).cuda()
    gen = Generator(model, max_batch_size=8, max_seq_len=96, kv_layout=kv_layout)
    gen.add_requests(random_prompts(4, seed=2), SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=0))
    for _ in range(3):  # the prefill, and decode steps that compile the kernels
        gen.step()
    torch.cuda.synchronize()
    steps = 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            records = [gen.step().record for _ in range(steps)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(r.kind == "decode" for r in records)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= steps, f"{len(syncs)} synchronisations in {steps} decode steps: {syncs[:4]}"
