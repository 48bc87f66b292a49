"""The tiny models shipped inside the package, loadable offline by short name.

`tiny-target` and `tiny-draft` are trained by `scripts/train_tiny_models.py` on the arithmetic task
(`rollout.tasks.arithmetic`) and share one tokenizer, so the draft can propose tokens for the target.
`tiny-target-1b` and `tiny-draft-150m` are built from them at load time (`rollout.models.widen`): they compute what
the shipped models compute at the cost of a Llama-3.2-1B and of a 150M draft with its 128k vocabulary.
"""

from __future__ import annotations

import pathlib
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the names are known without importing torch, so that the command line checks a recipe before it loads anything
MODEL_NAMES = ("tiny-target", "tiny-draft")  # shipped, each a folder in assets/
WIDENED_NAMES = ("tiny-target-1b", "tiny-draft-150m")  # built at load time from a shipped model: widen.WIDENED
ALL_NAMES = MODEL_NAMES + WIDENED_NAMES  # every name `load_model` takes


def model_path(name: str) -> pathlib.Path:
    """The folder of shipped model `name` (a Hugging Face folder: config, weights, tokenizer)."""
    if name in WIDENED_NAMES:
        from rollout.models.widen import WIDENED

        raise ValueError(
            f"{name!r} has no folder: it is built at load time from {WIDENED[name][0]!r}; load it with load_model"
        )
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model name {name!r}; valid names: {', '.join(ALL_NAMES)}")
    # importlib.resources resolves inside an installed wheel as well as an editable checkout; the
    # package is installed unzipped (setuptools), so the traversable is a real folder on disk.
    path = pathlib.Path(str(resources.files("rollout.models") / "assets" / name))
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {name!r} is missing its files at {path}; rebuild them with "
            "`python scripts/train_tiny_models.py --out rollout/models/assets`"
        )
    return path


def load_model(name: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """Load model `name` and its tokenizer offline, in eval mode.

    Args:
        name: a shipped model ("tiny-target", "tiny-draft") or a widened one ("tiny-target-1b", "tiny-draft-150m":
            the shipped model's function in a large Llama shape, built here in seconds; see `rollout.models.widen`).
        dtype: parameter dtype, e.g. torch.float64 for exactness tests (widened models: not float16); None is
            torch.float32.
        device: where the model is put (a widened one is built there, random init included); None is the CPU.

    Returns:
        (model, tokenizer): a `PreTrainedModel` and a left-padding `PreTrainedTokenizerFast` with EOS and pad set.
        A widened model's vocabulary is larger than the tokenizer's; its added ids have probability 0.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy import, only when a model is loaded

    dtype = torch.float32 if dtype is None else dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        dtype = getattr(torch, dtype)  # "bfloat16", as transformers takes it for the shipped ones
    if name in WIDENED_NAMES:
        from rollout.models.widen import WIDENED, widen

        base, shape = WIDENED[name]
        small, tokenizer = load_model(base, torch.float64)
        return widen(small, shape, dtype=dtype, device=device), tokenizer
    path = model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    if device is not None:
        model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
