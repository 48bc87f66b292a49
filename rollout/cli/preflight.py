"""Everything a recipe states, checked before torch is imported, a model loads or a file is written.

`rollout run`, `train` and `bench` call `preflight` right after the recipe loads. A bad recipe is refused in one line
naming the key and the fix, in a second or two (a hub id: one request), where it used to surface after the model
loaded, or after a whole rollout:

- the model and draft names: shipped, a local model folder, or a hub id the hub has (or, offline, the local cache);
- the rewards, and the data: its prompt column, the template's fields and the columns each reward needs, read from
  the embedded task or a local file's header without loading it;
- `rollout train`: options TRL would refuse only after a rollout, and a group of identical samples (greedy);
- a device other than the CPU (the one check that imports torch): CUDA must be there;
- last, the output folder: one that holds a run (unless `overwrite` or `resume` say what to do with it), one that
  holds other files (unless `overwrite`), a file in its place, a `resume` with no run or another recipe there (or,
  for `rollout train`, no complete checkpoint).

It returns the notes a run's header prints: what the recipe will do that a user may not expect.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
from typing import TYPE_CHECKING

from rollout.cli.files import (
    RUN_OUTPUTS,
    TRAIN_OUTPUTS,
    check_makeable,
    check_output_dir,
    check_resumable,
    check_unfinished,
    check_writable,
    checkpoint_to_resume,
)
from rollout.cli.hub import check_hub_id
from rollout.cli.recipe import WANDB_MODES, DataRecipe, Recipe, recipe_dict
from rollout.models import zoo
from rollout.prompts import check_prompt_column, template_fields
from rollout.rewards import build_rewards, check_reward_columns
from rollout.tasks.arithmetic import ARITHMETIC_COLUMNS
from specdec.config import SpecConfig

if TYPE_CHECKING:
    import torch

EMBEDDED_DATASETS = ("arithmetic",)
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def preflight(recipe: Recipe, command: str) -> list[str]:
    """Check what `recipe` states for `command` ("run", "train" or "bench"); raise ValueError (or FileNotFoundError)
    with one line at the first problem. Returns the header's notes."""
    if command == "train" and recipe.resume and recipe.train.save_steps == 0:
        raise ValueError(
            "resume=true continues a training from its last checkpoint, and with train.save_steps 0 it keeps none: "
            "run it again with overwrite=true (and train.save_steps=N to checkpoint every N steps)"
        )
    if command == "bench" and recipe.resume:
        raise ValueError(
            "resume=true continues a `rollout run`; `rollout bench` runs every row again: drop resume=true (and pass "
            "overwrite=true to replace an earlier bench.json)"
        )
    check_model_name(recipe.model.name, "model.name")
    spec = recipe.spec
    methods = [spec.method] if isinstance(spec.method, str) else list(spec.method or [])
    if "draft_model" in methods and isinstance(spec.model, str):
        check_model_name(spec.model, "spec.model")
    names = (recipe.model.name, spec.model if "draft_model" in methods else None)
    widened = [name for name in names if name in zoo.WIDENED_NAMES]
    if widened and recipe.model.dtype == "float16":  # (the widened models' added vocabulary rows need it)
        raise ValueError(
            f"model.dtype float16 cannot hold the added vocabulary guard of the widened {widened[0]!r}: set "
            "model.dtype to bfloat16, float32 or float64"
        )
    if names[1] in zoo.ALL_NAMES and recipe.model.name in zoo.ALL_NAMES and len(widened) == 1:
        # (refused once both had loaded, as another tokenizer: the widened models pad the same one to 128256 rows)
        raise ValueError(
            f"spec.model {names[1]!r} does not draft for model.name {recipe.model.name!r}: the widened models pad the "
            "vocabulary to 128256 rows and draft for each other (tiny-target-1b with spec.model=tiny-draft-150m, "
            "tiny-target with tiny-draft)"
        )
    terms = build_rewards([(r.name, r.weight) for r in recipe.rewards])
    columns = data_columns(recipe.data)
    if columns is not None:  # a hub data set's columns are checked once it loads
        d = recipe.data
        if d.template is None:  # (a template names its own columns)
            check_prompt_column(columns, d.prompt_column)
        check_template(d.template, columns)
        check_reward_columns(terms, columns, where=f"data.dataset {d.dataset!r}")
    s = recipe.sampling
    identical = s.temperature == 0 and s.n > 1
    if command == "train":
        if importlib.util.find_spec("trl") is None:
            raise ValueError(
                "rollout train needs TRL: install the trl extra from the checkout (pip install '.[trl]', as the "
                "README's command does; PyPI's 'rollout' is another project)"
            )
        if s.n < 2:  # TRL refuses it once the model has loaded, naming its own argument
            raise ValueError(
                f"sampling.n ({s.n}) must be at least 2 for GRPO: a prompt's advantages compare its samples; set "
                "sampling.n=2 or more, e.g. 8"
            )
        if identical:
            raise ValueError(
                f"sampling.temperature is 0 (greedy) with sampling.n {s.n}: the samples of a prompt are identical, "
                "so every GRPO advantage is 0 and nothing is learned; set sampling.temperature > 0, e.g. 1.0"
            )
        num_prompts, per_step = recipe.data.num_prompts, recipe.train.prompts_per_step
        if num_prompts is not None and num_prompts < per_step:  # the trainer keeps whole steps only: none
            raise ValueError(
                f"data.num_prompts ({num_prompts}) is below train.prompts_per_step ({per_step}): not one optimiser "
                "step fits; raise data.num_prompts or lower train.prompts_per_step"
            )
    environment_mode = os.environ.get("WANDB_MODE")  # wins over logging.wandb_mode, so it is checked alike
    if environment_mode and environment_mode not in WANDB_MODES:
        raise ValueError(
            f"the environment's WANDB_MODE ({environment_mode!r}) must be one of {', '.join(WANDB_MODES)}: set it to "
            "one of them, or unset it to use logging.wandb_mode"
        )
    device_type = "cpu"
    if recipe.model.device != "cpu":  # the one check that needs torch
        device_type = resolve_device(recipe.model.device).type
    r = recipe.rollout
    forced = [f"rollout.{k}=true" for k in ("cuda_graphs", "compile_forward") if getattr(r, k) is True]
    if device_type != "cuda" and forced:
        raise ValueError(
            f"{' and '.join(forced)} need{'s' if len(forced) == 1 else ''} a CUDA device; model.device is "
            f"{recipe.model.device!r} ({device_type}): set {'it' if len(forced) == 1 else 'them'} to false"
            + (" (or cuda_graphs to auto)" if forced == ["rollout.cuda_graphs=true"] else "")
            + ", or model.device=cuda"
        )
    # the output folder after what the recipe asks for: a typo is worth fixing before choosing where to write
    if command == "bench":  # it writes bench.json only: beside a run's files, but never over an earlier benchmark's
        folder = pathlib.Path(recipe.output_dir)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"output_dir {folder} is a file: choose a folder")
        check_writable(folder) if folder.exists() else check_makeable(folder)
        if (folder / "bench.json").exists() and not recipe.overwrite:
            raise ValueError(
                f"output_dir {folder} already holds a benchmark (bench.json): pass overwrite=true to replace it, or "
                "choose another output_dir"
            )
    elif recipe.resume:
        check_resumable(recipe.output_dir, recipe_dict(recipe))
        check_writable(pathlib.Path(recipe.output_dir))
        if command == "run":
            check_unfinished(recipe.output_dir)
        if command == "train":
            checkpoint_to_resume(recipe.output_dir, recipe.train.save_steps)
    else:
        resumable = command == "run" or (command == "train" and recipe.train.save_steps > 0)
        outputs = TRAIN_OUTPUTS if command == "train" else RUN_OUTPUTS
        check_output_dir(recipe.output_dir, recipe.overwrite, resumable=resumable, outputs=outputs)
    notes = []
    if identical:
        notes.append(
            f"note: sampling.temperature is 0 (greedy): the n={s.n} samples of each prompt are identical, and a GRPO "
            "group of identical samples has zero advantage"
        )
    if recipe.spec.method in (None, "none"):  # (SpecConfig checks its fields only when a method is set)
        default = SpecConfig(method=None)
        changed = [f"spec.{f.name}" for f in dataclasses.fields(default) if f.name != "method"
                   and getattr(recipe.spec, f.name) != getattr(default, f.name)]  # fmt: skip
        if changed:
            notes.append(f"note: spec.method is null (no speculation): {', '.join(changed)} not used")
    d, kind = recipe.data, name_kind(recipe.data.dataset, EMBEDDED_DATASETS)
    if kind == "path" and pathlib.Path(d.dataset).expanduser().is_file() and d.split != DataRecipe.split:
        notes.append(f"note: data.split ({d.split!r}) is not used: a data file is read whole")
    if kind != "hub" and d.config_name is not None:
        notes.append(f"note: data.config_name ({d.config_name!r}) is not used: it names a hub dataset's config")
    unused = {"bench": "bench times one rollout of every prompt", "train": "train runs train.steps or train.epochs"}
    if command in unused and recipe.rollout.num_rollouts > 1:
        num = recipe.rollout.num_rollouts
        notes.append(f"note: rollout.num_rollouts ({num}) is for rollout run: {unused[command]}")
    return notes


def name_kind(name: str, short_names: tuple[str, ...]) -> str:
    """ "short", "path", "hub", or raises: a missing path or an unknown short name is a user error."""
    if name in short_names:
        return "short"
    path = pathlib.Path(name).expanduser()
    if path.exists():
        return "path"
    if name.startswith(("/", "./", "../", "~")) or path.suffix in DATA_FILE_BUILDERS:
        raise FileNotFoundError(f"{name}: no such file or folder")
    if _HUB_ID.match(name):
        return "hub"
    raise ValueError(
        f"unknown name {name!r}: not one of the shipped names ({', '.join(short_names)}), not an existing path, "
        "and not a hub id of the form 'org/name'"
    )


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when there is a GPU, else the CPU; a CUDA device that is not there is a user error. (It
    imports torch.)"""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"model.device ({device!r}) is not a device: use cpu, cuda, cuda:N or auto") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"model.device is {device!r} but this torch ({torch.__version__}) sees no CUDA device: use "
                "model.device=cpu, or auto (CUDA when there is one)"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"model.device is {device!r} but there are {torch.cuda.device_count()} CUDA devices")
    elif resolved.type != "cpu":  # mps, xpu, ...: usable only where this torch has it (meta holds no values)
        usable = resolved.type != "meta"
        try:
            torch.empty(1, device=resolved)
        except (RuntimeError, AttributeError):
            usable = False
        if not usable:
            raise ValueError(
                f"model.device ({device!r}) is not a device this torch ({torch.__version__}) can compute on: use cpu, "
                "cuda, cuda:N or auto"
            )
    return resolved


def check_model_name(name: str, key: str) -> str:
    """A shipped name, a local transformers model folder (with config.json), or a hub id the hub has; returns the
    kind ("short", "path" or "hub"), raises with `key` in the message."""
    try:
        kind = name_kind(name, zoo.ALL_NAMES)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"{key}: {err}") from None
    if kind == "path":
        path = pathlib.Path(name).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{key}: {name} is not a transformers model folder (no config.json in it): give the folder that "
                "save_pretrained wrote, a shipped name or a hub id"
            )
        try:
            config = json.loads((path / "config.json").read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{key}: {name}/config.json is not JSON ({err}): the folder is damaged") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(
                f"{key}: {name}/config.json names no model_type, which transformers needs to build the model: give "
                "the folder that save_pretrained wrote"
            )
        weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("*.index.json")]
        if not weights:
            raise ValueError(
                f"{key}: {name} holds a config.json but no weights (model.safetensors or pytorch_model.bin): give the "
                "folder that save_pretrained wrote"
            )
    elif kind == "hub":
        check_hub_id(name, "model", key)
    return kind


def data_columns(d: DataRecipe) -> list[str] | None:
    """The data's column names, read without loading it (None for a hub data set: known once it loads). Checks the
    split of the embedded task and of a saved `DatasetDict`, and that a data file is not empty and, for JSON lines,
    that every line is a JSON object."""
    try:
        kind = name_kind(d.dataset, EMBEDDED_DATASETS)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"data.dataset: {err}") from None
    if kind == "short":
        if d.split not in ("train", "eval"):
            raise ValueError(f"data.split ({d.split!r}) must be 'train' or 'eval' for the arithmetic dataset")
        return list(ARITHMETIC_COLUMNS)
    if kind == "hub":
        check_hub_id(d.dataset, "dataset", "data.dataset")
        return None
    path = pathlib.Path(d.dataset).expanduser()
    if path.is_dir():
        return _saved_columns(path, d.split)
    if path.suffix not in DATA_FILE_BUILDERS:
        raise ValueError(f"data.dataset: {path}: unknown file type; use one of {', '.join(DATA_FILE_BUILDERS)}")
    if path.suffix == ".parquet":
        import pyarrow.parquet

        try:
            return list(pyarrow.parquet.read_schema(path).names)
        except Exception as err:  # pyarrow's own error types
            raise ValueError(f"data.dataset: {path} is not a parquet file: {err}") from None
    try:  # a byte-order mark (as spreadsheet programs write) is not part of the first column's name: datasets drops it
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"data.dataset: {path} is not UTF-8 text ({err.reason} at byte {err.start}): save it as UTF-8"
        ) from None
    if not text.strip():
        raise ValueError(f"data.dataset: {path} is empty: it needs one row per prompt")
    if path.suffix == ".jsonl":
        return _jsonl_columns(path, text)
    if path.suffix == ".csv":
        lines = text.splitlines()
        if len(lines) < 2 or not any(line.strip() for line in lines[1:]):
            raise ValueError(f"data.dataset: {path} holds a header and no rows: it needs one row per prompt")
        return next(csv.reader(lines))
    try:  # .json: JSON lines, a list of rows, or an object of columns (what datasets' json builder reads)
        whole = json.loads(text)
    except json.JSONDecodeError:
        return _jsonl_columns(path, text)
    if whole == [] or (isinstance(whole, dict) and whole and all(v == [] for v in whole.values())):
        raise ValueError(f"data.dataset: {path} holds no rows: it needs one row per prompt")
    if isinstance(whole, list) and whole and isinstance(whole[0], dict):
        return list(whole[0])
    if isinstance(whole, dict) and all(isinstance(v, list) for v in whole.values()):
        return list(whole)
    return None  # another layout (e.g. rows under a field): datasets decides when it loads


def check_template(template: str | None, columns: list[str]) -> None:
    """Every field of the `str.format` template is a column of the data."""
    if template is None:
        return
    parsed = template_fields(template)
    odd = [conversion for _, conversion in parsed if conversion not in (None, "r", "s", "a")]
    if odd:
        raise ValueError(f"data.template ({template!r:.60}) has the conversion !{odd[0]}: use !r, !s or !a, or none")
    for field, _ in parsed:
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not name or name.isdigit():
            raise ValueError(
                f"data.template ({template!r:.60}) has a positional field {{{field}}}: name a column, e.g. {{prompt}}"
            )
        if name not in columns:
            raise ValueError(
                f"data.template names the column {name!r} that the dataset lacks; its columns: {', '.join(columns)}"
            )


def _jsonl_columns(path: pathlib.Path, text: str) -> list[str]:
    """Every non-blank line is a JSON object (the first that is not is named with its line and column); returns the
    first row's keys."""
    first = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"data.dataset: {path}:{number}:{err.colno}: invalid JSON: {err.msg}") from None
        if not isinstance(row, dict):
            raise ValueError(f"data.dataset: {path}:{number}: a line must be a JSON object (one row), got {row!r:.40}")
        first = row if first is None else first
    return list(first)


def _saved_columns(path: pathlib.Path, split: str) -> list[str]:
    """The columns of a folder written by `Dataset.save_to_disk` (a `DatasetDict`'s: of `split`)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ValueError(f"data.split ({split!r}) is not in {path}; its splits: {', '.join(splits)}")
        path = path / split
    info = path / "dataset_info.json"
    if not info.is_file():
        raise ValueError(
            f"data.dataset: {path} is a folder but not a saved dataset (no dataset_info.json): give a data file "
            f"({', '.join(DATA_FILE_BUILDERS)}) or a folder written by Dataset.save_to_disk"
        )
    return list(json.loads(info.read_text()).get("features", {}))
