"""One sample of a request: what it asks for. What it has generated so far lives in the slot state while it runs
(`rollout.engine.slots`) and is copied here when it finishes."""

from __future__ import annotations

import collections

from rollout.engine.sampling import Completion, SamplingParams


class Sequence:
    """One (prompt, sample) pair: its prompt, settings, stop ids and seed; its completion once it finished."""

    def __init__(
        self,
        prompt_index: int,
        sample_index: int,
        prompt: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        seed: int,
        spec_cap: int,
    ):
        self.prompt_index = prompt_index
        self.sample_index = sample_index
        self.prompt = prompt
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.seed = seed  # the sample's random stream (unused when greedy)
        self.spec_cap = spec_cap  # the most draft tokens this request takes per step
        self.proposer_state: dict = {}  # proposers' per-sequence state, by proposer (e.g. the draft's cache length)
        self.admitted_at = 0  # the engine's admission counter when it last took this sequence in
        self.token_ids: list[int] = []  # the completion, set when the sequence finishes
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None  # "stop" | "length" once finished

    def completion(self) -> Completion:
        return Completion(self.prompt_index, self.sample_index, self.token_ids, self.logprobs, self.finish_reason or "")


class PromptGroups:
    """A call's samples by prompt, to hand a prompt's completions on as soon as its last sample finishes."""

    def __init__(self, sequences: list[Sequence]):
        self._members: dict[int, list[Sequence]] = collections.defaultdict(list)
        for seq in sequences:
            self._members[seq.prompt_index].append(seq)
        self._running = {index: len(members) for index, members in self._members.items()}

    def finish(self, prompt_index: int) -> list[Completion] | None:
        """One more sample of the prompt finished: the prompt's completions if it was the last, else None."""
        self._running[prompt_index] -= 1
        if self._running[prompt_index]:
            return None
        return [seq.completion() for seq in self._members[prompt_index]]
