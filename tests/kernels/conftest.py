"""Kernel tests run the compiled Triton kernels on a CUDA machine, the interpreter elsewhere.

The tests build their inputs on the CPU (seeded CPU generators, so the cases are the same everywhere). With CUDA, the
launchers the tests call are wrapped so that the kernel runs on the GPU: CPU tensor arguments are copied there (one
copy per distinct tensor, so arguments that alias still alias), the kernel runs compiled, in-place results are copied
back and outputs return to the CPU, where the test compares them with the torch reference. Without CUDA the wrapper
is not installed and `TRITON_INTERPRET=1` (set in the top-level conftest) runs the same kernels on the CPU.
"""

from __future__ import annotations

import functools

import torch

import kernels

LAUNCHERS = ("greedy_verify", "rejection_sample", "tree_greedy_verify", "tree_rejection_sample", "compact_kv_")
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
    for name in LAUNCHERS:
        setattr(kernels, name, on_gpu(getattr(kernels, name)))


def pytest_terminal_summary(terminalreporter):
    if torch.cuda.is_available():
        terminalreporter.write_line(
            f"kernels: {GPU_CALLS[0]} launcher calls ran compiled on {torch.cuda.get_device_name()}"
        )
