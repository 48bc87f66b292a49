"""Suffix-draft variants scored on one live rollout: tokens per row-step each would emit, from the same states.

The rollout runs the default suffix proposer (the shipped tiny target, the arithmetic task, 64 held-out prompts x 8
samples, temperature 1.0, 384 new tokens, 512 slots, static K). At every step each variant (a setting of the
proposer's fields) drafts from the same tries, after the same rows were taken in; once the rollout is over, each draft
is compared with what the row went on to emit. With exact verification the emitted tokens do not depend on the drafts
(plain sampling's tokens), and a one-hot draft is accepted exactly when it equals them, so 1 + the matched prefix is
each variant's tokens at that row-step, without bias. The default's estimate must equal the rollout's measured
tokens per row-step: the script checks that its bookkeeping agrees with the generator before printing.

    PYTHONPATH=. .venv/bin/python scripts/suffix_draft_quality.py --k 4 --scenario first
    PYTHONPATH=. .venv/bin/python scripts/suffix_draft_quality.py --k 4 --scenario second   # history: a first rollout
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from bench_suffix import record_history  # scripts/, beside this one

from rollout import Generator, SamplingParams
from rollout.models import zoo
from rollout.tasks import arithmetic_dataset
from specdec.config import SpecConfig

VARIANTS = {  # proposer fields each variant sets (the rest keep their defaults)
    "one round": {"continue_short": False},
    "two rounds, context +1": {"_CONTINUE_CONTEXT": 1},
    "two rounds (default: context +3)": {},
    "two rounds, context +8": {"_CONTINUE_CONTEXT": 8},
    "one round, max_spec_factor 2": {"continue_short": False, "max_spec_factor": 2.0},
    "two rounds, max_spec_factor 2": {"max_spec_factor": 2.0},
    "two rounds, min_token_prob 0.02": {"min_token_prob": 0.02},
    "two rounds, min_token_prob 0.3": {"min_token_prob": 0.3},
}


def variant_drafts(proposer, asked: np.ndarray, fields: dict) -> list[list[int]]:
    saved = {name: getattr(proposer, name) for name in fields}
    try:
        for name, value in fields.items():
            setattr(proposer, name, value)
        drafts, counts, _ = proposer._chains(asked)
    finally:
        for name, value in saved.items():
            setattr(proposer, name, value)
    return [drafts[i, :n].tolist() for i, n in enumerate(counts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--scenario", choices=["first", "second"], default="first")
    parser.add_argument("--num-prompts", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = zoo.load_model("tiny-target")
    data = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in data["prompt"]]
    max_seq_len = max(len(p) for p in prompts) + 384
    spec = SpecConfig(method="suffix", num_speculative_tokens=args.k)
    gen = Generator(model, max_batch_size=512, max_seq_len=max_seq_len, spec=spec)
    gen.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))  # allocate; its response is cleared below
    proposer = gen.draft_history
    proposer.clear()
    if args.scenario == "second":  # bench_suffix.py's history: a first rollout of the same prompts (seed 1)
        setting = argparse.Namespace(batch_size=512, max_seq_len=max_seq_len, n=8, max_new_tokens=384)
        proposer.add_responses(*record_history(model, prompts, setting))
    records = []  # (sequence, tokens it held, {variant: draft})
    propose = proposer.propose

    def scored(batch):
        drafts = propose(batch)  # takes the rows' new tokens in: every variant drafts from these tries
        asked = np.asarray(batch.num_asked, dtype=np.int64)
        by_variant = {name: variant_drafts(proposer, asked, fields) for name, fields in VARIANTS.items()}
        used = [drafts.token_ids[i, :n].tolist() for i, n in enumerate(drafts.num_drafted)]
        assert used == by_variant["two rounds (default: context +3)"], "expected the default variant's drafts"
        for row in np.flatnonzero(asked > 0).tolist():
            drafted = {name: d[row] for name, d in by_variant.items()}
            records.append((gen.slots.sequences[row], batch.num_tokens[row], drafted))
        return drafts

    proposer.propose = scored
    gen.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=384, seed=2))
    decode = [r for r in gen.last_trace if r.kind != "prefill"]
    measured = sum(r.num_emitted for r in decode) / sum(r.batch_size for r in decode)
    estimates = {name: [] for name in VARIANTS}
    for seq, num_tokens, drafted in records:
        future = (list(seq.prompt) + list(seq.token_ids))[num_tokens:]
        for name, draft in drafted.items():
            matched = 0
            while matched < min(len(draft), len(future)) and draft[matched] == future[matched]:
                matched += 1
            estimates[name].append(min(1 + matched, max(len(future), 1)))  # a row emits at most what it had left
    default = float(np.mean(estimates["two rounds (default: context +3)"]))
    assert abs(default - measured) < 0.01, f"expected the default's estimate {default:.4f} to match {measured:.4f}"
    print(f"{args.scenario} rollout, K={args.k}: measured {measured:.4f} tokens per row-step, {len(records)} row-steps")
    print("| variant | tokens / row-step | mean drafted |\n| --- | --- | --- |")
    for name, values in estimates.items():
        drafted = np.mean([len(r[2][name]) for r in records])
        print(f"| {name} | {np.mean(values):.4f} | {drafted:.2f} |")


if __name__ == "__main__":
    main()
