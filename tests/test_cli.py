"""The `rollout` CLI: a recipe runs end to end and its output folder (JSONL, summary, config, plot, W&B run) agrees
with itself; `report` and `bench`; every user error is one line naming the key or file, with exit status 2."""

import json
import pathlib
import struct
import subprocess
import sys
import time

import pytest
from wandb.proto import wandb_internal_pb2

from rollout.cli.main import main
from rollout.cli.recipe import load_recipe
from rollout.tasks import arithmetic_dataset, arithmetic_reward

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
SMALL = ["data.num_prompts=3", "sampling.n=2", "sampling.max_new_tokens=32", "rollout.max_batch_size=4"]
STEP_KEYS = {"phase", "batch_size", "num_draft_tokens", "num_drafted", "num_accepted", "num_emitted", "seconds"}
PHASE_KEYS = {"seconds", "tokens", "tokens_per_s", "mean_batch_size", "mean_k", "acceptance_rate"}
PHASE_KEYS |= {"mean_accepted_length"}


def wandb_records(path: pathlib.Path, timeout_s: float = 60.0) -> list:
    """The records of a finished W&B `.wandb` run file, read with W&B's own protobuf schema.

    W&B's service process writes the file: `finish()` returns once the run's exit is sent, and the service flushes and
    closes the file after (a CI run under load read it without its exit record). So the file is read again until its
    exit record, the run's last, is there, for at most `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_wandb_file_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _wandb_file_records(path: pathlib.Path):
    """The whole records in a `.wandb` file as it stands. The file is a LevelDB-style log: a 7-byte header (":W&B",
    magic, version), then 32 KiB blocks of chunks, each with a 7-byte header (checksum, length, type: 1 full, 2 first,
    3 middle, 4 last) that never crosses a block; a chunk the writer has not finished ends the reading."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"expected a W&B run file, got {data[:4]!r}"
    block, pos, parts = 32768, 7, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the end of the block
            pos += block - pos % block
            continue
        if pos + 7 + length > len(data):
            return
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One small quickstart run (draft-model speculation), W&B offline into the output folder."""
    out = tmp_path_factory.mktemp("run")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.delenv("WANDB_DIR", raising=False)
    mp.setenv("WANDB_SILENT", "true")
    try:
        code = main(["run", QUICKSTART, *SMALL, f"output_dir={out}"])
    finally:
        mp.undo()
    assert code == 0
    return out


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_a_consistent_output_folder(finished_run):
    rollouts = read_jsonl(finished_run / "rollouts.jsonl")
    steps = read_jsonl(finished_run / "steps.jsonl")
    summary = json.loads((finished_run / "summary.json").read_text())
    assert len(rollouts) == 3 * 2
    contract = {"prompt_index", "prompt", "completion", "completion_ids", "logprobs", "finish_reason", "reward"}
    assert all(contract <= set(row) for row in rollouts)
    assert all(len(row["logprobs"]) == len(row["completion_ids"]) for row in rollouts)
    assert all(STEP_KEYS | {"elapsed"} <= set(step) for step in steps)
    assert {s["phase"] for s in steps} <= {"prefill", "bulk", "tail"} and steps[0]["phase"] == "prefill"
    assert any(s["num_draft_tokens"] > 0 for s in steps), "the quickstart recipe speculates"
    # token counts add up across the three files
    tokens = sum(len(row["completion_ids"]) for row in rollouts)
    assert tokens == sum(s["num_emitted"] for s in steps) == summary["total"]["tokens"]
    assert tokens == sum(summary["phases"][p]["tokens"] for p in ("prefill", "bulk", "tail"))
    assert set(summary["phases"]) == {"prefill", "bulk", "tail"}
    assert all(PHASE_KEYS <= set(stats) for stats in [*summary["phases"].values(), summary["total"]])
    assert summary["total"]["seconds"] == pytest.approx(sum(s["seconds"] for s in steps))
    assert summary["total"]["num_steps"] == len(steps)
    # the rewards are the arithmetic reward of each completion against its problem's answer
    answers = arithmetic_dataset(3, split="eval", seed=0)["answer"]
    expected = arithmetic_reward([r["completion"] for r in rollouts], [answers[r["prompt_index"]] for r in rollouts])
    assert [r["reward"] for r in rollouts] == expected
    assert summary["reward_mean"] == pytest.approx(sum(expected) / len(expected))
    # the resolved config is the recipe with the overrides applied
    assert load_recipe(finished_run / "config.yaml") == load_recipe(QUICKSTART, [*SMALL, f"output_dir={finished_run}"])
    assert (finished_run / "rollout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def wandb_run_contents(run_file: pathlib.Path) -> tuple[list[dict], dict, dict]:
    """(history rows, summary, config) of a finished W&B run file."""
    history, summary, config = [], {}, {}
    items = lambda updates: {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(items(record.history.item))
        elif kind == "summary":
            summary.update(items(record.summary.update))
        elif kind == "run":  # wandb.init(config=...) travels in the run record
            config.update(items(record.run.config.update))
        elif kind == "config":
            config.update(items(record.config.update))
    return history, summary, config


def test_wandb_offline_run_holds_the_metrics(finished_run):
    run_files = list((finished_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history, summary, config = wandb_run_contents(run_files[0])
    steps = read_jsonl(finished_run / "steps.jsonl")
    step_rows = [row for row in history if "step/index" in row]
    assert [row["step/index"] for row in step_rows] == list(range(len(steps)))
    assert [row["step/batch_size"] for row in step_rows] == [s["batch_size"] for s in steps]
    assert [row["step/num_emitted"] for row in step_rows] == [s["num_emitted"] for s in steps]
    expected = json.loads((finished_run / "summary.json").read_text())
    for phase in ("prefill", "bulk", "tail"):
        assert summary[f"phase/{phase}/tokens"] == expected["phases"][phase]["tokens"]
        assert summary[f"phase/{phase}/tokens_per_s"] == pytest.approx(expected["phases"][phase]["tokens_per_s"])
    assert summary["total/tokens"] == expected["total"]["tokens"]
    assert summary["reward_mean"] == pytest.approx(expected["reward_mean"])
    assert config["sampling"]["n"] == 2 and config["data"]["num_prompts"] == 3
    tables = list((run_files[0].parent / "files" / "media" / "table").glob("samples_*.table.json"))
    table = json.loads(tables[0].read_text())
    rollouts = read_jsonl(finished_run / "rollouts.jsonl")
    rewards = [row[table["columns"].index("reward")] for row in table["data"]]
    assert rewards == [r["reward"] for r in rollouts]


def test_report_prints_the_phase_table_and_writes_the_plot(finished_run, capsys):
    (finished_run / "rollout.png").unlink()
    assert main(["report", str(finished_run)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("prefill", "bulk", "tail", "total", "tokens/s"))
    assert (finished_run / "rollout.png").is_file()


def test_the_plotted_rate_counts_what_was_kept_and_never_goes_below_zero():
    """A step that discards more than its window emitted (rows preempted, their earlier tokens given up): the plotted
    tokens/s is 0 there, not negative; elsewhere it is the kept tokens over their seconds."""
    from rollout.cli.plots import _windowed_rate

    steps = [{"num_emitted": 10, "seconds": 0.5}] * 3 + [{"num_emitted": 10, "num_discarded": 200, "seconds": 0.5}]
    steps += [{"num_emitted": 4, "num_discarded": 2, "seconds": 0.5}]
    assert _windowed_rate(steps, window=2) == [20.0, 20.0, 20.0, 0.0, 0.0]
    assert _windowed_rate(steps, window=1)[-1] == 4.0  # a preemption's few discarded tokens are taken off


def test_the_plotted_rate_is_each_windows_own_and_zero_where_no_step_took_time():
    """The rate at every step re-summed its whole window (a fiftieth of the run): quadratic, minutes for a long run's
    plot at its end and in `rollout report`. Running sums give each window's own rate, 0 exactly where none of its
    steps took time."""
    import random

    from rollout.cli.plots import _windowed_rate

    rng = random.Random(0)
    steps = [
        {
            "num_emitted": rng.randrange(0, 300),
            "num_discarded": rng.choice([0, 0, 0, rng.randrange(0, 500)]),
            "seconds": rng.choice([0.0, rng.uniform(0.001, 0.2)]),
        }
        for _ in range(500)
    ]
    steps[100:120] = [{"num_emitted": 5, "seconds": 0.0}] * 20  # a window of steps that took no time
    for window in (1, 7, 50):
        for i, rate in enumerate(_windowed_rate(steps, window)):
            chunk = steps[max(0, i - window + 1) : i + 1]
            seconds = sum(s["seconds"] for s in chunk)
            kept = max(sum(s["num_emitted"] - s.get("num_discarded", 0) for s in chunk), 0)
            assert rate == pytest.approx(kept / seconds if seconds > 0 else 0.0, rel=1e-9, abs=0.0), (window, i)
    assert _windowed_rate(steps, 7)[119] == 0.0


def test_report_reads_a_run_a_machine_failure_cut_short(finished_run, tmp_path, capsys):
    """A kill can cut the last line of steps.jsonl, and leave summary.json damaged: the report reads the whole lines."""
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(finished_run, cut)
    text = (cut / "steps.jsonl").read_text()
    (cut / "steps.jsonl").write_text(text + text.splitlines()[-1][:40])
    (cut / "summary.json").write_text('{"phases": {"pre')
    assert main(["report", str(cut)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("prefill", "bulk", "tail", "total", "tokens/s"))
    # a summary that parses but whose table is damaged (a traceback), and a line damaged before the last (left out
    # without a word): the table from the steps, and a note naming what was left out
    (cut / "summary.json").write_text('{"phases": {"bulk": 1}}')
    lines = text.splitlines()
    (cut / "steps.jsonl").write_text("\n".join([*lines[:2], lines[2][:30], *lines[3:]]) + "\n")
    assert main(["report", str(cut)]) == 0
    captured = capsys.readouterr()
    assert "total" in captured.out
    assert f"holds 1 damaged line(s), left out: the table counts the {len(lines) - 1} steps" in captured.err
    # no summary at all (a kill, a full disk): the table said nothing of the run being cut short
    (cut / "summary.json").unlink()
    assert main(["report", str(cut)]) == 0
    assert "incomplete (no summary.json: running, or stopped before it wrote one)" in capsys.readouterr().out


def test_report_says_a_run_is_incomplete_and_refuses_what_is_not_a_runs_steps(finished_run, tmp_path, capsys):
    """A stopped run's table is what finished, and the report says so; a steps.jsonl whose records are not steps (an
    edited or foreign file) is one line naming the record and what it lacks, not a traceback."""
    import shutil

    stopped = tmp_path / "stopped"
    shutil.copytree(finished_run, stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    (stopped / "summary.json").write_text(json.dumps({**summary, "complete": False, "incomplete_reason": "SIGINT"}))
    assert main(["report", str(stopped)]) == 0
    assert f"incomplete (SIGINT): these are the figures of the {summary['num_samples']} samples kept" in (
        capsys.readouterr().out
    )
    assert main(["report", str(finished_run)]) == 0
    assert "incomplete" not in capsys.readouterr().out
    (stopped / "steps.jsonl").write_text((finished_run / "steps.jsonl").read_text() + '{"phase": "bulk"}\n')
    assert main(["report", str(stopped)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a step (it lacks kind, seconds, batch_size" in err[0], err
    record = json.loads((finished_run / "steps.jsonl").read_text().splitlines()[0])
    for changed, message in (
        ({"phase": "warmup"}, "its phase 'warmup' is none of"),
        ({"seconds": None}, "its seconds"),
    ):
        (stopped / "steps.jsonl").write_text(json.dumps({**record, **changed}) + "\n")
        assert main(["report", str(stopped)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"record 1 is not a step ({message}" in err[0], err
    (stopped / "steps.jsonl").write_text("garbage\n")
    assert main(["report", str(stopped)]) == 2
    assert "holds no step record" in capsys.readouterr().err
    assert main(["report", str(stopped / "steps.jsonl")]) == 2
    assert "steps.jsonl is a file: give the output folder of a `rollout run`" in capsys.readouterr().err


def test_report_into_a_closed_pipe_ends_quietly(finished_run, tmp_path):
    """`rollout report DIR | head -1`: the reader has gone when the table is written. No error line (it said
    `error: [Errno 32] Broken pipe`) and no traceback at exit: the shell's status for a broken pipe."""
    import subprocess
    import sys

    code = (
        "import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "from rollout.cli.main import main\n"
        f"status = main(['report', {str(finished_run)!r}])\n"
        f"open({str(tmp_path / 'status')!r}, 'w').write(str(status))\n"
        "sys.exit(status)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (tmp_path / "status").read_text() == "141" and done.returncode == 141
    assert done.stderr == "", done.stderr


def test_bench_rows(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    code = main(["bench", QUICKSTART, "data.num_prompts=2", "sampling.n=2", "sampling.max_new_tokens=16",
                 "bench.static_k=[2]", f"output_dir={tmp_path}"])  # fmt: skip
    assert code == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["name"] for r in rows] == [
        "model.generate (padded)",
        "no speculation",
        "draft_model K=2",
        "recipe (draft_model auto K<=4)",
    ]
    for row in rows:
        assert {"name", "seconds", "tokens", "tokens_per_s", "tokens_per_s_per_phase"} <= set(row)
        assert row["tokens"] > 0 and row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
    assert rows[0]["tokens_per_s_per_phase"] is None
    assert set(rows[1]["tokens_per_s_per_phase"]) == {"prefill", "bulk", "tail"}
    captured = capsys.readouterr()
    assert all(r["name"] in captured.out for r in rows)
    # progress: each configuration is announced on stderr as it starts, with its time when it ends
    assert [line for line in captured.err.splitlines() if line.startswith("[")] == [
        f"[{i + 1}] {r['name']} ..." for i, r in enumerate(rows)
    ]


def test_a_stopped_bench_keeps_the_rows_that_finished(tmp_path, capsys, monkeypatch):
    """Ctrl-C (a KeyboardInterrupt where the SIGINT handler raises it) as the third row starts: bench.json holds the
    two rows that finished, marked incomplete, and the one line says where they are. Then an earlier benchmark there
    is refused, and overwrite=true replaces it."""
    import rollout.cli.bench as bench

    made = bench.make_rollout
    calls = []

    def stopped_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return made(*args, **kwargs)

    monkeypatch.setattr(bench, "make_rollout", stopped_at_the_second)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    small = ["data.num_prompts=2", "sampling.n=2", "sampling.max_new_tokens=8", "bench.static_k=[2]"]
    assert main(["bench", QUICKSTART, *small, f"output_dir={tmp_path}"]) == 130
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["complete"] is False
    assert [r["name"] for r in report["rows"]] == ["model.generate (padded)", "no speculation"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"rollout bench: interrupted: the rows that finished are in {tmp_path / 'bench.json'} (marked " \
        "incomplete)", err  # fmt: skip
    monkeypatch.setattr(bench, "make_rollout", made)
    assert main(["bench", QUICKSTART, *small, f"output_dir={tmp_path}"]) == 2
    assert "already holds a benchmark (bench.json)" in capsys.readouterr().err
    assert main(["bench", QUICKSTART, *small, "bench.baseline=false", f"output_dir={tmp_path}", "overwrite=true"]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["complete"] is True and len(report["rows"]) == 3  # none, K=2, the recipe's policy
    capsys.readouterr()

    def stopped_loading(recipe):
        raise KeyboardInterrupt

    # stopped while the model loads, under overwrite=true: the earlier benchmark stays, and is not claimed as this one
    monkeypatch.setattr(bench, "load_inputs", stopped_loading)
    assert main(["bench", QUICKSTART, *small, f"output_dir={tmp_path}", "overwrite=true"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "rollout bench: interrupted"
    assert json.loads((tmp_path / "bench.json").read_text()) == report


def all_nan(completions, **kwargs):
    """A reward for the test below: nothing it can score."""
    return [float("nan")] * len(completions)


def test_the_bench_baseline_does_the_generators_work(tmp_path, capsys, monkeypatch):
    """Greedy, so the baseline's completions are the generator's: the same tokens counted and the same reward, with
    `ignore_eos`, with a prompt that `max_seq_len` cuts short, and whatever the model's generation_config adds (a
    repetition penalty, which the generator does not apply); a reward null everywhere is shown as such."""
    import rollout.cli.bench as bench

    loaded = bench.load_inputs

    def with_a_penalty(recipe):
        inputs = loaded(recipe)
        inputs.model.generation_config.repetition_penalty = 2.0
        return inputs

    monkeypatch.setattr(bench, "load_inputs", with_a_penalty)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    small = ["data.num_prompts=4", "sampling.n=2", "sampling.max_new_tokens=32", "sampling.temperature=0"]
    small += ["bench.static_k=[]", "spec.method=null"]
    for i, extra in enumerate((["sampling.ignore_eos=true"], ["rollout.max_seq_len=130"])):
        assert main(["bench", QUICKSTART, *small, *extra, f"output_dir={tmp_path / str(i)}"]) == 0
        baseline, plain = json.loads((tmp_path / str(i) / "bench.json").read_text())["rows"]
        assert baseline["tokens"] == plain["tokens"] and baseline["reward_mean"] == plain["reward_mean"], extra
    capsys.readouterr()
    nulls = ["rollout.non_finite_rewards_as_null=true", "rewards=[{name: 'test_cli:all_nan'}]"]
    assert main(["bench", QUICKSTART, *small, *nulls, f"output_dir={tmp_path / 'nulls'}"]) == 0
    rows = json.loads((tmp_path / "nulls" / "bench.json").read_text())["rows"]
    assert [r["reward_mean"] for r in rows] == [None, None]
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("model.generate", "no spec"))]
    assert len(table) == 2 and all(line.rstrip().endswith(" -") for line in table)


def test_a_data_column_named_completions_reaches_no_reward_in_bench_either(tmp_path, monkeypatch):
    """The bench baseline scored its completions with every data column, one named `completions` too, which collided
    with the texts after the baseline had run (`got multiple values for argument 'completions'`)."""
    from rollout.tasks import arithmetic_dataset

    data = arithmetic_dataset(2, split="eval", seed=0)
    lines = [json.dumps({"prompt": r["prompt"], "answer": r["answer"], "completions": "x"}) for r in data]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    small = ["sampling.n=2", "sampling.max_new_tokens=8", "bench.static_k=[]", "spec.method=null"]
    assert main(["bench", QUICKSTART, *small, f"data.dataset={tmp_path / 'data.jsonl'}", f"output_dir={tmp_path}"]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["reward_mean"] is not None for r in rows)


def test_bench_refuses_a_row_the_loaded_data_rules_out_before_any_row_runs(tmp_path, capsys, monkeypatch):
    """A K table that ends below the slots `max_batch_size=auto` gives, or a K as long as `max_seq_len`: the bench ran
    every other row first, then refused the recipe's own (a long benchmark lost, `complete: false`). Both are refused
    once the data is loaded, before the first row."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    small = ["data.num_prompts=2", "sampling.n=2", "sampling.max_new_tokens=8", "bench.static_k=[1]"]
    table = ["rollout.max_batch_size=auto", "spec.num_speculative_tokens_per_batch_size=[[1,2,2]]"]
    line = _error(capsys, ["bench", QUICKSTART, *small, *table, f"output_dir={tmp_path / 'table'}"])
    assert "ends at batch size 2 but max_batch_size is 4" in line
    long_k = ["spec.num_speculative_tokens=300", "spec.num_speculative_tokens_per_batch_size=null"]
    line = _error(capsys, ["bench", QUICKSTART, *small, *long_k, f"output_dir={tmp_path / 'k'}"])
    assert "spec.num_speculative_tokens (300) must be below max_seq_len" in line
    assert not list(tmp_path.glob("*/bench.json")), "a row ran before the refusal"


def test_bench_without_speculation_runs_ngram_rows(tmp_path, monkeypatch):
    """A recipe with speculation off (`spec.method=null`, as the quickstart says to compare) benches its static-K rows
    with n-gram drafts: the recipe's `spec.model` is no part of them (it refused them, after the model had loaded)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    small = ["data.num_prompts=2", "sampling.n=2", "sampling.max_new_tokens=8", "bench.baseline=false"]
    code = main(["bench", QUICKSTART, *small, "spec.method=null", "bench.static_k=[2]", f"output_dir={tmp_path}"])
    assert code == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["no speculation", "ngram K=2"] and rows[1]["mean_k"] == 2.0


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {captured.err!r}"
    assert lines[0].startswith(f"rollout {argv[0]}: error: ")
    assert "Traceback" not in captured.err
    return lines[0]


def test_user_errors_are_one_line_naming_the_key_or_file(tmp_path, capsys):
    unknown_key = tmp_path / "unknown_key.yaml"
    unknown_key.write_text("model:\n  nme: tiny-target\n")
    assert "model.nme" in _error(capsys, ["run", str(unknown_key)])
    assert "sampling.n" in _error(capsys, ["run", QUICKSTART, "sampling.n=many"])
    assert "nowhere.yaml" in _error(capsys, ["run", str(tmp_path / "nowhere.yaml")])
    assert "missing.jsonl" in _error(capsys, ["run", QUICKSTART, f"data.dataset={tmp_path}/missing.jsonl"])
    line = _error(capsys, ["run", QUICKSTART, "model.name=tiny-nope"])
    assert "model.name" in line and "tiny-nope" in line and "tiny-target" in line
    bad_reward = tmp_path / "bad_reward.yaml"
    bad_reward.write_text("rewards:\n  - name: accuracy\n")
    line = _error(capsys, ["run", str(bad_reward)])
    assert "accuracy" in line and "arithmetic" in line
    line = _error(capsys, ["run", QUICKSTART, "data.prompt_column=question"])
    assert "data.prompt_column" in line and "'question'" in line and "answer" in line
    line = _error(capsys, ["run", QUICKSTART, "spec.num_speculative_tokens_per_batch_size=[[1,16,3],[8,64,1]]"])
    assert "num_speculative_tokens_per_batch_size" in line and "overlap" in line
    line = _error(capsys, ["bench", QUICKSTART, "spec.num_speculative_tokens_per_batch_size=[[1,32,3]]"])
    assert "max_batch_size" in line
    assert "no-run" in _error(capsys, ["report", str(tmp_path / "no-run")])


def test_the_installed_command_exits_2_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rollout.cli", "run", str(tmp_path / "absent.yaml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    expected = f"rollout run: error: recipe file not found: {tmp_path / 'absent.yaml'}"
    assert result.stderr.strip().splitlines() == [expected]


def test_more_user_errors_are_one_line_with_the_place(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "empty.jsonl is empty" in _error(capsys, ["run", QUICKSTART, f"data.dataset={empty}"])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1 + 1", "answer": "2"}\n{"prompt": "2 + 2", "answer": 4\n')
    assert f"{broken}:2:" in _error(capsys, ["run", QUICKSTART, f"data.dataset={broken}"])
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  name: tiny-target\n  dtype: [float32\n")
    line = _error(capsys, ["run", str(bad_yaml)])
    assert f"{bad_yaml}:4:1: invalid YAML" in line
    if not __import__("torch").cuda.is_available():
        line = _error(capsys, ["run", QUICKSTART, "model.device=cuda"])
        assert "sees no CUDA device" in line and "model.device=cpu" in line
    assert "temperature (nan)" in _error(capsys, ["run", QUICKSTART, "sampling.temperature=nan"])
    for bad in ("0", "many", "true"):
        assert "rollout.max_batch_size" in _error(capsys, ["run", QUICKSTART, f"rollout.max_batch_size={bad}"])


def test_a_draft_folder_holding_another_tokenizer_is_refused_before_the_output_folder(tmp_path, capsys):
    """From a helper's probe: a draft folder whose tokenizer maps tokens to other ids, its vocabulary the same size,
    drafted without a word (its drafts rejected: the samples the same, the speed lost). The recipe names both
    folders, so the command line compares their tokenizers; the shipped draft's folder holds the target's."""
    import shutil

    assets = ROOT / "rollout" / "models" / "assets"
    draft = tmp_path / "draft"
    shutil.copytree(assets / "tiny-draft", draft)
    vocab = json.loads((draft / "tokenizer.json").read_text())
    ids = vocab["model"]["vocab"]
    first, second = sorted(ids, key=ids.get)[40:42]
    ids[first], ids[second] = ids[second], ids[first]  # two tokens swapped: the same size, another tokenizer
    (draft / "tokenizer.json").write_text(json.dumps(vocab))
    out = tmp_path / "out"
    line = _error(capsys, ["run", QUICKSTART, *SMALL, f"spec.model={draft}", f"output_dir={out}"])
    assert "spec.model: " in line and "holds another tokenizer than model.name's (2 of its 476" in line, line
    assert not out.exists()
    from rollout.cli.sources import check_draft_tokenizer
    from rollout.models.zoo import load_model

    tokenizer = load_model("tiny-target")[1]
    check_draft_tokenizer(str(assets / "tiny-draft"), tokenizer)  # the same: nothing to say
    tokenizer.add_tokens(["<tool_call>"])  # a token one of them adds alone: the ids they share agree
    check_draft_tokenizer(str(assets / "tiny-draft"), tokenizer)
    # each adds its own token at the same id: one id, two tokens
    other = load_model("tiny-target")[1]
    other.add_tokens(["<draft_only>"])
    other.save_pretrained(tmp_path / "other")
    assert other.convert_tokens_to_ids("<draft_only>") == tokenizer.convert_tokens_to_ids("<tool_call>")
    with pytest.raises(ValueError, match=r"holds another tokenizer than model.name's \(1 of its"):
        check_draft_tokenizer(str(tmp_path / "other"), tokenizer)


def test_max_batch_size_auto_takes_a_whole_rollout(tmp_path, capsys):
    small = [s for s in SMALL if not s.startswith("rollout.max_batch_size")]
    argv = ["run", QUICKSTART, *small, "rollout.max_batch_size=auto", "logging.wandb_mode=disabled"]
    assert main([*argv, f"output_dir={tmp_path / 'out'}"]) == 0
    assert "(6 slots x" in capsys.readouterr().out  # 3 prompts x n=2


def test_wandb_online_without_a_key_logs_offline_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key from `wandb login`
    monkeypatch.setenv("NETRC", str(tmp_path / "absent-netrc"))
    assert main(["run", QUICKSTART, *SMALL, f"output_dir={tmp_path / 'out'}"]) == 0
    err = capsys.readouterr().err
    assert "W&B online needs an API key" in err and "logging offline" in err
    assert list((tmp_path / "out" / "wandb").glob("offline-run-*"))


def test_a_module_function_reward_in_the_current_folder(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def short(completions, **kw):\n    return [1.0] * len(completions)\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rewards:\n  - name: my_rewards:short\n")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from rollout.cli.main import main; sys.exit(main(sys.argv[1:]))",
            "run",
            str(recipe),
            *SMALL,
            "spec.method=null",
            "logging.wandb_mode=disabled",
            f"output_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONSAFEPATH": "1"},  # like the installed command: no '' on sys.path
    )
    assert result.returncode == 0, result.stderr
    assert "reward mean 1.000" in result.stdout


def test_non_finite_rewards_stop_the_run_or_are_recorded_as_null(tmp_path, capsys, monkeypatch):
    (tmp_path / "nan_rewards.py").write_text(
        "def first_nan(completions, **kw):\n    return [float('nan')] + [1.0] * (len(completions) - 1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["run", QUICKSTART, *SMALL, "rewards=[{name: 'nan_rewards:first_nan'}]", "logging.wandb_mode=disabled"]
    line = _error(capsys, [*argv, f"output_dir={tmp_path / 'a'}"])
    assert "prompt 0" in line and "nan_rewards:first_nan" in line and "non_finite_rewards_as_null" in line
    assert main([*argv, "rollout.non_finite_rewards_as_null=true", f"output_dir={tmp_path / 'b'}"]) == 0
    assert "3 non-finite rewards recorded as null" in capsys.readouterr().out
    text = (tmp_path / "b" / "rollouts.jsonl").read_text()
    assert "NaN" not in text
    records = [json.loads(line) for line in text.splitlines()]  # strict JSON: no NaN
    assert [r["reward"] for r in records if r["sample_index"] == 0] == [None] * 3
    assert all(r["reward"] == 1.0 for r in records if r["sample_index"] == 1)
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["num_null_rewards"] == 3 and summary["reward_mean"] == 1.0


def test_a_stopped_and_resumed_run_logs_every_step_and_the_whole_rollout_to_wandb(tmp_path, capsys, monkeypatch):
    """A run stopped part way (here by a reward that raises at its second group) logged none of its steps to W&B, and
    the resumed run's `rollout/*` metrics covered only what it generated itself (fewer tokens and steps, another
    reward mean than the files hold). Now the stopped run logs the steps of its rollout, and the resumed run logs
    the rollout it resumed in whole, as steps.jsonl and rollouts.jsonl hold it."""
    (tmp_path / "flaky_rewards.py").write_text(
        "import os\ncalls = 0\n"
        "def fail_at(completions, **kw):\n"
        "    global calls\n    calls += 1\n"
        "    if calls == int(os.environ.get('FAIL_AT', 0)):\n        raise RuntimeError('the reward service is down')\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = tmp_path / "run"
    argv = ["run", QUICKSTART, *SMALL, "rewards=[{name: 'flaky_rewards:fail_at'}]", f"output_dir={out}"]
    monkeypatch.setenv("FAIL_AT", "2")
    assert main([*argv, "rollout.num_rollouts=2"]) == 2
    (stopped,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    steps = read_jsonl(out / "steps.jsonl")
    assert steps and {s["rollout"] for s in steps} == {0}
    assert len(read_jsonl(out / "rollouts.jsonl")) == 2  # the first group only: the rollout was cut short
    history, _, _ = wandb_run_contents(stopped)
    assert [row["step/num_emitted"] for row in history if "step/index" in row] == [s["num_emitted"] for s in steps]
    assert not any("rollout/index" in row for row in history)  # no metrics for a rollout not closed
    monkeypatch.delenv("FAIL_AT")
    assert main([*argv, "rollout.num_rollouts=2", "resume=true"]) == 0
    capsys.readouterr()
    (resumed,) = set((out / "wandb").glob("offline-run-*/run-*.wandb")) - {stopped}
    history, _, _ = wandb_run_contents(resumed)
    steps, records = read_jsonl(out / "steps.jsonl"), read_jsonl(out / "rollouts.jsonl")
    step_rows = [row for row in history if "step/index" in row]
    assert [row["step/index"] for row in step_rows] == list(range(len(steps)))  # rollout 0's earlier steps too
    assert [row["step/num_emitted"] for row in step_rows] == [s["num_emitted"] for s in steps]
    (first,) = [row for row in history if row.get("rollout/index") == 0]
    kept = [r for r in records if r["rollout"] == 0]
    assert first["rollout/tokens"] == sum(len(r["completion_ids"]) for r in kept)
    assert first["rollout/num_steps"] == sum(s["rollout"] == 0 for s in steps)
    assert first["rollout/reward_mean"] == pytest.approx(sum(r["reward"] for r in kept) / len(kept))
    tables = (resumed.parent / "files" / "media" / "table").glob("samples_*.table.json")
    by_step = sorted(
        tables, key=lambda path: int(path.name.split("_")[1])
    )  # samples_<W&B step>_<hash>: rollout 0's first
    assert len(json.loads(by_step[0].read_text())["data"]) == len(kept) == 6


@pytest.mark.parametrize("stop", ["after its last group", "while W&B logs it"])
def test_a_rollout_whole_on_disk_when_the_run_stopped_reaches_wandb_once(tmp_path, capsys, monkeypatch, stop):
    """Stopped after a rollout's last group was written, or while W&B logged it: the summary said `num_rollouts: 0`
    beside a whole rollout in rollouts.jsonl, the stopped W&B run logged some of its steps twice (those logged before
    the stop, again) and none of its metrics, and the resume skipped it, so its metrics reached no W&B run. Now the
    stopped run closes it from the files: each step once, its metrics and samples once; the resumed run logs the next
    rollout only."""
    from wandb.sdk.wandb_run import Run

    import rollout.cli.tracking as tracking

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = tmp_path / "run"
    argv = ["run", QUICKSTART, *SMALL, "rollout.num_rollouts=2", f"output_dir={out}"]
    with monkeypatch.context() as patch:
        if stop == "after its last group":
            log_group, groups = tracking.RunTracker.log_group, []

            def stopping_log_group(self, group, rollout=None):
                log_group(self, group, rollout)
                groups.append(rollout)
                if groups == [0, 0, 0]:  # rollout 0's 3 groups are on disk
                    raise KeyboardInterrupt

            patch.setattr(tracking.RunTracker, "log_group", stopping_log_group)
        else:
            log, calls = Run.log, []

            def stopping_log(self, *args, **kwargs):
                calls.append(1)
                if len(calls) == 5:  # rollout 0's fifth step row
                    raise KeyboardInterrupt
                return log(self, *args, **kwargs)

            patch.setattr(Run, "log", stopping_log)
        assert main(argv) == 130
    capsys.readouterr()
    assert json.loads((out / "summary.json").read_text())["num_rollouts"] == 1
    steps = read_jsonl(out / "steps.jsonl")
    assert {s["rollout"] for s in steps} == {0} and len(read_jsonl(out / "rollouts.jsonl")) == 6
    (stopped,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history, _, _ = wandb_run_contents(stopped)
    assert [row["step/index"] for row in history if "step/index" in row] == list(range(len(steps)))
    (metrics,) = [row for row in history if "rollout/index" in row]
    assert metrics["rollout/index"] == 0 and metrics["rollout/num_steps"] == len(steps)
    assert metrics["rollout/tokens"] == sum(len(r["completion_ids"]) for r in read_jsonl(out / "rollouts.jsonl"))
    assert main([*argv, "resume=true"]) == 0
    (resumed,) = set((out / "wandb").glob("offline-run-*/run-*.wandb")) - {stopped}
    history, _, _ = wandb_run_contents(resumed)
    assert [row["rollout/index"] for row in history if "rollout/index" in row] == [1]
    steps = read_jsonl(out / "steps.jsonl")
    assert [row["step/index"] for row in history if "step/index" in row] == [
        i for i, s in enumerate(steps) if s["rollout"] == 1
    ]


def _step(emitted: int, seconds: float, elapsed: float, **extra) -> dict:
    """A decode step record as `Rollout` hands them to the tracker."""
    fields = {"kind": "decode", "phase": "bulk", "batch_size": 2, "num_draft_tokens": 0, "num_drafted": 0}
    return {**fields, "num_accepted": 0, "num_emitted": emitted, "seconds": seconds, "elapsed": elapsed, **extra}


def _record(prompt_index: int, sample_index: int, reward: float, tokens: int) -> dict:
    fields = {"prompt": "p", "completion": "c", "completion_ids": [1] * tokens, "logprobs": [0.0] * tokens}
    fields["finish_reason"] = "length"
    return {"prompt_index": prompt_index, "sample_index": sample_index, "reward": reward, **fields}


def test_the_tracker_logs_a_resumed_rollout_whole_on_several_processes_and_nothing_twice(tmp_path, monkeypatch):
    """On several processes, the rollout a run resumed in went to W&B with only its new steps, tokens and rewards
    (one process was fixed alone); and a resumed run stopped before its first step logged again the steps of the
    rollout the stopped run had closed."""
    from rollout.cli.tracking import RunTracker

    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = tmp_path / "run"
    first = RunTracker(out, {"k": 1}, wandb_mode="offline")
    for i in range(2):
        first.log_step(_step(4, 0.5, 0.5 * (i + 1)), 0)
    first.log_records([_record(0, 0, 0.0, 4), _record(0, 1, 0.0, 4)], 0)  # group 0 of rollout 0, then the stop
    first.finish(complete=False, reason="interrupted")
    second = RunTracker(out, {"k": 1}, wandb_mode="offline", resume=True, group_size=2)
    second.finish(complete=False, reason="interrupted")  # stopped again before a step of its own
    third = RunTracker(out, {"k": 1}, wandb_mode="offline", resume=True, group_size=2)
    rank_steps = [[_step(4, 0.25, 0.25)], [_step(4, 0.5, 0.5)]]
    summaries = [{"wall_seconds": 0.25, "total": {"tokens_per_s": 16.0, "acceptance_rate": 0.0}}]
    summaries.append({"wall_seconds": 0.5, "total": {"tokens_per_s": 8.0, "acceptance_rate": 0.0}})
    third.log_ranked_rollout([_record(1, 0, 1.0, 4), _record(1, 1, 1.0, 4)], rank_steps, summaries, 0, resumed=True)
    # a rank without a group (ranked.py's empty summary) failed in a KeyError ('acceptance_rate') with W&B on
    idle = {"wall_seconds": 0.0, "total": {"tokens_per_s": 0.0}}
    third.log_ranked_rollout(
        [_record(0, 0, 1.0, 4), _record(0, 1, 1.0, 4)], [[_step(4, 0.5, 1.0)], []], [summaries[1], idle], 1
    )
    third.log_ranked_rollout([], [[], []], [idle, idle], 2, resumed=True)  # all on disk: logged by its own run
    third.finish()
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))  # (names: the start's second, then a random id)
    assert len(runs) == 3
    contents = [wandb_run_contents(run)[0] for run in runs]
    step_rows = [[row["step/index"] for row in history if "step/index" in row] for history in contents]
    assert sorted(step_rows) == [[], [0, 1], [0, 1, 2, 3, 4]]  # the stopped run's; none again; the whole rollout
    (closed,) = [row for history in contents for row in history if row.get("rollout/index") == 0]
    (idle_rank,) = [row for history in contents for row in history if row.get("rollout/index") == 1]
    assert idle_rank["rollout/rank1/tokens_per_s"] == 0.0 and idle_rank["rollout/rank0/tokens_per_s"] == 8.0
    assert not any(row.get("rollout/index") == 2 for history in contents for row in history)
    assert closed["rollout/tokens"] == 16 and closed["rollout/num_steps"] == 4  # as the files hold them
    assert closed["rollout/reward_mean"] == pytest.approx(0.5)  # group 0 scored 0, group 1 scored 1


def test_a_resumed_data_parallel_run_counts_each_ranks_time_on_the_rollouts_before_the_stop(tmp_path):
    """From a helper's probe: after resume=true, a rollout all on disk before the stop counted 0 s for every rank
    (`rank_seconds_per_rollout` [[0.0, 0.0], ...], each rank's tokens over only this run's time, the straggler ratio
    without it); a rollout resumed inside counted only this run's part. Each rank's steps from before the stop now
    count as its time there, as the W&B metrics of a rollout resumed inside already did."""
    from rollout.cli.tracking import RunTracker

    out = tmp_path / "run"
    first = RunTracker(out, {"k": 1}, wandb_mode="disabled")
    idle = {"wall_seconds": 0.0, "total": {"tokens_per_s": 0.0}}
    summaries = [{"wall_seconds": 1.5, "total": {}}, {"wall_seconds": 1.0, "total": {}}]
    records = [_record(p, s, 1.0, 4) for p in (0, 1) for s in (0, 1)]
    steps = [[_step(4, 0.75, 0.75), _step(4, 0.75, 1.5)], [_step(4, 1.0, 1.0)]]
    first.log_ranked_rollout(records, steps, summaries, 0)
    first.log_step({**_step(4, 0.5, 2.0), "rank": 1}, 1)  # rollout 1 cut short: rank 1's step, no group written
    first.finish(complete=False, reason="interrupted")
    resumed = RunTracker(out, {"k": 1}, wandb_mode="disabled", resume=True, group_size=2)
    resumed.log_ranked_rollout([], [[], []], [idle, idle], 0, resumed=True)  # all on disk before the stop
    again = [[_step(4, 0.25, 2.25)], [_step(4, 0.75, 2.75)]]
    resumed.log_ranked_rollout(records, again, [{"wall_seconds": 0.25}, {"wall_seconds": 0.75}], 1, resumed=True)
    summary = resumed.finish()
    assert summary["rank_seconds_per_rollout"] == [[1.5, 1.0], [0.25, 1.25]]
    assert [rank["wall_seconds"] for rank in summary["ranks"]] == [1.75, 2.25]


def test_a_ranked_rollout_whose_wandb_logging_a_stop_cut_is_closed_from_the_files(tmp_path, monkeypatch):
    """Several processes: rank 0 wrote a rollout's every group, then a stop came while W&B logged its steps. The stopped
    run's tracker closes it from the files (as `rollout.cli.ranked` calls it): each step once, its metrics once."""
    from wandb.sdk.wandb_run import Run

    from rollout.cli.tracking import RunTracker

    monkeypatch.delenv("WANDB_DIR", raising=False)
    tracker = RunTracker(tmp_path / "run", {"k": 1}, wandb_mode="offline")
    rank_steps = [[_step(4, 0.25, 0.25), _step(4, 0.25, 0.5)], [_step(4, 0.5, 0.5)]]
    summaries = [{"wall_seconds": 0.5, "total": {"tokens_per_s": 16.0, "acceptance_rate": 0.0}}]
    summaries.append({"wall_seconds": 0.5, "total": {"tokens_per_s": 8.0, "acceptance_rate": 0.0}})
    records = [_record(p, s, float(p), 4) for p in range(2) for s in range(2)]
    log, calls = Run.log, []

    def stopping_log(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second step row
            raise KeyboardInterrupt
        return log(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Run, "log", stopping_log)
        with pytest.raises(KeyboardInterrupt):
            tracker.log_ranked_rollout(records, rank_steps, summaries, 0)
    tracker.close_if_whole(0, 3)  # a group short: not whole, nothing closed
    assert tracker.wandb_run is not None and 0 not in tracker._wandb_closed
    tracker.close_if_whole(0, 2)
    summary = tracker.finish(complete=False, reason="interrupted")
    assert summary["num_rollouts"] == 1
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history, _, _ = wandb_run_contents(run)
    assert [row["step/index"] for row in history if "step/index" in row] == [0, 1, 2]
    (closed,) = [row for row in history if "rollout/index" in row]
    assert closed["rollout/tokens"] == 12 and closed["rollout/reward_mean"] == pytest.approx(0.5)
    # a stop while rank 0 writes the ranks' steps, before their samples: the rollout is cut short (a resume redoes it),
    # not closed with some ranks' steps and times missing
    cut = RunTracker(tmp_path / "cut", {"k": 1}, wandb_mode="disabled", plot=False)
    log_step = RunTracker.log_step

    def stopping_log_step(self, step, rollout=None):
        if step.get("rank") == 1:
            raise KeyboardInterrupt
        log_step(self, step, rollout)

    with monkeypatch.context() as patch:
        patch.setattr(RunTracker, "log_step", stopping_log_step)
        with pytest.raises(KeyboardInterrupt):
            cut.log_ranked_rollout(records, rank_steps, summaries, 0)
    cut.close_if_whole(0, 2)
    assert cut.finish(complete=False, reason="interrupted")["num_rollouts"] == 0
    assert (tmp_path / "cut" / "rollouts.jsonl").read_text() == ""


def test_a_run_without_a_reward_says_so_rather_than_a_mean_of_zero(tmp_path, capsys, monkeypatch):
    """Every reward non-finite, recorded as null: summary.json's reward_mean is null, not 0.0 (which reads as every
    answer wrong), and the printed line and report show '-'."""
    (tmp_path / "null_rewards.py").write_text(
        "def all_nan(completions, **kw):\n    return [float('nan')] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    argv = ["run", QUICKSTART, *SMALL, "rewards=[{name: 'null_rewards:all_nan'}]", "logging.wandb_mode=disabled"]
    assert main([*argv, "rollout.non_finite_rewards_as_null=true", f"output_dir={out}"]) == 0
    assert "samples, reward mean -, " in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_mean"] is None and summary["num_null_rewards"] == 6
    assert main(["report", str(out)]) == 0
    assert "reward mean -\n" in capsys.readouterr().out


def test_a_bad_recipe_is_reported_before_torch_is_imported(tmp_path):
    code = (
        "import sys, time; start = time.perf_counter(); from rollout.cli.main import main; "
        "rc = main(['run', sys.argv[1], 'sampling.n=0']); "
        "print(rc, 'torch' in sys.modules, round(time.perf_counter() - start, 2))"
    )
    result = subprocess.run([sys.executable, "-c", code, QUICKSTART], capture_output=True, text=True, cwd=ROOT)
    rc, torch_imported, seconds = result.stdout.split()
    assert (rc, torch_imported) == ("2", "False"), result.stderr
    assert float(seconds) < 2.0
    assert result.stderr.strip() == (
        "rollout run: error: sampling: n (0) must be an integer >= 1: the number of completions per prompt"
    )


WARNING_REWARDS = """
import warnings

import transformers


def warns(completions, **kw):
    warnings.warn("an old keyword is deprecated", FutureWarning)
    transformers.utils.logging.get_logger("transformers.some_model").warning("a transformers notice")
    return [1.0] * len(completions)


def warns_then_fails(completions, **kw):
    warnings.warn("an old keyword is deprecated", FutureWarning)
    raise ValueError("this reward cannot score")
"""


LOG = "warnings.log"


def _cli(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """`rollout` in its own process (as a user runs it: Python's warnings reach stderr unless routed)."""
    code = "import sys; from rollout.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.slow
def test_library_warnings_go_to_the_run_log_never_into_the_one_line_error(tmp_path):
    (tmp_path / "warning_rewards.py").write_text(WARNING_REWARDS)
    small = [*SMALL, "spec.method=null", "logging.wandb_mode=disabled", "logging.progress=false"]
    done = _cli(tmp_path, "run", QUICKSTART, *small, "rewards=[{name: 'warning_rewards:warns'}]", "output_dir=a")
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "a" / "warnings.log").read_text()
    assert "FutureWarning: an old keyword is deprecated" in log and "a transformers notice" in log
    # the run says where its warnings went, in one line of its own
    count = log.count(" WARNING: ")  # one Python warning (once per place in the code), one notice per reward call
    assert done.stderr.strip().splitlines() == [f"rollout run: {count} library warnings in {pathlib.Path('a', LOG)}"]
    failed = _cli(
        tmp_path, "run", QUICKSTART, *small, "rewards=[{name: 'warning_rewards:warns_then_fails'}]", "output_dir=b"
    )
    assert failed.returncode == 2
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollout run: error:") and "cannot score" in lines[0], lines
    assert "FutureWarning: an old keyword is deprecated" in (tmp_path / "b" / "warnings.log").read_text()


def test_files_written_whole_take_the_umask_as_the_streamed_ones_do(tmp_path):
    """summary.json, config.yaml and the plots were written through mkstemp's file, 0600 whatever the umask (other
    users could not read a shared run's summary), where rollouts.jsonl took 0644 under umask 022."""
    import os

    from rollout.cli.files import append_lines, write_atomic

    previous = os.umask(0o022)
    try:
        write_atomic(tmp_path / "summary.json", "{}\n")
        append_lines(tmp_path / "rollouts.jsonl", "{}\n")
    finally:
        os.umask(previous)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("summary.json", "rollouts.jsonl")}
    assert modes == {"summary.json": 0o644, "rollouts.jsonl": 0o644}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.jsonl", "summary.json"]  # no temporary file left
