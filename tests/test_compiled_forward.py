"""The decoder's forward through `torch.compile` (`rollout.engine.compiled_forward`), as the CUDA graphs capture it
with `Generator(compile_forward=True)`. A CPU runs the graph runner's padded forward uncaptured: compiled, it must
generate what the eager paged forward generates; a model the compiler cannot serve runs its plain forward, said once."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_prompts
from torch._dynamo.utils import counters

from rollout import Generator, SamplingParams

PARAMS = [SamplingParams(n=2, temperature=0.0, max_new_tokens=12, seed=1)] * 2 + [
    SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=2)
] * 2


def padded(model, compile: bool) -> Generator:
    gen = Generator(model, max_batch_size=8, max_seq_len=48, kv_layout="paged", cuda_graphs=False)
    gen.runner.use_graphs(gen.max_width, capture=False, compile=compile)
    return gen


def test_the_compiled_forward_generates_what_the_eager_one_generates():
    model = make_model("llama")  # float64: rounding cannot flip a token
    prompts = random_prompts(4, seed=3)
    eager = padded(model, compile=False).generate(prompts, PARAMS)
    gen = padded(model, compile=True)
    breaks_before = sum(counters["graph_break"].values())
    outs = gen.generate(prompts, PARAMS)
    compiled = gen.runner.graphs.compiled
    assert compiled.error is None, compiled.error
    assert compiled.seconds > 0, "nothing was compiled: the test compared the eager forward with itself"
    # the paged attention is one opaque operator: the layers around it fuse, with no graph break at each of them
    breaks = {reason: n for reason, n in counters["graph_break"].items() if n}
    assert sum(counters["graph_break"].values()) == breaks_before, breaks
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    # Llama computes its rotary angles in float32 whatever the model's dtype, and inductor's sin and cos can differ from
    # eager's in the last bits: float32-sized differences, in a float64 model
    for a, b in zip(outs, eager):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_forward_the_compiler_cannot_serve_runs_plain_said_once():
    model = make_model("llama")
    prompts = random_prompts(3, seed=4)
    reference = padded(model, compile=False).generate(prompts, PARAMS[:3])
    gen = padded(model, compile=True)
    compiled = gen.runner.graphs.compiled

    def failing(**kwargs):  # what a compiler failure looks like from here (a real one needs a model dynamo rejects)
        raise RuntimeError("backend compiler failed")

    compiled._compiled = failing
    with pytest.warns(RuntimeWarning, match="could not compile") as caught:
        outs = gen.generate(prompts, PARAMS[:3])
    assert len([w for w in caught if "could not compile" in str(w.message)]) == 1
    assert compiled.error.startswith("RuntimeError: backend compiler failed")
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]


def test_compile_forward_needs_the_graphs():
    with pytest.raises(ValueError, match="compile_forward"):
        Generator(make_model("llama"), 4, 48, compile_forward=True)  # a CPU: no CUDA graphs to compile for
    with pytest.raises(ValueError, match="compile_forward"):
        Generator(make_model("llama"), 4, 48, compile_forward="yes")
