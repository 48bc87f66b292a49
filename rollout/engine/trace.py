"""One record per generator step: what the step did and how long it took; what `Generator.step` returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rollout.engine.sampling import Completion
from specdec.auto_policy import StepObservation


@dataclass
class StepRecord:
    kind: str  # "prefill" | "decode" (the rollout loop labels each step's phase: prefill, bulk or tail)
    batch_size: int  # active rows for decode; for prefill, the prompts the step admitted (one or more forwards)
    num_draft_tokens: int  # K the policy chose for this step (rows are further capped by request and length)
    num_drafted: int  # draft tokens actually proposed, all rows
    num_accepted: int  # draft tokens accepted, all rows
    num_emitted: int  # tokens appended to completions (accepted + one recovered/bonus per row, after stops)
    seconds: float
    # host time the proposers took: drafting and taking in text (inside a decode step's `seconds`), and removing rows:
    # the step's finished ones (after its read) and preempted ones (before its launch); those parts fall inside some
    # step's `seconds` under async scheduling only (the next step's), outside every step's in lockstep
    propose_seconds: float = 0.0
    policy_seconds: float = 0.0  # decode: host time the K policy took, choosing (inside `seconds`) and learning (after)
    drafted_per_position: list[int] = field(default_factory=list)  # rows that had a draft at position j
    accepted_per_position: list[int] = field(default_factory=list)  # rows whose draft j was accepted
    predicted_gain: float | None = None  # auto policy: predicted tokens/s with this K over K = 0
    measuring: bool = False  # auto policy: a climb or exploration step, drafting one position past those measured
    ran_ahead: bool = False  # decode: launched before the step before it was read (`rollout.engine.run_ahead`)
    rows_by_method: dict[str, int] = field(default_factory=dict)  # rows asked for drafts, by the proposer serving them
    num_preempted: int = 0  # paged KV: rows sent back to the queue before this step, short of blocks
    num_discarded: int = 0  # completion tokens those rows had emitted, given up (they start over): not kept
    kv_blocks_used: int | None = None  # paged KV: blocks rows hold after the step (None: the slot layout)
    kv_blocks_allocated: int | None = None  # paged KV: blocks in the pool (it grows on a CPU up to its plan)
    launch_seconds: float = 0.0  # decode: host time of its launch (drafting, inputs, the forward queued)
    wait_seconds: float = 0.0  # decode: time the host waited for its results (the device still computing)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepOutput:
    """What one `Generator.step` did."""

    record: StepRecord  # its trace record (also appended to `last_trace`)
    finished: list[Completion] = field(default_factory=list)  # samples that finished in this step
    observation: StepObservation | None = None  # decode steps: what a K policy learns from the step
