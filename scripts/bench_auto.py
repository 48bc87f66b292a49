"""The auto K policy against static K, side by side in one process, repeated: is auto within a few percent of the best
static K, run after run?

Each repeat runs every configuration once, in turn, on one workload (the quickstart's draft model on the held-out
arithmetic prompts; defaults: 32 prompts x 8 samples, temperature 1.0, up to 384 new tokens, 256 slots), each on a
fresh generator (the auto policy's warm-up is not timed), and prints each rollout's seconds, then per repeat tokens/s
over no speculation and auto's over the best static K of that repeat. One torch thread.

    PYTHONPATH=. .venv/bin/python scripts/bench_auto.py --repeats 3
    PYTHONPATH=. .venv/bin/python scripts/bench_auto.py --explore 20 10   # auto with other exploration periods

`--recipe` takes a recipe's workload instead (its model, prompts, sampling, slots and speculation method; `key=value`
overrides after it), each configuration a rollout as `rollout run` makes it; `--skip-none` leaves no speculation out.
Each repeat runs the configurations in an order rotated by one (no configuration always first):

    PYTHONPATH=. .venv/bin/python scripts/bench_auto.py --recipe recipes/quickstart_suffix.yaml --static-k 1 \
        --skip-none --repeats 12 --control

`--control` runs the first static K a second time as a configuration of its own and reports it as auto is reported:
with the best static K listed first, how far from it the run-to-run noise alone puts a configuration that is exactly
as fast, and how often below 0.97.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from rollout import Generator, SamplingParams
from rollout.models import zoo
from rollout.tasks import arithmetic_dataset
from specdec.config import SpecConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--static-k", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--explore", type=int, nargs="+", default=[20], help="auto rows' explore_every")
    parser.add_argument("--recipe", help="a recipe's workload instead of the draft-model default")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of --recipe")
    parser.add_argument("--skip-none", action="store_true", help="no row without speculation")
    parser.add_argument("--control", action="store_true", help="the first static K again, reported as auto is")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = recipe_runs(args) if args.recipe else default_runs(args)
    names = [name for name in run.configs if not (args.skip_none and name == "none")]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            seconds[name].append(run(name))
            print(f"repeat {repeat} {name}: {seconds[name][-1]:.2f} s", flush=True)
    static = [f"K={k}" for k in args.static_k]
    judged = [name for name in names if name.startswith("auto") or name.endswith(CONTROL)]
    for repeat in range(args.repeats):
        best = min(seconds[name][repeat] for name in static)
        speedups = "  ".join(
            f"{name} {seconds['none'][repeat] / seconds[name][repeat]:.3f}x" for name in names if "none" in seconds
        )
        autos = "  ".join(f"{name} / best static {best / seconds[name][repeat]:.3f}" for name in judged)
        print(f"repeat {repeat}: {speedups}  |  {autos}")
    for name in judged:
        ratios = [min(seconds[k][r] for k in static) / seconds[name][r] for r in range(args.repeats)]
        print(
            f"{name} / best static K over {args.repeats} repeats: mean {statistics.mean(ratios):.3f}, median "
            f"{statistics.median(ratios):.3f}, {sum(r < 0.97 for r in ratios)} below 0.97"
        )
    print(json.dumps({"args": vars(args), "seconds": seconds}))


CONTROL = " (control)"  # the first static K's configuration, run again under this name


def with_control(configs: dict, args) -> None:
    """Add the first static K's entry to `configs` again under its control name, when `--control` asks for it."""
    if args.control:
        first = f"K={args.static_k[0]}"
        configs[first + CONTROL] = configs[first]


class default_runs:
    """The quickstart's draft model on held-out arithmetic prompts: `run(name)` times one `generate` of that
    configuration on a fresh generator (its warm-up untimed)."""

    def __init__(self, args):
        self.args = args
        self.model, tokenizer = zoo.load_model("tiny-target")
        draft, _ = zoo.load_model("tiny-draft")
        data = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
        self.prompts = [tokenizer(row["prompt"])["input_ids"] for row in data]
        self.params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        self.configs: dict[str, tuple[SpecConfig | None, int | None]] = {"none": (None, None)}
        for k in args.static_k:
            self.configs[f"K={k}"] = (SpecConfig(method="draft_model", model=draft, num_speculative_tokens=k), None)
        for every in args.explore:
            auto = SpecConfig(method="draft_model", model=draft, num_speculative_tokens=4,
                              num_speculative_tokens_per_batch_size="auto")  # fmt: skip
            self.configs[f"auto (explore {every})"] = (auto, every)
        with_control(self.configs, args)

    def __call__(self, name: str) -> float:
        spec, every = self.configs[name]
        args = self.args
        gen = Generator(self.model, max_batch_size=args.slots, max_seq_len=args.max_new_tokens + 256, spec=spec)
        if every is not None:
            gen.policy.explore_every = every
        gen.generate(self.prompts[:2], SamplingParams(n=1, max_new_tokens=8))  # untimed warm-up
        start = time.perf_counter()
        gen.generate(self.prompts, self.params)
        return time.perf_counter() - start


class recipe_runs:
    """A recipe's workload: `run(name)` times one rollout of that configuration (static K, or the recipe's auto
    policy with `explore_every` set) as `rollout run` builds it, on a fresh generator (its warm-up untimed)."""

    def __init__(self, args):
        from rollout.cli.bench import make_rollout
        from rollout.cli.recipe import load_recipe
        from rollout.cli.runs import load_inputs, recipe_spec

        self.make_rollout, self.recipe_spec = make_rollout, recipe_spec
        overrides = ["logging.wandb_mode=disabled", "logging.progress=false", *args.overrides]
        self.recipe = load_recipe(args.recipe, overrides)
        self.inputs = load_inputs(self.recipe)
        self.configs = {"none": None, **{f"K={k}": k for k in args.static_k}}
        self.configs.update({f"auto (explore {every})": every for every in args.explore})
        with_control(self.configs, args)

    def __call__(self, name: str) -> float:
        setting, recipe = self.configs[name], self.recipe
        if name == "none":
            spec = None
        elif name.startswith("K="):
            spec = self.recipe_spec(recipe, num_speculative_tokens=setting, num_speculative_tokens_per_batch_size=None)
        else:
            spec = self.recipe_spec(recipe, num_speculative_tokens_per_batch_size="auto")
        rollout = self.make_rollout(recipe, self.inputs, spec, 1)
        if name.startswith("auto"):
            rollout.generator.policy.explore_every = setting
        rollout.generator.generate(self.inputs.prompt_ids[:2], replace(recipe.sampling, n=1, max_new_tokens=8))
        batch = rollout(self.inputs.data, group_indices=self.inputs.group_indices)
        return batch.summary["wall_seconds"]


if __name__ == "__main__":
    main()
