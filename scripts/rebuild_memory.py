"""Peak GPU memory across a TRL adapter rebuild: `trl_rollout_func` replaces its generator when a prompt needs more
positions than it has, and must free the old one (KV pool, CUDA graphs, caches) before it plans the new one from the
free memory. This runs a real `GRPOTrainer`'s adapter twice, a short prompt then a long one, and prints the memory
torch held (allocated and reserved) after each build and the peak while the second was built, beside what holding
both generators at once would take.

    python scripts/rebuild_memory.py                        # CUDA: tiny-target-1b in bf16
    .venv/bin/python scripts/rebuild_memory.py --device cpu # the code path only (no memory figures off CUDA)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rollout.integrations.trl import trl_rollout_func  # noqa: E402
from rollout.models import zoo  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402

SHORT = "Question: Ann has 3 apples.\nAnswer:"
LONG = "Question: " + "Ann has 3 apples and buys 2 more. " * 60 + "\nAnswer:"


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", help="zoo name (CUDA tiny-target-1b; CPU tiny-target)")
    parser.add_argument("--n", type=int, default=8, help="completions per call")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = args.model or ("tiny-target-1b" if device.type == "cuda" else "tiny-target")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = zoo.load_model(name, dtype, device=device)
    func = trl_rollout_func(spec=SpecConfig(method="suffix", num_speculative_tokens=4))
    with tempfile.TemporaryDirectory() as folder:
        config = GRPOConfig(
            output_dir=folder, use_cpu=device.type == "cpu", bf16=False, per_device_train_batch_size=args.n,
            num_generations=args.n, max_completion_length=args.max_new_tokens, report_to="none", save_strategy="no",
            max_steps=1,
        )  # fmt: skip
        data = Dataset.from_list([{"prompt": SHORT}] * args.n)
        trainer = GRPOTrainer(
            model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=config,
            train_dataset=data, processing_class=tokenizer, rollout_func=func,
        )  # fmt: skip
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result = {"model": name, "device": str(device), "weights": memory(device)}
        func([SHORT] * args.n, trainer)
        first = func.generator
        result["first"] = {"max_seq_len": first.max_seq_len, "kv_cache_bytes": first.kv_cache_bytes, **memory(device)}
        result["first"]["graph_memory_bytes"] = sum(g.memory_bytes for g in first.graph_runners)
        del first
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        func([LONG] * args.n, trainer)  # more positions than the first generator has: a rebuild
        second = func.generator
        result["second"] = {"max_seq_len": second.max_seq_len, "kv_cache_bytes": second.kv_cache_bytes}
        result["second"].update(memory(device), graph_memory_bytes=sum(g.memory_bytes for g in second.graph_runners))
    if device.type == "cuda":
        weights = result["weights"]["allocated"]
        both = weights + (result["first"]["allocated"] - weights) + (result["second"]["allocated"] - weights)
        result["both_at_once_allocated"] = both
        gib = 2**-30
        first, second = (result[k]["allocated"] - weights for k in ("first", "second"))
        print(
            f"{name} on {torch.cuda.get_device_name(device)}: weights {weights * gib:.2f} GiB; first generator "
            f"{first * gib:.2f} GiB, second {second * gib:.2f} GiB allocated beyond them; peak while rebuilding "
            f"{result['second']['peak_allocated'] * gib:.2f} GiB against {both * gib:.2f} GiB for both at once"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
