"""Measure the tiny target/draft pair on held-out arithmetic problems.

Metrics: greedy accuracy of the target; at temperature 1.0 with several samples per prompt, the share of prompts
with both right and wrong samples and the p99/p50 ratio of completion lengths; and how often the draft's greedy
next token equals the target's on target-generated text.

    python scripts/eval_tiny_models.py                       # the shipped models
    python scripts/eval_tiny_models.py --dir outputs/tiny    # models written by train_tiny_models.py --out

Uses batched `model.generate` with left padding and one torch thread.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from rollout.tasks.arithmetic import arithmetic_reward, format_prompt, generate_problems

MAX_NEW_TOKENS = 768  # the longest solution (30 days) is about 680 tokens


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompts: list[str],
    *,
    num_samples: int = 1,
    do_sample: bool = False,
    seed: int = 0,
    batch_size: int = 16,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[list[int]]:
    """Completion token ids (cut after the first EOS, which is kept) for each prompt, `num_samples` per prompt.

    Small batches of similar prompts are faster on CPU than large ones: `generate` runs every row until the
    longest is done, and a long-tailed batch mostly waits for its one long problem.

    Returns a list ordered prompt-major: samples of prompt i are at [i * num_samples, (i + 1) * num_samples).
    """
    tokenizer.padding_side = "left"  # generation appends on the right, so prompts must end at the same column
    # Sort by prompt length so a batch holds problems of similar size and short ones do not wait for long ones.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[list[int]]] = [[] for _ in prompts]
    prompts_per_batch = max(1, batch_size // num_samples)
    generator_seed = seed
    for start in range(0, len(order), prompts_per_batch):
        idx = order[start : start + prompts_per_batch]
        enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True)
        torch.manual_seed(generator_seed)  # a seed per batch keeps results independent of earlier batches
        generator_seed += 1
        out = model.generate(
            **enc,
            do_sample=do_sample,
            temperature=1.0 if do_sample else None,
            top_k=0 if do_sample else None,
            top_p=1.0 if do_sample else None,
            num_return_sequences=num_samples,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        completions = out[:, enc["input_ids"].shape[1] :].tolist()
        for row, ids in enumerate(completions):
            if tokenizer.eos_token_id in ids:
                ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
            results[idx[row // num_samples]].append(ids)
    return [ids for per_prompt in results for ids in per_prompt]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank, so small samples give an observed value."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


@torch.no_grad()
def draft_agreement(target, draft, tokenizer, prompts: list[str], completions: list[list[int]]) -> float:
    """Share of completion positions where the draft's argmax equals the target's argmax (teacher-forced)."""
    matches, total = 0, 0
    for prompt, completion in zip(prompts, completions):
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = torch.tensor([prompt_ids + completion])
        # Position t predicts token t + 1: the predictions for the completion start at the last prompt token.
        span = slice(len(prompt_ids) - 1, ids.shape[1] - 1)
        target_next = target(ids).logits[0, span].argmax(-1)
        draft_next = draft(ids).logits[0, span].argmax(-1)
        matches += int((target_next == draft_next).sum())
        total += target_next.numel()
    return matches / max(total, 1)


def evaluate(
    target,
    draft,
    tokenizer,
    *,
    num_greedy: int = 200,
    num_sampled: int = 100,
    num_samples: int = 8,
    num_agreement: int = 50,
    seed: int = 0,
) -> dict[str, float]:
    """All the metrics of this module on eval-split problems; see the module docstring."""
    start = time.time()
    problems = generate_problems(max(num_greedy, num_sampled, num_agreement), split="eval", seed=seed)
    prompts = [format_prompt(p.problem) for p in problems]
    answers = [p.answer for p in problems]

    greedy = generate_completions(target, tokenizer, prompts[:num_greedy])
    greedy_text = tokenizer.batch_decode(greedy, skip_special_tokens=True)
    greedy_accuracy = sum(arithmetic_reward(greedy_text, answers[:num_greedy])) / max(num_greedy, 1)

    sampled = generate_completions(
        target, tokenizer, prompts[:num_sampled], num_samples=num_samples, do_sample=True, seed=seed
    )
    sampled_text = tokenizer.batch_decode(sampled, skip_special_tokens=True)
    rewards = arithmetic_reward(sampled_text, [a for a in answers[:num_sampled] for _ in range(num_samples)])
    groups = [rewards[i * num_samples : (i + 1) * num_samples] for i in range(num_sampled)]
    mixed = sum(1 for g in groups if 0.0 < sum(g) < len(g)) / max(num_sampled, 1)
    lengths = [len(ids) for ids in sampled]
    p50, p99 = percentile(lengths, 50), percentile(lengths, 99)

    agreement = draft_agreement(target, draft, tokenizer, prompts[:num_agreement], greedy[:num_agreement])
    return {
        "greedy_accuracy": greedy_accuracy,
        "sampled_accuracy": sum(rewards) / max(len(rewards), 1),
        "mixed_fraction": mixed,
        "length_p50": p50,
        "length_p99": p99,
        "length_p99_over_p50": p99 / p50,
        "draft_agreement": agreement,
        "eval_seconds": time.time() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="folder holding tiny-target/ and tiny-draft/ (default: shipped)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the eval problems and of sampling")
    parser.add_argument("--num-greedy", type=int, default=200, help="prompts for greedy accuracy")
    parser.add_argument("--num-sampled", type=int, default=100, help="prompts sampled num-samples times each")
    parser.add_argument("--num-samples", type=int, default=8, help="samples per prompt at temperature 1.0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.models.zoo import model_path

    def path_of(name: str):
        return f"{args.dir}/{name}" if args.dir else model_path(name)

    target = AutoModelForCausalLM.from_pretrained(path_of("tiny-target")).eval()
    draft = AutoModelForCausalLM.from_pretrained(path_of("tiny-draft")).eval()
    tokenizer = AutoTokenizer.from_pretrained(path_of("tiny-target"))
    metrics = evaluate(
        target,
        draft,
        tokenizer,
        num_greedy=args.num_greedy,
        num_sampled=args.num_sampled,
        num_samples=args.num_samples,
        seed=args.seed,
    )
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")


if __name__ == "__main__":
    main()
