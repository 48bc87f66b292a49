"""TRL's GRPOTrainer with its own generation vs with this library's rollouts, side by side in one process.

The GRPO recipe's settings (shipped tiny model, arithmetic task, prompts x n per step, max_new_tokens, learning rate)
run for the same number of optimiser steps from the same initial weights and seed with each generation backend:

- TRL generate: `GRPOTrainer` without a rollout_func (transformers' `generate` on left-padded batches);
- rollout, none: `trl_rollout_func()` (this library's generator, no speculation);
- rollout, <method>: `trl_rollout_func(spec=...)` for each method asked (auto K; `a+b`: the cascade `[a, b]`).

Printed per backend: seconds per optimiser step, generation seconds per step (the trainer's `_generate`, which both
paths go through), the ratios to TRL generate, and the mean reward. One torch thread.

    .venv/bin/python scripts/bench_trl.py                       # 10 steps, suffix and draft model
    .venv/bin/python scripts/bench_trl.py --steps 20 --methods suffix
    .venv/bin/python scripts/bench_trl.py --steps 24 --no-baselines --methods suffix draft_model suffix+draft_model
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def run(name: str, rollout_func, recipe) -> dict:
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from rollout.cli.runs import load_inputs
    from rollout.cli.train import _trl_reward, grpo_config, trl_dataset
    from rollout.rewards import build_rewards

    inputs = load_inputs(recipe)
    dataset = trl_dataset(recipe, inputs)
    terms = build_rewards([(r.name, r.weight) for r in recipe.rewards])
    trainer = GRPOTrainer(
        model=inputs.model,
        reward_funcs=[_trl_reward(t, recipe.rollout.non_finite_rewards_as_null) for t in terms],
        args=grpo_config(recipe, report_to="none"),
        train_dataset=dataset,
        processing_class=inputs.tokenizer,
        rollout_func=rollout_func,
    )
    trainer.remove_callback(PrinterCallback)
    generation: list[float] = []
    inner = trainer._generate

    def timed(prompts):
        start = time.perf_counter()
        try:
            return inner(prompts)
        finally:
            generation.append(time.perf_counter() - start)

    trainer._generate = timed
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [e for e in trainer.state.log_history if "loss" in e]
    steps = [e["step_time"] for e in logs]
    row = {
        "name": name,
        "steps": len(logs),
        "wall_seconds": wall,
        "step_seconds": statistics.mean(steps),
        "generation_seconds": statistics.mean(generation),
        "reward": statistics.mean(e["reward"] for e in logs),
        "completion_tokens": statistics.mean(e["completions/mean_length"] for e in logs),
    }
    print(
        f"{name:24s} {row['step_seconds']:7.2f} s/step  generation {row['generation_seconds']:6.2f} s/step  "
        f"reward {row['reward']:.3f}  mean length {row['completion_tokens']:.0f}",
        flush=True,
    )
    del trainer, inputs
    gc.collect()
    return row


def main() -> None:
    from rollout.cli.recipe import load_recipe
    from rollout.cli.runs import recipe_spec
    from rollout.integrations.trl import trl_rollout_func

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="recipes/grpo_quickstart.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--methods", nargs="*", default=["suffix", "draft_model"], help="'a+b' runs the cascade [a, b]")
    parser.add_argument("--no-baselines", action="store_true", help="skip TRL generate and rollout, none")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides key.sub=value")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    overrides = [f"train.steps={args.steps}", "logging.wandb_mode=disabled", *args.overrides]
    recipe = load_recipe(args.recipe, overrides)
    rows = (
        []
        if args.no_baselines
        else [run("TRL generate", None, recipe), run("rollout, none", trl_rollout_func(), recipe)]
    )
    for method in args.methods:
        methods = method.split("+")  # "suffix+draft_model": the cascade ["suffix", "draft_model"]
        changes = {"method": methods if len(methods) > 1 else method, "num_speculative_tokens_per_batch_size": "auto"}
        if "draft_model" in methods:
            changes["model"] = "tiny-draft"
        spec = recipe_spec(recipe, **changes)
        rows.append(run(f"rollout, {method}", trl_rollout_func(spec=spec, max_batch_size=64), recipe))
    base = rows[0]  # the ratios are to the first row: TRL generate, unless --no-baselines
    print(f"\n{'backend':24s} {'s/step':>8s} {'gen s/step':>11s} {'step x TRL':>11s} {'gen x TRL':>10s} {'reward':>7s}")
    for row in rows:
        print(
            f"{row['name']:24s} {row['step_seconds']:8.2f} {row['generation_seconds']:11.2f} "
            f"{base['step_seconds'] / row['step_seconds']:11.2f} "
            f"{base['generation_seconds'] / row['generation_seconds']:10.2f} {row['reward']:7.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
