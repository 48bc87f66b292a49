"""Random bad input: recipe overrides and API arguments only ever give a one-line user error (CLI exit 2, or
ValueError / TypeError from the API), never a traceback or another exception. Seeded, so a failure reproduces."""

from __future__ import annotations

import math
import pathlib
import random

import pytest
import torch
from conftest import make_model

from rollout import Generator, SamplingParams
from rollout.cli.main import main
from rollout.cli.recipe import load_recipe
from specdec.config import SpecConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "recipes" / "quickstart_suffix.yaml")
SMALL = ["data.num_prompts=2", "sampling.n=1", "sampling.max_new_tokens=6", "logging.wandb_mode=disabled"]
KEYS = [
    "sampling.temperature",
    "sampling.top_p",
    "sampling.top_k",
    "sampling.max_new_tokens",
    "spec.method",
    "spec.num_speculative_tokens",
    "spec.num_speculative_tokens_per_batch_size",
    "spec.suffix_decoding_max_tree_depth",
    "spec.suffix_decoding_min_token_prob",
    "spec.num_candidates",
    "sampling.n",
    "rollout.max_batch_size",
    "rollout.max_seq_len",
    "rollout.tail_fraction",
    "rollout.num_rollouts",
    "rollout.non_finite_rewards_as_null",
    "data.num_prompts",
    "data.prompt_column",
    "model.dtype",
    "threads",
    "seed",
    "train.learning_rate",
    "logging.wandb_mode",
]
VALUES = ["0", "1", "-1", "2", "0.5", "nan", "inf", "-inf", "1e9", "abc", "null", "[]", "[1, 2]", "[[1, 4, 2]]"]
VALUES += ["true", "auto", "ngram", "suffix", "''", "{a: 1}"]


def random_overrides(rng: random.Random) -> list[str]:
    return [f"{key}={rng.choice(VALUES)}" for key in rng.sample(KEYS, rng.randint(1, 3))]


def test_random_recipe_overrides_load_or_name_the_problem():
    rng = random.Random(0)
    loaded = 0
    for _ in range(400):
        overrides = random_overrides(rng)
        try:
            load_recipe(QUICKSTART, overrides)
            loaded += 1
        except ValueError:  # anything else fails the test
            pass
    assert 0 < loaded < 400  # both kinds were exercised


def test_random_runs_exit_0_or_2(tmp_path, capsys):
    rng = random.Random(1)
    codes = []
    for trial in range(10):
        overrides = random_overrides(rng)
        code = main(["run", QUICKSTART, *SMALL, *overrides, f"output_dir={tmp_path / str(trial)}"])  # raises otherwise
        err = capsys.readouterr().err
        assert code in (0, 2), (overrides, err)
        if code == 2:
            assert err.count("\n") == 1 and err.startswith("rollout run: error: "), (overrides, err)
        codes.append(code)
    assert 2 in codes


ARGUMENTS = [0, 1, -1, 2, 0.5, math.nan, math.inf, "x", None, [], [1], [[1]], True, 1e9, torch.tensor(1)]


def test_random_api_arguments_raise_value_or_type_errors():
    rng = random.Random(2)
    sampling_fields = ["n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed", "spec"]
    spec_fields = ["method", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "num_candidates"]
    spec_fields += ["prompt_lookup_max", "prompt_lookup_min", "suffix_decoding_max_tree_depth"]
    for _ in range(300):
        for cls, fields in ((SamplingParams, sampling_fields), (SpecConfig, spec_fields)):
            kwargs = {name: rng.choice(ARGUMENTS) for name in rng.sample(fields, rng.randint(1, 3))}
            try:
                cls(**kwargs)
            except (ValueError, TypeError):
                pass


@pytest.fixture(scope="module")
def small_generator():
    return Generator(make_model("qwen2", dtype=torch.float32), max_batch_size=2, max_seq_len=16)


def test_random_prompts_raise_value_or_type_errors(small_generator):
    rng = random.Random(3)
    pool = [[1, 2], [], "12", [1.5], [-3], [10**6], [[1]], None, [True], torch.tensor([3, 4]), [1] * 20, 7]
    params = SamplingParams(temperature=0, max_new_tokens=2)
    for _ in range(200):
        prompts = rng.choice([rng.sample(pool, rng.randint(1, 2)), rng.choice(pool)])
        try:
            outs = small_generator.generate(prompts, params)
        except (ValueError, TypeError):
            continue
        assert all(len(o.token_ids) >= 1 for o in outs)
