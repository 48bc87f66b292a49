"""SpecConfig: vLLM's `--speculative-config` field names, so a user can paste theirs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass
class SpecConfig:
    """Speculative decoding settings. `Generator(model, spec=SpecConfig(...))` turns it on; `spec=None` is plain."""

    method: str = "ngram"  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int = 3  # the largest K: draft tokens verified per row and step
    prompt_lookup_max: int | None = None  # ngram: longest suffix to match (default 4)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix to match (default 1)
    model: Any = None  # draft_model: a path, a shipped short name, or a loaded transformers model
    num_candidates: int = 1  # ngram: continuations merged into a token tree of num_speculative_tokens nodes; 1 = chain
    num_speculative_tokens_per_batch_size: Any = None  # K per batch size: vLLM's [[start, end, K], ...] table

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method ({self.method!r}) must be one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens ({k!r}) must be an integer >= 1 (use spec=None for no drafts)")
        if self.method == "ngram":
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
            if self.model is not None:
                raise ValueError("model is set but method is 'ngram': set method='draft_model' to use a draft model")
        if not isinstance(self.num_candidates, int) or self.num_candidates < 1:
            raise ValueError(f"num_candidates ({self.num_candidates!r}) must be an integer >= 1 (1 = a chain)")
        if self.method == "draft_model" and self.num_candidates > 1:
            raise ValueError(
                f"num_candidates ({self.num_candidates}) > 1 builds token trees from n-gram candidates only; "
                "use method='ngram' or num_candidates=1 with a draft model"
            )
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method 'draft_model' needs model: a path, a shipped short name or a loaded model")
        if self.num_speculative_tokens_per_batch_size is not None:
            from specdec.policies import validate_batch_size_table

            validate_batch_size_table(self.num_speculative_tokens_per_batch_size, k)
