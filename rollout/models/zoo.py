"""The tiny models shipped inside the package, loadable offline by short name.

`tiny-target` and `tiny-draft` are trained by `scripts/train_tiny_models.py` on the arithmetic task
(`rollout.tasks.arithmetic`) and share one tokenizer, so the draft can propose tokens for the target.
"""

from __future__ import annotations

import pathlib
from importlib import resources

import torch

MODEL_NAMES = ("tiny-target", "tiny-draft")


def model_path(name: str) -> pathlib.Path:
    """The folder of shipped model `name` (a Hugging Face folder: config, weights, tokenizer)."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model name {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    # importlib.resources resolves inside an installed wheel as well as an editable checkout; the
    # package is installed unzipped (setuptools), so the traversable is a real folder on disk.
    path = pathlib.Path(str(resources.files("rollout.models") / "assets" / name))
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {name!r} is missing its files at {path}; rebuild them with "
            "`python scripts/train_tiny_models.py --out rollout/models/assets`"
        )
    return path


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """Load shipped model `name` and its tokenizer offline, in eval mode.

    Args:
        name: "tiny-target" or "tiny-draft".
        dtype: parameter dtype, e.g. torch.float64 for exactness tests.

    Returns:
        (model, tokenizer): a `PreTrainedModel` and a left-padding `PreTrainedTokenizerFast` with EOS and pad set.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy import, only when a model is loaded

    path = model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
