"""One sample in flight: its prompt, its random stream, the tokens it has so far, and its stop rules."""

from __future__ import annotations

import torch

from rollout.sampling import Completion, SamplingParams


class Sequence:
    """Host-side state of one (prompt, sample) pair.

    The KV cache holds `cache_len` tokens of this sequence; the last emitted token (`pending`) is not in the cache
    yet: the next forward feeds it, followed by that step's drafts.
    """

    def __init__(
        self,
        prompt_index: int,
        sample_index: int,
        prompt: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        generator: torch.Generator | None,
    ):
        self.prompt_index = prompt_index
        self.sample_index = sample_index
        self.prompt = prompt
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.generator = generator
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.cache_len = 0
        self.proposer_state: dict = {}  # proposers' per-sequence state, by proposer (e.g. the draft's cache length)
        self.spec_cap = 0  # the most draft tokens this request takes per step (set by the generator)
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.token_ids)

    @property
    def pending(self) -> int:
        return self.token_ids[-1]

    def append(self, token_ids: list[int], logprobs: list[float]) -> int:
        """Append emitted tokens up to the first stop token or the length cap; return how many were kept."""
        room = self.max_new_tokens - len(self.token_ids)
        kept = 0
        for token, logprob in zip(token_ids, logprobs):
            if kept == room:
                break
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            kept += 1
            if token in self.stop_ids:
                self.finish_reason = "stop"
                return kept
        if len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return kept

    def uniforms(self, count: int) -> torch.Tensor:
        """`[count]` float64 uniforms from this sample's own stream (float64: float32 can return exactly 0)."""
        return torch.rand(count, generator=self.generator, dtype=torch.float64)

    def completion(self) -> Completion:
        return Completion(self.prompt_index, self.sample_index, self.token_ids, self.logprobs, self.finish_reason or "")
