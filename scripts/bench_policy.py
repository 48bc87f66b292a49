"""The auto K policy's own cost per step (`choose` + `observe`), after a growing number of measured steps.

The policy runs between every two decode steps, and its time is the step's. This times it in a loop of its own (warm
caches: between two forwards of a real rollout it costs about 3x more) on a table profiled like the warm-up's (batch
sizes 1-64, K 0-4, two contexts), with steps of 64 rows at a context that grows by one token a step. Prints
microseconds per call at each checkpoint. One thread; run it at two commits to compare.

    PYTHONPATH=. .venv/bin/python scripts/bench_policy.py --checkpoints 300 4000 20000
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specdec.auto_policy import AutoPolicy, StepObservation
from specdec.step_time import StepTimeTable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[300, 4000, 20000])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls at each checkpoint")
    parser.add_argument(
        "--plain-prior",
        type=float,
        default=1.0,
        help="StepTimeTable's plain_prior: 0.5 as on a GPU (plain steps ahead)",
    )
    args = parser.parse_args()
    table = StepTimeTable(plain_prior=args.plain_prior)
    for batch_size in (1, 4, 16, 64):
        for width in (1, 2, 3, 5):
            for context in (32, 700):
                seconds = 1e-3 * batch_size * width * (1 + context / 1000)
                table.add(batch_size, width, 0, seconds, profiled=True, context=context)
    policy = AutoPolicy(4, {"suffix": False}, table)
    rng = np.random.default_rng(0)
    steps = 0

    def step() -> None:
        nonlocal steps
        context = 300 + steps % 400
        k = policy.choose(64, [4] * 64, ["suffix"] * 64, context).num_draft_tokens
        accepted = [int(min(k, rng.geometric(0.5) - 1)) for _ in range(64)]
        seconds = 1e-3 * 64 * (k + 1) * (1 + context / 1000) * rng.uniform(0.9, 1.1)
        policy.observe(StepObservation(64, k + 1, 0, seconds, {"suffix": ([k] * 64, accepted)} if k else {}, context))
        steps += 1

    for checkpoint in sorted(args.checkpoints):
        while steps < checkpoint:
            step()
        observation = StepObservation(64, 2, 0, 0.02, {"suffix": ([1] * 64, [1, 0] * 32)}, 300)
        start = time.perf_counter()
        for i in range(args.calls):
            policy.choose(64, [4] * 64, ["suffix"] * 64, 300 + i % 400)
        middle = time.perf_counter()
        for _ in range(args.calls):
            policy.observe(observation)
        end = time.perf_counter()
        seen = steps  # (past the checkpoint when the calls timed before it took the count past it)
        steps += args.calls  # the observed steps count as measured ones
        choose_us, observe_us = (middle - start) / args.calls * 1e6, (end - middle) / args.calls * 1e6
        print(f"after {seen:6d} steps: choose {choose_us:6.1f} us, observe {observe_us:6.1f} us")


if __name__ == "__main__":
    main()
