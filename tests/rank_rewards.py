"""Reward functions for the multi-process tests: they fail on one rank only (RANK is what the launcher sets)."""

import os
import signal


def fails_on_rank_one(completions, **kwargs):
    """Raises on rank 1, as a buggy reward would."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank one's reward breaks")
    return [0.0] * len(completions)


def killed_on_rank_one(completions, **kwargs):
    """Kills rank 1's own process, as the out-of-memory killer would."""
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
