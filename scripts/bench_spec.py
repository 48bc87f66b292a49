"""Speculative decoding vs none, side by side in one process, on the shipped tiny models and task.

    python scripts/bench_spec.py --batch-sizes 1 4 16 64 256 --ks 1 2 4 8 --temperature 1.0
    python scripts/bench_spec.py --batch-sizes 1 4 16 --ks 4 8 --methods ngram --candidates 1 2 4   # chain vs tree

For each batch size b: b held-out prompts, one sample each, `--max-new-tokens` short enough that most rows are still
running at the end, so the batch stays near b. Rows: no speculation, n-gram and draft model at each K. Columns:
tokens/s, speed-up over no speculation at the same b, acceptance rate, and mean emitted tokens per row and step
(vLLM's "mean acceptance length": 1 + accepted drafts). One torch thread; read the ratios.
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


def run(model, prompts, batch_size, spec, params, max_seq_len):
    gen = Generator(model, max_batch_size=batch_size, max_seq_len=max_seq_len, spec=spec)
    gen.generate(prompts[: min(4, len(prompts))], SamplingParams(temperature=0, max_new_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = gen.generate(prompts, params)
    seconds = time.perf_counter() - start
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    tokens = sum(len(o.token_ids) for o in outs)
    row_steps = sum(r.batch_size for r in decode)
    drafted = sum(r.num_drafted for r in decode)
    accepted = sum(r.num_accepted for r in decode)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "acceptance": accepted / drafted if drafted else 0.0,
        "emitted_per_row_step": (row_steps + accepted) / row_steps if row_steps else 0.0,
        "mean_batch_size": row_steps / len(decode) if decode else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft_model"], choices=["ngram", "draft_model"])
    parser.add_argument("--candidates", type=int, nargs="+", default=[1], help="n-gram tree widths (1 = chain)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = zoo.load_model("tiny-target")
    draft, _ = zoo.load_model("tiny-draft")
    data = arithmetic_dataset(max(args.batch_sizes), split="eval", seed=1)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in data["prompt"]]
    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens + 1
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    rows = []
    print(f"{'batch':>5} {'method':>12} {'K':>2} {'tokens/s':>9} {'vs none':>8} {'accept':>7} {'tok/row-step':>12}")
    lookup = {"prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": max(4, args.prompt_lookup_min)}
    for batch_size in args.batch_sizes:
        configs = [("none", 0, None)]
        for method in args.methods:
            for k in args.ks:
                if method == "draft_model":
                    configs.append((method, k, SpecConfig(method=method, num_speculative_tokens=k, model=draft)))
                    continue
                for c in args.candidates:
                    name = "ngram" if c == 1 else f"ngram-tree{c}"
                    configs.append((name, k, SpecConfig(num_speculative_tokens=k, num_candidates=c, **lookup)))
        baseline = None
        for method, k, spec in configs:
            result = run(model, prompts[:batch_size], batch_size, spec, params, max_seq_len)
            baseline = baseline or result["tokens_per_s"]
            result.update(batch_size=batch_size, method=method, k=k, speedup=result["tokens_per_s"] / baseline)
            rows.append(result)
            print(
                f"{batch_size:>5} {method:>12} {k:>2} {result['tokens_per_s']:>9.1f} {result['speedup']:>7.2f}x "
                f"{result['acceptance']:>7.2f} {result['emitted_per_row_step']:>12.2f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
