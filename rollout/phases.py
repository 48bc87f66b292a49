"""Phases of a rollout (prefill, bulk, tail) and per-phase throughput.

A generator step is `prefill` when it processes prompts. A decode step is `bulk` while its batch is at least
`tail_fraction` of the largest decode batch seen so far in the rollout, and `tail` below that: the few long
sequences that hold up the end of every rollout. Prefill steps interleave with decode steps when there are more
samples than slots; they do not move the peak.
"""

from __future__ import annotations

from collections.abc import Iterable

PHASES = ("prefill", "bulk", "tail")
SUMMARY_KEYS = (
    "seconds",
    "tokens",
    "tokens_per_s",
    "mean_batch_size",
    "mean_k",
    "acceptance_rate",
    "mean_accepted_length",
    "num_steps",
)


class PhaseLabeler:
    """Labels steps in order; holds the peak decode batch size of one rollout.

    Args:
        tail_fraction: a decode step is `tail` when its batch size < tail_fraction * peak decode batch size so far.
    """

    def __init__(self, tail_fraction: float = 0.25):
        number = isinstance(tail_fraction, (int, float)) and not isinstance(tail_fraction, bool)
        if not number or not 0.0 <= tail_fraction <= 1.0:  # (True is an int: it was taken as 1.0)
            raise ValueError(f"tail_fraction ({tail_fraction!r}) must be in [0, 1], e.g. 0.25 (0 = no tail phase)")
        self.tail_fraction = float(tail_fraction)
        self.peak_batch_size = 0

    def label(self, kind: str, batch_size: int) -> str:
        """The phase of the next step, given the kind of step ("prefill" | "decode") and its batch size."""
        if kind == "prefill":
            return "prefill"
        assert kind == "decode", f"expected a 'prefill' or 'decode' step, got {kind!r}"
        self.peak_batch_size = max(self.peak_batch_size, batch_size)
        return "tail" if batch_size < self.tail_fraction * self.peak_batch_size else "bulk"


def summarize(steps: Iterable[dict]) -> dict:
    """Per-phase and total throughput of labelled steps (dicts with the step-trace fields and a `phase`).

    Returns `{"phases": {phase: stats for each of PHASES}, "total": stats}`, where stats holds:

    - `seconds`: the summed wall time of the steps (generator-measured; host time between steps excluded).
    - `tokens`: completion tokens emitted and kept: `num_emitted` (a prefill step emits each sample's first token)
      less `num_discarded` (what rows preempted for lack of blocks had emitted before they started over, counted in
      the phase of the step that preempted them; in a run's files, also what the rows a stop cut off had emitted, on
      the stopped rollout's last steps), so that `total` is the completions' tokens.
    - `tokens_per_s`: tokens / seconds.
    - `mean_batch_size`: mean `batch_size` per step: active rows for decode steps, prompts admitted per step for
      prefill. `total` averages over its decode steps only (prefill batches count prompts, not rows): 0.0 without.
    - `mean_k`: mean `num_draft_tokens` (the K chosen that step) per step; `total` over its decode steps only
      (prefill never drafts).
    - `acceptance_rate`: accepted / drafted draft tokens (0.0 when nothing was drafted).
    - `mean_accepted_length`: accepted draft tokens per row per decode step, i.e. sum(num_accepted) /
      sum(decode batch_size); a decode step emits 1 + this many tokens per row before stops. 0.0 for prefill.
    - `num_steps`: the number of steps.

    A phase with no steps has zeros everywhere. Steps of a paged KV cache add `kv_cache` to the result: the most KV
    blocks rows held after any step (`peak_blocks_used`) against the blocks the pool had then (`blocks_allocated`),
    and the rows preempted for lack of blocks (`num_preempted`).
    """
    steps = list(steps)
    phases = {phase: _stats([s for s in steps if s["phase"] == phase]) for phase in PHASES}
    summary = {"phases": phases, "total": _stats(steps, decode_means=True)}
    paged = [s for s in steps if s.get("kv_blocks_used") is not None]
    if paged:
        summary["kv_cache"] = {
            "peak_blocks_used": max(s["kv_blocks_used"] for s in paged),
            "blocks_allocated": max(s["kv_blocks_allocated"] for s in paged),
            "num_preempted": sum(s.get("num_preempted", 0) for s in paged),
        }
    return summary


def summarize_ranks(steps: Iterable[dict], wall_seconds: list[list[float]]) -> dict:
    """`summarize` for a data-parallel run: steps carry their `rank` (a step without one, from a part of the run made
    by one process before a resume on several, counts as rank 0's), `wall_seconds[r]` lists rank r's wall time of
    each rollout.

    Per phase and in total, `tokens`, `num_steps` and the means are over every rank's steps, `tokens_per_s` is the
    sum of the ranks' own tokens/s and `seconds` the slowest rank's. Adds `ranks` (each rank's own `phases`, `total`
    and `wall_seconds`), `num_ranks`, `rank_seconds_per_rollout` (`[rollout][rank]` wall seconds) and
    `straggler_ratio` (see `straggler_ratio`).
    """
    steps = list(steps)
    num_ranks = len(wall_seconds)
    own = [summarize([s for s in steps if s.get("rank", 0) == rank]) for rank in range(num_ranks)]
    combined = summarize(steps)
    for phase in (*PHASES, None):
        parts = [s["total"] if phase is None else s["phases"][phase] for s in own]
        target = combined["total"] if phase is None else combined["phases"][phase]
        target["seconds"] = max(p["seconds"] for p in parts)
        target["tokens_per_s"] = sum(p["tokens_per_s"] for p in parts)
    combined["ranks"] = [{"rank": r, **own[r], "wall_seconds": sum(wall_seconds[r])} for r in range(num_ranks)]
    combined["num_ranks"] = num_ranks
    combined["rank_seconds_per_rollout"] = [list(x) for x in zip(*wall_seconds)]
    combined["straggler_ratio"] = straggler_ratio(combined["rank_seconds_per_rollout"])
    return combined


def straggler_ratio(rank_seconds: list[list[float]]) -> float:
    """How long a data-parallel run waits on its slowest rank: the sum over rollouts of the slowest rank's wall time
    over the sum of the ranks' mean (1.0: perfectly balanced). `rank_seconds[i][r]` is rank r's time on rollout i."""
    slowest = sum(max(seconds) for seconds in rank_seconds if seconds)
    mean = sum(sum(seconds) / len(seconds) for seconds in rank_seconds if seconds)
    return slowest / mean if mean > 0 else 1.0


def _stats(steps: list[dict], decode_means: bool = False) -> dict:
    """`summarize`'s stats of `steps`; `decode_means`: per-step means over the decode steps only (else over the
    decode steps when there are any: a phase is all prefill or all decode)."""
    seconds = sum(s["seconds"] for s in steps)
    tokens = sum(s["num_emitted"] - s.get("num_discarded", 0) for s in steps)  # (traces written before it: none)
    drafted = sum(s["num_drafted"] for s in steps)
    accepted = sum(s["num_accepted"] for s in steps)
    decode = [s for s in steps if s["phase"] != "prefill"]
    decode_rows = sum(s["batch_size"] for s in decode)
    averaged = decode if decode_means else decode or steps
    num_steps = len(steps)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "mean_batch_size": sum(s["batch_size"] for s in averaged) / len(averaged) if averaged else 0.0,
        "mean_k": sum(s["num_draft_tokens"] for s in averaged) / len(averaged) if averaged else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": accepted / decode_rows if decode_rows else 0.0,
        "num_steps": num_steps,
    }


def format_table(summary: dict) -> str:
    """The per-phase table of `summarize`'s output, one row per phase and a total row."""
    header = f"{'phase':8s}{'steps':>7s}{'seconds':>9s}{'tokens':>9s}{'tokens/s':>10s}{'batch':>7s}{'K':>6s}"
    header += f"{'accept':>8s}{'acc.len':>9s}"
    lines = [header]
    rows = [(phase, summary["phases"][phase]) for phase in PHASES] + [("total", summary["total"])]
    for name, s in rows:
        lines.append(
            f"{name:8s}{s['num_steps']:7d}{s['seconds']:9.2f}{s['tokens']:9d}{s['tokens_per_s']:10.1f}"
            f"{s['mean_batch_size']:7.1f}{s['mean_k']:6.2f}{s['acceptance_rate']:8.3f}{s['mean_accepted_length']:9.3f}"
        )
    return "\n".join(lines)
