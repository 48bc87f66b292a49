"""scripts/replay_suffix.py: a recording replays on a fresh proposer with the same drafts at every step, and a replay
that drafts otherwise is caught."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import pickle

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "replay_suffix.py"


@pytest.fixture(scope="module")
def replay_suffix():
    spec = importlib.util.spec_from_file_location("replay_suffix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_recording_replays_with_the_recorded_drafts(replay_suffix, tmp_path):
    path = tmp_path / "calls.pkl"
    args = argparse.Namespace(file=str(path), num_prompts=3, n=3, max_new_tokens=40, slots=6, k=3)
    replay_suffix.record(args)
    recording = pickle.loads(path.read_bytes())
    proposed = [call for call in recording["calls"] if call[0] == "propose"]
    assert len(proposed) > 10 and sum(int(call[5].sum()) for call in proposed) > 20  # steps that drafted
    assert {call[1] for call in recording["calls"] if call[0] == "rollout"} == {"first", "second"}
    timed = replay_suffix.replay(recording, check=True, flush=True)
    assert set(timed) == {"first", "second"} and all(np.isfinite(v) and v > 0 for v in timed.values())
    # one recorded draft changed: the replay names the step
    index = next(i for i, call in enumerate(recording["calls"]) if call[0] == "propose" and call[5].sum() > 0)
    tokens = recording["calls"][index][4].copy()
    row = int(np.flatnonzero(recording["calls"][index][5])[0])
    tokens[row, 0] += 1
    recording["calls"][index] = (*recording["calls"][index][:4], tokens, *recording["calls"][index][5:])
    step = sum(1 for call in recording["calls"][:index] if call[0] == "propose")
    with pytest.raises(AssertionError, match=f"step {step}: expected the recorded drafts"):
        replay_suffix.replay(recording, check=True, flush=False)
