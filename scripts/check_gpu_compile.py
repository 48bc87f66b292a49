"""Every Triton kernel compiled for a GPU, on a machine without one.

The kernel tests run under the interpreter on a CPU (`TRITON_INTERPRET=1`), which executes a kernel as Python and so
accepts what Triton's compiler refuses (a plain global read inside a kernel, a variable whose type an `if` changes).
This script records every launch the kernel tests make (kernel, argument types, constexpr values), then compiles each
distinct one for an H100 (sm_90 by default) with Triton's own compiler and the `ptxas` the `triton` wheel ships, in a
process without the interpreter, FMA contraction off as the launchers ask. It prints one line per kernel and exits 1
if any fails to compile.

    .venv/bin/python scripts/check_gpu_compile.py            # all of tests/kernels (the slow cases left out)
    .venv/bin/python scripts/check_gpu_compile.py -k keep    # pytest's -k, to record fewer launches
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRITON_TYPES = {
    "torch.float64": "fp64", "torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16",
    "torch.int64": "i64", "torch.int32": "i32", "torch.int16": "i16", "torch.int8": "i8", "torch.uint8": "u8",
    "torch.bool": "i1",
}  # fmt: skip


class Recorder:
    """A pytest plugin: records the interpreted launches of the session."""

    def __init__(self):
        self.launches: dict[str, dict] = {}

    def pytest_sessionstart(self, session):
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run
        recorder = self

        def recording(kernel, *args, **kwargs):
            recorder.add(kernel.fn, args, kwargs)
            return run(kernel, *args, **kwargs)

        InterpretedFunction.run = recording

    def add(self, fn, args: tuple, kwargs: dict) -> None:
        import torch

        params = inspect.signature(fn).parameters
        bound = dict(zip(params, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        signature, constexprs = {}, {}
        for name, param in params.items():
            value = bound.get(name, param.default)
            if "constexpr" in str(param.annotation) or value is None:
                signature[name] = "constexpr"
                constexprs[name] = value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + TRITON_TYPES[str(value.dtype)]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: argument {name} ({type(value).__name__}) has no Triton type here")
        if not fn.__module__.startswith("rollout_kernels"):  # a kernel a test defines for itself
            return
        constexprs = {name: _encode(value) for name, value in constexprs.items()}
        entry = {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs}
        self.launches.setdefault(json.dumps(entry, sort_keys=True, default=str), entry)


def _encode(value):
    """A constexpr value as JSON: a Triton dtype by its name."""
    import triton.language as tl

    return {"dtype": value.name} if isinstance(value, tl.dtype) else value


def _decode(value):
    import triton.language as tl

    return tl.dtype(value["dtype"]) if isinstance(value, dict) and "dtype" in value else value


def compile_all(entries: list[dict], capability: int) -> int:
    """In this process (no interpreter): compile each entry; returns the number that failed."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = 0
    for entry in entries:
        kernel = getattr(importlib.import_module(entry["module"]), entry["name"])
        where = f"{entry['module']}.{entry['name']} {entry['constexprs']}"
        try:
            constexprs = {name: _decode(value) for name, value in entry["constexprs"].items()}
            source = ASTSource(fn=kernel, signature=entry["signature"], constexprs=constexprs)
            compiled = triton.compile(
                source, target=GPUTarget("cuda", capability, 32), options={"enable_fp_fusion": False}
            )
            print(f"ok    {where}: {compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared")
        except Exception as err:  # noqa: BLE001 - every kernel is tried; each failure is printed
            failed += 1
            print(f"FAIL  {where}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="not slow", help="pytest -k expression over tests/kernels")
    parser.add_argument("--capability", type=int, default=90, help="CUDA compute capability (90: H100)")
    parser.add_argument("--compile", help=argparse.SUPPRESS)  # the child: a JSON file of recorded launches
    args = parser.parse_args()
    if args.compile:
        return 1 if compile_all(json.loads(pathlib.Path(args.compile).read_text()), args.capability) else 0
    import pytest

    recorder = Recorder()
    code = pytest.main(
        ["-q", "-p", "no:cacheprovider", "-k", args.k, str(ROOT / "tests" / "kernels")], plugins=[recorder]
    )
    if code not in (0, 5):
        print(f"the kernel tests failed (pytest exit {code}): fix those first")
        return 1
    path = pathlib.Path("/tmp") / f"gpu_compile_{os.getpid()}.json"
    path.write_text(json.dumps(list(recorder.launches.values()), default=str))
    print(f"{len(recorder.launches)} distinct launches recorded; compiling for sm_{args.capability}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    command = [sys.executable, __file__, "--compile", str(path), "--capability", str(args.capability)]
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
