"""The suffix proposer alone, on the calls real rollouts made: record every hook call once, then replay them on a
fresh proposer as often as wanted, drafts checked against the recorded ones at every step, us per bulk row-step.

    PYTHONPATH=. .venv/bin/python scripts/replay_suffix.py record suffix_calls.pkl           # ~30 s
    PYTHONPATH=. .venv/bin/python scripts/replay_suffix.py replay suffix_calls.pkl --flush --repeats 5

`record` runs the shipped tiny target on held-out arithmetic prompts (defaults: 32 prompts x 8 samples, temperature
1.0, 384 new tokens, 256 slots, static K = 4): a first rollout, then a second whose history holds the first, as
`scripts/bench_suffix.py --kernels` does. It keeps each call's arguments (a row's last 8 tokens stand for its text:
a proposer takes in only what a row gained since its last call) and each step's drafts, counts and scores.

`replay` feeds them to a new `SuffixProposer` and times its hooks between two steps, as `bench_suffix.py` attributes
them; the first replay checks every step's drafts, counts and scores against the recorded ones (an AssertionError
names the first step that differs). `--flush` reads 64 MiB between steps, standing in for the forward that evicts the
caches in a live rollout; without it the proposer runs with warm caches.

A replay is a quick proxy, not the measurement. First / second rollout, us per bulk row-step, after 9907b55: 4.5 / 7.8
replayed warm, 7.3 / 11.5 replayed with `--flush`, 6.2 / 10.7 in live rollouts (medians; the machine's spread is
several percent). A change that helped here did not always help live (two threads counting the two tries: 10-20%
faster replayed, no faster live); time a change in live rollouts before it lands (docs/benchmarks/cpu.md, suffix
proposer cost).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import numpy as np
import torch

from rollout.phases import PhaseLabeler
from specdec.proposers.base import ProposalBatch
from specdec.proposers.suffix import SuffixProposer

TAIL = 8  # tokens of a row kept per call: more than a step emits
HOOKS = ("propose", "update", "finish", "prefill", "copy_rows", "begin", "drop")


def record(args) -> None:
    from rollout import Generator, SamplingParams
    from rollout.models import zoo
    from rollout.tasks import arithmetic_dataset
    from specdec.config import SpecConfig

    model, tokenizer = zoo.load_model("tiny-target")
    data = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in data["prompt"]]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    spec = SpecConfig(method="suffix", num_speculative_tokens=args.k)
    gen = Generator(model, max_batch_size=args.slots, max_seq_len=longest, spec=spec)
    gen.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))  # the warm-up's rows, then forgotten
    proposer = gen.draft_history
    proposer.clear()
    calls: list[tuple] = []
    hooks = {name: getattr(proposer, name) for name in HOOKS}

    def propose(batch):
        drafts = hooks["propose"](batch)
        num_tokens = np.array(batch.num_tokens)
        tails = _tails(batch.token_ids, np.arange(len(num_tokens)), num_tokens)
        kept = (drafts.token_ids.numpy().copy(), np.array(drafts.num_drafted), drafts.scores.numpy().copy())
        calls.append(("propose", tails, num_tokens, np.array(batch.num_asked), *kept))
        return drafts

    def update(token_ids, num_tokens):
        num_tokens = np.array(num_tokens)
        calls.append(("update", _tails(token_ids, np.arange(len(num_tokens)), num_tokens), num_tokens))
        return hooks["update"](token_ids, list(num_tokens))

    def finish(rows, token_ids, num_tokens):
        rows_np, num_np = np.array(rows), np.array(num_tokens)
        calls.append(("finish", rows_np, _tails(token_ids, rows_np, num_np), num_np))
        return hooks["finish"](rows, token_ids, num_tokens)

    def prefill(row_start, prompts, group_of, states):
        calls.append(("prefill", row_start, [list(p) for p in prompts], group_of.cpu().numpy().copy(), len(states)))
        return hooks["prefill"](row_start, prompts, group_of, states)

    def copy_rows(src, dst, num_positions):
        calls.append(("copy_rows", src.cpu().numpy().copy(), dst.cpu().numpy().copy(), num_positions))
        return hooks["copy_rows"](src, dst, num_positions)

    def begin():
        calls.append(("begin",))
        return hooks["begin"]()

    def drop(rows):
        calls.append(("drop", list(rows)))
        return hooks["drop"](rows)

    for name, hook in zip(HOOKS, (propose, update, finish, prefill, copy_rows, begin, drop)):
        setattr(proposer, name, hook)
    for scenario, seed in (("first", 1), ("second", 2)):
        calls.append(("rollout", scenario))
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=seed)
        gen.generate(
            prompts, params, on_step=lambda rec, finished, total: calls.append(("step", rec.kind, rec.batch_size))
        )
    setup = {"k": args.k, "vocab_size": proposer.separator, "slots": args.slots, "positions": longest}
    with open(args.file, "wb") as f:
        pickle.dump({"setup": setup, "calls": calls}, f, protocol=pickle.HIGHEST_PROTOCOL)
    steps = sum(1 for c in calls if c[0] == "propose")
    print(f"recorded {len(calls)} calls ({steps} drafting steps) to {args.file}")


def _tails(token_ids: torch.Tensor, rows: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    """Each row's last `TAIL` tokens, right-aligned `[rows, TAIL]`."""
    ids = token_ids.numpy()
    out = np.zeros((len(rows), TAIL), dtype=np.int32)
    for i, (row, n) in enumerate(zip(rows.tolist(), num_tokens.tolist())):
        start = max(0, n - TAIL)
        out[i, TAIL - (n - start) :] = ids[row, start:n]
    return out


def _token_ids(
    tails: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray | None = None, slots: int = 0
) -> torch.Tensor:
    """Token ids `[rows or slots, longest]` holding each row's last tokens where the proposer reads them."""
    out = np.zeros((len(tails) if rows is None else slots, int(num_tokens.max(initial=0))), dtype=np.int64)
    for i, n in enumerate(num_tokens.tolist()):
        row = i if rows is None else int(rows[i])
        start = max(0, n - TAIL)
        out[row, start:n] = tails[i, TAIL - (n - start) :]
    return torch.from_numpy(out)


def replay(recording: dict, check: bool, flush: bool) -> dict[str, float]:
    """One replay on a fresh proposer: us per bulk row-step of each rollout (`PhaseLabeler`'s bulk, as the run's
    summary and `bench_suffix.py` label it)."""
    setup, calls = recording["setup"], recording["calls"]
    proposer = SuffixProposer(setup["k"], setup["vocab_size"], setup["slots"], setup["positions"])
    evict = np.zeros(8 << 20) if flush else None  # 64 MiB
    steps: dict[str, list[tuple[str, int, float]]] = {}
    rollout, seconds, num_steps = None, 0.0, 0
    for call in calls:
        kind = call[0]
        if kind == "rollout":
            rollout = steps.setdefault(call[1], [])
            continue
        if kind == "step":
            rollout.append((call[1], call[2], seconds))
            seconds = 0.0
            if evict is not None:
                evict += 1.0
            continue
        if kind == "propose":
            _, tails, num_tokens, asked, tokens, counts, scores = call
            # a row's text older than its tail must be in the tries already
            assert (proposer._num_inserted[: len(num_tokens)] >= num_tokens - TAIL).all(), "expected short steps"
            hook = proposer.propose
            hook_args = (ProposalBatch(_token_ids(tails, num_tokens), num_tokens.tolist(), asked.tolist(), None, None),)
        elif kind == "update":
            hook, hook_args = proposer.update, (_token_ids(call[1], call[2]), call[2].tolist())
        elif kind == "finish":
            _, rows, tails, num_tokens = call
            token_ids = _token_ids(tails, num_tokens, rows, setup["slots"])
            hook, hook_args = proposer.finish, (rows.tolist(), token_ids, num_tokens.tolist())
        elif kind == "prefill":
            _, row_start, prompts, group_of, num_rows = call
            hook = proposer.prefill
            hook_args = (row_start, prompts, torch.from_numpy(group_of), [{} for _ in range(num_rows)])
        elif kind == "copy_rows":
            hook, hook_args = proposer.copy_rows, (torch.from_numpy(call[1]), torch.from_numpy(call[2]), call[3])
        elif kind == "drop":
            hook, hook_args = proposer.drop, (call[1],)
        else:
            hook, hook_args = proposer.begin, ()
        start = time.perf_counter()
        result = hook(*hook_args)
        seconds += time.perf_counter() - start
        if kind == "propose":
            if check:
                where = f"step {num_steps}"
                assert np.array_equal(result.token_ids.numpy(), tokens), f"{where}: expected the recorded drafts"
                assert result.num_drafted == counts.tolist(), f"{where}: expected the recorded counts"
                assert np.array_equal(result.scores.numpy(), scores), f"{where}: expected the recorded scores"
            num_steps += 1
    out = {}
    for name, rows in steps.items():
        labeler = PhaseLabeler()
        bulk = [(batch, s) for kind, batch, s in rows if labeler.label(kind, batch) == "bulk"]
        out[name] = 1e6 * sum(s for _, s in bulk) / max(sum(b for b, _ in bulk), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record the hook calls of a first and a second rollout")
    rec.add_argument("file")
    rec.add_argument("--num-prompts", type=int, default=32)
    rec.add_argument("--n", type=int, default=8)
    rec.add_argument("--max-new-tokens", type=int, default=384)
    rec.add_argument("--slots", type=int, default=256)
    rec.add_argument("--k", type=int, default=4)
    rep = sub.add_parser("replay", help="replay them on a fresh proposer: drafts checked, us per bulk row-step")
    rep.add_argument("file")
    rep.add_argument("--repeats", type=int, default=5)
    rep.add_argument("--flush", action="store_true", help="read 64 MiB between steps (a forward's evicted caches)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "record":
        record(args)
        return
    with open(args.file, "rb") as f:
        recording = pickle.load(f)
    replay(recording, check=True, flush=args.flush)  # drafts checked; also compiles and warms
    print("drafts, counts and scores equal the recorded ones at every step")
    runs = [replay(recording, check=False, flush=args.flush) for _ in range(args.repeats)]
    for name in runs[0]:
        values = [run[name] for run in runs]
        each = " ".join(f"{v:.2f}" for v in values)
        print(f"{name}: {statistics.median(values):.2f} us per bulk row-step, median of {len(values)} ({each})")


if __name__ == "__main__":
    main()
