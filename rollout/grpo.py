"""GRPO in plain PyTorch over `Rollout`: the pieces any PPO/GRPO trainer needs, with no trainer library.

Each step: sample n completions per prompt (`Rollout`, speculative decoding on), turn the rewards into group-relative
advantages, and take one clipped policy-gradient step on the completion tokens. The behaviour log-probs that the
rollout returns are the PPO "old" log-probs, so no extra forward pass is needed to get them.

    .venv/bin/python -m rollout.grpo --steps 40        # the tiny model on the arithmetic task, CPU
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import Tensor

from rollout.batch import RolloutBatch
from rollout.engine.sampling import SamplingParams
from rollout.loop import Rollout
from specdec.config import SpecConfig


def policy_logprobs(model, tensors: dict[str, Tensor], temperature: float) -> Tensor:
    """`[N, C]` log-probs of the completion tokens under `model` (temperature applied, as when sampling; greedy's,
    temperature 0, are the plain log-softmax, as a greedy rollout's are).

    Prompts are left-padded, completions right-padded (`RolloutBatch.to_padded`); position ids count real tokens
    only, so every sample sees the positions it was generated at.
    """
    ids = torch.cat([tensors["prompt_ids"], tensors["completion_ids"]], dim=1)  # [N, P + C]
    mask = torch.cat([tensors["prompt_mask"], tensors["completion_mask"]], dim=1)  # [N, P + C]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # [N, P + C, V]
    width = tensors["completion_ids"].shape[1]
    logits = logits[:, -width - 1 : -1].float() / (temperature or 1.0)  # the logits that predicted each token
    return torch.log_softmax(logits, dim=-1).gather(-1, tensors["completion_ids"][..., None]).squeeze(-1)


def grpo_loss(model, batch: RolloutBatch, temperature: float, clip: float = 0.2) -> tuple[Tensor, dict]:
    """The clipped GRPO objective over one rollout, averaged over completion tokens (DAPO's token-level mean).

    ratio = pi(token) / behaviour(token); loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), where A is the
    sample's advantage `(r - group mean) / group std`.
    """
    tensors = batch.to_padded()
    mask = tensors["completion_mask"].float()  # [N, C]
    logps = policy_logprobs(model, tensors, temperature)  # [N, C]
    ratio = torch.exp(logps - tensors["logprobs"])  # the behaviour log-probs are the "old" policy's
    advantages = batch.advantages(std="sample").float()[:, None]  # [N, 1]
    objective = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    loss = -(objective * mask).sum() / mask.sum().clamp(min=1)
    drift = ((logps - tensors["logprobs"]).abs() * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"logprob_drift": drift.item()}


def train(
    model,
    tokenizer,
    dataset,
    *,
    steps: int = 40,
    prompts_per_step: int = 8,
    n: int = 8,
    learning_rate: float = 1e-4,
    max_new_tokens: int = 256,
    spec: SpecConfig | None = None,
    seed: int = 0,
    log=print,
) -> list[dict]:
    """Run GRPO for `steps` optimiser steps over `dataset` (rows with `prompt` and `answer`, cycled); return one record
    per step: reward, rollout and update seconds, rollout tokens/s."""
    torch.manual_seed(seed)
    rollout = Rollout(
        model,
        tokenizer,
        rewards=["arithmetic"],
        sampling=SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens),
        spec=spec,
        max_batch_size=prompts_per_step * n,
        max_seq_len=max(len(tokenizer(p)["input_ids"]) for p in dataset["prompt"]) + max_new_tokens,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    records = []
    for step in range(steps):
        first = step * prompts_per_step
        rows = [dataset[(first + i) % len(dataset)] for i in range(prompts_per_step)]
        start = time.perf_counter()
        batch = rollout(rows, seed=seed * 100003 + step)
        rollout_seconds = time.perf_counter() - start
        loss, info = grpo_loss(model, batch, temperature=1.0)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        record = {
            "step": step,
            "reward": batch.summary["reward_mean"],
            "loss": loss.item(),
            "rollout_seconds": rollout_seconds,
            "update_seconds": time.perf_counter() - start - rollout_seconds,
            "rollout_tokens_per_s": batch.num_tokens / rollout_seconds,
            **info,
        }
        records.append(record)
        log(
            f"step {step} | reward {record['reward']:.3f} | rollout {rollout_seconds:.1f} s "
            f"({record['rollout_tokens_per_s']:.0f} tokens/s) | update {record['update_seconds']:.1f} s"
        )
    return records


def main() -> None:
    from rollout.models.zoo import load_model
    from rollout.tasks import arithmetic_dataset

    parser = argparse.ArgumentParser(description="GRPO in plain PyTorch on the shipped tiny model and arithmetic task")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)  # 3e-4 made the reward fall
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--spec", default="suffix", help="suffix | ngram | none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("tiny-target")
    dataset = arithmetic_dataset(args.steps * args.prompts_per_step, split="train", seed=0)
    spec = None
    if args.spec != "none":
        spec = SpecConfig(method=args.spec, num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto")
    records = train(
        model,
        tokenizer,
        dataset,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        n=args.n,
        learning_rate=args.lr,
        max_new_tokens=args.max_new_tokens,
        spec=spec,
    )
    tenth = max(1, len(records) // 10)
    first = sum(r["reward"] for r in records[:tenth]) / tenth
    last = sum(r["reward"] for r in records[-tenth:]) / tenth
    print(f"reward first 10% {first:.3f} -> last 10% {last:.3f} ({last - first:+.3f})")


if __name__ == "__main__":
    main()
