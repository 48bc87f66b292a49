"""The `rollout` command line.

    rollout run RECIPE [key=value ...]     run a recipe; write its output folder (rollouts, steps, summary, plot, W&B)
    rollout train RECIPE [key=value ...]   GRPO through TRL's GRPOTrainer, rollouts by this library; per-step metrics
    rollout bench RECIPE [key=value ...]   baseline, no speculation, static K values and the recipe's policy, one table
    rollout report OUTPUT_DIR              print a run's per-phase table (a training's summary) and write its plot

`key.sub=value` overrides win over the recipe file, e.g. `rollout run recipes/quickstart.yaml sampling.n=8`.
User errors print one line `rollout <command>: error: ...` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time

from rollout.cli.files import checkpoint_to_resume, read_summary
from rollout.cli.library_log import capture_library_warnings, route_transformers
from rollout.distributed import VANISHED, Ranks, RankStopped, signal_behind, signals_ignored, start_ranks
from rollout.engine.errors import NonFiniteLogits


def _setup(args: argparse.Namespace):
    """Load the recipe and check everything it states (`rollout.cli.preflight`), all before torch is imported; then
    set torch threads, quiet the model loaders' progress bars and send transformers' log warnings to the run's log.
    The preflight's notes go in `args.notes`, for the run's header."""
    from rollout.cli.preflight import preflight
    from rollout.cli.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    args.notes = preflight(recipe, args.command)
    import torch
    import transformers

    if recipe.threads > 0:
        torch.set_num_threads(recipe.threads)
    transformers.utils.logging.disable_progress_bar()
    route_transformers()
    return recipe


def _run(args: argparse.Namespace) -> None:
    recipe = _setup(args)  # a bad recipe is reported before torch is imported
    args.run_folder = pathlib.Path(recipe.output_dir)  # (what a signal's one line looks at)
    args.config_before = _file_version(args.run_folder / "config.yaml")  # an earlier run's, where one is there
    from rollout.cli.recipe import method_name
    from rollout.cli.runs import run_recipe
    from rollout.phases import format_table, summarize, summarize_ranks

    spec = recipe.spec
    policy = method_name(spec.method)
    if policy != "none":
        table = spec.num_speculative_tokens_per_batch_size
        how = "static" if table is None else ("auto" if table == "auto" else "table")
        policy += f" ({how}, K<={spec.num_speculative_tokens})"
    ranks = args.ranks
    if ranks.is_main:
        print(
            f"model {recipe.model.name} | data {recipe.data.dataset} | n {recipe.sampling.n} | "
            f"max_new_tokens {recipe.sampling.max_new_tokens} | speculation {policy}"
            + (f" | {ranks.world_size} processes, balance {recipe.distributed.balance}" if ranks.distributed else ""),
            flush=True,
        )
        for note in args.notes:
            print(note, flush=True)
    if args.ranks.distributed:
        from rollout.cli.ranked import run_recipe_ranked

        summary, tracker = run_recipe_ranked(recipe, args.ranks)
        if not args.ranks.is_main:
            return
    else:
        summary, tracker = run_recipe(recipe)
    if summary["num_rollouts"] > 1:
        per_rollout = summary.get("rank_seconds_per_rollout")  # several processes: [rollout][rank] wall seconds
        for index in range(summary["num_rollouts"]):
            steps = tracker.steps_of(index)  # (indexed by rollout: a scan of every step per rollout took hours)
            if per_rollout is not None and index < len(per_rollout):  # the ranks ran side by side, as in the table
                total = summarize_ranks(steps, [[seconds] for seconds in per_rollout[index]])["total"]
            else:
                total = summarize(steps)["total"]
            print(
                f"rollout {index}: {total['tokens']} tokens in {total['seconds']:.2f} s, "
                f"{total['tokens_per_s']:.0f} tokens/s, K {total['mean_k']:.2f}, accept {total['acceptance_rate']:.2f}"
            )
    print(format_table(summary))
    if "kv_cache" in summary:
        kv = summary["kv_cache"]
        print(
            f"KV blocks: peak {kv['peak_blocks_used']} used of {kv['blocks_allocated']} allocated, "
            f"{kv['num_preempted']} rows preempted"
        )
    if "ranks" in summary:
        for rank in summary["ranks"]:
            total = rank["total"]
            print(
                f"rank {rank['rank']}: {total['tokens']} tokens in {rank['wall_seconds']:.2f} s, "
                f"{total['tokens_per_s']:.0f} tokens/s, accept {total['acceptance_rate']:.2f}"
            )
        print(f"straggler ratio (slowest rank / mean) {summary['straggler_ratio']:.3f}")
    print(
        f"{summary['num_samples']} samples, reward mean {_reward(summary['reward_mean'])}, "
        f"{summary['wall_seconds']:.2f} s"
        + (
            f" ({summary['num_null_rewards']} non-finite rewards recorded as null)"
            if summary["num_null_rewards"]
            else ""
        )
    )
    print(f"output: {tracker.output_dir}")
    if tracker.wandb_dir is not None:
        print(f"W&B run: {tracker.wandb_dir}")


def _train(args: argparse.Namespace) -> None:
    recipe = _setup(args)
    from rollout.cli.recipe import method_name
    from rollout.cli.train import run_training

    args.ranks = start_ranks(cpu=recipe.model.device == "cpu")  # before TRL's accelerator, which reuses it
    args.train_recipe = recipe  # a stop's line names its last checkpoint
    t = recipe.train
    length = f"{t.steps} steps" if t.steps is not None else f"{t.epochs:g} epochs"
    if args.ranks.is_main:
        print(
            f"GRPO | model {recipe.model.name} | data {recipe.data.dataset} | {length} x {t.prompts_per_step} "
            f"prompts x n {recipe.sampling.n} | lr {t.learning_rate:g} | speculation {method_name(recipe.spec.method)}"
            + (f" | {args.ranks.world_size} processes" if args.ranks.distributed else ""),
            flush=True,
        )
    summary = run_training(recipe, args.ranks, checked=True)  # `_setup` ran the preflight
    if not args.ranks.is_main:
        return
    _print_training(summary)
    print(f"output: {recipe.output_dir}")


def _print_training(summary: dict) -> None:
    """A training's summary lines: steps, time, reward at the start and the end, rollout share, tokens/s per epoch."""
    first, last, gain = (summary[k] for k in ("reward_first_10pct", "reward_last_10pct", "reward_gain"))
    rewards = "no reward logged" if None in (first, last, gain) else (
        f"reward first 10% {first:.3f} -> last 10% {last:.3f} ({gain:+.3f})"
    )  # fmt: skip
    print(
        f"{summary['num_steps']} steps in {summary['wall_seconds']:.1f} s | {rewards} | rollout "
        f"{100 * (summary['rollout_share'] or 0):.0f}% of step time"
    )
    for epoch, tps in summary["rollout_tokens_per_s_per_epoch"].items():
        print(f"epoch {epoch}: rollout {tps:.0f} tokens/s")


def _bench(args: argparse.Namespace) -> None:
    recipe = _setup(args)
    from rollout.cli.bench import format_bench, run_bench

    if args.ranks.is_main:
        for note in args.notes:
            print(note, file=sys.stderr, flush=True)

    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    # what a stop keeps (`_interrupted`): this benchmark's file, once it has written one
    rows = run_bench(recipe, log=log, ranks=args.ranks, on_write=lambda path: setattr(args, "bench_file", path))
    if not args.ranks.is_main:
        return
    print(format_bench(rows))
    print(f"rows written to {pathlib.Path(recipe.output_dir) / 'bench.json'}")


# what the report's table reads of each step record
_STEP_KEYS = (
    "kind",
    "phase",
    "seconds",
    "batch_size",
    "num_emitted",
    "num_drafted",
    "num_accepted",
    "num_draft_tokens",
    "elapsed",  # (the plot's)
)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _reward(mean: float | None) -> str:
    """A reward mean as printed: '-' where no sample has a reward (every one null, or no sample kept)."""
    return "-" if mean is None else f"{mean:.3f}"


def _report(args: argparse.Namespace) -> None:
    from rollout.cli.plots import plot_steps
    from rollout.cli.tracking import PLOT_NAME
    from rollout.phases import format_table, summarize, summarize_ranks

    folder = pathlib.Path(args.output_dir)
    steps_path = folder / "steps.jsonl"
    if folder.is_file():
        raise ValueError(
            f"{folder} is a file: give the output folder of a `rollout run` or `rollout train` (the one holding "
            "steps.jsonl or train.jsonl)"
        )
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    from rollout.cli.files import read_jsonl

    if not steps_path.is_file() and (folder / "train.jsonl").is_file():
        return _report_training(folder)
    if not steps_path.is_file():
        raise FileNotFoundError(
            f"{steps_path}: not found; is {folder} the output_dir of a `rollout run` (or of a `rollout train`, which "
            "holds train.jsonl)?"
        )
    from rollout.phases import PHASES

    damaged: list[int] = []
    steps = read_jsonl(steps_path, damaged)  # a line cut by a kill (the last) is left out
    if not steps:
        raise ValueError(f"{steps_path} holds no step record: the run recorded no steps, or the file is not a run's")
    for number, step in enumerate(steps, 1):
        missing = [key for key in _STEP_KEYS if not isinstance(step, dict) or key not in step]
        wrong = [key for key in _STEP_KEYS[2:] if key not in missing and not _is_number(step[key])]
        what = f"it lacks {', '.join(missing)}" if missing else None
        if what is None and wrong:
            what = f"its {wrong[0]} is {step[wrong[0]]!r}, not a number"
        if what is None and step["phase"] not in PHASES:
            what = f"its phase {step['phase']!r} is none of {', '.join(PHASES)}"
        if what is not None:
            raise ValueError(
                f"{steps_path}: record {number} is not a step ({what}): the file is not a `rollout run`'s "
                "steps.jsonl, or was edited"
            )
    if [i for i in damaged if i != len(steps) + len(damaged) - 1]:  # damaged lines before the last (a kill cuts that)
        print(
            f"note: {steps_path} holds {len(damaged)} damaged line(s), left out: the table counts the "
            f"{len(steps)} steps that parse",
            file=sys.stderr,
        )
    summary_path = folder / "summary.json"
    summary = read_summary(folder)  # ({} where damaged: the steps say the same)
    table = None
    if "phases" in summary:
        try:
            table = format_table(summary)
        except (KeyError, TypeError, ValueError, AttributeError):  # its table damaged in place: from the steps
            table = None
    if table is None:  # from the steps: each rank's own under ranks
        num_ranks = 1 + max(s.get("rank", 0) for s in steps)
        if num_ranks > 1:  # (each rank's wall time taken as its steps' time: the steps hold no other)
            own = [[sum(s["seconds"] for s in steps if s.get("rank", 0) == r)] for r in range(num_ranks)]
            table = format_table(summarize_ranks(steps, own))
        else:
            table = format_table(summarize(steps))
    print(table)
    if "reward_mean" in summary:
        print(f"reward mean {_reward(summary['reward_mean'])}")
    if summary.get("complete") is False:  # stopped: the figures are those of what finished
        reason = summary.get("incomplete_reason") or "stopped"
        print(f"incomplete ({reason}): these are the figures of the {summary.get('num_samples', '?')} samples kept")
    elif not summary_path.is_file():  # killed (or its disk full) before it wrote one: nothing says it finished
        print(
            "incomplete (no summary.json: running, or stopped before it wrote one): the table counts every step in "
            "steps.jsonl, the tokens of samples a stop cut off included; resume=true continues a stopped run"
        )
    print(f"plot: {plot_steps(steps, folder / PLOT_NAME, title=str(folder))}")


def _report_training(folder: pathlib.Path) -> None:
    """`rollout report` of a `rollout train` folder: its summary lines from train.jsonl (the wall time from its
    summary.json where that has one), and train.png written again."""
    from rollout.cli.files import read_jsonl
    from rollout.cli.train import plot_training, summarize_training

    path = folder / "train.jsonl"
    damaged: list[int] = []
    steps = read_jsonl(path, damaged)
    if not steps:
        raise ValueError(f"{path} holds no step record: the training stopped before its first optimiser step")
    for number, step in enumerate(steps, 1):
        wrong = [key for key in ("step", "step_time") if not isinstance(step, dict) or not _is_number(step.get(key))]
        if wrong:
            raise ValueError(
                f"{path}: record {number} is not an optimiser step (its {wrong[0]} is not a number): the file is not "
                "a `rollout train`'s train.jsonl, or was edited"
            )
    if [i for i in damaged if i != len(steps) + len(damaged) - 1]:
        print(f"note: {path} holds {len(damaged)} damaged line(s), left out", file=sys.stderr)
    kept = read_summary(folder)
    wall = kept.get("wall_seconds")  # (none, or damaged: the steps' own time)
    summary = summarize_training(steps, wall if _is_number(wall) else sum(s["step_time"] for s in steps))
    _print_training(summary)
    if kept.get("complete") is False:
        print(f"incomplete ({kept.get('incomplete_reason') or 'stopped'}): the figures of its {len(steps)} steps")
    print(f"plot: {plot_training(steps, folder / 'train.png', title=str(folder))}")


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: `rollout <command>: error: ...` and the usage in the same line."""

    def error(self, message: str):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        if message.startswith("the following arguments are required: recipe"):  # (argparse lists overrides too)
            example = "recipes/grpo_quickstart.yaml" if self.prog.endswith("train") else "recipes/quickstart.yaml"
            message = f"give a recipe file, e.g. {self.prog} {example}"
        self.exit(2, f"{self.prog}: error: {message} (usage: {usage}; {self.prog.split()[0]} --help for more)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rollout", description="RL rollout generation with speculative decoding")
    parser.add_argument("--version", action="version", version=f"rollout {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    overrides_help = "recipe overrides key.sub=value (win over the file), e.g. sampling.n=8 spec.method=null"
    run = sub.add_parser("run", help="run a recipe and write its output folder")
    run.add_argument("recipe", help="a recipe YAML file, e.g. recipes/quickstart.yaml")
    run.add_argument("overrides", nargs="*", help=overrides_help)
    run.set_defaults(func=_run)
    train = sub.add_parser("train", help="GRPO training through TRL's GRPOTrainer with this library's rollouts")
    train.add_argument("recipe", help="a recipe YAML file with a train section, e.g. recipes/grpo_quickstart.yaml")
    train.add_argument("overrides", nargs="*", help=overrides_help)
    train.set_defaults(func=_train)
    bench = sub.add_parser("bench", help="baseline vs no speculation vs static K vs the recipe's policy")
    bench.add_argument("recipe", help="a recipe YAML file")
    bench.add_argument("overrides", nargs="*", help=overrides_help)
    bench.set_defaults(func=_bench)
    report = sub.add_parser("report", help="per-phase table and plot of a run, or a training's summary and plot")
    report.add_argument("output_dir", help="the output_dir of a `rollout run` or a `rollout train`")
    report.set_defaults(func=_report)
    parser.commands = {"run": run, "train": train, "bench": bench, "report": report}
    return parser


def _version() -> str:
    """The installed package's version ("(not installed)" when run from a source tree that pip did not install)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollout")
    except PackageNotFoundError:
        return "(not installed)"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a run closes its files as it does for Ctrl-C."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status. Under `accelerate launch` (WORLD_SIZE above 1) every process
    runs it as one rank: the first rank to fail prints the one error line, naming itself; the others stop quietly.
    Library warnings go to the run's `warnings.log` (`rollout.cli.library_log`), never between those lines."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, as its other errors are
        command = parser.commands[args.command]
        hint = "; settings are key=value overrides, e.g. overwrite=true" if args.command != "report" else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    with capture_library_warnings() as log:
        status = _main(args, on_success=lambda: log.report(args.command))
    return status


def command() -> int:
    """The `rollout` command as its own process runs it (the console script, `python -m rollout`): `main()`, and
    after a run stopped by a signal, a second signal ends the process at once (`_exit_at_the_next_signal`). A program
    that calls `main()` itself keeps its own signal handlers."""
    status = main()
    if status in (130, 143):
        _exit_at_the_next_signal(status)
    return status


def _exit_at_the_next_signal(status: int) -> None:
    """After a run stopped by a signal has said so (its files written), a second Ctrl-C or SIGTERM while the
    interpreter shuts down (libraries' exit callbacks: W&B's, torch's) ends the process at once with the same status,
    not with a traceback of the callback it broke off after the one line."""
    sys.stdout.flush()
    sys.stderr.flush()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: os._exit(status))


def _main(args: argparse.Namespace, on_success=lambda: None) -> int:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    args.ranks = Ranks()
    succeeded = False
    try:
        if args.command in ("run", "bench"):
            args.ranks = start_ranks()
        args.func(args)
        succeeded = True
    except RankStopped:
        return 1  # another rank failed and said so
    except BrokenPipeError:  # the reader of the output went away (`rollout report ... | head`): nothing to say to it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (the interpreter's last flush at exit would raise again)
        return 141  # a shell's status for SIGPIPE
    except (ValueError, TypeError, OSError) as err:  # OSError: missing files, unreachable hub ids
        if signal_behind(err) is not None:  # a signal that compiled code reported as its own error
            return _interrupted(args, signal_behind(err))
        return _fail(args, err, 2, with_type=False)
    except KeyboardInterrupt as err:
        return _interrupted(args, err)
    except NonFiniteLogits as err:  # the policy's logits went NaN: what finished is kept, and nothing more is said
        return _fail(args, err, 1, with_type=False)
    except Exception as err:  # a rank's unexpected failure: one line naming the rank (one process: the traceback)
        if signal_behind(err) is not None:  # a signal that compiled code reported as its own error
            return _interrupted(args, signal_behind(err))
        if not args.ranks.distributed:
            raise
        if _stopped_by_another(args):  # e.g. gloo's "connection closed" when a peer died
            return 1
        return _fail(args, err, 1, with_type=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        args.ranks.mark_exit()
        if succeeded:  # not after a failure: a peer may be gone, and the barrier would wait for it
            if args.ranks.is_main:  # (before a rank's exit, which ends the process at once)
                on_success()
            args.ranks.exit_process()
    return 0


def _interrupted(args: argparse.Namespace, err: KeyboardInterrupt) -> int:
    """Ctrl-C (130) or SIGTERM (143): one line saying what stopped the run and that what finished was kept. Under
    several ranks the first rank a signal stopped records it and speaks, naming itself (a signal may reach one rank
    or all): the others, stopped by it (its closed connection) or by the same signal, stay quiet."""
    terminated = isinstance(err, Terminated)
    code = 143 if terminated else 130
    ranks = args.ranks
    if _a_later_rank_before_the_ranks_start(args):  # the launcher stopping it after rank 0's refusal: quiet
        return code
    if _stopped_by_another(args):
        return code if _by_a_signal(ranks.failure()) else 1
    speaks, rank = ranks.is_main, ""
    if ranks.distributed:
        from rollout.cli.tracking import stop_reason

        with signals_ignored():  # the claim and the line are not broken off by the launcher's SIGTERM
            speaks = ranks.claim_failure(stop_reason(err))
        rank = f"rank {ranks.rank} of {ranks.world_size}: "
    if speaks:
        what = "terminated (SIGTERM)" if terminated else "interrupted"
        print(f"rollout {args.command}: {rank}{what}{_what_was_kept(args)}", file=sys.stderr)
    return code


def _what_was_kept(args: argparse.Namespace) -> str:
    """What a stopped command left and how to go on, as the end of its one line ("" where there is nothing to say)."""
    if args.command == "run":
        # the run's folder is written once the model is loaded and warmed up: a stop before that leaves none (and an
        # earlier run's config there, one overwrite=true was to replace, is not this run's)
        folder = getattr(args, "run_folder", None)
        config = _file_version(folder / "config.yaml") if folder is not None else None
        if config is None or config == getattr(args, "config_before", None):
            return " before the run began: nothing was written; run the same command again"
        if read_summary(folder).get("complete") is True:  # stopped while its plot or W&B run closed: nothing to resume
            return " after the run finished: its files are whole; rollout report draws its plot again"
        return ": what finished is in the output folder; resume=true continues the run"
    if args.command == "bench":
        bench_file = getattr(args, "bench_file", None)
        if bench_file is not None and bench_file.is_file():
            return f": the rows that finished are in {bench_file} (marked incomplete)"
    elif args.command == "train":
        recipe = getattr(args, "train_recipe", None)
        try:  # (none, or one that ends the training: nothing to resume)
            _, step = checkpoint_to_resume(recipe.output_dir, recipe.train.save_steps) if recipe else (None, None)
        except ValueError:
            step = None
        if step is not None:
            return f": the checkpoint of step {step} is kept; resume=true continues from it"
        if recipe is not None and _stopped_before_a_checkpoint(pathlib.Path(recipe.output_dir)):
            return ": no checkpoint was kept yet, so nothing resumes; overwrite=true runs it again"
    return ""


def _file_version(path: pathlib.Path) -> tuple[int, int] | None:
    """(inode, mtime in ns) of `path`, None where there is none: a file written again (through a rename) differs."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _a_later_rank_before_the_ranks_start(args: argparse.Namespace) -> bool:
    """Whether this process is a rank other than 0 of a launch (`WORLD_SIZE` above 1) that failed or stopped before
    its ranks started (`rollout train` checks its recipe first, as one process): every rank checks the same recipe,
    and each printed the same refusal."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return launched and not args.ranks.distributed and os.environ.get("RANK", "0") != "0"


def _stopped_before_a_checkpoint(folder: pathlib.Path) -> bool:
    """Whether a training's folder was written (its config) but holds no complete checkpoint: the same command is
    refused there, and resume=true too."""
    complete = any(folder.glob("trainer/checkpoint-*/trainer_state.json"))
    return (folder / "config.yaml").is_file() and not complete


def _by_a_signal(failure: str | None) -> bool:
    """Whether a rank's recorded failure ("rank R: cause") is a signal that stopped it."""
    return failure is not None and failure.endswith(("(SIGTERM)", "(SIGINT)"))


LATER_RANK_GRACE_S = 10.0  # how long a later rank that refused a recipe waits for rank 0 to say it


def _fail(args: argparse.Namespace, err: BaseException, status: int, with_type: bool) -> int:
    """Print the one error line (under several ranks: only the first rank to fail, naming itself)."""
    if _a_later_rank_before_the_ranks_start(args):  # rank 0 refuses the same recipe in the same line
        # and is given the time to: this rank's exit makes the launcher stop rank 0 (SIGTERM), which then said
        # "terminated" instead, when this exit came first (a CI run saw it); rank 0's exit stops this one sooner
        try:
            time.sleep(LATER_RANK_GRACE_S)
        except KeyboardInterrupt:  # (the launcher's SIGTERM, once rank 0 has said it and exited)
            pass
        return status
    message = " ".join(str(err).split())  # one line, whatever the message held
    if with_type:
        message = f"{type(err).__name__}: {message}"
    kept = _what_was_kept(args) if isinstance(err, OSError) else ""
    if kept and not kept.startswith(" before the run began"):
        # a file that could not be written once the output was begun (a full disk): what stands, as a stop says
        message += kept.replace(": ", "; ", 1)
    ranks = args.ranks
    if ranks.distributed:
        if _stopped_by_another(args):
            return 1
        with signals_ignored():  # as above: the claim and the line are not broken off by the launcher's SIGTERM
            if not ranks.claim_failure(message):
                return 1
        message = f"rank {ranks.rank} of {ranks.world_size}: {message}"
    print(f"rollout {args.command}: error: {message}", file=sys.stderr)
    return status


def _stopped_by_another(args: argparse.Namespace) -> bool:
    """Whether this rank stopped because another rank failed. A rank that recorded its failure printed it; one whose
    process vanished (killed) is named here, by the first rank to notice."""
    ranks = args.ranks
    if not ranks.distributed:
        return False
    # the launcher's SIGTERM follows a peer's death: it must not break off the look (up to a second) and the one line
    with signals_ignored():
        cause = ranks.stop_cause()
        if cause is None:
            return False
        rank, _, what = cause.partition(": ")
        if what == VANISHED and ranks.claim_failure(what, rank=int(rank.split()[1])):
            print(f"rollout {args.command}: error: {rank} of {ranks.world_size}: {what}", file=sys.stderr)
    return True


if __name__ == "__main__":
    sys.exit(main())
