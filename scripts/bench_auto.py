"""The auto K policy against static K, side by side in one process, repeated: is auto within a few percent of the best
static K, run after run?

Each repeat runs every configuration once, in turn, on one workload (the quickstart's draft model on the held-out
arithmetic prompts; defaults: 32 prompts x 8 samples, temperature 1.0, up to 384 new tokens, 256 slots), each on a
fresh generator (the auto policy's warm-up is not timed), and prints each rollout's seconds, then per repeat tokens/s
over no speculation and auto's over the best static K of that repeat. One torch thread.

    PYTHONPATH=. .venv/bin/python scripts/bench_auto.py --repeats 3
    PYTHONPATH=. .venv/bin/python scripts/bench_auto.py --explore 20 10   # auto with other exploration periods
"""

from __future__ import annotations

import argparse
import json
import time

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
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = zoo.load_model("tiny-target")
    draft, _ = zoo.load_model("tiny-draft")
    data = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in data]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    configs: dict[str, tuple[SpecConfig | None, int | None]] = {"none": (None, None)}
    for k in args.static_k:
        configs[f"K={k}"] = (SpecConfig(method="draft_model", model=draft, num_speculative_tokens=k), None)
    for every in args.explore:
        auto = SpecConfig(method="draft_model", model=draft, num_speculative_tokens=4,
                          num_speculative_tokens_per_batch_size="auto")  # fmt: skip
        configs[f"auto (explore {every})"] = (auto, every)
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    for repeat in range(args.repeats):
        for name, (spec, every) in configs.items():
            gen = Generator(model, max_batch_size=args.slots, max_seq_len=args.max_new_tokens + 256, spec=spec)
            if every is not None:
                gen.policy.explore_every = every
            gen.generate(prompts[:2], SamplingParams(n=1, max_new_tokens=8))  # untimed warm-up
            start = time.perf_counter()
            gen.generate(prompts, params)
            seconds[name].append(time.perf_counter() - start)
            print(f"repeat {repeat} {name}: {seconds[name][-1]:.2f} s", flush=True)
    static = [f"K={k}" for k in args.static_k]
    for repeat in range(args.repeats):
        best = min(seconds[name][repeat] for name in static)
        speedups = "  ".join(f"{name} {seconds['none'][repeat] / seconds[name][repeat]:.3f}x" for name in configs)
        autos = "  ".join(
            f"{name} / best static {best / seconds[name][repeat]:.3f}" for name in configs if name.startswith("auto")
        )
        print(f"repeat {repeat}: {speedups}  |  {autos}")
    print(json.dumps({"args": vars(args), "seconds": seconds}))


if __name__ == "__main__":
    main()
