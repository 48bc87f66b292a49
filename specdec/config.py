"""SpecConfig: vLLM's `--speculative-config` field names, so a user can paste theirs; SpecDecodeParams: what one
request may change of it."""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

METHODS = ("ngram", "suffix", "draft_model")
VERIFICATIONS = ("exact", "rejection")
MAX_TREE_DEPTH = 1024  # each token a row takes in updates this many nodes in each of two tries (vLLM's default: 24)
_INT_FIELDS = (
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "num_candidates",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
)
_FLOAT_FIELDS = ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


def python_number(value: Any, kind: type) -> Any:
    """numpy's integers (`kind` int), reals (`kind` float) or bools (`kind` bool) as Python's, what a config built
    with numpy holds; anything else (bools where a number is asked for included) as it is, for the checks to name."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, np.bool_):  # (numpy's bool is no number: it would be refused as one below, or as a bool)
        return bool(value) if kind is bool else value
    if kind is bool:
        return value
    if isinstance(value, numbers.Integral if kind is int else numbers.Real):
        return kind(value)
    return value


@dataclass
class SpecConfig:
    """Speculative decoding settings. `Generator(model, spec=SpecConfig(...))` turns it on; `spec=None` (or
    `method=None`) is plain decoding. The field names are vLLM's `--speculative-config`, so a vLLM config pastes in.

    Attributes:
        method: `"ngram"` (prompt lookup), `"suffix"` (suffix trees over the batch in flight and earlier responses),
            `"draft_model"`, or a list in priority order: each row takes the first proposer that drafts for it,
            except that suffix passes a row on where the next proposer is measured to earn more and the step's gain
            pays for running it (`["suffix", "draft_model"]`: suffix where it has a confident draft, the draft model
            elsewhere). None (or `"none"`): no speculation, the other fields ignored.
        num_speculative_tokens: the largest K: draft tokens verified per row and step.
        prompt_lookup_max: ngram: the longest suffix to match; None: 4, or `prompt_lookup_min` where that is larger.
        prompt_lookup_min: ngram: the shortest suffix to match; None: 1.
        model: draft_model: a path, a shipped short name (`tiny-draft`) or a loaded transformers model that shares
            the target's tokenizer.
        num_candidates: ngram / suffix: drafts merged into a token tree of `num_speculative_tokens` nodes; 1 = a
            chain.
        suffix_decoding_max_tree_depth: suffix: the longest n-gram counted (match length + draft length), 2 to
            1024.
        suffix_decoding_max_cached_requests: suffix: finished responses kept as history, oldest evicted first;
            0 keeps none.
        suffix_decoding_max_spec_factor: suffix: a draft is at most this many times its match length (any factor
            from the depth up, `inf` included, caps nothing more than the depth does).
        suffix_decoding_min_token_prob: suffix: stop drafting where the path probability falls below this.
        num_speculative_tokens_per_batch_size: K per step. None: always `num_speculative_tokens`; vLLM's table
            `[[start_bs, end_bs, K], ...]` of inclusive batch-size ranges (rows in decode; K = 0 turns drafts off);
            or `"auto"`: each step the K that maximises predicted tokens/s from measured acceptance and step times.
        verification: `"exact"`: every token is the exponential race's at its position, a draft is accepted when it
            equals that token, and a draft model draws its drafts by the same race over its own distribution: the
            same seed gives the same tokens with or without speculation, whatever K and proposer. `"rejection"`:
            rejection sampling with fresh uniforms (Leviathan et al.): the same distribution, other tokens.
    """

    method: Any = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: Any = None
    num_candidates: int = 1
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    num_speculative_tokens_per_batch_size: Any = None
    verification: str = "exact"

    @property
    def methods(self) -> tuple[str, ...]:
        """The configured proposers in priority order (none when speculation is off)."""
        if self.method is None:
            return ()
        return (self.method,) if isinstance(self.method, str) else tuple(self.method)

    def check_room(self, max_seq_len: int, key: str = "max_seq_len", prefix: str = "") -> None:
        """Refuse a K that a row of `max_seq_len` tokens (named `key`) never has room for; `prefix` names where the
        setting came from (`spec.`)."""
        k = self.num_speculative_tokens
        if k >= max_seq_len:  # (the KV cache holds max_seq_len + K + 1 positions a slot)
            raise ValueError(
                f"{prefix}num_speculative_tokens ({k}) must be below {key} ({max_seq_len}): a row never has room for "
                "more drafts than that; lower it (a few tokens, e.g. 4)"
            )

    def _check_suffix(self) -> None:
        depth = self.suffix_decoding_max_tree_depth
        if not isinstance(depth, int) or isinstance(depth, bool) or not 2 <= depth <= MAX_TREE_DEPTH:
            raise ValueError(
                f"suffix_decoding_max_tree_depth ({depth!r}) must be an integer in [2, {MAX_TREE_DEPTH}]: every token "
                "taken in is counted at each depth (vLLM's default: 24)"
            )
        cached = self.suffix_decoding_max_cached_requests
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise ValueError(
                f"suffix_decoding_max_cached_requests ({cached!r}) must be an integer >= 0 (0 keeps no history)"
            )
        factor = self.suffix_decoding_max_spec_factor
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor ({factor!r}) must be a number > 0, e.g. 1.0")
        prob = self.suffix_decoding_min_token_prob
        if not isinstance(prob, (int, float)) or isinstance(prob, bool) or not 0 <= prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob ({prob!r}) must be a probability in [0, 1], e.g. 0.1")

    def __post_init__(self) -> None:
        self.check()
        if (
            self.method is not None
            and self.verification == "rejection"
            and self.num_speculative_tokens_per_batch_size == "auto"
        ):
            warnings.warn(
                "verification='rejection' draws its uniforms by count (2K + 1 a step) and the auto K policy chooses K "
                "from measured step times: the same seed gives other samples from run to run; verification='exact' "
                "(the default) keeps them",
                stacklevel=3,
            )

    def prompt_lookup_range(self) -> tuple[int, int]:
        """ngram's shortest and longest suffix to match, the defaults of fields left None filled in (the fields keep
        what was given, so that `dataclasses.replace(spec, prompt_lookup_min=6)` derives the longest again)."""
        low = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
        return low, (max(4, low) if self.prompt_lookup_max is None else self.prompt_lookup_max)

    def check(self) -> None:
        """Check the fields (numpy's numbers taken as Python's, `method` `"none"` as None). A `Generator` calls it
        again when built: a field set after construction is checked there too."""
        if self.method in (None, "none"):  # speculation off: nothing else is used
            self.method = None
            return
        self._python_numbers()
        methods = [self.method] if isinstance(self.method, str) else self.method
        if (
            not isinstance(methods, (list, tuple))
            or not methods
            or not all(isinstance(m, str) for m in methods)
            or len(set(methods)) != len(methods)
        ):
            raise ValueError(f"method ({self.method!r}) must be one of {', '.join(METHODS)} or a list of distinct ones")
        for method in methods:
            if method not in METHODS:
                raise ValueError(f"method ({method!r}) must be one of {', '.join(METHODS)}")
        if not isinstance(self.method, str):
            self.method = list(self.method)
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification ({self.verification!r}) must be one of {', '.join(VERIFICATIONS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"num_speculative_tokens ({k!r}) must be an integer >= 1 (no drafts: spec=None, or spec.method: null "
                "in a recipe)"
            )
        if "ngram" in methods:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                    raise ValueError(f"{name} ({value!r}) must be an integer >= 1, or None (the default)")
            low, high = self.prompt_lookup_range()
            if low > high:
                raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        if self.model is not None and "draft_model" not in methods:
            raise ValueError(
                f"model is set but method is {self.method!r}: add 'draft_model' to method to use a draft model, or "
                "unset model (spec.model=null in a recipe)"
            )
        candidates = self.num_candidates
        if not isinstance(candidates, int) or isinstance(candidates, bool) or candidates < 1:
            raise ValueError(f"num_candidates ({self.num_candidates!r}) must be an integer >= 1 (1 = a chain)")
        if self.num_candidates > 1 and (len(methods) > 1 or methods[0] == "draft_model"):
            raise ValueError(
                f"num_candidates ({self.num_candidates}) > 1 builds token trees from a single 'ngram' or 'suffix' "
                f"proposer, not from {self.method!r}; use one of those alone or num_candidates=1"
            )
        self._check_suffix()
        if "draft_model" in methods and self.model is None:
            raise ValueError("method 'draft_model' needs model: a path, a shipped short name or a loaded model")
        if self.num_speculative_tokens_per_batch_size is not None:
            from specdec.policies import validate_batch_size_table

            validate_batch_size_table(self.num_speculative_tokens_per_batch_size, k)

    def _python_numbers(self) -> None:
        """numpy's numbers in the fields (and the K table's entries) as Python's, which the checks take."""
        for name in _INT_FIELDS:
            setattr(self, name, python_number(getattr(self, name), int))
        for name in _FLOAT_FIELDS:
            setattr(self, name, python_number(getattr(self, name), float))
        table = self.num_speculative_tokens_per_batch_size
        rows = table.tolist() if getattr(table, "ndim", None) == 2 else table  # a numpy array (or tensor) of rows
        if not isinstance(rows, (list, tuple)):
            return
        converted, changed = [], rows is not table
        for entry in rows:
            if getattr(entry, "ndim", None) == 1:  # a row that is an array
                entry, changed = entry.tolist(), True
            if isinstance(entry, (list, tuple)):
                numbers = [python_number(v, int) for v in entry]
                changed = changed or any(a is not b for a, b in zip(numbers, entry))
                entry = numbers
            converted.append(entry)
        if changed:  # a table of Python's numbers stays the object it is
            self.num_speculative_tokens_per_batch_size = converted


@dataclass
class SpecDecodeParams:
    """Speculation settings of one request (`SamplingParams.spec`); a batch mixes requests with different ones.

    Attributes:
        enabled: False: this request's rows never get drafts (they still share the batch's forward pass).
        max_num_draft_tokens: a cap on this request's K per step; None = the policy's K.
        method: draft only with this configured proposer; None = the configured order.
    """

    enabled: bool = True
    max_num_draft_tokens: int | None = None
    method: str | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check the fields (again for each call that takes them: see `SamplingParams.check`), numpy's numbers and
        bools taken as Python's."""
        self.enabled = python_number(self.enabled, bool)
        self.max_num_draft_tokens = python_number(self.max_num_draft_tokens, int)
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
