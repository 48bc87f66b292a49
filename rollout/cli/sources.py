"""Where models and datasets come from: a shipped or embedded short name, a local path, or a Hugging Face hub id."""

from __future__ import annotations

import pathlib

import torch

from rollout.cli.preflight import DATA_FILE_BUILDERS, EMBEDDED_DATASETS, name_kind, resolve_device
from rollout.models import zoo

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_model(name: str, dtype: str = "float32", device: str = "cpu", key: str = "model.name"):
    """Load a causal LM and its tokenizer from a shipped short name, a local folder or a hub id.

    Args:
        name: a zoo name ("tiny-target", "tiny-draft", or a widened one such as "tiny-target-1b": see
            `rollout.models.zoo`), a folder with a transformers model, or "org/name".
        dtype: one of `DTYPES`.
        device: "cpu", "cuda", "cuda:1", ... or "auto".
        key: the recipe key that named the model, quoted in errors.
    Returns:
        (model, tokenizer), the model in eval mode on `device`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        kind = name_kind(name, zoo.ALL_NAMES)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"{key}: {err}") from None
    if kind == "short":  # a widened model is built on the device: its random init is much faster on a GPU
        model, tokenizer = zoo.load_model(name, DTYPES[dtype], device=resolve_device(device))
    else:
        local = kind == "path"
        model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype], local_files_only=local)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local)
    return model.to(resolve_device(device)).eval(), tokenizer


def draft_model_spec(name, dtype: str, device: str):
    """What `SpecConfig.model` gets: a shipped name or a local path as is (the generator loads it in the target's
    dtype); a hub id or a widened zoo name loaded here, since the generator loads only folders."""
    if name is None or not isinstance(name, str):
        return name
    try:
        kind = name_kind(name, zoo.ALL_NAMES)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"spec.model: {err}") from None
    if kind != "hub" and name not in zoo.WIDENED_NAMES:
        return name
    model, _ = load_model(name, dtype, device, key="spec.model")
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_draft_tokenizer(name, tokenizer) -> None:
    """A draft model's folder (`spec.model`) that holds a tokenizer must hold the target's: the generator sees only
    the models, whose vocabularies may be the same size and the tokens other ones (its drafts would then be rejected,
    the samples unchanged and the speed lost, without a word). A draft given otherwise is not checked here."""
    if not isinstance(name, str) or name in zoo.ALL_NAMES or not pathlib.Path(name).is_dir():
        return
    folder = pathlib.Path(name)
    if not any((folder / file).is_file() for file in TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    draft = AutoTokenizer.from_pretrained(folder, local_files_only=True).get_vocab()
    target = tokenizer.get_vocab()
    common = [token for token in draft if token in target]
    other = sum(1 for token in common if draft[token] != target[token])
    # an id each holds for a token the other lacks: one id, two tokens (tokens one of them adds alone are fine)
    target_ids = {i: token for token, i in target.items()}
    other += sum(1 for token, i in draft.items() if token not in target and i in target_ids)
    if other or 2 * len(common) < min(len(draft), len(target)):
        raise ValueError(
            f"spec.model: {name} holds another tokenizer than model.name's ({other} of its {len(draft)} tokens have "
            f"other ids there, or their ids other tokens; the target's has {len(target)}): a draft model must share "
            "the target's tokenizer, or its drafts are rejected"
        )


def load_dataset(name: str, split: str = "eval", config_name: str | None = None, num_prompts: int | None = None):
    """A `datasets.Dataset` from the embedded `arithmetic` task, a local data file (json, jsonl, csv, parquet), a
    folder written by `Dataset.save_to_disk`, or a hub id. `num_prompts` keeps the first rows (None: all). Quiet:
    datasets' progress bars (a new or edited file is prepared anew) would come before a run's one-line error."""
    import datasets

    datasets.disable_progress_bars()

    try:
        kind = name_kind(name, EMBEDDED_DATASETS)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"data.dataset: {err}") from None
    if kind == "short":
        from rollout.tasks import arithmetic_dataset

        if split not in ("train", "eval"):
            raise ValueError(f"data.split ({split!r}) must be 'train' or 'eval' for the arithmetic dataset")
        return arithmetic_dataset(num_prompts if num_prompts is not None else 1000, split=split)
    path = pathlib.Path(name).expanduser()
    if kind == "path" and path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(f"data.dataset: {name}: unknown file type; use one of {', '.join(DATA_FILE_BUILDERS)}")
        data = datasets.load_dataset(builder, data_files=str(path), split="train")
    elif kind == "path":
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"data.split ({split!r}) is not in {name}; its splits: {', '.join(data)}")
            data = data[split]
    else:
        data = datasets.load_dataset(name, config_name, split=split)
    if num_prompts is not None:
        data = data.select(range(min(num_prompts, len(data))))
    return data
