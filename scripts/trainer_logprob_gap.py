"""Behaviour log-probs against the trainer's own recomputation, over a real GRPO batch.

TRL's `GRPOTrainer` runs one step with this library's `trl_rollout_func`; at the moment the batch is made, before the
optimiser step, TRL's own per-token log-prob pass (`_get_per_token_logps_and_entropies`: its fused LM head, the
model's own sdpa attention, under its accelerator's autocast) scores the completions, and each token's
|rollout log-prob - trainer log-prob| is kept. One trainer per configuration: the slot layout, the paged layout eager,
the paged layout with CUDA graphs. The reference point is HF `generate` on the same prompts under the same autocast:
its own scores (log-softmax of `output_logits` over the temperature) against the same TRL pass.

Prints, per configuration, the tokens compared, the largest and mean gap and the share of tokens over 1e-2, then one
JSON line.

    .venv/bin/python scripts/trainer_logprob_gap.py                    # the CPU: tiny-target, float32, small
    python scripts/trainer_logprob_gap.py --model tiny-target-1b --bf16 --num-prompts 16 --n 8 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rollout.integrations.trl import trl_rollout_func  # noqa: E402
from rollout.models import zoo  # noqa: E402
from rollout.tasks import arithmetic_dataset  # noqa: E402
from rollout.tasks.arithmetic import arithmetic_reward  # noqa: E402

CONFIGS = {
    "slots": {"kv_layout": "slots", "cuda_graphs": False},
    "paged-eager": {"kv_layout": "paged", "cuda_graphs": False},
    "paged-graphs": {"kv_layout": "paged", "cuda_graphs": True},
}


def reward(completions, answer, **kwargs):
    return arithmetic_reward(completions, answer)


def make_trainer(args, folder: str, rollout_func=None) -> GRPOTrainer:
    model, tokenizer = zoo.load_model(args.model, torch.float32, device=args.device)
    config = GRPOConfig(
        output_dir=folder,
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        per_device_train_batch_size=args.num_prompts * args.n,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
    )
    data = arithmetic_dataset(args.num_prompts, split="train", seed=args.seed)
    return GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )


def trainer_logps(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """TRL's own per-token log-probs of the completions `[rows, completion width]`."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, completion_ids.shape[1])
    return logps.double()


def gap_stats(gaps: torch.Tensor) -> dict:
    return {
        "tokens": int(gaps.numel()),
        "max": float(gaps.max()),
        "mean": float(gaps.mean()),
        "share_over_1e-2": float((gaps > 1e-2).double().mean()),
    }


def rollout_gap(args, name: str, options: dict) -> dict:
    """One GRPO step with `trl_rollout_func(**options)`: the gaps of the batch it made."""
    func = trl_rollout_func(max_batch_size=args.num_prompts * args.n, **options)
    with tempfile.TemporaryDirectory() as folder:
        trainer = make_trainer(args, folder, func)
        batches = []
        inner = trainer._generate_and_score_completions

        def record(inputs):
            out = inner(inputs)
            recomputed = trainer_logps(
                trainer, out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"]
            )
            mask = out["completion_mask"].bool()
            batches.append((out["sampling_per_token_logps"].double()[mask] - recomputed[mask]).abs())
            return out

        trainer._generate_and_score_completions = record
        trainer.train()
        gen = func.generator
        stats = gap_stats(torch.cat(batches).cpu())
        stats.update(layout=gen.runner.kv_layout, graphs=len(gen.runner.graphs.graphs) if gen.runner.graphs else 0)
        stats["dtype"] = str(func.dtype).removeprefix("torch.")
    return stats


def generate_gap(args) -> dict:
    """HF `generate` on the batch's prompts under the trainer's autocast: its own scores against TRL's pass."""
    with tempfile.TemporaryDirectory() as folder:
        trainer = make_trainer(args, folder)
        model, tokenizer = trainer.model, trainer.processing_class
        prompts = [row["prompt"] for row in trainer.train_dataset]
        encoded = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
        model.eval()
        torch.manual_seed(args.seed)
        with torch.no_grad(), trainer.accelerator.autocast():
            out = model.generate(
                **encoded,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                num_return_sequences=args.n,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
            )
        width = encoded["input_ids"].shape[1]
        completion_ids = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).double()  # [rows, new tokens, V]
        own = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]
        eos = completion_ids == tokenizer.eos_token_id
        after_eos = (eos.cumsum(1) - eos.long()) > 0  # tokens past a row's first EOS: padding
        completion_mask = (~after_eos).long()
        prompt_ids = encoded["input_ids"].repeat_interleave(args.n, 0)
        prompt_mask = encoded["attention_mask"].repeat_interleave(args.n, 0)
        model.train()
        recomputed = trainer_logps(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask)
        mask = completion_mask.bool()
        return gap_stats((own[mask] - recomputed[mask]).abs().cpu()) | {"layout": "hf-generate"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-target")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16=True: autocast over float32 weights")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--no-generate", action="store_true", help="skip the HF generate reference")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name in args.configs:
        if name == "paged-graphs" and args.device != "cuda":
            continue  # graphs need CUDA
        results[name] = rollout_gap(args, name, CONFIGS[name])
    if not args.no_generate:
        results["hf-generate"] = generate_gap(args)
    header = f"{args.model} on {args.device}, bf16 autocast {args.bf16}, {args.num_prompts} x {args.n} prompts"
    print(header)
    for name, stats in results.items():
        print(
            f"  {name:13s} {stats['tokens']:6d} tokens  |ours - TRL| max {stats['max']:.3e}  mean {stats['mean']:.3e}"
            f"  over 1e-2 {100 * stats['share_over_1e-2']:.2f}%",
            flush=True,
        )
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
