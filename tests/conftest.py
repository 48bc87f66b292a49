"""Shared test fixtures: small random-weight transformers models of several architectures."""

from __future__ import annotations

import functools
import os

# Triton kernels run under the CPU interpreter when there is no GPU; set before anything imports triton.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

torch.set_num_threads(1)

ARCHITECTURES = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {}),
    # a window shorter than the sequences, so a mask without the window would give different logits
    "mistral": (MistralConfig, {"sliding_window": 6}),
}


def make_model(
    arch: str = "qwen2",
    attn: str = "sdpa",
    dtype: torch.dtype = torch.float64,
    vocab_size: int = 97,
    seed: int = 0,
    eos_token_id: int | None = None,
    **overrides,
):
    """A 2-layer random model; float64 by default so that rounding cannot flip an argmax."""
    config_cls, extra = ARCHITECTURES[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        bos_token_id=None,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    # larger init than the default 0.02 so logits are far from uniform and sampling tests see sharp distributions
    model = AutoModelForCausalLM.from_config(config_cls(**kwargs), attn_implementation=attn, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = eos_token_id
    return model.eval()


def random_prompts(num_prompts: int, vocab_size: int = 97, min_len: int = 1, max_len: int = 12, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num_prompts):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        prompts.append(torch.randint(1, vocab_size, (length,), generator=generator).tolist())
    return prompts


@pytest.fixture
def model_factory():
    return make_model


# ---- on a CUDA machine the kernel launchers run compiled ------------------------------------------------------------
# The kernel tests build their inputs on the CPU (seeded CPU generators, so the cases are the same everywhere). With
# CUDA, the launchers are wrapped so that the kernel runs on the GPU: CPU tensor arguments are copied there (one copy
# per distinct tensor, so arguments that alias still alias), the kernel runs compiled, in-place results are copied
# back and outputs return to the CPU, where the tests compare them with the torch references. Without CUDA nothing is
# wrapped and TRITON_INTERPRET=1 (above) runs the same kernels on the CPU.

LAUNCHERS = ("greedy_verify", "rejection_sample", "tree_greedy_verify", "tree_rejection_sample", "compact_kv_")
LAUNCHERS += ("paged_attention", "store_kv_")
GPU_CALLS = [0]  # launcher calls that ran on the GPU (reported at the end of the session)


def on_gpu(launcher):
    """`launcher` with CPU tensors moved to CUDA for the call and results brought back."""

    @functools.wraps(launcher)
    def wrapper(*args, **kwargs):
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def to_gpu(value):
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                return value
            if id(value) not in copies:
                copies[id(value)] = (value, value.to("cuda"))
            return copies[id(value)][1]

        out = launcher(*[to_gpu(a) for a in args], **{k: to_gpu(v) for k, v in kwargs.items()})
        GPU_CALLS[0] += 1
        for cpu, gpu in copies.values():  # in-place launchers (their name ends in _) wrote into the GPU copy
            cpu.copy_(gpu)
        if isinstance(out, torch.Tensor):
            return out.cpu()
        if isinstance(out, tuple):
            items = [o.cpu() if isinstance(o, torch.Tensor) else o for o in out]
            return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
        return out

    return wrapper


if torch.cuda.is_available():
    import rollout_kernels

    for name in LAUNCHERS:
        setattr(rollout_kernels, name, on_gpu(getattr(rollout_kernels, name)))


def pytest_terminal_summary(terminalreporter):
    if torch.cuda.is_available():
        terminalreporter.write_line(
            f"kernels: {GPU_CALLS[0]} launcher calls ran compiled on {torch.cuda.get_device_name()}"
        )
