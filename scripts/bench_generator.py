"""Generator vs `model.generate` in padded batches (TRL's path without vLLM), side by side in one process.

    python scripts/bench_generator.py --model tiny-target --num-prompts 128 --batch-size 32

Greedy decoding, so both produce the same tokens and do the same useful work; the workload's completion lengths
have a long tail (most problems are short, a few are long). Also times a decode step with 2 active rows in a
64-slot generator against one in a 2-slot generator. One torch thread; ratios are what to read.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rollout import Generator, SamplingParams


def load(name: str, num_prompts: int):
    from rollout.models.zoo import load_model
    from rollout.tasks.arithmetic import arithmetic_dataset

    model, tokenizer = load_model(name)
    rows = arithmetic_dataset(num_prompts, split="eval")
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    return model.eval(), tokenizer, prompts


def hf_generate(model, tokenizer, prompts, batch_size, max_new_tokens):
    """Padded batches, left padding; returns completions (cut at EOS) and seconds."""
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id
    outs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        for row in out[:, width:].tolist():
            outs.append(row[: row.index(eos) + 1] if eos in row else row)
    return outs, time.perf_counter() - start


def step_cost(model, prompt, num_slots: int, max_new_tokens: int) -> float:
    gen = Generator(model, max_batch_size=num_slots, max_seq_len=len(prompt) + max_new_tokens + 8)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0, stop_token_ids=None)
    gen.generate([prompt, prompt], params)  # warm-up (allocates the cache)
    gen.generate([prompt, prompt], params)
    decode = [r.seconds for r in gen.last_trace if r.kind == "decode" and r.batch_size == 2]
    return statistics.median(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-target")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, prompts = load(args.model, args.num_prompts)
    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens

    gen = Generator(model, max_batch_size=args.batch_size, max_seq_len=max_seq_len)
    gen.generate(prompts[:4], SamplingParams(temperature=0, max_new_tokens=8))  # warm-up
    start = time.perf_counter()
    outs = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens))
    ours_s = time.perf_counter() - start
    ref, hf_s = hf_generate(model, tokenizer, prompts, args.batch_size, args.max_new_tokens)

    lengths = sorted(len(o.token_ids) for o in outs)
    tokens = sum(lengths)
    same = sum(o.token_ids == r for o, r in zip(outs, ref))
    p50, p99 = lengths[len(lengths) // 2], lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))]
    print(f"workload: {len(prompts)} prompts, batch {args.batch_size}, {tokens} tokens, length p50 {p50} p99 {p99}")
    print(f"identical completions: {same}/{len(outs)}")
    print(f"{'':24s}{'seconds':>10s}{'tokens/s':>12s}")
    print(f"{'model.generate (padded)':24s}{hf_s:10.2f}{tokens / hf_s:12.1f}")
    print(f"{'Generator':24s}{ours_s:10.2f}{tokens / ours_s:12.1f}")
    print(f"speed-up: {hf_s / ours_s:.2f}x")

    t64 = step_cost(model, prompts[0], 64, 48)
    t2 = step_cost(model, prompts[0], 2, 48)
    print(f"decode step, 2 active rows: 64 slots {t64 * 1e3:.2f} ms, 2 slots {t2 * 1e3:.2f} ms, ratio {t64 / t2:.2f}")


if __name__ == "__main__":
    main()
