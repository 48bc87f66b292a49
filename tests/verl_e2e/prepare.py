"""The end-to-end run's inputs, written locally: the arithmetic task as veRL's parquet files, and the shipped
tiny-target model as a Hugging Face folder whose tokenizer has a chat template that renders the prompt as is (veRL
builds every prompt through the chat template; the shipped tokenizer has none)."""

from __future__ import annotations

import json
import pathlib
import shutil

from rollout.models.zoo import model_path
from rollout.tasks import ArithmeticConfig, arithmetic_dataset

DATA_SOURCE = "rollout/arithmetic"
# the user message's text, nothing around it: the prompt the model was trained on (`format_prompt`)
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def write_data(folder: pathlib.Path, num_train: int, num_val: int, max_steps: int = 1) -> dict[str, pathlib.Path]:
    """`train.parquet` and `val.parquet` in veRL's layout: data_source, prompt (chat messages), ability,
    reward_model.ground_truth, extra_info."""
    folder.mkdir(parents=True, exist_ok=True)
    config = ArithmeticConfig(max_steps=max_steps)
    paths = {}
    for split, name, num in (("train", "train", num_train), ("eval", "val", num_val)):
        dataset = arithmetic_dataset(num, split=split, seed=0, config=config)
        rows = dataset.map(
            _verl_row, with_indices=True, fn_kwargs={"split": split}, remove_columns=dataset.column_names
        )
        paths[name] = folder / f"{name}.parquet"
        rows.to_parquet(str(paths[name]))
    return paths


def _verl_row(row: dict, index: int, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": row["prompt"]}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": row["answer"]},
        "extra_info": {"split": split, "index": index},
    }


def write_model(folder: pathlib.Path) -> pathlib.Path:
    """A copy of the shipped tiny-target folder with the chat template added."""
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(model_path("tiny-target"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return folder
