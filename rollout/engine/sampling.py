"""What a caller asks for (SamplingParams) and what it gets back (Completion)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from specdec.config import SpecDecodeParams, python_number

MIN_TEMPERATURE = 1e-5  # the smallest temperature above 0 (greedy): vLLM's sampling epsilon


@dataclass
class SamplingParams:
    """How to sample completions for every prompt of one `Generator.generate` call (or one prompt, given a list).

    Attributes:
        n: completions per prompt (the GRPO group size); the prompt is prefilled once and its KV copied.
        temperature: 0 = greedy; else at least `MIN_TEMPERATURE` (1e-5).
        top_p: nucleus mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.
        max_new_tokens: the completion length cap (`finish_reason` "length").
        stop_token_ids: extra stop tokens besides the model's EOS ids.
        ignore_eos: keep generating past the model's EOS ids (`stop_token_ids` still stop).
        seed: the same seed and inputs give the same completions; None draws a fresh seed.
        spec: this request's speculation settings (off, a K cap, one proposer), or their fields as a dict; None =
            drafted as configured.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    spec: SpecDecodeParams | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check the fields (numpy's numbers taken as Python's, `spec` None as the default settings). A `Generator`
        calls it again for each call's params: a field set after construction is checked there too."""
        # numpy's integers and floats (what a config built with numpy holds) as Python's: the checks and the
        # engine's tensors take those
        for name in ("n", "top_k", "max_new_tokens", "seed"):
            setattr(self, name, python_number(getattr(self, name), int))
        for name in ("temperature", "top_p"):  # (np.float64 is a float, and still numpy's: OmegaConf refuses it)
            setattr(self, name, python_number(getattr(self, name), float))
        self.ignore_eos = python_number(self.ignore_eos, bool)
        ids = self.stop_token_ids
        if isinstance(ids, (list, tuple)) and any(isinstance(t, np.integer) for t in ids):
            self.stop_token_ids = [int(t) if isinstance(t, np.integer) else t for t in ids]
        for name in ("n", "top_k", "max_new_tokens", "seed", "temperature", "top_p", "ignore_eos"):
            value = getattr(self, name)  # (a bool is an int to Python)
            if isinstance(value, bool) != (name == "ignore_eos"):
                kind = {"ignore_eos": "True or False", "temperature": "a number", "top_p": "a number"}
                raise ValueError(f"{name} ({value!r}) must be {kind.get(name, 'an integer')}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n ({self.n!r}) must be an integer >= 1: the number of completions per prompt")
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
            or 0 < self.temperature < MIN_TEMPERATURE
        ):
            raise ValueError(
                f"temperature ({self.temperature!r}) must be 0 (greedy decoding) or a finite number >= "
                f"{MIN_TEMPERATURE:g} (logits divided by less overflow float32)"
            )
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p ({self.top_p!r}) must be in (0, 1]; use 1.0 to turn nucleus sampling off")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k ({self.top_k!r}) must be an integer >= 0; use 0 to turn top-k off")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens!r}) must be an integer >= 1")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                example = f"e.g. [{ids}]" if isinstance(ids, int) else "e.g. [2]"
                raise ValueError(f"stop_token_ids ({ids!r}) must be a list of non-negative token ids, {example}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed ({self.seed!r}) must be an integer or None")
        if isinstance(self.spec, Mapping):  # `dataclasses.asdict` of params, a config file's section
            names = [f.name for f in dataclasses.fields(SpecDecodeParams)]
            unknown = [key for key in self.spec if key not in names]
            if unknown:
                raise ValueError(f"spec has no field {unknown[0]!r}: SpecDecodeParams takes {', '.join(names)}")
            self.spec = SpecDecodeParams(**self.spec)
        if self.spec is None:
            self.spec = SpecDecodeParams()
        elif not isinstance(self.spec, SpecDecodeParams):
            raise ValueError(f"spec ({self.spec!r}) must be a specdec.config.SpecDecodeParams or None")
        else:
            self.spec.check()


@dataclass
class Completion:
    """One sampled completion.

    Attributes:
        prompt_index: the prompt's index in the call.
        sample_index: the sample's index among the prompt's `n`.
        token_ids: the completion's tokens, the stop token included when it stopped on one.
        logprobs: `logprobs[i]` is the log-probability of `token_ids[i]` under the distribution it was sampled from
            (after temperature / top-k / top-p; for greedy, the model's plain log-softmax).
        finish_reason: `"stop"` (an EOS or stop token) or `"length"` (`max_new_tokens` reached, or the generator's
            `max_seq_len` where that comes first: a warning says so at the call).
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
