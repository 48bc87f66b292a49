"""Multi-step runs from recipes: `rollout train` (GRPO through TRL with this library's rollouts) and `rollout run`
with several rollouts; the plain-PyTorch GRPO loop."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest
import transformers

from rollout.cli.main import main
from rollout.cli.progress import Progress

ROOT = pathlib.Path(__file__).resolve().parent.parent
GRPO = str(ROOT / "recipes" / "grpo_quickstart.yaml")
QUICKSTART_SUFFIX = str(ROOT / "recipes" / "quickstart_suffix.yaml")


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_train_writes_per_step_metrics_summary_plot_and_a_wandb_run(tmp_path, offline_wandb, capsys):
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from test_cli import wandb_records

    small = ["train.steps=3", "train.prompts_per_step=2", "sampling.n=2", "sampling.max_new_tokens=24"]
    assert main(["train", GRPO, *small, "data.num_prompts=7", "train.beta=0.05", f"output_dir={tmp_path}"]) == 0
    printed = capsys.readouterr().out
    assert (
        "warning: 7 prompts make 3 steps of train.prompts_per_step 2 an epoch and 1 is left out of each" in printed
    ), printed
    from rollout.cli.recipe import TrainRecipe
    from rollout.cli.train import _left_out_warning

    assert _left_out_warning(9, TrainRecipe(steps=3, prompts_per_step=2)) is None  # it ends before its first epoch
    assert _left_out_warning(8, TrainRecipe(steps=None, epochs=2, prompts_per_step=2)) is None  # whole steps
    assert printed.count("\nstep ") + printed.startswith("step ") == 3 and "reward first 10%" in printed
    steps = read_jsonl(tmp_path / "train.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert 0.0 <= s["reward"] <= 1.0 and s["step_time"] > 0
        assert 0.0 < s["rollout/seconds"] < s["step_time"] and s["rollout/share"] == pytest.approx(
            s["rollout/seconds"] / s["step_time"]
        )
        assert s["rollout/tokens_per_s"] > 0 and s["rollout/bulk/tokens_per_s"] > 0
        assert "rollout/mean_k" in s and 0.0 <= s["rollout/acceptance_rate"] <= 1.0
        # TRL's own metrics beside them: the KL term's (train.beta > 0; it moves in the resume test below), the
        # policy's entropy, the clipping
        assert s["kl"] >= 0.0 and s["entropy"] > 0.0 and 0.0 <= s["frac_reward_zero_std"] <= 1.0
        assert 0.0 <= s["clip_ratio/region_mean"] <= 1.0 and 0.0 <= s["completions/clipped_ratio"] <= 1.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_steps"] == 3
    assert summary["reward_first_10pct"] == pytest.approx(steps[0]["reward"])
    assert summary["reward_last_10pct"] == pytest.approx(steps[-1]["reward"])
    assert summary["rollout_share"] == pytest.approx(
        sum(s["rollout/seconds"] for s in steps) / sum(s["step_time"] for s in steps)
    )
    assert list(summary["rollout_tokens_per_s_per_epoch"]) == ["1"]
    assert (tmp_path / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "train:" in (tmp_path / "config.yaml").read_text()
    # `rollout report` on the folder prints the training's summary lines again and writes its plot again
    lines = printed.splitlines()
    ended = lines[[i for i, line in enumerate(lines) if line.startswith("3 steps in ")][0] : -1]  # (not 'output:')
    (tmp_path / "train.png").unlink()
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [*ended, f"plot: {tmp_path / 'train.png'}"]
    assert (tmp_path / "train.png").is_file()
    # the trainer's own W&B run holds the rollout metrics of every step
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    logged = []
    for record in wandb_records(run_files[0]):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "train/rollout/tokens_per_s" in row:
                logged.append(row)
    assert [row["train/rollout/tokens_per_s"] for row in logged] == pytest.approx(
        [s["rollout/tokens_per_s"] for s in steps]
    )
    assert [row["train/reward"] for row in logged] == pytest.approx([s["reward"] for s in steps])


def failing_after_two_calls(completions, **kwargs):
    """A reward for the test below: fine twice, then raises."""
    failing_after_two_calls.calls = getattr(failing_after_two_calls, "calls", 0) + 1
    if failing_after_two_calls.calls > 2:
        raise RuntimeError("the reward server went away")
    return [0.0] * len(completions)


def test_a_failing_train_run_keeps_its_steps_and_says_it_is_incomplete(tmp_path, offline_wandb, capsys):
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from test_cli import wandb_records

    failing_after_two_calls.calls = 0
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rewards:\n  - name: test_train:failing_after_two_calls\n")
    args = ["train.steps=4", "train.prompts_per_step=2", "sampling.n=2", "sampling.max_new_tokens=16"]
    args += ["spec.method=null", f"output_dir={tmp_path / 'out'}"]
    code = main(["train", str(recipe), *args])
    assert code == 2 and "the reward server went away" in capsys.readouterr().err
    steps = read_jsonl(tmp_path / "out" / "train.jsonl")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [s["step"] for s in steps] == [1, 2] and summary["num_steps"] == 2
    assert summary["complete"] is False and "the reward server went away" in summary["incomplete_reason"]
    # and its W&B run says it failed, as `rollout run`'s does
    (run_file,) = (tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in wandb_records(run_file) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]


def test_a_stop_while_the_trainer_is_built_leaves_an_incomplete_summary(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the folder is written and before training begins (while TRL builds its trainer, or W&B starts):
    the folder held config.yaml and an empty train.jsonl, no summary, where outputs.md has one marked incomplete."""
    pytest.importorskip("trl", reason="the trl extra is not installed")
    import rollout.cli.train as train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # what the SIGINT handler raises there

    monkeypatch.setattr(train, "start_wandb_run", interrupted)
    args = [
        "train.steps=2",
        "train.prompts_per_step=2",
        "sampling.n=2",
        "sampling.max_new_tokens=8",
        "data.num_prompts=4",
    ]
    assert main(["train", GRPO, *args, "logging.wandb_mode=disabled", f"output_dir={tmp_path / 'out'}"]) == 130
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["complete"] is False and summary["incomplete_reason"] == "interrupted (SIGINT)"
    assert summary["num_steps"] == 0


def test_trls_log_warnings_go_to_the_runs_warnings_log(tmp_path, capsys):
    """TRL warns through Python's logging (a null reward's warning, every step): with no handler of its own, Python's
    last resort printed it on stderr, beside the command's one line. It is held with the other library warnings."""
    import logging

    from rollout.cli.library_log import attach_library_log, capture_library_warnings

    with capture_library_warnings() as log:
        attach_library_log(tmp_path)
        logging.getLogger("trl.trainer.grpo_trainer").warning("All reward functions returned None")
    assert capsys.readouterr().err == ""
    assert "All reward functions returned None" in (tmp_path / "warnings.log").read_text()
    assert logging.getLogger("trl").propagate and log.messages


def test_a_step_whose_rewards_were_all_null_is_logged_and_summarised(tmp_path, capsys):
    # with rollout.non_finite_rewards_as_null, TRL logs reward None for a step whose every completion was unscorable
    from rollout.cli.train import StepLog, summarize_training

    log = StepLog(tmp_path / "train.jsonl")
    state = types.SimpleNamespace(global_step=1, max_steps=2)
    timing = {"loss": 0.1, "step_time": 0.3, "rollout/seconds": 0.2}
    log.on_log(None, state, None, logs={**timing, "reward": None, "reward_std": None, "epoch": 0.5})
    state.global_step = 2
    log.on_log(None, state, None, logs={**timing, "reward": 0.5, "reward_std": 0.1, "epoch": 1.0})
    assert "step 1/2 | reward nan |" in capsys.readouterr().out
    assert [s["reward"] for s in read_jsonl(tmp_path / "train.jsonl")] == [None, 0.5]
    summary = summarize_training(log.steps, 1.0)
    assert summary["reward_first_10pct"] == summary["reward_last_10pct"] == 0.5 and summary["num_steps"] == 2


def test_run_makes_several_rollouts_on_one_generator(tmp_path, offline_wandb, capsys, monkeypatch):
    counted = []  # the tokens the progress line counted, at each line it ended

    class Recording(Progress):
        def __init__(self, enabled=None):
            super().__init__(stream=io.StringIO(), enabled=True, min_interval=0.0)

        def close(self):
            counted.append(self.tokens)
            super().close()

    monkeypatch.setattr("rollout.cli.runs.Progress", Recording)
    args = ["rollout.num_rollouts=3", "rollout.prompts_per_rollout=2", "data.num_prompts=4", "sampling.n=2"]
    args += ["sampling.max_new_tokens=32", "logging.wandb_mode=disabled", f"output_dir={tmp_path}"]
    assert main(["run", QUICKSTART_SUFFIX, *args]) == 0
    printed = capsys.readouterr().out
    assert all(f"rollout {i}: " in printed for i in range(3))
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")  # groups in the order they finished, rollout by rollout
    steps = read_jsonl(tmp_path / "steps.jsonl")
    assert [r["rollout"] for r in rollouts] == [0] * 4 + [1] * 4 + [2] * 4
    rollouts.sort(key=lambda r: (r["rollout"], r["prompt_index"], r["sample_index"]))
    assert {s["rollout"] for s in steps} == {0, 1, 2}
    # prompts are taken in order and cycled: rollout 2 repeats rollout 0's prompts, with its own seed
    prompts = [r["prompt"] for r in rollouts]
    assert prompts[8:] == prompts[:4] and prompts[4:8] != prompts[:4]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_rollouts"] == 3 and summary["num_samples"] == 12
    # the progress line is each rollout's own (its tokens over its own clock), not the run's so far
    assert counted[:3] == [sum(s["num_emitted"] for s in steps if s["rollout"] == i) for i in range(3)]


def test_bad_train_settings_are_one_line(tmp_path, capsys):
    assert main(["train", GRPO, "train.steps=0", f"output_dir={tmp_path}"]) == 2
    assert "train.steps (0) must be >= 1" in capsys.readouterr().err
    assert main(["train", GRPO, "train.warmup_steps=1.5", f"output_dir={tmp_path}"]) == 2
    assert "train.warmup_steps (1.5) must be a whole number of steps" in capsys.readouterr().err
    assert main(["run", GRPO, "rollout.num_rollouts=0", f"output_dir={tmp_path}"]) == 2
    assert "rollout.num_rollouts (0) must be >= 1" in capsys.readouterr().err
    assert main(["train", GRPO, "resume=true", "train.save_steps=0", f"output_dir={tmp_path}"]) == 2
    assert "with train.save_steps 0 it keeps none" in capsys.readouterr().err
    assert main(["train", GRPO, "train.save_steps=-1", f"output_dir={tmp_path}"]) == 2
    assert "train.save_steps (-1) must be >= 0" in capsys.readouterr().err


def digit_share(completions, problem, **kwargs):
    """A reward for the test below that moves with the policy and tells the prompts apart: the share of digits in
    the completion, times 1 to 5 by the length of the problem."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [(1 + len(p) % 5) * sum(ch.isdigit() for ch in t) / max(len(t), 1) for t, p in zip(texts, problem)]


def test_a_stopped_training_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path, monkeypatch, capsys):
    """With train.save_steps, Ctrl-C at step 4 keeps the checkpoint of step 3 and says so; resume=true then makes
    steps 4 and 5 exactly as the uninterrupted training did (rewards, losses and gradient norms: the model,
    optimiser, scheduler and RNG restored, the rollouts seeded by their step, and the second epoch's prompts in the
    uninterrupted order). Without a checkpoint it is refused."""
    pytest.importorskip("trl", reason="the trl extra is not installed")
    import rollout.cli.train as train

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rewards:\n  - name: test_train:digit_share\n")
    # 3 steps an epoch: the checkpoint of step 3 ends the first, and the resumed steps are the second epoch's
    args = ["train.steps=5", "train.save_steps=3", "train.prompts_per_step=2", "train.learning_rate=3e-3"]
    args += ["sampling.n=4", "sampling.max_new_tokens=24", "data.num_prompts=6", "logging.wandb_mode=disabled"]
    args += ["logging.plot=false", "spec.method=suffix"]  # (exact: the same samples as without drafts)
    args += ["train.beta=0.05"]  # a reference model restored too, and its KL copied to train.jsonl
    written = []  # per checkpoint the trainer saves: was the history in it when its state made it complete?
    save_state = transformers.TrainerState.save_to_json

    def save_to_json(self, json_path):
        folder = pathlib.Path(json_path).parent
        if folder.name.startswith("checkpoint-"):
            written.append((folder.name, (folder / "draft_history-rank0.npz").is_file()))
        save_state(self, json_path)

    with monkeypatch.context() as patch:
        patch.setattr(transformers.TrainerState, "save_to_json", save_to_json)
        assert main(["train", str(recipe), *args, f"output_dir={tmp_path / 'whole'}"]) == 0
    # a stop between the two would leave a complete checkpoint that resumes drafting from nothing
    assert written == [("checkpoint-3", True), ("checkpoint-5", True)]
    whole = read_jsonl(tmp_path / "whole" / "train.jsonl")
    capsys.readouterr()
    assert [p.name for p in (tmp_path / "whole" / "trainer").glob("checkpoint-*")] == ["checkpoint-5"]  # the last

    logged = train.StepLog.on_log

    def stopped_at(step: int):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged(self, args, state, control, logs=logs, **kwargs)
            if logs and "loss" in logs and state.global_step == step:
                raise KeyboardInterrupt  # as Ctrl-C's handler raises it

        return on_log

    out = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        patch.setattr(train.StepLog, "on_log", stopped_at(4))
        assert main(["train", str(recipe), *args, f"output_dir={out}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rollout train: interrupted: the checkpoint of step 3 is kept; resume=true continues from it"], err
    assert [s["step"] for s in read_jsonl(out / "train.jsonl")] == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["complete"] is False
    assert main(["train", str(recipe), *args, f"output_dir={out}", "resume=true"]) == 0
    capsys.readouterr()
    resumed = read_jsonl(out / "train.jsonl")
    assert [s["step"] for s in resumed] == [1, 2, 3, 4, 5]  # step 4 made again, once
    for key in ("reward", "loss", "grad_norm", "kl"):
        assert [s[key] for s in resumed] == [s[key] for s in whole], key
    # and the resumed steps draft from the history the checkpoint kept (they started from none: 8 responses, not 32)
    assert [s["rollout/history_responses"] for s in resumed] == [s["rollout/history_responses"] for s in whole]
    assert (out / "trainer" / "checkpoint-5" / "draft_history-rank0.npz").is_file()  # (the last one kept)
    # a real check: the steps differ, and the model had moved before the checkpoint (its weights and the
    # optimiser's moments are what the resume restores)
    assert len({s["reward"] for s in whole}) > 1 and all(s["grad_norm"] > 0 for s in whole[:3]), whole
    assert whole[0]["kl"] == 0.0 and all(s["kl"] > 0 for s in whole[1:]), whole  # away from the reference model
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is True and summary["num_steps"] == 5
    # stopped before its first checkpoint: nothing to resume from, and the line says what runs it again
    early = tmp_path / "early"
    with monkeypatch.context() as patch:
        patch.setattr(train.StepLog, "on_log", stopped_at(1))
        assert main(["train", str(recipe), *args, f"output_dir={early}"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "rollout train: interrupted: no checkpoint was kept yet, so nothing resumes; overwrite=true runs it again"
    ]
    assert main(["train", str(recipe), *args, f"output_dir={early}", "resume=true"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    # a finished training has nothing left to run (transformers went on into the unfinished epoch, past train.steps)
    assert main(["train", str(recipe), *args, f"output_dir={tmp_path / 'whole'}", "resume=true"]) == 2
    assert "finished: its last checkpoint is of step 5 of 5" in capsys.readouterr().err
    # stopped after its last checkpoint was saved (in the final save_model, say): the line promises no resume
    late = tmp_path / "late"
    with monkeypatch.context() as patch:

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == state.max_steps:
                raise KeyboardInterrupt

        patch.setattr(train.StepLog, "on_save", on_save, raising=False)
        assert main(["train", str(recipe), *args, f"output_dir={late}"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "rollout train: interrupted"
    assert (late / "trainer" / "checkpoint-5" / "trainer_state.json").is_file()


def test_plain_pytorch_grpo_raises_the_reward_of_the_prompts_it_trains_on():
    from rollout.engine.sampling import SamplingParams
    from rollout.grpo import train
    from rollout.loop import Rollout
    from rollout.models.zoo import load_model
    from rollout.tasks import arithmetic_dataset

    model, tokenizer = load_model("tiny-target")
    rows = arithmetic_dataset(64, split="train", seed=3)
    rows = rows.select(
        [i for i, steps in enumerate(rows["num_steps"]) if 3 <= steps <= 6][:4]
    )  # neither sure nor hopeless

    def reward_on(rows) -> float:  # 3 seeds x 16 samples of each prompt
        rollout = Rollout(model, tokenizer, sampling=SamplingParams(n=16, max_new_tokens=160), max_batch_size=64)
        return sum(rollout(rows, seed=s).summary["reward_mean"] for s in range(3)) / 3

    before = reward_on(rows)
    records = train(model, tokenizer, rows, steps=8, prompts_per_step=4, n=8, max_new_tokens=160, log=lambda _: None)
    after = reward_on(rows)
    assert len(records) == 8 and all(r["rollout_tokens_per_s"] > 0 for r in records)
    assert after > before + 0.1, (before, after)
    assert all(r["logprob_drift"] < 1e-4 for r in records)  # the behaviour log-probs are the policy's own


def test_a_raising_reward_under_train_names_the_reward_its_exception_and_a_prompt(tmp_path, monkeypatch):
    """TRL scores a whole batch through each reward function: one that raises is named with its exception type and
    the batch's first prompt (the last message of a conversational one)."""
    from rollout.cli.train import _trl_reward
    from rollout.rewards import RewardError, build_rewards

    (tmp_path / "bad_rewards.py").write_text("def boom(completions, **kwargs):\n    raise KeyError('oops')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (term,) = build_rewards([("bad_rewards:boom", 1.0)])
    reward = _trl_reward(term, as_null=False)
    with pytest.raises(RewardError, match=r"a batch from prompt 'Q: 2 \+ 2\?': reward 'bad_rewards:boom' raised KeyE"):
        reward(["4"], prompts=["Q: 2 + 2?"], completion_ids=[[1]])
    with pytest.raises(RewardError, match=r"a batch from prompt 'Q: 3\?': reward"):
        reward([[{"role": "assistant", "content": "4"}]], prompts=[[{"role": "user", "content": "Q: 3?"}]])


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_grpo_loss_reads_the_rollouts_own_logprobs_back_greedy_included(temperature):
    """Right after sampling, the policy's log-probs are the behaviour log-probs the rollout returned: the temperature
    applied as when sampling, and greedy's the plain log-softmax (dividing by a tiny temperature drifted 0.05)."""
    from rollout.engine.sampling import SamplingParams
    from rollout.grpo import grpo_loss
    from rollout.loop import Rollout
    from rollout.models.zoo import load_model
    from rollout.tasks import arithmetic_dataset

    model, tokenizer = load_model("tiny-target")
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=30)
    batch = Rollout(model, tokenizer, sampling=params, max_batch_size=4)(arithmetic_dataset(2, seed=0), seed=0)
    _, info = grpo_loss(model, batch, temperature=temperature)
    assert info["logprob_drift"] < 1e-4


def test_an_offline_wandb_run_prints_nothing_between_the_steps(tmp_path):
    """TRL's model card asks the W&B run for its URL at every checkpoint; an offline run answers with a warning line
    on the terminal, between the step lines. The command quiets W&B's own lines (its process is the command's: run as
    a user runs it, in a process of its own, where W&B reads that setting when it first starts)."""
    pytest.importorskip("trl", reason="the trl extra is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_SILENT", "WANDB_DIR")}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1")
    small = ["train.steps=2", "train.save_steps=1", "train.prompts_per_step=2", "sampling.n=2"]
    small += ["sampling.max_new_tokens=8", "data.num_prompts=4", "logging.plot=false", "threads=1"]
    command = [sys.executable, "-m", "rollout", "train", GRPO, *small, f"output_dir={tmp_path}"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = (result.stdout + result.stderr).splitlines()
    assert not [line for line in lines if line.startswith("wandb:") or "URL not available" in line], lines


def test_a_checkpoint_resumes_only_on_the_number_of_processes_that_made_it(tmp_path):
    """Each process seeds its rollouts by its rank: a two-process checkpoint resumed on one process ran steps that
    were neither training's, without a word. The checkpoint's RNG states (one per process) say how many made it."""
    from omegaconf import OmegaConf

    from rollout.cli.recipe import load_recipe, recipe_dict
    from rollout.cli.train import _resume_point

    recipe = load_recipe(GRPO, ["train.save_steps=1", f"output_dir={tmp_path}", "resume=true"])
    OmegaConf.save(OmegaConf.create(recipe_dict(recipe)), tmp_path / "config.yaml")
    checkpoint = tmp_path / "trainer" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"max_steps": 3}))
    for rank in (0, 1):
        (checkpoint / f"rng_state_{rank}.pth").write_bytes(b"")
    (tmp_path / "train.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match=r"checkpoint-1 was made by 2 process\(es\) and this training runs on 1: "):
        _resume_point(tmp_path, recipe, 1)
    assert _resume_point(tmp_path, recipe, 2)[0] == str(checkpoint)
    for rank in (0, 1):
        (checkpoint / f"rng_state_{rank}.pth").unlink()
    (checkpoint / "rng_state.pth").write_bytes(b"")
    with pytest.raises(ValueError, match=r"made by 1 process\(es\) and this training runs on 2: .* resume on one proc"):
        _resume_point(tmp_path, recipe, 2)
