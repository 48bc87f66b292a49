"""Shared test fixtures: small random-weight transformers models of several architectures."""

from __future__ import annotations

import functools
import importlib
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
    model = model_from_config(config_cls(**kwargs), attn=attn, dtype=dtype, seed=seed)
    model.generation_config.eos_token_id = eos_token_id
    return model


def model_from_config(config, attn: str = "sdpa", dtype: torch.dtype = torch.float64, seed: int = 0, **options):
    """A random model of `config` in eval mode, its matrices drawn with std 0.15 (the default 0.02 gives logits near
    uniform: sampling tests want sharp distributions); `options` go to `from_config`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype, **options)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
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
# CUDA, the launchers are wrapped so that the kernel runs on the GPU: CPU tensor arguments are copied there (each with
# its storage, so strided rows stay strided and arguments that alias still alias), the kernel runs compiled, in-place
# results are copied back and outputs return to the CPU, where the tests compare them with the torch references. A call
# without CPU tensors (the engine's, on the device) goes to the launcher as it is. Without CUDA nothing is wrapped and
# TRITON_INTERPRET=1 (above) runs the same kernels on the CPU.

LAUNCHERS = {  # module of rollout_kernels: the launchers in it that the kernel tests call (references stay unwrapped)
    "greedy_verify": ("greedy_verify",),
    "keep_threshold": ("keep_threshold",),
    "kv_compact": ("compact_kv_",),
    "paged_attention": ("paged_attention",),
    "race_logits": ("race_logits", "race_log_noise"),
    "race_sample": ("race_sample",),
    "rejection_sample": ("rejection_sample",),
    "store_kv": ("store_kv_",),
    "tree_greedy_verify": ("tree_greedy_verify",),
    "tree_rejection_sample": ("tree_rejection_sample",),
}
GPU_CALLS = [0]  # launcher calls that the wrappers moved to the GPU (reported at the end of the session)


def has_cpu_tensor(values: tuple) -> bool:
    for value in values:  # a loop, not a generator: torch.compile traces this inside the engine's forward
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return True
    return False


def on_cuda(value, storages: dict[int, tuple[torch.Tensor, torch.Tensor]]):
    """A CPU tensor as a CUDA view, with its offset and strides, of a copy of its whole storage (one copy per storage
    in `storages`: CPU bytes and their CUDA copy); anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return value
    storage = value.untyped_storage()
    key = storage.data_ptr() or id(value)  # empty storages share address 0
    if key not in storages:
        host = torch.empty(0, dtype=torch.uint8).set_(storage)
        storages[key] = (host, host.to("cuda"))
    device_storage = storages[key][1].untyped_storage()
    return torch.empty(0, dtype=value.dtype, device="cuda").set_(
        device_storage, value.storage_offset(), value.shape, value.stride()
    )


def on_gpu(launcher):
    """`launcher` with CPU tensors moved to CUDA for the call and results brought back; CUDA calls pass through."""

    @functools.wraps(launcher)
    def wrapper(*args, **kwargs):
        if not has_cpu_tensor((*args, *kwargs.values())):
            return launcher(*args, **kwargs)
        storages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        out = launcher(*[on_cuda(a, storages) for a in args], **{k: on_cuda(v, storages) for k, v in kwargs.items()})
        GPU_CALLS[0] += 1
        for host, device in storages.values():  # in-place launchers (their name ends in _) wrote into the CUDA copy
            host.copy_(device)
        if isinstance(out, torch.Tensor):
            return out.cpu()
        if isinstance(out, tuple):
            items = [o.cpu() if isinstance(o, torch.Tensor) else o for o in out]
            return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
        return out

    return wrapper


if torch.cuda.is_available():  # before any test module imports a launcher, from the package or from its module
    import rollout_kernels

    for module_name, names in LAUNCHERS.items():
        module = importlib.import_module(f"rollout_kernels.{module_name}")
        for name in names:
            wrapped = on_gpu(getattr(module, name))
            setattr(module, name, wrapped)
            if hasattr(rollout_kernels, name):
                setattr(rollout_kernels, name, wrapped)


def pytest_terminal_summary(terminalreporter):
    if torch.cuda.is_available():
        terminalreporter.write_line(
            f"kernels: {GPU_CALLS[0]} launcher calls ran compiled on {torch.cuda.get_device_name()}"
        )
