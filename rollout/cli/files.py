"""Output files that are never half-written, and output folders that are never silently replaced."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import shutil
import tempfile
from collections.abc import Iterator

# what each command writes into its output folder (and so what its `overwrite` removes); anything else there, a
# benchmark beside a run or a user's own `model/` beside a `rollout run`, is left as it is
RUN_OUTPUTS = ("rollouts.jsonl", "steps.jsonl", "summary.json", "config.yaml", "rollout.png", "warnings.log", "wandb",
               "ranks")  # fmt: skip
TRAIN_OUTPUTS = ("train.jsonl", "summary.json", "config.yaml", "train.png", "warnings.log", "wandb", "trainer", "model")


def write_atomic(path: str | pathlib.Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename: a reader sees the old file
    or the new one, never a part."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_path(path: str | pathlib.Path):
    """A temporary path beside `path` to write to; renamed onto `path` when the block ends without an error."""
    path = pathlib.Path(path)
    while True:  # (not mkstemp: its file is 0600, where a file written in place takes 0666 less the umask)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}{path.suffix}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:  # named as the file it was to be (a full disk failed on '.summary.json.5384331b.json')
        if err.filename != str(tmp):
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # (a folder removed or made read-only: the error above says so)


def check_output_dir(
    path: str | pathlib.Path, overwrite: bool, resumable: bool = True, outputs: tuple[str, ...] = RUN_OUTPUTS
) -> None:
    """Refuse, without writing anything, an output folder a new run may not write to: a file; one that cannot be
    written; one that holds what the command writes (`outputs`), or other files, unless `overwrite`. (Hidden files,
    e.g. a half-written temporary one, are ignored.)"""
    folder = pathlib.Path(path)
    if not folder.exists():
        check_makeable(folder)
        return
    if not folder.is_dir():
        raise ValueError(f"output_dir {folder} is a file: choose a folder")
    check_writable(folder)
    if overwrite:
        return
    existing = [name for name in outputs if (folder / name).exists()]
    if existing:
        # (resume needs the run's recipe: a folder without it holds a stopped run's first files at most)
        resume = resumable and (folder / "config.yaml").is_file()
        raise ValueError(
            f"output_dir {folder} already holds a run ({', '.join(existing)}): "
            + ("pass resume=true to continue it, " if resume else "")
            + "pass overwrite=true to replace it, or choose another output_dir"
        )
    others = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ValueError(
            f"output_dir {folder} holds files that are not a run's ({shown}): choose another output_dir, or pass "
            "overwrite=true to write the run among them (only a run's own files are replaced)"
        )


MIN_FREE_BYTES = 1 << 20  # a run's first files (its config, summary, plot) take some hundreds of KB


def check_writable(folder: pathlib.Path, output_dir: pathlib.Path | None = None) -> None:
    """Refuse a folder no file can be made in (read-only, immutable, another user's) or whose disk is full, before a
    model loads: an unnamed temporary file is made there and dropped. `output_dir`: the folder to be made in it, if
    not `folder`."""
    where = f"{folder}" if output_dir is None else f"{output_dir}: {folder}"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
        free = shutil.disk_usage(folder).free
    except OSError as err:
        raise ValueError(f"output_dir {where} cannot be written ({err.strerror}): choose another output_dir") from None
    if free < MIN_FREE_BYTES:
        raise ValueError(
            f"output_dir {where} is on a disk with {free // 1024} KiB free: free some space or choose another "
            "output_dir"
        )


def check_makeable(folder: pathlib.Path) -> None:
    """Refuse an output folder that cannot be made because a file stands where one of its parents would be."""
    for parent in folder.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"output_dir {folder}: {parent} is a file, so no folder can be made in it")
            check_writable(parent, folder)
            return


def checkpoint_to_resume(output_dir: str | pathlib.Path, save_steps: int) -> tuple[pathlib.Path, int]:
    """The newest complete checkpoint `rollout train` keeps (`output_dir/trainer/checkpoint-N`) and its step N.
    Complete: its `trainer_state.json` is there (the trainer writes it last; a stop while it saves leaves a folder
    without it, and the one before stays until the new one is whole). Refused (ValueError) where there is none, or
    where it ends the training (a resume would have nothing to run: transformers then goes on into the unfinished
    epoch, past `train.steps`)."""
    found = []
    for path in (pathlib.Path(output_dir) / "trainer").glob("checkpoint-*"):
        step = path.name[len("checkpoint-") :]
        if step.isdigit() and (path / "trainer_state.json").is_file():
            found.append((int(step), path))
    if not found:
        raise ValueError(
            f"resume=true but {output_dir} holds no complete checkpoint (trainer/checkpoint-N, written every "
            f"train.save_steps={save_steps} steps: the training stopped before the first): run it again with "
            "overwrite=true"
        )
    step, path = max(found)
    total = json.loads((path / "trainer_state.json").read_text()).get("max_steps") or 0
    if 0 < total <= step:
        raise ValueError(
            f"resume=true but the training in {output_dir} finished: its last checkpoint is of step {step} of "
            f"{total}, and holds the trained model ({path}); nothing is left to run (overwrite=true trains it again)"
        )
    return path, step


def check_resumable(path: str | pathlib.Path, config: dict | None) -> None:
    """Refuse to resume where there is no run, or a run made with another recipe (sections that change samples)."""
    folder = pathlib.Path(path)
    saved_path = folder / "config.yaml"
    if not saved_path.is_file():
        raise ValueError(f"resume=true but {folder} holds no run (no config.yaml): drop resume=true")
    if config is None:
        return
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(OmegaConf.load(saved_path))
    # none of these changes a sample (output_dir: the folder resumed is this one, however its path is spelt;
    # bench: `rollout bench` only)
    ignored = {"resume", "overwrite", "logging", "distributed", "output_dir", "bench"}
    for key in sorted(set(saved) | set(config)):
        if key not in ignored and saved.get(key) != config.get(key):
            raise ValueError(
                f"resume=true but the run in {folder} was made with another {key!r} section: resume with the same "
                "recipe and overrides, or start afresh with overwrite=true"
            )


def read_summary(folder: str | pathlib.Path) -> dict:
    """A run's summary.json, {} where there is none (a stopped or killed run) or it is not a summary."""
    try:
        summary = json.loads((pathlib.Path(folder) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def check_unfinished(path: str | pathlib.Path) -> None:
    """Refuse to resume a `rollout run` that finished: its summary says it is complete, and a resume would have
    nothing to run (it rewrote the same files and started a W&B run holding the summary alone)."""
    if read_summary(path).get("complete") is True:
        raise ValueError(
            f"resume=true but the run in {path} is complete (its summary.json says so): nothing is left to run; pass "
            "overwrite=true to run it again, or choose another output_dir"
        )


def prepare_output_dir(
    path: str | pathlib.Path, overwrite: bool, resumable: bool = True, outputs: tuple[str, ...] = RUN_OUTPUTS
) -> pathlib.Path:
    """Create the run's output folder (`check_output_dir` first); with `overwrite`, what the command writes
    (`outputs`) is removed where it is there already (so nothing stale from the old run stays beside the new one)."""
    folder = pathlib.Path(path)
    check_output_dir(folder, overwrite, resumable, outputs)
    for name in outputs:
        target = folder / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def append_lines(path: str | pathlib.Path, text: str) -> None:
    """Append whole lines with one write to a file opened for appending: a reader, or a run killed at any point,
    sees each line whole or not at all (at worst the last line is cut if the machine itself fails)."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    finally:
        os.close(fd)


def write_jsonl(path: str | pathlib.Path, records: list[dict], allow_nan: bool = False) -> None:
    """Replace `path` with `records`, one JSON object a line, in one write (`write_atomic`)."""
    write_atomic(path, "".join(json.dumps(r, allow_nan=allow_nan) + "\n" for r in records))


def read_jsonl(path: str | pathlib.Path, damaged: list[int] | None = None) -> list[dict]:
    """The whole lines of a JSONL file that parse (a line cut by a kill, the last one, is left out); `damaged`, if
    given, gets the index among the non-blank lines of each one left out."""
    return list(iter_jsonl(path, damaged))


def iter_jsonl(path: str | pathlib.Path, damaged: list[int] | None = None) -> Iterator[dict]:
    """`read_jsonl`'s records one at a time, the file read line by line (a run's files reach gigabytes: read whole
    and split, one took several times its size in memory)."""
    path = pathlib.Path(path)
    if not path.is_file():
        return
    with path.open() as file:
        for index, line in enumerate(line for line in file if line.strip()):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if damaged is not None:
                    damaged.append(index)
                continue
            yield record
