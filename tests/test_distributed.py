"""Data-parallel rollouts under `accelerate launch`: real processes over gloo on this CPU. Two ranks give exactly the
samples of one process, each once, in prompt order, in one output folder; a rank that fails or is killed stops the
run with one line naming it and a summary marked incomplete. Also the parts: sharding, costs, packing, summaries."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
from test_cli import wandb_records

from rollout.distributed import (
    OutputLengths,
    Ranks,
    add_others,
    group_costs,
    pack_responses,
    prompt_key,
    shard_groups,
    share_responses,
    unpack_responses,
)
from rollout.phases import straggler_ratio, summarize_ranks

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "recipes" / "quickstart_suffix.yaml")
SMALL = [
    "data.num_prompts=5",
    "sampling.n=2",
    "sampling.max_new_tokens=24",
    "rollout.max_batch_size=8",
    "logging.plot=false",
    "logging.wandb_mode=disabled",
]


# ---- the parts ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 7])
@pytest.mark.parametrize("balance", ["work", "count"])
def test_every_group_goes_to_exactly_one_rank_in_order(num_ranks, balance):
    costs = [5.0, 1.0, 9.0, 3.0, 3.0]
    shards = shard_groups(costs, num_ranks, balance)
    assert len(shards) == num_ranks
    assert sorted(g for s in shards for g in s) == list(range(len(costs)))
    assert all(s == sorted(s) for s in shards)


def test_work_balance_evens_out_expected_tokens_where_counting_does_not():
    costs = [100.0, 100.0, 10.0, 10.0]  # two long groups first: a split by count puts both on rank 0
    by_count = shard_groups(costs, 2, "count")
    by_work = shard_groups(costs, 2, "work")
    load = lambda shards: [sum(costs[g] for g in s) for s in shards]  # noqa: E731
    assert load(by_count) == [200.0, 20.0]
    assert load(by_work) == [110.0, 110.0]
    with pytest.raises(ValueError, match="distributed.balance"):
        shard_groups(costs, 2, "size")


def test_costs_count_prompt_tokens_and_predicted_completions():
    prompts = [[1, 2, 3], [4], [5, 6]]
    assert group_costs(prompts, 4) == [12.0, 4.0, 8.0]  # nothing seen, no prior: prompt tokens alone
    assert group_costs(prompts, 1, prior=10) == [13.0, 11.0, 12.0]  # nothing seen: each expects the prior
    lengths = OutputLengths()
    lengths.add([[1, 2, 3], [1, 2, 3], [4]], [10, 20, 2])
    # seen prompts expect their own mean, an unseen one the mean over all seen completions (32 / 3)
    assert group_costs(prompts, 2, lengths) == pytest.approx([2 * (3 + 15), 2 * (1 + 2), 2 * (2 + 32 / 3)])


def test_responses_pack_and_unpack_unchanged():
    prompts = [[1, 2], [1, 2], [7], [3, 4, 5]]
    completions = [[9, 9, 9], [], [8], [1, 2]]
    packed = pack_responses(prompts, completions)
    assert len(packed["prompt_lengths"]) == 3  # each distinct prompt sent once
    assert unpack_responses(packed) == (prompts, completions)
    assert unpack_responses(pack_responses([], [])) == ([], [])


def test_one_process_shares_nothing_and_returns_its_own():
    class History:
        def __init__(self):
            self.added = []

        def add_responses(self, prompts, responses):
            self.added.append((prompts, responses))

    history = History()
    prompts, completions, sent = share_responses(Ranks(), [[1, 2]], [[3, 4, 5]], history)
    assert (prompts, completions) == ([[1, 2]], [[3, 4, 5]])
    assert history.added == []  # its own responses are in its history already
    assert sent > 0


def test_a_rank_keeps_the_other_ranks_responses_to_the_prompts_it_asks_for():
    class History:
        def __init__(self):
            self.added = []

        def add_responses(self, prompts, responses):
            self.added += list(zip(map(tuple, prompts), map(tuple, responses)))

    every = [([[1, 2], [3]], [[7], [8, 8]]), ([[1, 2], [4]], [[9], [6]])]  # rank 0's and rank 1's responses
    history = History()
    assert add_others(Ranks(rank=1, world_size=2), history, every) == 2
    assert history.added == [((1, 2), (7,)), ((3,), (8, 8))]  # all of rank 0's, none of its own
    history = History()
    assert add_others(Ranks(rank=0, world_size=2), history, every, {prompt_key([4])}) == 1
    assert history.added == [((4,), (6,))]


def test_rank_summary_sums_throughput_and_takes_the_slowest_time():
    step = lambda rank, phase, tokens, seconds: {  # noqa: E731
        "rank": rank,
        "phase": phase,
        "kind": "decode",
        "batch_size": 4,
        "num_draft_tokens": 0,
        "num_drafted": 0,
        "num_accepted": 0,
        "num_emitted": tokens,
        "seconds": seconds,
    }
    steps = [step(0, "bulk", 100, 1.0), step(1, "bulk", 100, 2.0), step(1, "tail", 10, 1.0)]
    summary = summarize_ranks(steps, [[1.0], [3.0]])
    assert summary["phases"]["bulk"]["tokens_per_s"] == pytest.approx(100 + 50)
    assert summary["phases"]["bulk"]["seconds"] == 2.0
    assert summary["total"]["tokens"] == 210
    assert [r["wall_seconds"] for r in summary["ranks"]] == [1.0, 3.0]
    assert summary["straggler_ratio"] == pytest.approx(3.0 / 2.0)
    assert straggler_ratio([[1.0, 1.0], [2.0, 4.0]]) == pytest.approx((1 + 4) / (1 + 3))


# ---- real processes ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_processes: int, args: list[str], timeout: float = 240, wandb: str = "disabled"):
    """`accelerate launch` of `python -m rollout` on this CPU (gloo), from the repository root."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "WANDB_MODE": wandb}
    env.pop("WANDB_DIR", None)
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch"),
        *("--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1"),
        *("--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())),
        *("-m", "rollout", *args),
    ]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_alone(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m rollout` in one process, as a user runs it without accelerate."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "rollout", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def records(folder: pathlib.Path) -> list[dict]:
    lines = (folder / "rollouts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]  # every line whole: json.loads raises on a cut one


# the same greedy two-rollout suffix run (history carried into the second rollout) on 1 and on 2 processes: two
# fixtures, so that a test needing one of them (on another xdist worker) does not pay for both
ONE_AND_TWO = ["run", QUICKSTART, *SMALL, "sampling.temperature=0", "rollout.num_rollouts=2"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dp") / "one"
    one = run_alone([*ONE_AND_TWO, f"output_dir={out}"])
    assert one.returncode == 0, one.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("dp") / "two"
    two = launch(2, [*ONE_AND_TWO, f"output_dir={out}"], wandb="offline")
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    return out, two


def test_two_ranks_give_the_one_process_samples_each_once_in_prompt_order(one_process, two_processes):
    one, (two, _) = one_process, two_processes
    key = lambda r: (r["rollout"], r["prompt_index"], r["sample_index"])  # noqa: E731
    ones, twos = records(one), records(two)
    assert [key(r) for r in twos] == sorted({key(r) for r in ones})  # prompt order, each sample exactly once
    assert {key(r): r["completion_ids"] for r in twos} == {key(r): r["completion_ids"] for r in ones}
    assert {key(r): r["reward"] for r in twos} == {key(r): r["reward"] for r in ones}


def test_rank_zero_writes_steps_with_ranks_and_a_summary_per_rank(two_processes, tmp_path):
    two, result = two_processes
    steps = [json.loads(line) for line in (two / "steps.jsonl").read_text().splitlines()]
    assert {s["rank"] for s in steps} == {0, 1}
    assert {s["rollout"] for s in steps} == {0, 1}
    summary = json.loads((two / "summary.json").read_text())
    assert summary["complete"] is True and summary["num_ranks"] == 2 and summary["num_samples"] == 20
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert (
        summary["total"]["tokens"]
        == sum(r["total"]["tokens"] for r in summary["ranks"])
        == sum(s["num_emitted"] for s in steps)
    )
    assert summary["total"]["tokens_per_s"] == pytest.approx(sum(r["total"]["tokens_per_s"] for r in summary["ranks"]))
    assert summary["straggler_ratio"] >= 1.0
    # every rank's drafter holds every response of the run: its own, and the other rank's all-gathered
    assert [s["history_responses"] for s in summary["history_sharing"]] == [[10, 10], [20, 20]]
    assert all(path.read_text() == "" for path in (two / "ranks").rglob("*.jsonl"))  # all merged into the run's files
    assert "straggler ratio" in result.stdout and result.stdout.count("samples, reward mean") == 1  # rank 0 prints
    assert result.stdout.count("rank 0: KV cache ") == 1  # the header's KV line, rank 0's (it printed none)
    # each rollout's line counts as the table does: the ranks side by side (tokens/s summed, the slowest rank's time)
    for index in (0, 1):
        mine = [s for s in steps if s["rollout"] == index]
        wall = [[seconds] for seconds in summary["rank_seconds_per_rollout"][index]]
        total = summarize_ranks(mine, wall)["total"]
        assert f"rollout {index}: {total['tokens']} tokens in {total['seconds']:.2f} s, " in result.stdout
        assert f"{total['tokens_per_s']:.0f} tokens/s" in result.stdout
    # the plot: one clock (rank 0's: each rank's steps are on its own), never going back
    from rollout.cli.plots import _one_clock, plot_steps

    plotted, title = _one_clock(steps, "run")
    assert title == "run: rank 0 of 2" and {s["rank"] for s in plotted} == {0}
    ends = [s["elapsed"] for s in plotted]
    assert ends == sorted(ends) and plot_steps(steps, tmp_path / "rollout.png", "run").stat().st_size > 0


def test_one_wandb_run_holds_every_rank(two_processes):
    two, _ = two_processes
    runs = list((two / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # rank 0's alone
    history = []
    for record in wandb_records(runs[0]):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    steps = [row for row in history if "step/index" in row]
    assert {row["step/rank"] for row in steps} == {0, 1}
    assert len(steps) == len((two / "steps.jsonl").read_text().splitlines())
    rollouts = [row for row in history if "rollout/index" in row]
    assert [row["rollout/index"] for row in rollouts] == [0, 1]
    assert all(row["rollout/rank0/tokens_per_s"] > 0 and row["rollout/rank1/tokens_per_s"] > 0 for row in rollouts)
    assert all(row["rollout/straggler_ratio"] >= 1.0 for row in rollouts)


def test_history_scope_next_keeps_only_what_each_rank_drafts_next(tmp_path):
    out = tmp_path / "run"
    args = ["run", QUICKSTART, *SMALL, "rollout.num_rollouts=2", "rollout.prompts_per_rollout=3"]
    args += ["distributed.balance=count", "distributed.history_scope=next", f"output_dir={out}"]
    result = launch(2, args)
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = json.loads((out / "summary.json").read_text())["history_sharing"]
    # rollout 0 is data rows 0, 1, 2 (rank 0: 0 and 1, rank 1: 2); rollout 1 is rows 3, 4, 0 (rank 0: 3 and 4,
    # rank 1: 0). After rollout 0, rank 0 keeps its own 4 responses and none of rank 1's (row 2 is not next for it);
    # rank 1 keeps its own 2 and rank 0's 2 to row 0. After the last rollout nobody takes in anything more.
    assert first["history_responses"] == [4, 4]
    assert last["history_responses"] == [8, 6]


@pytest.mark.parametrize(
    "reward, cause",
    [
        ("rank_rewards:fails_on_rank_one", "rank 1 of 2: prompt .*raised RuntimeError: rank one's reward breaks"),
        ("rank_rewards:killed_on_rank_one", "rank 1 of 2: its process ended without a word"),
    ],
)
def test_a_failing_rank_stops_the_run_with_one_line_and_an_incomplete_summary(tmp_path, reward, cause):
    out = tmp_path / "run"
    result = launch(2, ["run", QUICKSTART, *SMALL, f"rewards=[{{name: '{reward}'}}]", f"output_dir={out}"])
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("rollout run:")]
    assert len(ours) == 1, result.stderr[-3000:]
    assert ours[0].startswith("rollout run: error: rank 1 of 2: ")
    assert __import__("re").search(cause, ours[0]), ours[0]
    assert (out / "summary.json").is_file(), result.stdout[-2000:] + result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["incomplete_reason"].startswith("rank 1: ")
    assert records(out) == []  # no rollout finished on every rank: the run's file claims nothing
    for path in (out / "ranks").rglob("*.jsonl"):  # what a rank finished stays, in whole lines
        [json.loads(line) for line in path.read_text().splitlines()]


def test_a_signal_to_one_rank_is_said_by_that_rank(tmp_path):
    """SIGTERM to rank 1 alone: rank 1 says so in the one line, naming itself, and the summary names it; rank 0, whose
    connection to it closes, stays quiet (it used to report the closed connection as its own failure)."""
    out = tmp_path / "run"
    reward = "rewards=[{name: 'rank_rewards:terminated_on_rank_one'}]"
    result = launch(2, ["run", QUICKSTART, *SMALL, reward, f"output_dir={out}"])
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("rollout run:")]
    assert ours == [
        "rollout run: rank 1 of 2: terminated (SIGTERM): what finished is in the output folder; resume=true continues "
        "the run"
    ], result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["incomplete_reason"] == "rank 1: terminated (SIGTERM)"


def test_the_summary_and_the_report_of_a_run_resumed_on_another_number_of_ranks(tmp_path, capsys):
    """Steps written by one process carry no rank: under several ranks they count as rank 0's (a resume on 2 processes
    of a run begun on one failed on them); a ranked folder without summary.json is reported per rank, its tokens/s
    the ranks' sum (the steps' seconds were summed over the ranks)."""
    from rollout.cli.main import main
    from rollout.phases import summarize_ranks

    step = dict(
        kind="decode", batch_size=4, num_draft_tokens=0, num_drafted=0, num_accepted=0, num_emitted=4, elapsed=1.0
    )
    steps = [
        {**step, "seconds": 1.0, "phase": "bulk"},
        *({**step, "seconds": 0.5, "phase": "bulk", "rank": r} for r in (0, 1)),
    ]
    summary = summarize_ranks(steps, [[2.0], [1.0]])
    assert [r["total"]["tokens"] for r in summary["ranks"]] == [8, 4]
    assert summary["total"]["tokens_per_s"] == pytest.approx(8 / 1.5 + 4 / 0.5)
    run = tmp_path / "ranked"
    run.mkdir()
    (run / "steps.jsonl").write_text("".join(json.dumps({**s, "rank": r}) + "\n" for s in steps[1:] for r in (0, 1)))
    assert main(["report", str(run)]) == 0
    total = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("total"))
    assert f"{2 * (8 / 1.0):.1f}" in total.split()  # each rank 8 tokens in 1.0 s: 16 tokens/s, not 8


def test_trl_training_on_two_ranks_shares_the_drafting_history_and_resumes_as_if_never_stopped(tmp_path, monkeypatch):
    """`rollout train` under accelerate: TRL's GRPOTrainer on 2 processes, each generating its own 2 prompts x 2
    samples per step; with sharing each drafter holds both ranks' responses after every step. The sharing training is
    stopped by rank 1 at step 2, then resumed on two ranks from its checkpoint of step 1: each rank's history comes
    back from it, and the steps are those of a training never stopped (rewards, losses, gradient norms; drafts change
    no sample, so that one may share nothing)."""
    args = [
        *("train", str(ROOT / "recipes" / "grpo_quickstart.yaml"), "data.num_prompts=8", "sampling.n=2"),
        *("sampling.max_new_tokens=16", "train.steps=2", "train.prompts_per_step=4", "logging.plot=false"),
        *("model.dtype=float64", "train.save_steps=1", "rewards=[{name: 'rank_rewards:fails_late_on_rank_one'}]"),
    ]
    own = 2 * 2  # a rank's responses per step
    whole = tmp_path / "whole"
    result = launch(2, [*args, "distributed.share_history=false", f"output_dir={whole}"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    expected = [json.loads(line) for line in (whole / "train.jsonl").read_text().splitlines()]
    assert [s["rollout/history_responses"] for s in expected] == [own, 2 * own]
    out = tmp_path / "train"
    args += ["distributed.share_history=true", f"output_dir={out}"]
    monkeypatch.setenv("RANK_FAIL_AT", "2")
    assert launch(2, args).returncode != 0
    monkeypatch.delenv("RANK_FAIL_AT")
    assert [json.loads(line)["step"] for line in (out / "train.jsonl").read_text().splitlines()] == [1]
    result = launch(2, [*args, "resume=true"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]  # rank 0 alone writes
    assert [s["rollout/history_responses"] for s in steps] == [2 * own, 4 * own]
    for key in ("reward", "reward_std", "loss", "grad_norm"):
        assert [s[key] for s in steps] == pytest.approx([s[key] for s in expected], rel=1e-9, abs=1e-12), key
    assert len({s["reward_std"] for s in expected}) == 2 and expected[1]["grad_norm"] > 0, expected  # (a real check)
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert result.stdout.count("steps in") == 1 and "2 steps in" in result.stdout
    # the warnings line of a finished command: rank 0's, before the ranks' exit (which ended the process first)
    assert result.stderr.count("rollout train: ") == 1 and "library warnings in" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("setting", ["train.stepz=3", "sampling.n=1"])
def test_a_bad_training_recipe_on_two_ranks_is_refused_in_one_line(tmp_path, setting):
    """`rollout train` checks its recipe before its ranks start (TRL's accelerator starts them): each process refused
    it in its own line (the same line twice, or rank 1 then said it was terminated). Rank 0 says it."""
    result = launch(2, ["train", str(ROOT / "recipes" / "grpo_quickstart.yaml"), setting, f"output_dir={tmp_path}"])
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("rollout train:")]
    assert len(ours) == 1 and ours[0].startswith("rollout train: error: "), result.stderr[-3000:]


def test_a_run_stopped_by_a_rank_resumes_to_every_sample_once(one_process, tmp_path, monkeypatch):
    """Rank 1 fails in the second rollout; resuming on 2 processes keeps the first rollout and redoes the rest: the
    folder then holds the uninterrupted run's samples, each once, in order."""
    one = one_process
    out = tmp_path / "run"
    args = ["run", QUICKSTART, *SMALL, "sampling.temperature=0", "rollout.num_rollouts=2", "distributed.balance=count"]
    args += ["rewards=[{name: 'rank_rewards:fails_late_on_rank_one'}]", f"output_dir={out}"]
    monkeypatch.setenv("RANK_FAIL_AT", "3")  # by count rank 1 scores groups 3 and 4 a rollout: it fails in the second
    stopped = launch(2, args)
    monkeypatch.delenv("RANK_FAIL_AT")
    assert stopped.returncode != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["incomplete_reason"].startswith("rank 1: ")
    assert {r["rollout"] for r in records(out)} == {0}  # the first rollout whole, nothing of the second
    resumed = launch(2, [*args, "resume=true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    key = lambda r: (r["rollout"], r["prompt_index"], r["sample_index"])  # noqa: E731
    ones, outs = records(one), records(out)
    assert [key(r) for r in outs] == sorted(key(r) for r in ones)
    assert {key(r): r["completion_ids"] for r in outs} == {key(r): r["completion_ids"] for r in ones}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is True
    assert summary["total"]["tokens"] == sum(len(r["completion_ids"]) for r in outs)  # the redone work counted once


def test_bench_on_two_ranks_reports_the_whole_of_the_one_process_work(tmp_path):
    """`rollout bench` under accelerate: every row runs on each rank's share; rank 0's table counts every token of
    the one-process bench (greedy: the same completions), with the slowest rank's seconds."""
    args = ["bench", QUICKSTART, *SMALL, "sampling.temperature=0", "bench.static_k=[2]"]
    one = run_alone([*args, f"output_dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = launch(2, [*args, f"output_dir={tmp_path / 'two'}"])
    assert two.returncode == 0, two.stderr[-3000:]
    ones = json.loads((tmp_path / "one" / "bench.json").read_text())["rows"]
    twos = json.loads((tmp_path / "two" / "bench.json").read_text())
    assert twos["workload"]["num_processes"] == 2
    assert [r["name"] for r in twos["rows"]] == [r["name"] for r in ones]
    for a, b in zip(ones, twos["rows"]):
        assert b["tokens"] == a["tokens"], b["name"]
        assert b["seconds"] == max(b["rank_seconds"]) and len(b["rank_seconds"]) == 2
        assert b["tokens_per_s"] == pytest.approx(b["tokens"] / b["seconds"])
    assert two.stdout.count("rows written to") == 1


def test_training_refuses_groups_that_would_split_over_the_ranks():
    from rollout.cli.recipe import load_recipe
    from rollout.cli.train import run_training

    recipe = load_recipe(ROOT / "recipes" / "grpo_quickstart.yaml", ["train.prompts_per_step=8"])
    with pytest.raises(ValueError, match=r"train\.prompts_per_step \(8\) must be divisible by the number of processes"):
        run_training(recipe, Ranks(rank=0, world_size=3))
