"""What an installed copy of this library looks like from outside the repository: its import names live beside Hugging
Face's `kernels` package (hub kernels for transformers), which owns the name `kernels`."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

BOTH = """
import pathlib, sys
import kernels  # Hugging Face's
import rollout_kernels
import torch
from rollout import Generator, SamplingParams
from rollout.models.zoo import load_model

root = pathlib.Path(sys.argv[1])
assert pathlib.Path(kernels.__file__).parent != root / "kernels", kernels.__file__  # not this repository's folder
assert callable(kernels.get_kernel) and callable(kernels.kernelize)  # the hub-kernel API, not ours
assert rollout_kernels.greedy_verify_ref is not None and not hasattr(kernels, "greedy_verify_ref")
model, tokenizer = load_model("tiny-target")
params = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=0)  # 4 tokens whatever is drawn (CI once drew EOS)
out = Generator(model, max_batch_size=2, max_seq_len=32).generate([[5, 6, 7]], params)
print(kernels.__name__, rollout_kernels.__name__, len(out[0].token_ids))
"""


def test_hugging_face_kernels_and_this_library_import_side_by_side(tmp_path):
    pytest.importorskip("kernels", reason="Hugging Face's kernels package is not installed (the dev extra has it)")
    # outside the repository (its kernels/ folder would shadow any installed `kernels` on sys.path), as a user runs
    result = subprocess.run(
        [sys.executable, "-c", BOTH, str(ROOT)], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["kernels", "rollout_kernels", "4"]
