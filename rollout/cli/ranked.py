"""Running a recipe on the ranks of a data-parallel run: `accelerate launch --num_processes N -m rollout run RECIPE`.

Each rollout's prompt groups are sharded over the ranks (`rollout.distributed.shard_groups`); each rank generates its
share with its own generator on its own device and streams what finishes to `output_dir/ranks/rank-R/` (its own
`rollouts.jsonl` and `steps.jsonl`, on its own machine). When every rank has finished the rollout, the ranks
all-gather the finished responses into each other's suffix history (all of them, or with
`distributed.history_scope=next` those to the prompts of each rank's next share), rank 0 writes the rollout into the
run's files (samples in prompt order, steps with their `rank`), and the part files are emptied. The run's own files
therefore only ever hold whole rollouts; a run stopped by any rank keeps them, its part files, and a summary marked
incomplete that names the rank and the cause.
"""

from __future__ import annotations

import json
import pathlib
import time

from rollout.cli.files import append_lines
from rollout.cli.progress import Progress
from rollout.cli.recipe import Recipe
from rollout.cli.runs import (
    header_warning,
    kept_responses,
    kv_cache_header,
    load_inputs,
    make_rollout,
    make_tracker,
    on_rank_device,
    recipe_spec,
)
from rollout.cli.tracking import RunTracker, stop_reason
from rollout.distributed import (
    OutputLengths,
    Ranks,
    RankStopped,
    add_others,
    gather_responses,
    group_costs,
    prompt_key,
    shard_groups,
    signal_behind,
    signals_ignored,
)


class RankFiles:
    """One rank's stream of what it finished in the rollout in progress: whole lines, emptied once rank 0 holds them."""

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.clear()

    def log_group(self, group, rollout: int) -> None:
        lines = [json.dumps({"rollout": rollout, **r}, allow_nan=False) + "\n" for r in group.records()]
        append_lines(self.folder / "rollouts.jsonl", "".join(lines))

    def log_step(self, step: dict, rollout: int, rank: int) -> None:
        append_lines(self.folder / "steps.jsonl", json.dumps({**step, "rollout": rollout, "rank": rank}) + "\n")

    def clear(self) -> None:
        for name in ("rollouts.jsonl", "steps.jsonl"):
            (self.folder / name).write_text("")


def run_recipe_ranked(recipe: Recipe, ranks: Ranks) -> tuple[dict | None, RunTracker | None]:
    """Run the recipe's rollouts as rank `ranks.rank` of `ranks.world_size`; returns (summary, tracker) on rank 0 and
    (None, None) on the others. Every rank must call it. A failure on any rank stops every rank; rank 0 then writes
    the summary, marked incomplete with the failing rank and its cause, and every rank raises."""
    local = on_rank_device(recipe, ranks)
    inputs = load_inputs(local)
    rollout = make_rollout(local, inputs, recipe_spec(local), ranks.world_size)
    if ranks.is_main:  # (each rank plans its own generator; rank 0's stands for them, as one machine's ranks agree)
        print(f"rank 0: {kv_cache_header(rollout.generator, inputs.max_seq_len)}", flush=True)
    if ranks.is_main and (warning := header_warning(recipe, inputs)) is not None:
        print(warning, flush=True)
    tracker, error = None, None
    if ranks.is_main:
        try:
            tracker = make_tracker(recipe, inputs)
        except (ValueError, OSError) as err:  # an output folder that holds a run: every rank stops, rank 0 says why
            error = err
    if ranks.broadcast(None if error is None else str(error)) is not None:
        if error is not None:
            raise error
        raise RankStopped()
    done = ranks.broadcast(tracker.done if tracker is not None else None)
    kept = ranks.broadcast(kept_responses(tracker, recipe, inputs) if tracker is not None else None)
    files = RankFiles(pathlib.Path(recipe.output_dir) / "ranks" / f"rank-{ranks.rank}")
    history = rollout.generator.draft_history
    share = recipe.distributed.share_history
    lengths = OutputLengths()
    if kept[0]:
        lengths.add(kept[0], [len(c) for c in kept[1]])
        if history is not None:
            history.add_responses(*kept)
    rows = list(inputs.data)
    per_rollout = recipe.rollout.prompts_per_rollout or len(rows)
    progress = Progress(enabled=None if (recipe.logging.progress and ranks.is_main) else False)

    def rows_of(index: int) -> list[int]:
        """The data rows of rollout `index`'s prompts (`per_rollout` of them, in order, cycling)."""
        return [(index * per_rollout + j) % len(rows) for j in range(per_rollout)]

    def shard_of(index: int) -> list[int]:
        """This rank's groups of rollout `index` (their indices in the rollout), from the lengths seen so far."""
        prompt_ids = [inputs.prompt_ids[i] for i in rows_of(index)]
        costs = group_costs(prompt_ids, recipe.sampling.n, lengths, prior=recipe.sampling.max_new_tokens)
        return shard_groups(costs, ranks.world_size, recipe.distributed.balance)[ranks.rank]

    def wanted(index: int) -> set[bytes] | None:
        """The prompts whose responses from other ranks this rank keeps after rollout `index - 1`: every one (None),
        or with `history_scope="next"` those of its share of rollout `index` (none after the last rollout)."""
        if recipe.distributed.history_scope == "all":
            return None
        if index >= recipe.rollout.num_rollouts:
            return set()
        return {prompt_key(inputs.prompt_ids[rows_of(index)[j]]) for j in shard_of(index)}

    index = None
    try:
        for index in range(recipe.rollout.num_rollouts):
            row_of = rows_of(index)
            shard = shard_of(index)
            todo = [j for j in shard if j not in done.get(index, set())]
            records, steps, summary = [], [], {"wall_seconds": 0.0, "total": {"tokens_per_s": 0.0}}
            if todo:

                def on_step(step, finished, total, index=index):
                    files.log_step(step, index, ranks.rank)
                    progress(step, finished, total)

                batch = rollout(
                    [rows[row_of[j]] for j in todo],
                    recipe.sampling.seed + index,
                    on_step,
                    on_group=lambda group, index=index: files.log_group(group, index),
                    group_indices=todo,
                )
                records, steps = batch.records(), batch.steps
                progress.close()  # each rollout its own line: its tokens/s over its own steps and clock
                summary = {"wall_seconds": batch.summary["wall_seconds"], "total": batch.summary["total"]}
            prompts = [inputs.prompt_ids[row_of[r["prompt_index"]]] for r in records]
            completions = [r["completion_ids"] for r in records]
            ranks.barrier()  # every rank done generating: what follows times the sharing alone, not the wait
            start = time.perf_counter()
            every, summary["share_bytes"] = gather_responses(ranks, prompts, completions)
            for rank_prompts, rank_completions in every:
                lengths.add(rank_prompts, [len(c) for c in rank_completions])
            if share and history is not None:
                add_others(ranks, history, every, wanted(index + 1))
            summary["share_seconds"] = time.perf_counter() - start
            summary["history_responses"] = len(history.history) if history is not None else 0
            gathered = ranks.gather((records, steps, summary))
            if tracker is not None:
                tracker.log_ranked_rollout(
                    [r for rank_records, _, _ in gathered for r in rank_records],
                    [rank_steps for _, rank_steps, _ in gathered],
                    [rank_summary for _, _, rank_summary in gathered],
                    index,
                    resumed=bool(done.get(index)),
                )
            ranks.barrier()  # rank 0 holds the rollout: the part files can go
            files.clear()
    except BaseException as err:
        progress.close()
        with signals_ignored():  # the launcher's SIGTERM follows a peer's failure: let the summary be written first
            cause = ranks.stop_cause()
            if cause is None and signal_behind(err) is not None:  # a signal stopped this rank: say so to the others
                if not ranks.claim_failure(stop_reason(err)):  # another rank said it first: the line names that one
                    cause = ranks.failure()
            if tracker is not None:
                try:
                    tracker.close_if_whole(index, per_rollout)  # stopped after its last group was written
                finally:
                    tracker.finish(complete=False, reason=cause or f"rank {ranks.rank}: {stop_reason(err)}")
        raise
    progress.close()
    if tracker is None:
        return None, None
    return tracker.finish(), tracker
