"""SpecConfig: vLLM's `--speculative-config` field names, so a user can paste theirs; SpecDecodeParams: what one
request may change of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass
class SpecConfig:
    """Speculative decoding settings. `Generator(model, spec=SpecConfig(...))` turns it on; `spec=None` is plain."""

    # "ngram" (prompt lookup), "draft_model", or a list of both in priority order: each row takes the first
    # proposer that drafts for it (["ngram", "draft_model"]: n-gram where a row has a match, the draft model elsewhere)
    method: Any = "ngram"
    num_speculative_tokens: int = 3  # the largest K: draft tokens verified per row and step
    prompt_lookup_max: int | None = None  # ngram: longest suffix to match (default 4)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix to match (default 1)
    model: Any = None  # draft_model: a path, a shipped short name, or a loaded transformers model
    num_candidates: int = 1  # ngram: continuations merged into a token tree of num_speculative_tokens nodes; 1 = chain
    # K per step: None = always num_speculative_tokens; vLLM's [[start_bs, end_bs, K], ...] table (rows in decode);
    # or "auto": the K that maximises predicted tokens/s from measured acceptance and step times (specdec/auto_policy)
    num_speculative_tokens_per_batch_size: Any = None

    @property
    def methods(self) -> tuple[str, ...]:
        """The configured proposers in priority order."""
        return (self.method,) if isinstance(self.method, str) else tuple(self.method)

    def __post_init__(self) -> None:
        methods = [self.method] if isinstance(self.method, str) else self.method
        if not isinstance(methods, (list, tuple)) or not methods or len(set(methods)) != len(methods):
            raise ValueError(f"method ({self.method!r}) must be one of {', '.join(METHODS)} or a list of distinct ones")
        for method in methods:
            if method not in METHODS:
                raise ValueError(f"method ({method!r}) must be one of {', '.join(METHODS)}")
        if not isinstance(self.method, str):
            self.method = list(self.method)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens ({k!r}) must be an integer >= 1 (use spec=None for no drafts)")
        if "ngram" in methods:
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = max(4, self.prompt_lookup_min or 1)
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = 1
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                    f"({self.prompt_lookup_max})"
                )
        if self.model is not None and "draft_model" not in methods:
            raise ValueError(
                f"model is set but method is {self.method!r}: add 'draft_model' to method to use a draft model"
            )
        if not isinstance(self.num_candidates, int) or self.num_candidates < 1:
            raise ValueError(f"num_candidates ({self.num_candidates!r}) must be an integer >= 1 (1 = a chain)")
        if "draft_model" in methods and self.num_candidates > 1:
            raise ValueError(
                f"num_candidates ({self.num_candidates}) > 1 builds token trees from n-gram candidates only; "
                "use method='ngram' or num_candidates=1 with a draft model"
            )
        if "draft_model" in methods and self.model is None:
            raise ValueError("method 'draft_model' needs model: a path, a shipped short name or a loaded model")
        if self.num_speculative_tokens_per_batch_size is not None:
            from specdec.policies import validate_batch_size_table

            validate_batch_size_table(self.num_speculative_tokens_per_batch_size, k)


@dataclass
class SpecDecodeParams:
    """Speculation settings of one request (`SamplingParams.spec`); a batch mixes requests with different ones."""

    enabled: bool = True  # False: this request's rows never get drafts (they still share the batch's forward)
    max_num_draft_tokens: int | None = None  # cap on this request's K per step; None = the policy's K
    method: str | None = None  # draft only with this configured proposer; None = the configured order

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled ({self.enabled!r}) must be True or False")
        cap = self.max_num_draft_tokens
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ValueError(f"max_num_draft_tokens ({cap!r}) must be an integer >= 0 or None (no cap)")
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"method ({self.method!r}) must be one of {', '.join(METHODS)} or None")

    def cap(self, num_speculative_tokens: int) -> int:
        """The most draft tokens this request takes per step."""
        if not self.enabled:
            return 0
        return num_speculative_tokens if self.max_num_draft_tokens is None else self.max_num_draft_tokens
