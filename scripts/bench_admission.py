"""Admission in whole prompt groups against admission as slots free up, side by side in one process.

    python scripts/bench_admission.py recipes/quickstart.yaml --repeats 2 sampling.n=8 spec.method=null

A recipe's rollout (its model, prompts, sampling, speculation and slots) run on one generator per setting, the two
settings alternating, `--repeats` times each; every rollout draws the same samples (one seed), so the ratio reads
the schedule alone. Prints each run's seconds, tokens/s, prefill steps and the prompts they prefilled (a prompt split
over two admissions is prefilled twice), then the ratio of the medians. One torch thread unless `--threads`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rollout import Generator, SamplingParams
from rollout.cli.recipe import load_recipe
from rollout.cli.runs import batch_size, engine_options, load_inputs, recipe_spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="a recipe YAML, e.g. recipes/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", help="key.sub=value, as `rollout run` takes them")
    parser.add_argument("--repeats", type=int, default=2, help="rollouts per setting (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return parser.parse_intermixed_args(argv)


def run(gen: Generator, prompt_ids: list[list[int]], params: SamplingParams) -> dict:
    """One rollout; its seconds, tokens and prefill steps."""
    start = time.perf_counter()
    outs = gen.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    prefills = [r for r in gen.last_trace if r.kind == "prefill"]
    return {
        "seconds": seconds,
        "tokens": sum(len(o.token_ids) for o in outs),
        "prefill_steps": len(prefills),
        "prompts_prefilled": sum(r.batch_size for r in prefills),
        "prefill_seconds": sum(r.seconds for r in prefills),
        "decode_steps": len(gen.last_trace) - len(prefills),
        "samples": [o.token_ids for o in outs],
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe, args.overrides)
    inputs = load_inputs(recipe)
    spec = recipe_spec(recipe)
    params = recipe.sampling  # a SamplingParams, as `rollout run` samples with
    slots = batch_size(recipe, inputs, spec)
    generators = {}
    for whole in (True, False):
        gen = Generator(inputs.model, max_batch_size=slots, max_seq_len=inputs.max_seq_len, spec=spec,
                        **engine_options(recipe))  # fmt: skip
        gen.scheduler.whole_groups = whole
        generators[whole] = gen
    print(f"{len(inputs.prompt_ids)} prompts x {params.n}, {slots} slots, speculation {spec.method if spec else None}")
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for repeat in range(args.repeats):
        for whole in (True, False):
            gen = generators[whole]
            if gen.draft_history is not None:  # each rollout drafts from nothing earlier, as the first of a run does
                gen.draft_history.clear()
            result = run(gen, inputs.prompt_ids, params)
            runs[whole].append(result)
            print(
                f"{'whole groups' if whole else 'as slots free'} {repeat}: {result['seconds']:.2f} s, "
                f"{result['tokens'] / result['seconds']:.0f} tokens/s, {result['prefill_steps']} prefill steps "
                f"({result['prompts_prefilled']} prompts, {result['prefill_seconds']:.2f} s), "
                f"{result['decode_steps']} decode steps",
                flush=True,
            )
    same = all(r["samples"] == runs[True][0]["samples"] for r in runs[True] + runs[False])
    median = {whole: statistics.median(r["seconds"] for r in runs[whole]) for whole in runs}
    ratio = median[False] / median[True]
    print(f"same samples in every run: {same}; whole groups over as slots free (median seconds): {ratio:.3f}x")
    return {"ratio": ratio, "same_samples": same, "runs": runs}


if __name__ == "__main__":
    main()
