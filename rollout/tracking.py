"""Recording rollouts: the output folder (JSONL, summary, resolved config, plot) and a Weights & Biases run.

Output folder contract (external tools read these names):

- `config.yaml`: the resolved config of the run.
- `rollouts.jsonl`: one line per sample: `prompt_index`, `prompt`, `completion`, `completion_ids`, `logprobs`,
  `finish_reason`, `reward` (and `rollout`, `sample_index`, `truncated`, `reward_<term>` per reward term).
- `steps.jsonl`: one line per generator step: the step-trace fields (`phase` = prefill / bulk / tail,
  `batch_size`, `num_draft_tokens`, `num_drafted`, `num_accepted`, `num_emitted`, `seconds`, ...) plus `elapsed`
  (seconds since the tracker started, across rollouts) and `rollout` (which call of the rollout loop).
- `summary.json`: `phases` = {prefill|bulk|tail: {seconds, tokens, tokens_per_s, mean_batch_size, mean_k,
  acceptance_rate, mean_accepted_length, num_steps}}, `total` with the same keys, `reward_mean` (see
  `rollout.phases.summarize`), plus `reward_terms`, `wall_seconds`, `num_samples`, `num_rollouts`.
- `rollout.png`: batch size, K and tokens/s over time with the phases shaded.
- `wandb/`: the W&B run folder (unless `WANDB_DIR` points elsewhere or W&B is disabled).
"""

from __future__ import annotations

import json
import os
import pathlib

from rollout.batch import RolloutBatch
from rollout.phases import PHASES, SUMMARY_KEYS, summarize
from rollout.plots import plot_steps

WANDB_MODES = ("offline", "online", "disabled")
PLOT_NAME = "rollout.png"


class RunTracker:
    """Writes every rollout of a run to `output_dir` and to W&B.

    Args:
        output_dir: the folder to write (created).
        config: the resolved config, written to config.yaml and to the W&B run.
        wandb_mode: "offline" (default: nothing leaves the machine), "online" or "disabled". The environment's
            `WANDB_MODE` wins when set; `WANDB_DIR` decides where the W&B run folder goes (default: output_dir).
        project: W&B project. run_name: W&B run name (None: W&B picks one).
        num_table_rows: samples per rollout logged to the W&B table of completions and rewards.
        plot: write the PNG plot at `finish`.
    """

    def __init__(
        self,
        output_dir: str | pathlib.Path,
        config: dict | None = None,
        wandb_mode: str = "offline",
        project: str = "rollout",
        run_name: str | None = None,
        num_table_rows: int = 32,
        plot: bool = True,
    ):
        self.output_dir = pathlib.Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.config = config or {}
        self.num_table_rows = num_table_rows
        self.plot = plot
        for name in ("rollouts.jsonl", "steps.jsonl"):  # a rerun into the same folder starts these afresh
            (self.output_dir / name).write_text("")
        if config is not None:
            from omegaconf import OmegaConf

            (self.output_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
        self.steps: list[dict] = []
        self.rewards: list[float] = []
        self.reward_terms: dict[str, list[float]] = {}
        self.num_rollouts = 0
        self.wall_seconds = 0.0
        self.wandb_run = self._start_wandb(os.environ.get("WANDB_MODE") or wandb_mode, project, run_name)

    def _start_wandb(self, mode: str, project: str, run_name: str | None):
        if mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb_mode / WANDB_MODE ({mode!r}) must be one of {', '.join(WANDB_MODES)}")
        if mode == "disabled":
            return None
        import wandb

        wandb_dir = os.environ.get("WANDB_DIR") or str(self.output_dir)
        pathlib.Path(wandb_dir).mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            project=project,
            name=run_name,
            dir=wandb_dir,
            mode=mode,
            config=self.config,
            settings=wandb.Settings(console="off", silent=True),
        )
        run.define_metric("step/index")
        run.define_metric("step/*", step_metric="step/index")
        run.define_metric("rollout/index")
        run.define_metric("rollout/*", step_metric="rollout/index")
        return run

    @property
    def wandb_dir(self) -> pathlib.Path | None:
        """The W&B run folder (offline-run-... / run-...), or None without W&B."""
        return pathlib.Path(self.wandb_run.settings.sync_dir) if self.wandb_run is not None else None

    def log_rollout(self, batch: RolloutBatch) -> None:
        """Append one rollout: its samples, its steps (elapsed shifted to run time) and its W&B metrics."""
        offset = self.wall_seconds
        first_index = len(self.steps)
        steps = [{**step, "elapsed": step["elapsed"] + offset, "rollout": self.num_rollouts} for step in batch.steps]
        with open(self.output_dir / "steps.jsonl", "a") as f:
            for step in steps:
                f.write(json.dumps(step) + "\n")
        with open(self.output_dir / "rollouts.jsonl", "a") as f:
            for record in batch.records():
                f.write(json.dumps({"rollout": self.num_rollouts, **record}) + "\n")
        self.steps.extend(steps)
        self.rewards.extend(batch.reward or ())
        for name, values in batch.reward_terms.items():
            self.reward_terms.setdefault(name, []).extend(values)
        self.wall_seconds = offset + batch.summary.get("wall_seconds", 0.0)
        if self.wandb_run is not None:
            self._log_wandb(batch, steps, first_index)
        self.num_rollouts += 1

    def _log_wandb(self, batch: RolloutBatch, steps: list[dict], first_index: int) -> None:
        import wandb

        for index, step in enumerate(steps, start=first_index):
            metrics = _numeric_fields(step, "step/")
            metrics["step/index"] = index
            metrics["step/phase_id"] = PHASES.index(step["phase"])  # 0 prefill, 1 bulk, 2 tail: charts need numbers
            metrics["step/tokens_per_s"] = step["num_emitted"] / step["seconds"] if step["seconds"] > 0 else 0.0
            self.wandb_run.log(metrics)
        total = batch.summary["total"]
        metrics = {"rollout/index": self.num_rollouts}
        if batch.summary.get("reward_mean") is not None:
            metrics["rollout/reward_mean"] = batch.summary["reward_mean"]
        metrics.update({f"rollout/{key}": total[key] for key in SUMMARY_KEYS})
        metrics.update({f"rollout/{p}_tokens_per_s": batch.summary["phases"][p]["tokens_per_s"] for p in PHASES})
        if self.num_table_rows > 0:
            columns = ["rollout", "prompt_index", "sample_index", "prompt", "completion", "finish_reason", "reward"]
            table = wandb.Table(columns=columns)
            for row in batch.records()[: self.num_table_rows]:
                table.add_data(self.num_rollouts, *(row[c] for c in columns[1:]))
            metrics["samples"] = table
        self.wandb_run.log(metrics)

    def abort(self) -> None:
        """Close the W&B run as failed (the rollout raised): no run is left open."""
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1)
            self.wandb_run = None

    def summary(self) -> dict:
        """The run's summary.json: per-phase and total stats over every step so far, and reward means."""
        summary = summarize(self.steps)
        summary["reward_mean"] = sum(self.rewards) / len(self.rewards) if self.rewards else 0.0
        summary["reward_terms"] = {name: sum(v) / len(v) for name, v in self.reward_terms.items()}
        summary["wall_seconds"] = self.wall_seconds
        summary["num_samples"] = len(self.rewards)
        summary["num_rollouts"] = self.num_rollouts
        return summary

    def finish(self) -> dict:
        """Write summary.json and the plot, close the W&B run; returns the summary."""
        summary = self.summary()
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_path = plot_steps(self.steps, self.output_dir / PLOT_NAME) if self.plot and self.steps else None
        if self.wandb_run is not None:
            for phase in PHASES:
                for key in SUMMARY_KEYS:
                    self.wandb_run.summary[f"phase/{phase}/{key}"] = summary["phases"][phase][key]
            for key in SUMMARY_KEYS:
                self.wandb_run.summary[f"total/{key}"] = summary["total"][key]
            self.wandb_run.summary["reward_mean"] = summary["reward_mean"]
            if plot_path is not None:
                import wandb

                self.wandb_run.log({"plot": wandb.Image(str(plot_path))})
            self.wandb_run.finish()
        return summary


def _numeric_fields(record: dict, prefix: str) -> dict:
    """Every number in a step record, nested dicts flattened (`rows_by_method/ngram`): trace fields added to the
    generator later reach W&B without a change here. Lists and None are left to steps.jsonl."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_numeric_fields(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):
            out[f"{prefix}{key}"] = value
    return out
