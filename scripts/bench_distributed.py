"""Data-parallel rollouts on this machine: the same recipe on 1 and on 2 processes (`accelerate launch`, gloo, one
torch thread each), run one after another from this script and compared in one table.

Each configuration runs `rollout run` on recipes/quickstart_suffix.yaml with two rollouts of the same prompts (the
second drafts from the first one's history) and reads back the run's summary.json and steps.jsonl. Printed per
configuration: run tokens/s (tokens over the run's wall time: on 2 ranks the slowest rank's per rollout, plus the
history all-gather after it) and its
ratio to 1 process, the summary's summed tokens/s, the straggler ratio (slowest rank / mean, per rollout and over
the run), and the draft acceptance and tokens per row-step of each rollout.

Configurations: 1 process; 2 processes balanced by work (prompt tokens + each prompt's mean completion length so
far) with the history shared; the same balanced by count; the same by work without sharing the history; by work
keeping only the other rank's responses to the prompts a rank generates next (`distributed.history_scope=next`).

    PYTHONPATH=. .venv/bin/python scripts/bench_distributed.py                       # 64 prompts x 4, ~10 min
    PYTHONPATH=. .venv/bin/python scripts/bench_distributed.py --set data.num_prompts=16 --only 1 2-work
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "quickstart_suffix.yaml"
CONFIGS = {  # name: (processes, overrides)
    "1": (1, []),
    "2-work": (2, ["distributed.balance=work", "distributed.share_history=true"]),
    "2-count": (2, ["distributed.balance=count", "distributed.share_history=true"]),
    "2-work-unshared": (2, ["distributed.balance=work", "distributed.share_history=false"]),
    "2-work-next": (
        2,
        ["distributed.balance=work", "distributed.share_history=true", "distributed.history_scope=next"],
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, processes: int, overrides: list[str], out: pathlib.Path) -> dict:
    args = ["run", str(RECIPE), *overrides, f"output_dir={out}", "logging.wandb_mode=disabled", "logging.plot=false"]
    args += ["logging.progress=false", "threads=1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if processes == 1:
        command = [sys.executable, "-m", "rollout", *args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes"]
        command += [str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        command += ["--main_process_port", str(free_port()), "-m", "rollout", *args]
    print(f"[{name}] {' '.join(command[-len(args) - 2 :])}", file=sys.stderr, flush=True)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    per_rollout = []
    for index in sorted({s["rollout"] for s in steps}):
        mine = [s for s in steps if s["rollout"] == index]
        decode = [s for s in mine if s["kind"] == "decode"]
        drafted = sum(s["num_drafted"] for s in mine)
        rows = sum(s["batch_size"] for s in decode)
        per_rollout.append(
            {
                "acceptance": sum(s["num_accepted"] for s in mine) / drafted if drafted else 0.0,
                "tokens_per_row_step": sum(s["num_emitted"] for s in decode) / rows if rows else 0.0,
                "tokens": sum(s["num_emitted"] for s in mine),
            }
        )
    per_rollout_seconds = summary.get("rank_seconds_per_rollout", [])
    return {
        "name": name,
        "processes": processes,
        "tokens": summary["total"]["tokens"],
        "wall_seconds": summary["wall_seconds"],
        "run_tokens_per_s": summary["total"]["tokens"] / summary["wall_seconds"],
        "summed_tokens_per_s": summary["total"]["tokens_per_s"],
        "straggler_ratio": summary.get("straggler_ratio", 1.0),
        "rank_wall_seconds": [r["wall_seconds"] for r in summary.get("ranks", [])],
        "rollouts": per_rollout,
        "rollout_straggler_ratios": [max(s) / (sum(s) / len(s)) for s in per_rollout_seconds],
        "rank_seconds_per_rollout": per_rollout_seconds,
        "phase_seconds": {p: summary["phases"][p]["seconds"] for p in ("prefill", "bulk", "tail")},
        "rank_phase_seconds": [
            {p: r["phases"][p]["seconds"] for p in ("prefill", "bulk", "tail")} for r in summary.get("ranks", [])
        ],
        "share_seconds": [x["seconds"] for x in summary.get("history_sharing", [])],
        "share_bytes": [x["bytes"] for x in summary.get("history_sharing", [])],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides for every configuration")
    parser.add_argument("--only", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=1, help="passes over the configs, every other one reversed")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    base = ["rollout.num_rollouts=2", *args.set]
    passes = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = args.only if repeat % 2 == 0 else args.only[::-1]  # no config always runs first
            done = {
                n: run(n, CONFIGS[n][0], [*base, *CONFIGS[n][1]], pathlib.Path(tmp) / f"{n}-{repeat}") for n in order
            }
            passes.append([done[n] for n in args.only])
    for index, rows in enumerate(passes):
        print(f"pass {index + 1} of {len(passes)}")
        report(rows)
    if len(passes) > 1:
        print(
            "run tokens/s vs 1 process, every pass: "
            + "; ".join(
                f"{rows[i]['name']} "
                + "/".join(
                    f"{p[i]['run_tokens_per_s'] / next(r for r in p if r['processes'] == 1)['run_tokens_per_s']:.2f}"
                    for p in passes
                )
                for i in range(len(args.only))
                if rows[i]["processes"] > 1
            )
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(passes, indent=2) + "\n")


def report(rows: list[dict]) -> None:
    one = next((r for r in rows if r["processes"] == 1), None)
    print(
        f"{'config':18s}{'tokens':>8s}{'wall s':>8s}{'run tok/s':>11s}{'vs 1':>7s}{'summed':>9s}{'straggler':>10s}"
        f"{'per rollout':>13s}{'rank s':>13s}{'acc r0':>8s}{'acc r1':>8s}{'tok/rs r0':>10s}{'tok/rs r1':>10s}"
    )
    for r in rows:
        ratio = r["run_tokens_per_s"] / one["run_tokens_per_s"] if one else float("nan")
        ranks = "/".join(f"{s:.1f}" for s in r["rank_wall_seconds"]) or "-"
        each = "/".join(f"{s:.3f}" for s in r["rollout_straggler_ratios"]) or "-"
        acc = [x["acceptance"] for x in r["rollouts"]] + [0.0, 0.0]
        trs = [x["tokens_per_row_step"] for x in r["rollouts"]] + [0.0, 0.0]
        print(
            f"{r['name']:18s}{r['tokens']:8d}{r['wall_seconds']:8.1f}{r['run_tokens_per_s']:11.1f}{ratio:6.2f}x"
            f"{r['summed_tokens_per_s']:9.1f}{r['straggler_ratio']:10.3f}{each:>13s}{ranks:>13s}{acc[0]:8.3f}{acc[1]:8.3f}"
            f"{trs[0]:10.3f}{trs[1]:10.3f}"
        )
    for r in rows:
        phases = r["rank_phase_seconds"] or [r["phase_seconds"]]
        print(
            f"{r['name']}: seconds per rank prefill/bulk/tail "
            + ", ".join(f"{p['prefill']:.1f}/{p['bulk']:.1f}/{p['tail']:.1f}" for p in phases)
            + (" | per rollout per rank " + str([[round(x, 1) for x in s] for s in r["rank_seconds_per_rollout"]]))
        )
    for r in rows:
        if r["share_seconds"]:
            print(
                f"{r['name']}: history all-gather per rollout "
                + ", ".join(f"{s:.2f} s / {b / 2**20:.2f} MiB" for s, b in zip(r["share_seconds"], r["share_bytes"]))
                + " (slowest rank's seconds, all ranks' bytes sent; in the wall time)"
            )


if __name__ == "__main__":
    main()
