"""The rollout plot: batch size, K and tokens/s over time, with the phases shaded."""

from __future__ import annotations

import pathlib

from rollout.cli.files import atomic_path
from rollout.phases import PHASES

PHASE_COLORS = {"prefill": "#9ecae1", "bulk": "#c7e9c0", "tail": "#fdd0a2"}


def plot_steps(steps: list[dict], path: str | pathlib.Path, title: str | None = None) -> pathlib.Path:
    """Write a PNG of the step trace to `path`. Steps of several processes (each with its `rank`, on its own clock)
    plot rank 0's, said in the title: one clock, one series.

    Args:
        steps: step dicts with `phase` (prefill / bulk / tail), `elapsed`, `seconds`, `batch_size`,
            `num_draft_tokens` and `num_emitted`, in order.
        path: the PNG file to write.
        title: the figure title.
    Returns:
        the path written.
    """
    steps, title = _one_clock(steps, title)
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only: never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = pathlib.Path(path)
    ends = [s["elapsed"] for s in steps]
    starts = [max(0.0, e - s["seconds"]) for e, s in zip(ends, steps)]
    # batch size and K of decode steps only: a prefill's batch counts prompts, not rows in decode
    decode = [(end, s) for end, s in zip(ends, steps) if s["phase"] != "prefill"]
    window = max(1, len(steps) // 50)  # tokens/s over a running window of ~2% of the steps: one step is noisy
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    series = [
        ([e for e, _ in decode], [s["batch_size"] for _, s in decode], "decode batch size"),
        ([e for e, _ in decode], [s["num_draft_tokens"] for _, s in decode], "K (draft tokens)"),
        (ends, _windowed_rate(steps, window), "tokens/s"),
    ]
    spans = _phase_spans(steps, starts, ends)
    for ax, (times, values, label) in zip(axes, series):
        for phase in PHASES:  # one collection of bars a phase, the axes' full height (a patch a span took minutes)
            bars = [(start, end - start) for p, start, end in spans if p == phase]
            if bars:
                ax.broken_barh(bars, (0, 1), transform=ax.get_xaxis_transform(), color=PHASE_COLORS[phase], linewidth=0)
        ax.step(times, values, where="pre", color="black", linewidth=1)
        ax.set_ylim(0, 1.1 * max([1, *values]))  # from zero: a constant K should not look like noise
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since the start")
    handles = [Patch(color=PHASE_COLORS[p], label=p) for p in PHASES]
    axes[0].legend(handles=handles, loc="upper right", ncol=3, fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path


def _one_clock(steps: list[dict], title: str | None) -> tuple[list[dict], str | None]:
    """The steps of rank 0 where several ranks' are given (each on its own clock), and the title saying so."""
    ranks = {s.get("rank", 0) for s in steps}
    if len(ranks) < 2:
        return steps, title
    return [s for s in steps if s.get("rank", 0) == 0], f"{title + ': ' if title else ''}rank 0 of {len(ranks)}"


def _windowed_rate(steps: list[dict], window: int) -> list[float]:
    """Tokens/s of the last `window` steps at every step: tokens kept (emitted less discarded) over the seconds they
    took, 0 where more was discarded than emitted (a step that preempts rows discards what they emitted before)."""
    # running sums, each window one subtraction (the window grows with the run: re-summing it made a long run's plot
    # quadratic, minutes for 100,000 steps); the tokens are integers, and the steps that took time are counted, so
    # that a window of none is 0 exactly and not a rounding residue
    seconds, kept, timed = [0.0], [0], [0]
    for s in steps:
        seconds.append(seconds[-1] + s["seconds"])
        kept.append(kept[-1] + s["num_emitted"] - s.get("num_discarded", 0))
        timed.append(timed[-1] + (s["seconds"] > 0))
    rates = []
    for i in range(1, len(steps) + 1):
        start = max(0, i - window)
        took = seconds[i] - seconds[start]
        tokens = max(kept[i] - kept[start], 0)
        rates.append(tokens / took if timed[i] > timed[start] and took > 0 else 0.0)
    return rates


def _phase_spans(steps: list[dict], starts: list[float], ends: list[float]) -> list[tuple[str, float, float]]:
    """Runs of consecutive steps in one phase, as (phase, start, end): one shaded span per run."""
    spans: list[tuple[str, float, float]] = []
    for step, start, end in zip(steps, starts, ends):
        if spans and spans[-1][0] == step["phase"]:
            spans[-1] = (step["phase"], spans[-1][1], end)
        else:
            spans.append((step["phase"], start, end))
    return spans
