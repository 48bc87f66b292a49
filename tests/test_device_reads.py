"""A decode step reads the device once: the packed copy of its results (started by `DecodeStep._launch_decode`,
waited for by `_finish_decode`), for chains, token trees and the cascade alike (DESIGN.md's invariant).

A CPU has no device to wait for, so it cannot see a synchronisation: the gate is `tests/test_gpu_policy.py`, which
counts them on CUDA with torch's sync-debug mode. What a CPU can count is the engine's own marker of a read: by this
code's convention a tensor comes back from the device through `.cpu()`, and host-side data goes through
`device_io.host`, which never calls it. A weak proxy: a read written as `.tolist()`, `int()` or a blocking
`.to(device)` of a device tensor escapes it. It caught the tree step's three extra reads (the compaction reading the
accepted nodes, the root positions it had just uploaded and a device `arange`)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_prompts
from torch.overrides import TorchFunctionMode

from rollout import Generator, SamplingParams
from specdec.config import SpecConfig


class CountingReads(TorchFunctionMode):
    """Counts `Tensor.cpu()` calls made while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cpu:
            self.count += 1
        return func(*args, **(kwargs or {}))


def draft_model():
    return make_model("qwen2", seed=4)


SPECS = {
    "none": lambda: None,
    "suffix chain": lambda: SpecConfig(method="suffix", num_speculative_tokens=3),
    "ngram tree": lambda: SpecConfig(method="ngram", num_speculative_tokens=4, num_candidates=3, prompt_lookup_min=1),
    "suffix tree": lambda: SpecConfig(method="suffix", num_speculative_tokens=4, num_candidates=2),
    "cascade": lambda: SpecConfig(method=["suffix", "draft_model"], num_speculative_tokens=3, model=draft_model()),
}


@pytest.mark.parametrize("kv_layout", ["paged", "slots"])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_a_decode_step_reads_its_results_once(spec, kv_layout):
    spec = spec()
    model = make_model("llama")
    gen = Generator(model, max_batch_size=6, max_seq_len=64, kv_layout=kv_layout, spec=spec)
    prompts = [p * 3 for p in random_prompts(3, max_len=6, seed=2)]  # repeats: the n-gram and suffix drafts hit
    if spec is not None and len(spec.methods) > 1:  # the cascade: suffix drafts where it has some, the draft model
        gen.proposers.pass_on = False  # for the rest, combined into one step's drafts
    gen.add_requests(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=0))
    reads, kinds, trees, mixed = [], [], 0, 0
    while gen.has_unfinished:
        counter = CountingReads()
        with counter:
            out = gen.step()
        if out.record.kind == "decode":
            reads.append(counter.count)
            mixed += len(out.record.rows_by_method) > 1
            trees += out.record.num_drafted > 0 and spec is not None and spec.num_candidates > 1
        kinds.append(out.record.kind)
    assert kinds.count("decode") >= 5
    if spec is not None and spec.num_candidates > 1:
        assert trees >= 2, "no step drafted a tree: nothing was tested"
    if spec is not None and len(spec.methods) > 1:
        assert mixed >= 2, "no step combined two proposers' drafts: nothing was tested"
    assert reads == [1] * len(reads), reads
