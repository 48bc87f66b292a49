"""The `rollout` command line.

    rollout generate [--model tiny-target] [--num-prompts 64] [--method ngram|draft_model] [--k 3] [--draft tiny-draft]

`generate` samples completions for held-out problems of the embedded arithmetic task and prints accuracy and
tokens/s. User errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time


def _generate(args: argparse.Namespace) -> None:
    import torch

    from rollout import Generator, SamplingParams, zoo
    from rollout.tasks import arithmetic_dataset, arithmetic_reward
    from specdec.config import SpecConfig

    torch.set_num_threads(args.threads)
    model, tokenizer = zoo.load_model(args.model)
    rows = arithmetic_dataset(args.num_prompts, split="eval", seed=args.seed)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in rows["prompt"]]
    spec = None
    if args.method is not None:
        draft = args.draft if args.method == "draft_model" else None
        spec = SpecConfig(method=args.method, num_speculative_tokens=args.k, model=draft)
    gen = Generator(model, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len, spec=spec)
    params = SamplingParams(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    start = time.perf_counter()
    outs = gen.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    texts = tokenizer.batch_decode([o.token_ids for o in outs], skip_special_tokens=True)
    answers = [rows["answer"][o.prompt_index] for o in outs]
    rewards = arithmetic_reward(texts, answers)
    tokens = sum(len(o.token_ids) for o in outs)
    trace = gen.last_trace
    drafted = sum(r.num_drafted for r in trace)
    accepted = sum(r.num_accepted for r in trace)
    print(f"model {args.model}: {len(prompt_ids)} held-out prompts x {args.n} samples, temperature {args.temperature}")
    print(f"sample: {rows['prompt'][0]!r} -> {texts[0]!r}")
    print(f"accuracy {sum(rewards) / len(rewards):.3f}")
    print(f"{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s ({len(trace)} steps)")
    if spec is not None:
        print(f"speculation {args.method} K={args.k}: acceptance {accepted / max(drafted, 1):.3f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description="RL rollout generation with speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="sample completions for held-out problems; print accuracy and tokens/s")
    gen.add_argument("--model", default="tiny-target", help="a shipped model short name")
    gen.add_argument("--num-prompts", type=int, default=64)
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--max-new-tokens", type=int, default=384)
    gen.add_argument("--max-seq-len", type=int, default=640)
    gen.add_argument("--batch-size", type=int, default=64)
    gen.add_argument("--method", choices=["ngram", "draft_model"], default=None, help="speculative proposer")
    gen.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    gen.add_argument("--draft", default="tiny-draft", help="draft model (short name or path) for --method draft_model")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--threads", type=int, default=1, help="torch threads (1 gives stable timings)")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"rollout {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
