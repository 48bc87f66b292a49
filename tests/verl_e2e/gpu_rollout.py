"""On a GPU: what veRL's rollout backend costs per rollout and holds in memory, measured on its `ServingEngine` (the
server's engine, without Ray or veRL): GRPO groups sent as concurrent single requests, as veRL's agent loop sends
them, two rollouts per setting (the second drafts from the first's responses), speculation off and on; the GPU
memory while generating, after `sleep` with the weights still on the device, and with the weights moved off (what
the server's `sleep` does).

    python tests/verl_e2e/gpu_rollout.py --out OUT [--model tiny-target-1b] [--prompts 32] [--samples 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import time

import torch

from rollout.integrations.verl import RequestLimits, ServingEngine, sampling_params_from_verl
from rollout.models.zoo import load_model
from rollout.tasks import format_prompt, generate_problems
from specdec.config import SpecConfig

SETTINGS = {
    "none": None,
    "suffix_auto": SpecConfig(method="suffix", num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto"),
}


CUDA = torch.cuda.is_available()  # a CPU runs the same steps, for a smoke test, without memory figures
DEVICE = "cuda" if CUDA else "cpu"


def mib(num_bytes: int) -> float:
    return round(num_bytes / 2**20, 1)


def allocated() -> float | None:
    return mib(torch.cuda.memory_allocated()) if CUDA else None


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


async def rollout(engine: ServingEngine, requests) -> list:
    return await asyncio.gather(*[engine.generate(ids, params) for ids, params in requests])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--model", default="tiny-target-1b")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=512)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, torch.bfloat16 if CUDA else torch.float32, device=DEVICE)
    limits = RequestLimits(prompt_length=512, response_length=args.response_length, max_model_len=1024)
    sampled = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    prompts = [tokenizer(format_prompt(p.problem))["input_ids"] for p in generate_problems(args.prompts, "eval")]
    requests = [(ids, sampling_params_from_verl(sampled, len(ids), limits)[0]) for ids in prompts
                for _ in range(args.samples)]  # fmt: skip
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    results = {"device": device, "model": args.model, "torch": torch.__version__, "prompts": args.prompts,
               "samples": args.samples, "weights_mib": mib(weights), "settings": {}}  # fmt: skip
    for name, spec in SETTINGS.items():
        sync()
        start = time.perf_counter()
        slots, positions = len(requests), limits.max_model_len
        engine = ServingEngine(model, max_batch_size=slots, max_seq_len=positions, spec=spec, seed=0)
        engine.wake_up()  # the cache, the graphs and (auto) the K policy's step-time profile, before the first rollout
        entry = {"build_s": round(time.perf_counter() - start, 2), "rollouts": []}
        for index in range(2):
            sync()
            start = time.perf_counter()
            outs = asyncio.run(rollout(engine, requests))
            sync()
            seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            record = {"seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds)}
            entry["rollouts"].append({**record, "totals": dict(engine.totals)})
            if index == 0:
                entry["generating_mib"] = allocated()
                engine.sleep()
                entry["asleep_weights_on_gpu_mib"] = allocated()
                model.to("cpu")
                if CUDA:
                    torch.cuda.empty_cache()
                entry["asleep_weights_off_mib"] = allocated()
                model.to(DEVICE)
                start = time.perf_counter()
                engine.wake_up()
                sync()
                entry["wake_up_s"] = round(time.perf_counter() - start, 2)
        engine.close()
        del engine
        results["settings"][name] = entry
        print(name, json.dumps(entry), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_rollout.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
