"""Build the widened models and check that they compute what the shipped ones compute.

For `tiny-target-1b` and `tiny-draft-150m`: parameter count, KV-cache bytes per token in bf16, build time, and, on N
held-out arithmetic prompts, the shipped model's greedy completion teacher-forced through the widened model: its
greedy token at every position must be the shipped model's (so greedy generation gives the same completions), the
log-probs of the emitted tokens agree, and every added vocabulary row has probability exactly 0.

    python scripts/check_widened.py                                  # float32 on the CPU (~6 GB of memory)
    python scripts/check_widened.py --device cuda --dtype bfloat16 --num-prompts 32
"""

from __future__ import annotations

import argparse
import time

import torch

from rollout.models.widen import WIDENED
from rollout.models.zoo import load_model
from rollout.tasks.arithmetic import format_prompt, generate_problems

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@torch.no_grad()
def compare(small, wide, tokenizer, prompts: list[str], max_new_tokens: int, device) -> dict[str, float]:
    """Greedy completions of `small`, teacher-forced through both models, one prompt at a time."""
    vocab = small.config.vocab_size
    stats = {"positions": 0, "equal": 0, "emitted": 0.0, "full": 0.0, "added_prob": 0.0}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        sequence = small.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        small_logprobs = small(sequence).logits.double().log_softmax(-1)  # [1, T, vocab]
        wide_logits = wide(sequence).logits  # [1, T, wide vocab], in the model's dtype
        wide_logprobs = wide_logits.double().log_softmax(-1)
        span = slice(ids.shape[1] - 1, sequence.shape[1] - 1)  # positions that predict a completion token
        emitted = sequence[:, span.start + 1 :, None]
        stats["positions"] += emitted.shape[1]
        stats["equal"] += (wide_logprobs[:, span].argmax(-1) == small_logprobs[:, span].argmax(-1)).sum().item()
        diff = small_logprobs[:, span].gather(-1, emitted) - wide_logprobs[:, span].gather(-1, emitted)
        stats["emitted"] = max(stats["emitted"], diff.abs().max().item())
        full = (small_logprobs - wide_logprobs[..., :vocab]).abs().max().item()
        stats["full"] = max(stats["full"], full)
        for probs in (wide_logits.float().softmax(-1), wide_logits.softmax(-1)):
            stats["added_prob"] = max(stats["added_prob"], probs[..., vocab:].max().item())
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    problems = generate_problems(args.num_prompts, split="eval", seed=123)
    prompts = [format_prompt(p.problem) for p in problems]
    print(f"torch {torch.__version__}, device {device}, dtype {args.dtype}, {args.num_prompts} held-out prompts")
    for name, (base, shape) in WIDENED.items():
        start = time.perf_counter()
        wide, tokenizer = load_model(name, dtype=dtype, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        small, _ = load_model(base, dtype=dtype, device=device)
        c = wide.config
        print(
            f"{name}: hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads} query / "
            f"{c.num_key_value_heads} KV heads of {c.head_dim}, MLP {c.intermediate_size}, vocab {c.vocab_size}"
        )
        print(
            f"  parameters {wide.num_parameters():,} (shape says {shape.num_parameters():,}; {base}: "
            f"{small.num_parameters():,}); KV per token in bf16 {shape.kv_bytes_per_token(2):,} bytes; "
            f"built in {seconds:.1f} s"
        )
        start = time.perf_counter()
        s = compare(small, wide, tokenizer, prompts, args.max_new_tokens, device)
        print(
            f"  vs {base}: greedy token equal at {s['equal']}/{s['positions']} completion positions; "
            f"max |log-prob diff|: emitted tokens {s['emitted']:.2e}, full vocabulary {s['full']:.2e}; "
            f"largest added-row probability {s['added_prob']} ({time.perf_counter() - start:.0f} s)"
        )
        del wide, small


if __name__ == "__main__":
    main()
