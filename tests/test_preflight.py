"""A newcomer's bad inputs: everything a recipe states is refused in one line before torch is imported, a model
loads or a file is written; hub ids are asked once; what a run will do unexpectedly is said in its header."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from rollout.cli.main import main
from rollout.cli.recipe import LR_SCHEDULER_TYPES, TRL_LOSS_TYPES, UNUSABLE_SCHEDULERS, load_recipe

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
GRPO = str(ROOT / "recipes" / "grpo_quickstart.yaml")
SMALL = ["data.num_prompts=3", "sampling.n=2", "sampling.max_new_tokens=32", "rollout.max_batch_size=4"]
SMALL += ["spec.method=null", "logging.wandb_mode=disabled", "logging.plot=false", "logging.progress=false"]
REWARDS = """
def explodes(completions, **kwargs):
    raise RuntimeError("reward exploded on purpose")


def needs_answer(completions, answer, **kwargs):
    return [1.0] * len(completions)
"""
CHECK = (
    "import sys, time; start = time.perf_counter(); from rollout.cli.main import main; rc = main(sys.argv[1:]); "
    "print(rc, 'torch' in sys.modules, round(time.perf_counter() - start, 2))"
)


@pytest.fixture
def scratch(tmp_path):
    """A folder with a notes folder (not a run), a model-less folder, a data file and a rewards module."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Question: 2 + 2?\\nAnswer:"}\n')
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "bad_reward.yaml").write_text("rewards:\n  - name: accuracy\n")
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    (tmp_path / "none.json").write_text("[]\n")
    for name, config in (("untyped", "{}"), ("weightless", '{"model_type": "llama"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
    (tmp_path / "benched").mkdir()
    (tmp_path / "benched" / "bench.json").write_text('{"rows": []}\n')
    (tmp_path / "project" / "model").mkdir(parents=True)  # a user's own model folder, named as a training saves one
    (tmp_path / "project" / "model" / "model.safetensors").write_text("weights\n")
    return tmp_path


# (arguments, text the one line must hold, extra environment)
REFUSED = [
    (["run", QUICKSTART, "output_dir=notes"], ["output_dir notes holds files that are not a run's", "todo.txt"], {}),
    (["run", QUICKSTART, "model.name=tiny-targt"], ["model.name", "tiny-targt", "tiny-target"], {}),
    (["run", "bad_reward.yaml"], ["unknown reward name 'accuracy'", "arithmetic"], {}),
    (["train", GRPO, "train.loss_type=ppo2"], ["train.loss_type ('ppo2')", "dapo"], {}),
    (["train", GRPO, "train.lr_scheduler_type=cosin"], ["train.lr_scheduler_type ('cosin')", "cosine"], {}),
    (["train", GRPO, "train.lr_scheduler_type=reduce_lr_on_plateau"], ["runs no evaluation", "cosine"], {}),
    (["train", GRPO, "train.lr_scheduler_type=warmup_stable_decay"], ["num_decay_steps", "linear"], {}),
    (["train", GRPO, "train.lr_scheduler_type=greedy"], ["runs no evaluation", "cosine"], {}),  # (after the model)
    (["train", GRPO, "train.warmup_steps=2"], ["does nothing with train.lr_scheduler_type constant"], {}),
    (["train", GRPO, "data.num_prompts=1"], ["data.num_prompts (1) is below train.prompts_per_step (8)"], {}),
    (["train", GRPO, "sampling.temperature=0"], ["sampling.temperature is 0", "sampling.n 8"], {}),
    (["train", GRPO, "sampling.n=1"], ["sampling.n (1) must be at least 2 for GRPO"], {}),
    (["train", GRPO, "resume=true", "train.save_steps=0"], ["with train.save_steps 0 it keeps none"], {}),
    (["run", QUICKSTART, "rewards=[arithmetic]"], ["rewards[0]: each entry is a mapping of fields", "got a str"], {}),
    (["run", QUICKSTART, "sampling.seed=4294967295", "rollout.num_rollouts=2"], ["sampling.seed (4294967295)"], {}),
    (["train", GRPO, "sampling.seed=-1"], ["sampling.seed (-1) must be in [0, 4294967295]"], {}),
    (["run", QUICKSTART, "data.template='Q: A:'"], ["data.template ('Q: A:') names no column"], {}),
    (["run", QUICKSTART, "data.template='{prompt.upper}'"], ["reads the attribute .upper in {prompt.upper}"], {}),
    (["run", QUICKSTART, "rollout.max_seq_len=0"], ["rollout.max_seq_len (0) must be >= 2"], {}),
    (["run", QUICKSTART, "logging.num_table_rows=-5"], ["logging.num_table_rows (-5) must be >= 0"], {}),
    (["bench", QUICKSTART, "resume=true"], ["`rollout bench` runs every row again: drop resume=true"], {}),
    (["bench", QUICKSTART, "output_dir=benched"], ["benched already holds a benchmark (bench.json)", "overwrite"], {}),
    # no network here: the hub cannot be reached; with one, the hub answers that the id is not there
    (["run", QUICKSTART, "model.name=nobody/no-such-model"], ["model.name", "'nobody/no-such-model'"], {}),
    (["run", QUICKSTART, "data.dataset=nobody/no-such-data"], ["data.dataset", "'nobody/no-such-data'"], {}),
    (
        ["run", QUICKSTART, "model.name=nobody/no-such-model"],
        ["not in the local Hugging Face cache and HF_HUB_OFFLINE is set"],
        {"HF_HUB_OFFLINE": "1"},
    ),
    (["run", QUICKSTART, "spec.model=tiny-drft"], ["spec.model", "tiny-drft"], {}),
    (  # (found by the generator, after the model had loaded)
        ["run", QUICKSTART, "rollout.max_seq_len=1024", "spec.num_speculative_tokens=1024"],
        ["spec.num_speculative_tokens (1024) must be below rollout.max_seq_len (1024)"],
        {},
    ),
    (["run", QUICKSTART, "data.template='\"Q: {question}\"'"], ["data.template names the column 'question'"], {}),
    (["run", QUICKSTART, "data.template='\"Q: {problem!z}\"'"], ["data.template", "has the conversion !z"], {}),
    (["run", QUICKSTART, "data.dataset=prompts.jsonl"], ["reward 'arithmetic' needs the column(s) ['answer']"], {}),
    (["run", QUICKSTART, "rewards.1.weight=2"], ["rewards is a list of 1 entry", "index from 0 to 0"], {}),
    (["run", QUICKSTART, "output_dir=prompts.jsonl"], ["output_dir prompts.jsonl is a file"], {}),
    (["run", QUICKSTART, "output_dir=prompts.jsonl/a/b"], ["prompts.jsonl is a file, so no folder can be made"], {}),
    (["bench", QUICKSTART, "output_dir=prompts.jsonl/b"], ["prompts.jsonl is a file, so no folder can be made"], {}),
    (["run", QUICKSTART, "data.dataset=none.json"], ["data.dataset: none.json holds no rows"], {}),
    (["run", QUICKSTART, "resume=true", "output_dir=nothing"], ["resume=true but nothing holds no run"], {}),
    (["run", QUICKSTART, "model.name=./notes"], ["model.name: ./notes is not a transformers model folder"], {}),
    (["run", QUICKSTART, "model.name=./untyped"], ["model.name: ./untyped/config.json names no model_type"], {}),
    (["run", QUICKSTART, "spec.model=./weightless"], ["spec.model: ./weightless holds a config.json but no"], {}),
    (["run", QUICKSTART, "data.split=test"], ["data.split ('test')", "'train' or 'eval'"], {}),
    (["run", QUICKSTART, "rewards.0.name=no_such_module:score"], ["cannot import module 'no_such_module'"], {}),
    (["run", "empty.yaml"], ["empty.yaml: a recipe is a mapping of sections", "got nothing (an empty file)"], {}),
    (["run", QUICKSTART, "model.name=tiny-target-1b", "model.dtype=float16"], ["model.dtype float16", "bfloat16"], {}),
    # the quickstart's draft for the widened target: refused after both had loaded, as another tokenizer
    (["run", QUICKSTART, "model.name=tiny-target-1b"], ["spec.model 'tiny-draft' does not draft for", "150m"], {}),
    (["run", "notes"], ["recipe file not found: notes is a folder; name a YAML file in it"], {}),
    (["run", "sampling.n=8", QUICKSTART], ["not found: sampling.n=8; the recipe file comes first, then the key"], {}),
    (["run", QUICKSTART, "logging.wandb_mode=onlin"], ["logging.wandb_mode ('onlin')", "online"], {}),
    (["run", QUICKSTART, "rollout.cuda_graphs=true"], ["cuda_graphs=true needs a CUDA", "(or cuda_graphs to"], {}),
    # 1 == True to `in`: an integer switch passed the check, then the engine's `is True` read it as off
    (["run", QUICKSTART, "rollout.async_scheduling=1"], ["rollout.async_scheduling (1) must be auto, true or"], {}),
    (["run", QUICKSTART, "rollout.cuda_graphs=0"], ["rollout.cuda_graphs (0) must be auto, true or false"], {}),
    # what `rollout run` does not write is not a run of its own: a benchmark, a user's model/ (which was called a run
    # to resume, and which overwrite=true deleted)
    (["run", QUICKSTART, "output_dir=benched"], ["benched holds files that are not a run's (bench.json)"], {}),
    (["run", QUICKSTART, "output_dir=project"], ["project holds files that are not a run's (model)"], {}),
    (["train", GRPO, "output_dir=project"], ["project already holds a run (model): pass overwrite=true"], {}),
    # a folder no file can be made in, refused before the model loads (it failed on the first file written)
    (["run", QUICKSTART, "output_dir=/proc/rollout-out"], ["output_dir /proc/rollout-out: /proc cannot be"], {}),
    (["bench", QUICKSTART, "output_dir=/proc/sys"], ["output_dir /proc/sys cannot be written"], {}),
    (["run", QUICKSTART, "rollout.compile_forward=true"], ["compile_forward=true needs a", "false, or model"], {}),
    (["run", QUICKSTART], ["WANDB_MODE ('ofline')", "offline"], {"WANDB_MODE": "ofline"}),
    # what the recipe asks for comes before where it writes: a typo is named even where the folder is taken
    (["run", QUICKSTART, "output_dir=notes", "model.name=tiny-targt"], ["model.name: unknown name 'tiny-targt'"], {}),
]


@pytest.mark.parametrize(
    "argv, expected, env",
    REFUSED,
    ids=[" ".join(case[0][2:]) or " ".join(f"{k}={v}" for k, v in case[2].items()) for case in REFUSED],
)
def test_a_bad_recipe_is_refused_in_one_line_before_torch_loads_and_writes_nothing(scratch, argv, expected, env):
    before = sorted(p.relative_to(scratch) for p in scratch.rglob("*"))
    environ = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    result = subprocess.run(
        [sys.executable, "-c", CHECK, *argv], capture_output=True, text=True, cwd=scratch, env={**environ, **env}
    )
    rc, torch_imported, seconds = result.stdout.split()[-3:]
    assert (rc, torch_imported) == ("2", "False"), result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rollout {argv[0]}: error: "), lines
    for text in expected:
        assert text in lines[0]
    assert sorted(p.relative_to(scratch) for p in scratch.rglob("*") if "__pycache__" not in p.parts) == before


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["run"], "rollout run: error: give a recipe file, e.g. rollout run recipes/quickstart.yaml"),
        (["runn", QUICKSTART], "rollout: error: argument command: invalid choice: 'runn'"),
        (["run", QUICKSTART, "--n", "8"], "rollout run: error: unrecognized arguments: --n 8; settings are key=value"),
        (["run", QUICKSTART, "--overwrite"], "rollout run: error: unrecognized arguments: --overwrite; settings are"),
        (["report", "outputs/x", "extra"], "rollout report: error: unrecognized arguments: extra"),
    ],
)
def test_a_bad_command_line_is_one_line_with_the_usage(argv, expected):
    result = subprocess.run([sys.executable, "-m", "rollout.cli", *argv], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(expected) and "(usage: rollout" in line, line


def test_a_prompt_longer_than_max_seq_len_is_refused_before_the_folder_is_made(tmp_path, capsys):
    argv = ["run", QUICKSTART, *SMALL, "rollout.max_seq_len=10", f"output_dir={tmp_path / 'out'}"]
    assert main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert "rollout.max_seq_len (10) leaves no room for a completion after prompt" in line
    assert not (tmp_path / "out").exists()


def test_an_existing_run_is_refused_and_overwrite_writes_among_other_files(scratch, capsys):
    notes = scratch / "notes"
    assert main(["run", QUICKSTART, *SMALL, f"output_dir={notes}", "overwrite=true"]) == 0
    assert (notes / "todo.txt").read_text() == "mine\n"  # only a run's own files are replaced
    assert (notes / "rollouts.jsonl").is_file()
    capsys.readouterr()
    assert main(["run", QUICKSTART, *SMALL, f"output_dir={notes}"]) == 2
    line = capsys.readouterr().err.strip()
    assert "already holds a run" in line and "resume=true" in line and "overwrite=true" in line
    # a different recipe cannot resume this run; the same one can
    assert main(["run", QUICKSTART, *SMALL, "sampling.n=3", "resume=true", f"output_dir={notes}"]) == 2
    assert "another 'sampling' section" in capsys.readouterr().err


def test_a_raising_reward_is_named_with_its_exception_type_and_prompt(scratch, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(scratch))
    argv = ["run", QUICKSTART, *SMALL, "rewards.0.name=my_rewards:explodes", f"output_dir={scratch / 'out'}"]
    assert main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        "rollout run: error: prompt 0: reward 'my_rewards:explodes' raised RuntimeError: reward exploded on purpose"
    )


def test_the_header_says_what_a_run_will_cut_or_repeat(tmp_path, capsys):
    argv = ["run", QUICKSTART, *SMALL, "sampling.max_new_tokens=1024", "rollout.max_seq_len=160"]
    assert main([*argv, f"output_dir={tmp_path / 'a'}"]) == 0
    out = capsys.readouterr().out
    [warning] = [line for line in out.splitlines() if line.startswith("warning:")]
    assert "max_new_tokens 1024 does not fit in max_seq_len 160 after the longest prompt" in warning
    assert "(sampling.max_new_tokens, rollout.max_seq_len)" in warning
    records = [json.loads(line) for line in (tmp_path / "a" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}
    argv = ["run", QUICKSTART, *SMALL, "sampling.temperature=0", "sampling.n=3"]
    assert main([*argv, f"output_dir={tmp_path / 'b'}"]) == 0
    out = capsys.readouterr().out
    assert "note: sampling.temperature is 0 (greedy): the n=3 samples of each prompt are identical" in out


def test_list_entries_are_overridden_by_index():
    recipe = load_recipe(QUICKSTART, ["rewards.0.weight=2", "rewards.0.name=gsm8k", "bench.static_k.1=7"])
    assert (recipe.rewards[0].name, recipe.rewards[0].weight) == ("gsm8k", 2.0)
    assert recipe.bench.static_k == [1, 7, 5]
    with pytest.raises(ValueError, match=r"rewards\[0\]\.weight: Value 'x' .* could not be converted"):
        load_recipe(QUICKSTART, ["rewards.0.weight=x"])
    with pytest.raises(ValueError, match="bench.static_k is a list of 3 entries, so '3' must be an index from 0 to 2"):
        load_recipe(QUICKSTART, ["bench.static_k.3=1"])


def test_data_files_as_spreadsheets_and_editors_write_them(tmp_path):
    """A byte-order mark (Excel's UTF-8 CSV) is no part of a column name; text in another encoding and a header
    without rows are refused naming the file."""
    from rollout.cli.preflight import data_columns
    from rollout.cli.recipe import DataRecipe

    files = {
        "bom.csv": "\ufeffprompt,answer\n2 + 2?,4\n".encode(),
        "bom.jsonl": '\ufeff{"prompt": "2 + 2?", "answer": "4"}\n'.encode(),
        "latin1.csv": "prompt,answer\ncaf\u00e9?,4\n".encode("latin-1"),
        "header.csv": b"prompt,answer\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    for name in ("bom.csv", "bom.jsonl"):
        assert data_columns(DataRecipe(dataset=str(tmp_path / name))) == ["prompt", "answer"]
    with pytest.raises(ValueError, match=r"latin1.csv is not UTF-8 text \(invalid continuation byte at byte 17\)"):
        data_columns(DataRecipe(dataset=str(tmp_path / "latin1.csv")))
    with pytest.raises(ValueError, match=r"header.csv holds a header and no rows"):
        data_columns(DataRecipe(dataset=str(tmp_path / "header.csv")))


def test_a_device_this_torch_cannot_compute_on_is_refused():
    from rollout.cli.preflight import resolve_device

    for device in ("meta", "mps"):  # no values; not in this (Linux) torch
        with pytest.raises(
            ValueError, match=f"model.device \\('{device}'\\) is not a device this torch .* can compute on"
        ):
            resolve_device(device)
    assert str(resolve_device("cpu")) == "cpu"


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"rollout {version('rollout')}"


def test_the_checked_trainer_choices_are_the_installed_trl_and_transformers_ones():
    """The recipe refuses a loss or scheduler by these lists (TRL checks a loss only after a rollout): they must be
    the ones the installed TRL and transformers take."""
    pytest.importorskip("trl", reason="the trl extra is not installed")
    import dataclasses

    from transformers.trainer_utils import SchedulerType
    from trl import GRPOConfig

    assert LR_SCHEDULER_TYPES == tuple(s.value for s in SchedulerType)
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    for name in LR_SCHEDULER_TYPES:  # what rollout train builds: no lr_scheduler_kwargs
        # (those stepping on an evaluation metric fail in the Trainer's checks)
        if name in UNUSABLE_SCHEDULERS and name not in ("reduce_lr_on_plateau", "greedy"):
            with pytest.raises((TypeError, ValueError)):
                get_scheduler(name, optimizer, num_warmup_steps=0, num_training_steps=10)
        elif name not in UNUSABLE_SCHEDULERS:
            get_scheduler(name, optimizer, num_warmup_steps=0, num_training_steps=10)
    help_text = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    supported = help_text.split("Supported values are ", 1)[1].split(". ", 1)[0]
    assert sorted(TRL_LOSS_TYPES) == sorted(re.findall(r"'(\w+)'", supported))


def test_the_header_warns_when_the_data_holds_fewer_rows_than_asked_for():
    from rollout.cli.runs import RecipeInputs, header_warning

    recipe = load_recipe(QUICKSTART, ["data.num_prompts=5", "sampling.max_new_tokens=8"])
    inputs = RecipeInputs(None, None, None, ["a", "b"], [[1, 2], [1, 2, 3]], 100)
    assert header_warning(recipe, inputs) == "warning: data.num_prompts is 5 but the data holds 2 rows: using them all"
    assert header_warning(load_recipe(QUICKSTART, ["data.num_prompts=2", "sampling.max_new_tokens=8"]), inputs) is None


def test_the_header_notes_a_setting_the_command_does_not_use(tmp_path):
    from rollout.cli.preflight import preflight

    settings = ["rollout.num_rollouts=5", f"output_dir={tmp_path / 'out'}"]
    for command, what in (("bench", "bench times one rollout of every prompt"), ("train", "train runs train.steps")):
        recipe = load_recipe(GRPO if command == "train" else QUICKSTART, settings)
        assert f"note: rollout.num_rollouts (5) is for rollout run: {what}" in "\n".join(preflight(recipe, command))
    assert not any("num_rollouts" in note for note in preflight(load_recipe(QUICKSTART, settings), "run"))
    # spec's settings with speculation off (SpecConfig checks them only with a method: a typo there passed unseen)
    off = ["spec.method=null", "spec.model=tiny-drft", "spec.prompt_lookup_max=2"]
    recipe = load_recipe(QUICKSTART, [*settings, *off])
    [note] = [note for note in preflight(recipe, "run") if note.startswith("note: spec.method is null")]
    assert "spec.model" in note and "spec.prompt_lookup_max" in note and note.endswith("not used")
    assert not any("spec.method" in note for note in preflight(load_recipe(QUICKSTART, settings), "run"))
    # a local file's split and a config name for anything but a hub dataset
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    local = [f"data.dataset={tmp_path / 'rows.jsonl'}", "data.split=test", "data.config_name=main"]
    notes = preflight(load_recipe(QUICKSTART, [*settings, *local]), "run")
    assert "note: data.split ('test') is not used: a data file is read whole" in notes
    assert "note: data.config_name ('main') is not used: it names a hub dataset's config" in notes
    assert not any("data." in note for note in preflight(load_recipe(QUICKSTART, settings), "run"))
