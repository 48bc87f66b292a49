"""Output files that are never half-written, and output folders that are never silently replaced."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile

# what a run writes into its output folder (and so what `overwrite` removes)
RUN_FILES = (
    "rollouts.jsonl",
    "steps.jsonl",
    "summary.json",
    "config.yaml",
    "rollout.png",
    "train.jsonl",
    "train.png",
    "bench.json",
    "warnings.log",
)
RUN_FOLDERS = ("wandb", "trainer", "model", "ranks")


def write_atomic(path: str | pathlib.Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename: a reader sees the old file
    or the new one, never a part."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_path(path: str | pathlib.Path):
    """A temporary path beside `path` to write to; renamed onto `path` when the block ends without an error."""
    path = pathlib.Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = pathlib.Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def prepare_output_dir(path: str | pathlib.Path, overwrite: bool, resumable: bool = True) -> pathlib.Path:
    """Create the run's output folder; refuse one that holds a run's files unless `overwrite`, which removes them
    first (so nothing stale from the old run stays beside the new one)."""
    folder = pathlib.Path(path)
    existing = [name for name in (*RUN_FILES, *RUN_FOLDERS) if (folder / name).exists()]
    if existing and not overwrite:
        raise ValueError(
            f"output_dir {folder} already holds a run ({', '.join(existing)}): "
            + ("pass resume=true to continue it, " if resumable else "")
            + "pass overwrite=true to replace it, or choose another output_dir"
        )
    for name in existing:
        target = folder / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
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


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
    """The whole lines of a JSONL file that parse (a line cut by a kill, the last one, is left out)."""
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().split("\n"):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
