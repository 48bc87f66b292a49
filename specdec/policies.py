"""K policies: how many draft tokens each decode step asks for, given the rows in decode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class Decision:
    """A policy's choice for one decode step."""

    num_draft_tokens: int  # K for the batch (each row is further capped by its request and its length limit)
    predicted_gain: float | None = None  # auto: predicted tokens/s with this K over tokens/s with K = 0
    # auto: the step drafts past the positions measured so far (climbing toward a better K, or exploring) to measure
    # the next one; its own predicted gain may be below 1
    measuring: bool = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # (True is an int to Python; not a K)


def validate_batch_size_table(table: Any, num_speculative_tokens: int) -> list[tuple[int, int, int]]:
    """Check vLLM's `num_speculative_tokens_per_batch_size` table: `[[start_bs, end_bs, K], ...]`, inclusive ranges
    from batch size 1 upward, no overlaps or gaps, `0 <= K <= num_speculative_tokens`. Returns it as tuples."""
    name = "num_speculative_tokens_per_batch_size"
    if isinstance(table, str):
        if table == "auto":
            return []
        raise ValueError(f"{name} ({table!r}) must be 'auto' or a list of [start_bs, end_bs, K] entries")
    if not isinstance(table, (list, tuple)) or not table:
        raise ValueError(f"{name} ({table!r}) must be 'auto' or a non-empty list of [start_bs, end_bs, K] entries")
    entries = []
    for entry in table:
        entry = list(entry) if isinstance(entry, (list, tuple)) else entry
        if not isinstance(entry, list) or len(entry) != 3 or not all(_is_int(v) for v in entry):
            raise ValueError(f"{name} entry {entry!r} must be three integers [start_bs, end_bs, K]")
        start, end, k = entry
        if start < 1 or end < start:
            raise ValueError(f"{name} entry {entry!r} is reversed or starts below 1: need 1 <= start_bs <= end_bs")
        if not 0 <= k <= num_speculative_tokens:
            raise ValueError(
                f"{name} entry {entry!r} has K={k} outside [0, num_speculative_tokens={num_speculative_tokens}]"
            )
        entries.append((start, end, k))
    entries.sort()
    if entries[0][0] != 1:
        raise ValueError(f"{name} entry {list(entries[0])!r} leaves batch sizes 1..{entries[0][0] - 1} uncovered")
    for prev, cur in zip(entries, entries[1:]):
        if cur[0] <= prev[1]:
            raise ValueError(f"{name} entries {list(prev)!r} and {list(cur)!r} overlap")
        if cur[0] != prev[1] + 1:
            raise ValueError(f"{name} entries {list(prev)!r} and {list(cur)!r} leave a gap at {prev[1] + 1}")
    return entries


class StepTimerProtocol(Protocol):
    """What a policy may measure before the first rollout (the engine implements it: `rollout.engine.step_timer`)."""

    max_batch_size: int  # the most rows a step can hold
    max_context: int  # the longest context a timed row can have

    def fill(self, context: int) -> None:
        """Fill every slot with a row of `context` tokens on which any K drafts in full."""

    def time_step(self, num_rows: int, num_draft_tokens: int, with_models: bool | None = None) -> Any:
        """One decode step of `num_rows` of those rows at K; returns its `StepObservation`. `with_models`: True, a
        cascade passes every row on to its proposers that run a model; False, those sit the step out; None, the
        cascade's own rule."""


class KPolicy(Protocol):
    """What every K policy does: choose a step's K, learn from the step, calibrate before the first rollout."""

    num_speculative_tokens: int

    def choose(
        self, batch_size: int, caps: list[int] | None = None, routes: list[str] | None = None, context: int = 0
    ) -> Decision: ...

    def observe(self, observation, profiled: bool = False) -> None: ...

    def calibrate(self, timer: StepTimerProtocol) -> None: ...


class StaticPolicy:
    """K fixed at `num_speculative_tokens`."""

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens

    def choose(
        self, batch_size: int, caps: list[int] | None = None, routes: list[str] | None = None, context: int = 0
    ) -> Decision:
        return Decision(self.num_speculative_tokens)

    def observe(self, observation, profiled: bool = False) -> None:
        """Static and table policies learn nothing from a step."""

    def calibrate(self, timer: StepTimerProtocol) -> None:
        """Static and table policies need no measurements before the first rollout."""


class TablePolicy(StaticPolicy):
    """vLLM's per-batch-size table, looked up with the number of rows in decode (not requests in prefill, which
    is what makes vLLM's K flip: vllm-project/vllm#49548)."""

    def __init__(self, table: list, num_speculative_tokens: int, max_batch_size: int):
        super().__init__(num_speculative_tokens)
        self.entries = validate_batch_size_table(table, num_speculative_tokens)
        if self.entries[-1][1] < max_batch_size:
            raise ValueError(
                f"num_speculative_tokens_per_batch_size ends at batch size {self.entries[-1][1]} but max_batch_size "
                f"is {max_batch_size}: extend the last range to {max_batch_size}"
            )
        self.k_by_batch_size = [0] * (max_batch_size + 1)
        for start, end, k in self.entries:
            for batch_size in range(start, min(end, max_batch_size) + 1):
                self.k_by_batch_size[batch_size] = k

    def choose(
        self, batch_size: int, caps: list[int] | None = None, routes: list[str] | None = None, context: int = 0
    ) -> Decision:
        return Decision(self.k_by_batch_size[batch_size])


class ForcedPolicy(StaticPolicy):
    """Every step at the K it is given (a calibration's timed steps, `rollout.engine.step_timer.forced_steps`): it
    learns nothing, and keeps the last step's observation for whoever forced the step."""

    # each timed step is read before the next one is launched (the timer rolls the rows back between steps): a
    # generator that runs ahead of the device (`rollout.engine.run_ahead`) does not, under this policy
    lockstep = True

    def __init__(self, num_draft_tokens: int):
        super().__init__(num_draft_tokens)
        self.observation = None

    def observe(self, observation, profiled: bool = False) -> None:
        self.observation = observation
