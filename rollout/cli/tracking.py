"""Recording rollouts: the output folder (JSONL, summary, resolved config, plot) and a Weights & Biases run.

Output folder contract (external tools read these names):

- `config.yaml`: the resolved config of the run.
- `rollouts.jsonl`: one line per sample, appended group by group as groups finish: `prompt_index`, `prompt`,
  `completion`, `completion_ids`, `logprobs`, `finish_reason`, `reward` (and `rollout`, `sample_index`,
  `truncated`, `reward_<term>` per reward term).
- `steps.jsonl`: one line per generator step: the step-trace fields (`kind` = prefill / decode,
  `phase` = prefill / bulk / tail, `batch_size`, `num_draft_tokens`, `num_drafted`, `num_accepted`, `num_emitted`,
  `seconds`, ...) plus `elapsed` (seconds into the rollout plus the wall time of the rollouts before it: the host
  work between rollouts is not counted) and `rollout` (which call of the rollout loop). A stopped rollout's last
  steps also count, in `num_discarded`, the tokens of the rows and groups the stop cut off (not kept; a resume redoes
  them).
- `summary.json`: `phases` = {prefill|bulk|tail: {seconds, tokens, tokens_per_s, mean_batch_size, mean_k,
  acceptance_rate, mean_accepted_length, num_steps}}, `total` with the same keys, `reward_mean` (see
  `rollout.phases.summarize`), plus `reward_terms`, `wall_seconds`, `num_samples`, `num_rollouts`, and
  `complete` (false when an error or a signal stopped the run, with `incomplete_reason`; `wall_seconds` then runs to
  its last step).
- `rollout.png`: batch size, K and tokens/s over time with the phases shaded.
- `wandb/`: the W&B run folder (unless `WANDB_DIR` points elsewhere or W&B is disabled).

A run on several processes (`rollout.cli.ranked`) writes the same files from rank 0, a rollout at a time:
`rollouts.jsonl` in prompt order, steps with their `rank`, and in `summary.json` the totals over the ranks
(`rollout.phases.summarize_ranks`) with each rank's own table under `ranks`, `straggler_ratio` and
`history_sharing`; `ranks/rank-R/` holds what each rank finished of the rollout in progress.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys

from rollout.batch import RolloutBatch
from rollout.cli.files import (
    append_lines,
    check_resumable,
    check_unfinished,
    prepare_output_dir,
    read_jsonl,
    read_summary,
    write_atomic,
    write_jsonl,
)
from rollout.cli.library_log import attach_library_log
from rollout.cli.plots import plot_steps
from rollout.cli.recipe import WANDB_MODES
from rollout.distributed import signal_behind
from rollout.phases import PHASES, SUMMARY_KEYS, straggler_ratio, summarize, summarize_ranks
from rollout.rewards import mean_reward

ONLINE_TIMEOUT_S = 15  # how long an online W&B run may take to start before the run falls back to offline
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
        overwrite: replace a run already in `output_dir` (its files are removed first), or write among other files
            there; without it a folder holding a run or other files is refused.
        resume: continue the interrupted run in `output_dir` (same config): its complete groups (`group_size`
            samples of a prompt) are kept and listed in `done`, a group cut short is dropped, and the run clock goes
            on from its last step. The W&B run is a new one; the rollout it resumes in is logged there whole (its
            steps and samples from before the stop too).
        group_size: with resume, the samples of a complete group (the rollout's `n`); None takes every group on disk
            as complete.

    After `finish`, the tracker logs nothing more (a RuntimeError says so): resume the run with a new one.
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
        overwrite: bool = False,
        resume: bool = False,
        group_size: int | None = None,
    ):
        self.done: dict[int, set[int]] = {}  # with resume: the prompts of each rollout whose samples are all on disk
        if resume:
            self.output_dir = pathlib.Path(output_dir)
            check_resumable(self.output_dir, config)
            check_unfinished(self.output_dir)
            # the rollouts the stopped run closed: the default index of the next (its summary says; a kill writes
            # none, and then the next index is past every rollout on disk)
            closed = read_summary(self.output_dir).get("num_rollouts")
            self._closed = closed if isinstance(closed, int) and not isinstance(closed, bool) else None
            # the stopped run's summary counts only its own steps: until this run writes its own, `rollout report`
            # rebuilds the table from steps.jsonl (a kill writes no summary)
            (self.output_dir / "summary.json").unlink(missing_ok=True)
            # and its plot is of its own steps: this run draws all of them (or, with logging.plot=false, none)
            (self.output_dir / PLOT_NAME).unlink(missing_ok=True)
        else:
            self.output_dir = prepare_output_dir(output_dir, overwrite)
        attach_library_log(self.output_dir)  # the folder is this run's now: library warnings go to its log
        self.config = config or {}
        self.num_table_rows = num_table_rows
        self.plot = plot
        # the config first: a run is resumable by it, so a failure before it leaves no files that say otherwise (a
        # full disk left the two empty files, and neither the same command nor resume=true would take the folder);
        # without a config too, as an empty one (resume refused a run made without one)
        from omegaconf import OmegaConf

        write_atomic(self.output_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(config or {})))
        for name in ("rollouts.jsonl", "steps.jsonl"):
            (self.output_dir / name).touch()
        self.steps: list[dict] = []
        self._positions: dict[int, list[int]] = {}  # each rollout's positions in `self.steps`, up to `_indexed`
        self._indexed = 0
        self.rewards: list[float | None] = []  # None: a non-finite reward recorded as null
        self.reward_terms: dict[str, list[float | None]] = {}
        self.num_rollouts = 0
        self.num_samples = 0
        self.kept_tokens: dict[int, int] = {}  # each rollout's completion tokens in rollouts.jsonl
        self.wall_seconds = 0.0
        self._streamed: set[int] = set()  # rollouts whose samples went out group by group
        self._streamed_steps: set[int] = set()
        self.rank_seconds: list[list[float]] = []  # a data-parallel run: each rollout's wall seconds per rank
        self.kept_records: list[dict] = []  # with resume: the samples on disk kept
        self._wandb_closed: set[int] = set()  # rollouts whose steps and metrics this W&B run logged
        self._wandb_steps: set[int] = set()  # positions in `self.steps` of the steps it logged (each once)
        self._prompts_written: dict[int, set[int]] = {}  # each rollout's groups in rollouts.jsonl, by prompt index
        self.sharing: list[dict] = []  # and each rollout's history all-gather: seconds, bytes, responses held
        self._finished = False  # `finish` wrote the summary: nothing more is logged
        if resume:
            self._load_finished(group_size)
        self.wandb_run = None
        try:
            self.wandb_run = self._start_wandb(os.environ.get("WANDB_MODE") or wandb_mode, project, run_name)
        except BaseException as err:  # a signal while W&B starts: the folder is this run's already, and says so
            self.finish(complete=False, reason=stop_reason(err))
            raise

    def _load_finished(self, group_size: int | None) -> None:
        """Keep the complete groups of the run on disk (rewriting rollouts.jsonl without cut ones) and its steps."""
        records = read_jsonl(self.output_dir / "rollouts.jsonl")
        counts: dict[tuple[int, int], int] = {}
        for r in records:
            key = (r["rollout"], r["prompt_index"])
            counts[key] = counts.get(key, 0) + 1
        complete = {key for key, count in counts.items() if group_size is None or count == group_size}
        kept = [r for r in records if (r["rollout"], r["prompt_index"]) in complete]
        write_jsonl(self.output_dir / "rollouts.jsonl", kept)
        for rollout, prompt_index in complete:
            self.done.setdefault(rollout, set()).add(prompt_index)
            self._prompts_written.setdefault(rollout, set()).add(prompt_index)
        # without their log-probs, which neither the drafting history nor W&B's samples table reads (a long run's
        # records whole held gigabytes for the rest of the run)
        self.kept_records = [{k: v for k, v in r.items() if k != "logprobs"} for r in kept]
        self._count_rewards(kept)
        self._count_kept_tokens(kept)
        self.num_samples = len(kept)
        self.steps = read_jsonl(self.output_dir / "steps.jsonl")
        self._mark_unkept_tokens()  # a kill left them unmarked; a caught signal marked them already
        write_jsonl(self.output_dir / "steps.jsonl", self.steps)
        self.wall_seconds = self.steps[-1]["elapsed"] if self.steps else 0.0
        on_disk = [r["rollout"] for r in (*kept, *self.steps)]
        # the rollout in progress when it stopped, or the next one: what a loop that logs without an index goes on
        # with (numbered from 0 again, it wrote its next rollout into the first and a second resume dropped both)
        self.num_rollouts = self._closed if self._closed is not None else max(on_disk, default=-1) + 1

    def _count_kept_tokens(self, records: list[dict], rollout: int | None = None) -> None:
        for r in records:
            index = r["rollout"] if rollout is None else rollout
            self.kept_tokens[index] = self.kept_tokens.get(index, 0) + len(r["completion_ids"])

    def _mark_unkept_tokens(self) -> bool:
        """Mark as `num_discarded`, on each rollout's last steps, the completion tokens its steps emitted that no sample
        in rollouts.jsonl holds: the rows and groups a stop cut off (a resumed run generates them again). So the
        summary's `tokens` stay the completions' tokens (`rollout.phases.summarize`), also over a stop and a resume.
        The marks go from the last step back, none past what a step kept, so that no step, and no phase, counts below
        zero. Returns whether a step changed (marked steps have nothing left to mark)."""
        steps_of: dict[int, list[int]] = {}
        for i, step in enumerate(self.steps):
            steps_of.setdefault(step["rollout"], []).append(i)
        changed = False
        for index, positions in steps_of.items():
            kept = [self.steps[i]["num_emitted"] - self.steps[i].get("num_discarded", 0) for i in positions]
            # (below 0 only if a kill lost a step line written after its samples' lines: nothing to take away then)
            unkept = sum(kept) - self.kept_tokens.get(index, 0)
            for i, step_kept in zip(reversed(positions), reversed(kept)):
                if unkept <= 0:
                    break
                marked = min(unkept, max(step_kept, 0))
                if marked:
                    step = self.steps[i]
                    self.steps[i] = {**step, "num_discarded": step.get("num_discarded", 0) + marked}
                    unkept -= marked
                    changed = True
        return changed

    def _start_wandb(self, mode: str, project: str, run_name: str | None):
        run = start_wandb_run(mode, project, run_name, self.output_dir, self.config)
        if run is not None:
            run.define_metric("step/index")
            run.define_metric("step/*", step_metric="step/index")
            run.define_metric("rollout/index")
            run.define_metric("rollout/*", step_metric="rollout/index")
        return run

    @property
    def wandb_dir(self) -> pathlib.Path | None:
        """The W&B run folder (offline-run-... / run-...), or None without W&B."""
        return pathlib.Path(self.wandb_run.settings.sync_dir) if self.wandb_run is not None else None

    def log_group(self, group: RolloutBatch, rollout: int | None = None) -> None:
        """Append one finished group's samples to rollouts.jsonl now, in one write (whole lines only), as
        `Rollout(on_group=...)` hands them over; `rollout` defaults to the rollout in progress."""
        self.log_records(group.records(), rollout)

    def log_records(self, records: list[dict], rollout: int | None = None) -> None:
        """Append samples given as `rollouts.jsonl` records (`RolloutBatch.records()`) in one write."""
        self._check_open()
        index = self.num_rollouts if rollout is None else rollout
        kept = self.done.get(index, set())  # groups on disk from before a resume: a loop that runs them again
        records = [r for r in records if r["prompt_index"] not in kept]  # does not write them twice
        lines = [json.dumps({"rollout": index, **_finite_rewards(r)}, allow_nan=False) + "\n" for r in records]
        # counted before the lines go out: a stop between the two then marks too few tokens unkept, which the resume's
        # count from the file makes up (too many, for lines written but not counted, it could not take back)
        self._count_kept_tokens(records, index)
        append_lines(self.output_dir / "rollouts.jsonl", "".join(lines))
        self._streamed.add(index)
        self._prompts_written.setdefault(index, set()).update(r["prompt_index"] for r in records)
        self._count_rewards(records)
        self.num_samples += len(records)

    def _check_open(self) -> None:
        if self._finished:  # (its lines went into rollouts.jsonl while summary.json counted without them)
            raise RuntimeError(
                f"this RunTracker finished ({self.output_dir / 'summary.json'} is written): log before finish(), or "
                "build a RunTracker with resume=True to add rollouts to the run"
            )

    def _count_rewards(self, records: list[dict]) -> None:
        for r in records:
            terms = [k[len("reward_") :] for k in r if k.startswith("reward_")]
            if r.get("reward") is not None or terms:  # scored (None: a non-finite reward recorded as null)
                self.rewards.append(_finite(r.get("reward")))  # (NaN or infinite: one a trainer set, null on disk)
            for name in terms:
                self.reward_terms.setdefault(name, []).append(_finite(r[f"reward_{name}"]))

    def log_step(self, step: dict, rollout: int | None = None) -> None:
        """Append one generator step (a step dict of the rollout loop) to steps.jsonl now."""
        self._check_open()
        index = self.num_rollouts if rollout is None else rollout
        record = {**step, "elapsed": step["elapsed"] + self.wall_seconds, "rollout": index}
        append_lines(self.output_dir / "steps.jsonl", json.dumps(record, allow_nan=False) + "\n")
        self.steps.append(record)
        self._streamed_steps.add(index)

    def log_rollout(self, batch: RolloutBatch, rollout: int | None = None) -> None:
        """Close one rollout: append its samples and steps unless they were streamed (`log_group`, `log_step`),
        move the run clock on, and log its W&B metrics."""
        self._check_open()
        index = self.num_rollouts if rollout is None else rollout
        if index not in self._streamed:
            self.log_group(batch, index)
        if index not in self._streamed_steps:
            for step in batch.steps:
                self.log_step(step, index)
        self.wall_seconds += batch.summary.get("wall_seconds", 0.0)
        self.num_rollouts = max(self.num_rollouts, index + 1)  # its files are whole: it counts, whatever stops W&B
        if self.wandb_run is not None:
            kept = self.done.get(index, set())  # (written from before the stop; the batch's are not written again)
            records = [_finite_rewards(r) for r in batch.records() if r["prompt_index"] not in kept]
            # the reward mean of what is logged: a trainer that scores sets batch.reward after the call made the
            # summary (whose reward_mean is then None)
            summary = {**batch.summary, "reward_mean": _reward_mean(records)}
            positions = self._positions_of(index)
            if len(positions) > len(batch.steps):  # resumed inside this rollout: its W&B metrics are the whole one's
                records = self._with_kept(records, index)  # (the steps and samples on disk from before the stop too)
                summary = {**summarize([self.steps[i] for i in positions]), "reward_mean": _reward_mean(records)}
            self._log_wandb(summary, records, positions, index)

    def steps_of(self, rollout: int) -> list[dict]:
        """`rollout`'s steps, in order."""
        return [self.steps[i] for i in self._positions_of(rollout)]

    def _positions_of(self, rollout: int) -> list[int]:
        """Where `rollout`'s steps are in `self.steps` (their `step/index` in W&B), from an index of the steps by
        rollout kept up to date here (a scan of every step for each rollout made a long run quadratic)."""
        for i in range(self._indexed, len(self.steps)):  # (steps are only appended, or changed in place)
            self._positions.setdefault(self.steps[i]["rollout"], []).append(i)
        self._indexed = len(self.steps)
        return list(self._positions.get(rollout, ()))

    def _with_kept(self, records: list[dict], rollout: int) -> list[dict]:
        """`records` of a rollout resumed part way, with its samples kept on disk from before the stop, in order."""
        kept = [r for r in self.kept_records if r["rollout"] == rollout]
        return sorted([*kept, *records], key=lambda r: (r["prompt_index"], r["sample_index"]))

    def log_ranked_rollout(
        self, records: list[dict], steps: list[list[dict]], summaries: list[dict], rollout: int, resumed: bool = False
    ) -> None:
        """Close one rollout of a data-parallel run (rank 0 writes for every rank): append every rank's steps (each with
        its `rank`) and its samples in prompt order, move the run clock on by the slowest rank's wall time,
        and log W&B metrics per rank. `steps[r]` and `summaries[r]` are rank r's (its `Rollout` summary). `resumed`:
        the file already held some of this rollout's groups, so it is rewritten in order."""
        order = lambda r: (r["rollout"], r["prompt_index"], r["sample_index"])  # noqa: E731
        records = sorted(({"rollout": rollout, **r} for r in records), key=order)
        first = len(self.steps)
        for rank, rank_steps in enumerate(steps):
            for step in rank_steps:
                self.log_step({**step, "rank": rank}, rollout)
        seconds = [s.get("wall_seconds", 0.0) for s in summaries]  # this run's
        positions = self._positions_of(rollout)
        earlier = [self.steps[i] for i in positions if i < first]  # its steps a stopped run recorded before a resume
        own = [sum(s["seconds"] for s in earlier if s.get("rank", 0) == r) for r in range(len(seconds))]
        sharing = [s.get("share_seconds", 0.0) for s in summaries]
        self.sharing.append(
            {
                "seconds": max(sharing),
                "bytes": sum(s.get("share_bytes", 0) for s in summaries),
                "history_responses": [s.get("history_responses", 0) for s in summaries],  # each rank's, after it
            }
        )
        self.wall_seconds += max(seconds) + max(sharing)  # the ranks generate, then share their responses
        # each rank's time on the rollout, its steps from before a resume taken as their seconds (all the files hold;
        # a rollout all on disk before it took 0 s here, and its time was left out of the ranks' and the straggler's)
        seconds = [a + b for a, b in zip(own, seconds)]
        self.rank_seconds.append(seconds)
        # the samples last: a stop before them leaves a rollout cut short (redone on resume); after them, its steps and
        # times are all there for `close_if_whole`
        self.log_records(records, rollout)
        if resumed:
            write_jsonl(
                self.output_dir / "rollouts.jsonl", sorted(read_jsonl(self.output_dir / "rollouts.jsonl"), key=order)
            )
        self.num_rollouts = max(self.num_rollouts, rollout + 1)  # its files are whole
        # a rollout all on disk before a resume (no rank had a group left) was logged by the run that closed it
        if self.wandb_run is not None and (records or len(self.steps) > first):
            if earlier:  # resumed inside this rollout: the whole rollout's metrics (its ranks' times as above)
                records = self._with_kept(records, rollout)
            summary = summarize_ranks([self.steps[i] for i in positions], [[x] for x in seconds])
            summary["reward_mean"] = _reward_mean(records)
            extra = {"rollout/straggler_ratio": straggler_ratio([seconds]), "rollout/share_seconds": max(sharing)}
            for rank, own_summary in enumerate(summary["ranks"]):  # (a rank without a group this rollout: zeros)
                extra[f"rollout/rank{rank}/seconds"] = seconds[rank]
                extra[f"rollout/rank{rank}/tokens_per_s"] = own_summary["total"]["tokens_per_s"]
                extra[f"rollout/rank{rank}/acceptance_rate"] = own_summary["total"]["acceptance_rate"]
            self._log_wandb(summary, records, positions, rollout, extra)

    def close_if_whole(self, rollout: int | None, num_groups: int) -> None:
        """After a stop: the rollout it came in counts if its `num_groups` groups are all in rollouts.jsonl (the stop
        came after its last group was written, or while W&B logged it), and its metrics and samples go to W&B from
        the files, as closing it would have logged them (a resume skips a rollout all on disk)."""
        if rollout is None or len(self._prompts_written.get(rollout, ())) < num_groups:
            return
        self.num_rollouts = max(self.num_rollouts, rollout + 1)
        if self.wandb_run is None or rollout in self._wandb_closed:
            return
        records = [r for r in read_jsonl(self.output_dir / "rollouts.jsonl") if r["rollout"] == rollout]
        records.sort(key=lambda r: (r["prompt_index"], r["sample_index"]))
        positions = self._positions_of(rollout)
        steps = [self.steps[i] for i in positions]
        num_ranks = 1 + max((s.get("rank", 0) for s in steps), default=0)
        if num_ranks > 1:  # each rank's time: its steps' seconds (all that the files record)
            seconds = [[sum(s["seconds"] for s in steps if s.get("rank", 0) == r)] for r in range(num_ranks)]
            summary = summarize_ranks(steps, seconds)
        else:
            summary = summarize(steps)
        self._log_wandb({**summary, "reward_mean": _reward_mean(records)}, records, positions, rollout)

    def _log_wandb_steps(self, positions: list[int]) -> None:
        """Log the steps at `positions` of `self.steps` (each position is its `step/index`) that this W&B run has
        not logged yet (a stop may have cut a rollout's logging short, and its close goes on from there)."""
        for index in positions:
            if index in self._wandb_steps:
                continue
            step = self.steps[index]
            metrics = _numeric_fields(step, "step/")
            metrics["step/index"] = index
            metrics["step/phase_id"] = PHASES.index(step["phase"])  # 0 prefill, 1 bulk, 2 tail: charts need numbers
            metrics["step/tokens_per_s"] = step["num_emitted"] / step["seconds"] if step["seconds"] > 0 else 0.0
            self.wandb_run.log(metrics)
            self._wandb_steps.add(index)

    def _log_wandb(self, summary, records, positions: list[int], rollout: int, extra: dict | None = None) -> None:
        """Close `rollout` in W&B: its steps (at `positions` of `self.steps`), its metrics and its samples table."""
        import wandb

        self._log_wandb_steps(positions)
        total = summary["total"]
        metrics = {"rollout/index": rollout, **(extra or {})}
        if summary.get("reward_mean") is not None:
            metrics["rollout/reward_mean"] = summary["reward_mean"]
        metrics.update({f"rollout/{key}": total[key] for key in SUMMARY_KEYS})
        metrics.update({f"rollout/{p}_tokens_per_s": summary["phases"][p]["tokens_per_s"] for p in PHASES})
        if self.num_table_rows > 0:
            columns = ["rollout", "prompt_index", "sample_index", "prompt", "completion", "finish_reason", "reward"]
            table = wandb.Table(columns=columns)
            for row in records[: self.num_table_rows]:
                table.add_data(rollout, *(row[c] for c in columns[1:]))
            metrics["samples"] = table
        self.wandb_run.log(metrics)
        self._wandb_closed.add(rollout)  # (after its metrics: a stop before them leaves it to `close_if_whole`)

    def abort(self) -> None:
        """Close the W&B run as failed (the rollout raised): no run is left open."""
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1)
            self.wandb_run = None

    def summary(self) -> dict:
        """The run's summary.json: per-phase and total stats over every step so far, and reward means."""
        if self.rank_seconds:  # a data-parallel run: totals over the ranks, and each rank's own table
            summary = summarize_ranks(self.steps, [list(r) for r in zip(*self.rank_seconds)])
            summary["history_sharing"] = self.sharing
        else:
            summary = summarize(self.steps)
        summary["reward_mean"] = mean_reward(self.rewards)  # None where no sample has a reward (all null, or none)
        summary["reward_terms"] = {name: mean_reward(v) for name, v in self.reward_terms.items()}
        summary["num_null_rewards"] = sum(r is None for r in self.rewards)
        summary["wall_seconds"] = self.wall_seconds
        summary["num_samples"] = self.num_samples
        summary["num_rollouts"] = self.num_rollouts
        return summary

    def finish(self, complete: bool = True, reason: str | None = None) -> dict:
        """Write summary.json and the plot, close the W&B run; returns the summary. `complete=False` (a run stopped
        by an error or a signal) marks the summary incomplete with `reason`: the files hold what finished."""
        # a stopped run's files are what finished whatever fails here (a full disk): each part is tried, and a stopped
        # run's own error goes on up, not one of these (which replaced it, and left no summary and W&B open)
        if not complete:
            try:
                if self._mark_unkept_tokens():  # the rows in flight were not kept: out of the totals
                    write_jsonl(self.output_dir / "steps.jsonl", self.steps)
            except OSError:
                pass  # unmarked on disk: a resume marks them again, as after a kill
        summary = self.summary()
        summary["complete"] = complete
        if not complete:
            summary["incomplete_reason"] = reason
            if self.steps:  # the run's clock moves on a rollout at a time: a stopped one ran until its last step
                summary["wall_seconds"] = max(summary["wall_seconds"], self.steps[-1].get("elapsed", 0.0))
        failed = None
        try:
            write_atomic(self.output_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        except OSError as err:
            failed = err
        plot_path = None
        if self.plot and self.steps and failed is None:
            try:  # the run is whole without it: `rollout report` draws it again
                plot_path = plot_steps(self.steps, self.output_dir / PLOT_NAME)
            except OSError as err:
                said = " ".join(str(err).split())
                _warn(f"the plot was not written ({said}): rollout report {self.output_dir} draws it again")
        try:
            self._finish_wandb(summary, complete, plot_path)
        except Exception as err:  # noqa: BLE001 - the files hold the run; W&B's own failure is said, not raised
            self.wandb_run = None
            _warn(f"the W&B run was not closed ({type(err).__name__}: {' '.join(str(err).split())})")
        self._finished = True
        if failed is not None and complete:  # (a stopped run's caller raises its own error)
            raise failed
        return summary

    def _finish_wandb(self, summary: dict, complete: bool, plot_path: pathlib.Path | None) -> None:
        if self.wandb_run is not None:
            stopped_in = self.steps[-1]["rollout"] if self.steps else None
            # the steps of the rollout the stop cut short, as steps.jsonl holds them (no metrics: it did not close),
            # where this run stepped in it (a resumed run stopped before its first step has nothing of its own)
            if not complete and stopped_in in self._streamed_steps and stopped_in not in self._wandb_closed:
                self._log_wandb_steps(self._positions_of(stopped_in))
            for phase in PHASES:
                for key in SUMMARY_KEYS:
                    self.wandb_run.summary[f"phase/{phase}/{key}"] = summary["phases"][phase][key]
            for key in SUMMARY_KEYS:
                self.wandb_run.summary[f"total/{key}"] = summary["total"][key]
            if summary["reward_mean"] is not None:
                self.wandb_run.summary["reward_mean"] = summary["reward_mean"]
            if plot_path is not None:
                import wandb

                self.wandb_run.log({"plot": wandb.Image(str(plot_path))})
            self.wandb_run.finish(exit_code=0 if complete else 1)
            self.wandb_run = None


def _warn(message: str) -> None:
    """One line on stderr about a part of the output that failed where the run's files stand whole."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def stop_reason(err: BaseException) -> str:
    """What stopped a run, for its incomplete summary."""
    interrupt = signal_behind(err)
    if interrupt is not None:
        return "terminated (SIGTERM)" if type(interrupt).__name__ == "Terminated" else "interrupted (SIGINT)"
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


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


def _wandb_key() -> bool:
    """Whether W&B has an API key: the environment or the netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        entries = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return any("wandb" in host for host in entries)


def _finite(value: float | None) -> float | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _finite_rewards(record: dict) -> dict:
    """`record` with a NaN or infinite reward or reward term (as a trainer may set them) as None: null in JSON, a
    reward left out (as the advantages leave it out). JSON has no NaN; the line failed to write."""
    bad = [
        key
        for key, value in record.items()
        if (key == "reward" or key.startswith("reward_")) and isinstance(value, float) and not math.isfinite(value)
    ]
    return {**record, **dict.fromkeys(bad)} if bad else record


def _reward_mean(records: list[dict]) -> float | None:
    return mean_reward([r["reward"] for r in records if "reward" in r])


def start_wandb_run(mode: str, project: str, run_name: str | None, output_dir: pathlib.Path, config: dict):
    """A W&B run in `WANDB_DIR` or `output_dir`; None when `mode` is "disabled". "online" without an API key, or
    when the service cannot be reached within `ONLINE_TIMEOUT_S`, logs offline instead, with one line on stderr."""
    if mode not in WANDB_MODES:
        raise ValueError(f"logging.wandb_mode / WANDB_MODE ({mode!r}) must be one of {', '.join(WANDB_MODES)}")
    if mode == "disabled":
        return None
    import wandb

    wandb_dir = os.environ.get("WANDB_DIR") or str(output_dir)
    pathlib.Path(wandb_dir).mkdir(parents=True, exist_ok=True)
    if mode == "online" and not _wandb_key():
        print("rollout: W&B online needs an API key (wandb login, WANDB_API_KEY): logging offline", file=sys.stderr)
        mode = "offline"

    def start(mode: str):
        return wandb.init(
            project=project,
            name=run_name,
            dir=wandb_dir,
            mode=mode,
            config=config,
            settings=wandb.Settings(console="off", silent=True, init_timeout=ONLINE_TIMEOUT_S),
        )

    try:
        return start(mode)
    except Exception as err:  # no network, a refused key: the run goes on offline
        if mode != "online":
            raise
        reason = " ".join(str(err).split())[:120]
        print(f"rollout: W&B online failed ({reason}): logging offline (`wandb sync` uploads it)", file=sys.stderr)
        return start("offline")
