"""A live one-line progress display for a running rollout, redrawn in place on a terminal."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import TextIO


class Progress:
    """An `on_step` callback that redraws one status line: done / total samples, tokens/s, batch size, K, acceptance.

    Args:
        stream: where to draw (stderr by default, so stdout stays clean for results).
        enabled: None draws only when `stream` is a terminal (a log file would collect every redraw).
        min_interval: seconds between redraws.
    """

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None, min_interval: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self.min_interval = min_interval
        self.reset()

    def reset(self) -> None:
        """Start counting a new rollout."""
        self.tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.last_draw = 0.0
        self.drawn = False

    def __call__(self, step: dict, num_finished: int, num_total: int) -> None:
        self.tokens += step["num_emitted"] - step.get("num_discarded", 0)
        self.drafted += step["num_drafted"]
        self.accepted += step["num_accepted"]
        now = time.perf_counter()
        if not self.enabled or (now - self.last_draw < self.min_interval and num_finished < num_total):
            return
        self.last_draw = now
        rate = self.tokens / step["elapsed"] if step["elapsed"] > 0 else 0.0
        accept = f"{self.accepted / self.drafted:.2f}" if self.drafted else "-"
        line = (
            f"rollout {num_finished}/{num_total} samples | {rate:.0f} tokens/s | batch {step['batch_size']} | "
            f"K {step['num_draft_tokens']} | acceptance {accept} | {step['phase']}"
        )
        # cut to the terminal's width (a line that wraps leaves its first rows behind at every redraw), and erased by
        # spaces where the terminal takes no escapes (TERM=dumb)
        width = shutil.get_terminal_size((80, 24)).columns - 1
        line = line[: max(width, 10)]
        if os.environ.get("TERM") == "dumb":
            self.stream.write("\r" + line.ljust(max(width, 10)))
        else:
            self.stream.write("\r\x1b[K" + line)  # carriage return + erase line: redraw in place
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        """End the line so that later output starts on a fresh one."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
        self.reset()
