"""The gap between the behaviour log-probs a rollout returns and what a trainer recomputes.

A trainer scores the rollout's completions with one teacher-forced forward through the model's own attention (sdpa);
the generator computed each token's log-prob step by step, through its KV layout (`slots`: a dense cache and 4D masks;
`paged`: blocks read by the attention function it registers with transformers). Both are the same function of the
same weights, so the gap is rounding: this prints its largest and mean absolute value per token, for each layout.

    .venv/bin/python scripts/logprob_gap.py                                   # float32 on the CPU
    .venv/bin/python scripts/logprob_gap.py --device cuda --dtype bfloat16 --model tiny-target-1b
"""

from __future__ import annotations

import argparse
import json

import torch

from rollout import Generator, SamplingParams
from rollout.models import zoo
from rollout.tasks import arithmetic_dataset
from specdec.processing import RowSampling, processed_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def teacher_forced(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """`[len(completion)]` float64 log-probs of one forward over prompt + completion, processed as the generator does
    (temperature, no top-k / top-p)."""
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    rows = logits.shape[0]
    sampling = RowSampling(
        temperature=torch.full((rows,), temperature, device=logits.device),
        top_k=torch.zeros(rows, dtype=torch.long, device=logits.device),
        top_p=torch.ones(rows, device=logits.device),
        needs_filter=False,
        all_greedy=False,
        any_greedy=False,
    )
    logprobs = processed_logprobs(logits, sampling)
    return logprobs[torch.arange(rows, device=logits.device), torch.tensor(completion, device=logits.device)].cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-target")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--layouts", nargs="+", default=["slots", "paged"])
    parser.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto", help="decode steps replayed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = zoo.load_model(args.model, DTYPES[args.dtype], device=args.device)
    data = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in data]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    results = {}
    for layout in args.layouts:
        graphs = {"auto": "auto", "on": True, "off": False}[args.cuda_graphs]
        gen = Generator(
            model, max_batch_size=args.num_prompts * args.n, max_seq_len=512, kv_layout=layout, cuda_graphs=graphs
        )
        gaps = []
        for out in gen.generate(prompts, params):
            expected = teacher_forced(model, prompts[out.prompt_index], out.token_ids, params.temperature)
            gaps.append((torch.tensor(out.logprobs, dtype=torch.float64) - expected).abs())
        gap = torch.cat(gaps)
        results[gen.runner.kv_layout] = {"tokens": len(gap), "max": float(gap.max()), "mean": float(gap.mean())}
        print(
            f"{args.model} {args.dtype} on {args.device}, {gen.runner.kv_layout}: {len(gap)} tokens, "
            f"|generator - teacher-forced sdpa| max {gap.max():.3e}, mean {gap.mean():.3e}",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
