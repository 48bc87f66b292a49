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


def terminated_on_rank_one(completions, **kwargs):
    """Sends SIGTERM to rank 1's own process only, as a scheduler stopping one worker would."""
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGTERM)
    return [0.0] * len(completions)


_calls = []


def fails_late_on_rank_one(completions, **kwargs):
    """Raises on rank 1 from its `RANK_FAIL_AT`-th call on (unset: never): a run stopped after some rollouts."""
    _calls.append(len(completions))
    at = os.environ.get("RANK_FAIL_AT")
    if at is not None and os.environ.get("RANK") == "1" and len(_calls) >= int(at):
        raise RuntimeError("rank one stops late")
    return [float(len(c) % 3) for c in completions]
