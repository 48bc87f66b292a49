"""A newcomer's bad inputs, tried on the installed `rollout` command: exit code, the one line, time, what was written.

Each case runs `rollout ...` in a process of its own inside a scratch folder (offline: no hub, no GPU) and records its
exit status, its stderr lines (a refusal must be exactly one), the seconds it took and the files it left in the
scratch folder. Cases that run (a warning in the header, an override that works) use a few prompts and short
completions. Prints a Markdown table; `--json PATH` writes the rows too.

    PYTHONPATH=. .venv/bin/python scripts/first_hour.py [--only SUBSTRING ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
GRPO = str(ROOT / "recipes" / "grpo_quickstart.yaml")
GPU_HUB = str(ROOT / "recipes" / "gpu_hub.yaml")
# a run small enough to finish in seconds on a 2-core CPU
SMALL = [
    "data.num_prompts=4",
    "sampling.n=2",
    "sampling.max_new_tokens=48",
    "spec.method=null",
    "logging.wandb_mode=disabled",
    "logging.plot=false",
]
REWARDS = """
def explodes(completions, **kwargs):
    raise RuntimeError("reward exploded on purpose")


def words(completions, **kwargs):
    return ["high"] * len(completions)
"""


def cases() -> list[tuple[str, list[str], dict]]:
    """(what a newcomer did, the command's arguments, extra environment)."""
    run = ["run", QUICKSTART]
    return [
        ("an existing run folder", [*run, *SMALL, "output_dir=done"], {}),
        ("a folder holding other files", [*run, *SMALL, "output_dir=notes"], {}),
        ("a misspelt shipped model", [*run, "model.name=tiny-targt", "output_dir=a"], {}),
        ("an unknown reward in the YAML", ["run", "bad_reward.yaml", "output_dir=a"], {}),
        ("train.loss_type=ppo2", ["train", GRPO, "train.loss_type=ppo2", "output_dir=a"], {}),
        ("a model id not on the hub (no network)", [*run, "model.name=nobody/no-such-model", "output_dir=a"], {}),
        ("recipes/gpu_hub.yaml (no network)", ["run", GPU_HUB, "output_dir=a"], {}),
        (
            "max_new_tokens past max_seq_len (runs)",
            [*run, *SMALL, "sampling.max_new_tokens=1024", "rollout.max_seq_len=256", "output_dir=trunc"],
            {},
        ),
        (
            "temperature 0 with n 4 in `rollout run` (runs)",
            [*run, *SMALL, "sampling.temperature=0", "sampling.n=4", "output_dir=greedy"],
            {},
        ),  # fmt: skip
        ("temperature 0 with n 8 in `rollout train`", ["train", GRPO, "sampling.temperature=0", "output_dir=a"], {}),
        ("a reward that raises", [*run, *SMALL, "rewards.0.name=my_rewards:explodes", "output_dir=raises"], {}),
        ("a list override rewards.0.weight=2 (runs)", [*run, *SMALL, "rewards.0.weight=2", "output_dir=weighted"], {}),
        ("rollout --version", ["--version"], {}),
        # ten more
        ("a data set id not on the hub (no network)", [*run, "data.dataset=nobody/no-such-data", "output_dir=a"], {}),
        (
            "a hub model, HF_HUB_OFFLINE=1, not cached",
            [*run, "model.name=nobody/no-such-model", "output_dir=a"],
            {"HF_HUB_OFFLINE": "1"},
        ),  # fmt: skip
        ("a template naming a missing column", [*run, "data.template='\"Q: {question}\"'", "output_dir=a"], {}),
        ("a local JSONL without the reward's column", [*run, "data.dataset=prompts.jsonl", "output_dir=a"], {}),
        ("a misspelt draft model", [*run, "spec.model=tiny-drft", "output_dir=a"], {}),
        ("a list index out of range", [*run, "rewards.1.weight=2", "output_dir=a"], {}),
        ("train.lr_scheduler_type=cosin", ["train", GRPO, "train.lr_scheduler_type=cosin", "output_dir=a"], {}),
        ("output_dir is a file", [*run, "output_dir=prompts.jsonl"], {}),
        ("resume=true where there is no run", [*run, "resume=true", "output_dir=nothing-here"], {}),
        ("resume=true with another recipe", [*run, *SMALL, "sampling.n=3", "resume=true", "output_dir=done"], {}),
        ("a folder that is not a model", [*run, "model.name=./notes", "output_dir=a"], {}),
        ("data.split=test on the embedded task", [*run, "data.split=test", "output_dir=a"], {}),
        ("a reward module that does not exist", [*run, "rewards.0.name=no_such_module:score", "output_dir=a"], {}),
        ("a reward that returns text", [*run, *SMALL, "rewards.0.name=my_rewards:words", "output_dir=words"], {}),
        ("model.device=cuda without a GPU", [*run, "model.device=cuda", "output_dir=a"], {}),
        ("an unknown key", [*run, "sampling.temprature=0.7", "output_dir=a"], {}),
        ("a misspelt command", ["runn", QUICKSTART], {}),
        ("an empty recipe file", ["run", "empty.yaml", "output_dir=a"], {}),
        ("max_seq_len shorter than a prompt", [*run, "rollout.max_seq_len=64", "output_dir=short"], {}),
    ]


def prepare(folder: pathlib.Path, command: list[str]) -> None:
    """The scratch folder's fixtures: a finished run (`done`), a folder of notes, a bad recipe, data, rewards."""
    (folder / "notes").mkdir()
    (folder / "notes" / "todo.txt").write_text("my own notes\n")
    (folder / "bad_reward.yaml").write_text("rewards:\n  - name: accuracy\n")
    (folder / "empty.yaml").write_text("# to do\n")
    (folder / "prompts.jsonl").write_text('{"prompt": "Question: 2 + 2?\\nAnswer:"}\n')
    (folder / "my_rewards.py").write_text(REWARDS)
    done = subprocess.run([*command, "run", QUICKSTART, *SMALL, "output_dir=done"], cwd=folder, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def snapshot(folder: pathlib.Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts}


def written(folder: pathlib.Path, before: set[str]) -> str:
    """The new top-level entries of `folder`, a folder with the number of files under it."""
    new = sorted(snapshot(folder) - before)
    tops = sorted({path.split("/", 1)[0] for path in new})
    shown = []
    for top in tops:
        if (folder / top).is_dir():
            shown.append(f"{top}/ ({sum(1 for p in new if p.startswith(top + '/') and (folder / p).is_file())} files)")
        else:
            shown.append(top)
    return ", ".join(shown) or "nothing"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only the cases whose description holds one of these")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rollout = shutil.which("rollout", path=str(pathlib.Path(sys.executable).parent))
    command = [rollout] if rollout else [sys.executable, "-m", "rollout.cli"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_OFFLINE", None)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = pathlib.Path(scratch)
        prepare(folder, command)
        for what, argv, extra in cases():
            if args.only and not any(s in what for s in args.only):
                continue
            before = snapshot(folder)
            start = time.perf_counter()
            done = subprocess.run([*command, *argv], cwd=folder, capture_output=True, text=True, env={**env, **extra})
            seconds = time.perf_counter() - start
            err = [line for line in done.stderr.splitlines() if line.strip()]
            notes = [line for line in done.stdout.splitlines() if line.startswith(("warning:", "note:"))]
            rows.append(
                {
                    "case": what,
                    "exit": done.returncode,
                    "seconds": round(seconds, 2),
                    "stderr_lines": len(err),
                    "line": err[0]
                    if done.returncode and err
                    else (notes or done.stdout.strip().splitlines()[-1:] or [""])[0],
                    "written": written(folder, before),
                }
            )
            print(f"{what}: exit {done.returncode}, {seconds:.2f} s", file=sys.stderr, flush=True)
    print("| case | exit | s | stderr lines | the line (stderr; or the header's warning / note) | written |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        line = r["line"].replace("|", "\\|").replace("[", "\\[")  # a table cell; no link syntax
        print(f"| {r['case']} | {r['exit']} | {r['seconds']:.2f} | {r['stderr_lines']} | {line} | {r['written']} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
