"""veRL's settings in this library's terms: a request's `sampling_params` dict as `SamplingParams`, the rollout
config's `engine_kwargs.rollout` (with a vLLM-style `speculative_config`) as `EngineOptions` and a `SpecConfig`.

Plain Python: nothing here imports veRL, so the mapping is checked where veRL is not installed.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout.engine.sampling import SamplingParams
from specdec.config import SpecConfig

# what veRL's agent loops and vLLM-style callers put in a request's sampling_params that this backend honours
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "max_new_tokens", "logprobs", "seed", "ignore_eos",
                 "stop_token_ids", "n")  # fmt: skip
# settings this backend does not implement, accepted only at the value that turns them off
NEUTRAL_VALUES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
SPEC_KEYS = tuple(f.name for f in dataclasses.fields(SpecConfig))
KV_LAYOUTS = ("auto", "paged", "slots")


@dataclass
class RequestLimits:
    """The lengths a request is capped by, from veRL's rollout config.

    Attributes:
        prompt_length: `rollout.prompt_length`: the longest prompt veRL builds.
        response_length: `rollout.response_length`: the most tokens a response keeps.
        max_model_len: prompt + response tokens a sequence may hold (`rollout.max_model_len`, or the two above).
        ignore_eos: `rollout.ignore_eos`: the default when a request does not say.
    """

    prompt_length: int
    response_length: int
    max_model_len: int
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("prompt_length", "response_length", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")


def prompt_token_ids(prompt_ids: Any) -> list:
    """A request's prompt as a list of token ids, taken in the forms veRL's own servers take: a list or tuple, a
    tensor or array, a tokenizer's output (`apply_chat_template(tokenize=True)` gives a `BatchEncoding` under
    transformers 5) or a batch of that one prompt. Integer ids become Python ints; anything else is left for the
    engine's check, which refuses it naming the value (a float was cut to an int, a bool taken as 0 or 1).

    Raises:
        ValueError: text, or no sequence at all.
    """
    ids = prompt_ids
    if not isinstance(ids, (list, tuple, str)) and hasattr(ids, "keys") and "input_ids" in ids.keys():
        ids = ids["input_ids"]  # a tokenizer's output (a BatchEncoding, a dict)
    if hasattr(ids, "tolist") and not isinstance(ids, str):
        ids = ids.tolist()
    if isinstance(ids, (list, tuple)) and len(ids) == 1 and isinstance(ids[0], (list, tuple)):
        ids = ids[0]  # a batch of one prompt
    if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
        raise ValueError(
            f"prompt_ids must be the prompt's token ids (a list of integers), got {type(prompt_ids).__name__} "
            f"{prompt_ids!r:.60}: the 'rollout' backend takes tokenized prompts"
        )
    ids = [t.item() if getattr(t, "ndim", None) == 0 and hasattr(t, "item") else t for t in ids]  # 0-dim tensors
    return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in ids]


def sampling_params_from_verl(
    sampling_params: dict[str, Any], num_prompt_tokens: int, limits: RequestLimits
) -> tuple[SamplingParams, bool]:
    """One veRL request's `sampling_params` as this library's `SamplingParams`, and whether it asked for log-probs.

    veRL's conventions: temperature 0 is greedy; top_k -1 (or 0) is off; `max_tokens` (or SGLang's `max_new_tokens`)
    caps the response, else `min(response_length, prompt_length + response_length - prompt tokens)`, as veRL's vLLM
    server does; either way at most `max_model_len - prompt tokens`. A request's own `seed` is kept (None without).

    Raises:
        ValueError: a key this backend does not know, a setting it does not implement at a value other than off
            (repetition_penalty, presence/frequency_penalty, min_p), `n` other than 1, `max_tokens` below 1,
            `ignore_eos` that is not a bool, or a prompt that leaves no room for a response.
    """
    params = dict(sampling_params)
    unknown = sorted(set(params) - set(SAMPLING_KEYS) - set(NEUTRAL_VALUES))
    if unknown:
        raise ValueError(
            f"sampling_params has {unknown}, which the 'rollout' backend does not know; it takes "
            f"{', '.join(SAMPLING_KEYS)} (and {', '.join(NEUTRAL_VALUES)} at their off values)"
        )
    for key, off in NEUTRAL_VALUES.items():
        if _number(params.get(key), key, off) != off:
            raise ValueError(
                f"sampling_params[{key!r}] ({params[key]!r}) is not supported by the 'rollout' backend (it would break "
                f"exact drafting): set it to {off}"
            )
    if params.get("n", 1) != 1:
        raise ValueError(f"sampling_params['n'] ({params['n']!r}) must be 1: veRL sends each sample as its own request")
    room = limits.max_model_len - num_prompt_tokens
    if room < 1:
        raise ValueError(
            f"a prompt of {num_prompt_tokens} tokens leaves no room for a response within max_model_len "
            f"({limits.max_model_len}): raise rollout.max_model_len or shorten the prompt"
        )
    key = "max_tokens" if params.get("max_tokens") is not None else "max_new_tokens"
    max_tokens = _number(params.get(key), key, None, integer=True)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"sampling_params[{key!r}] ({max_tokens}) must be at least 1: a response's most tokens")
    if max_tokens is None:
        max_tokens = min(limits.response_length, limits.prompt_length + limits.response_length - num_prompt_tokens)
    max_tokens = max(1, min(max_tokens, room))
    top_k = _number(params.get("top_k"), "top_k", -1, integer=True)
    if top_k < -1:
        raise ValueError(f"sampling_params['top_k'] ({top_k}) must be -1 (off) or a positive integer")
    stop_token_ids = params.get("stop_token_ids")
    stop_token_ids = [] if stop_token_ids is None else stop_token_ids
    if hasattr(stop_token_ids, "tolist") and not isinstance(stop_token_ids, (str, bytes)):  # a numpy or torch array
        stop_token_ids = stop_token_ids.tolist()
    if not isinstance(stop_token_ids, (list, tuple)):
        raise ValueError(f"sampling_params['stop_token_ids'] ({stop_token_ids!r}) must be a list of token ids")
    converted = SamplingParams(
        n=1,
        temperature=_number(params.get("temperature"), "temperature", 1.0),
        top_p=_number(params.get("top_p"), "top_p", 1.0),
        top_k=max(top_k, 0),
        max_new_tokens=max_tokens,
        stop_token_ids=[_number(t, "stop_token_ids", None, integer=True) for t in stop_token_ids],
        ignore_eos=_flag(params.get("ignore_eos"), "ignore_eos", limits.ignore_eos),
        seed=_number(params.get("seed"), "seed", None, integer=True),
    )
    return converted, bool(params.get("logprobs", False))


def spec_config_from_dict(options: dict[str, Any] | None) -> SpecConfig | None:
    """A vLLM-style `speculative_config` dict as a `SpecConfig` (None, `{}` or `method: none`: no speculation).

    Raises:
        ValueError: a key that is not a `SpecConfig` field (the valid ones are listed), or a value `SpecConfig`
            refuses.
    """
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ValueError(f"speculative_config ({options!r}) must be a mapping of SpecConfig fields or None")
    if not options:
        return None
    unknown = sorted(set(options) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config has {unknown}, which are not SpecConfig fields; valid keys: {', '.join(SPEC_KEYS)}"
        )
    values = {key: _plain(value) for key, value in options.items()}
    spec = SpecConfig(**values)
    return spec if spec.methods else None


@dataclass
class EngineOptions:
    """What `actor_rollout_ref.rollout.engine_kwargs.rollout` sets for this backend (veRL keeps one dict per backend
    under `engine_kwargs`).

    Attributes:
        speculative_config: vLLM's `--speculative-config` dict (`SpecConfig`'s fields); None, `{}` or
            `method: none` decodes without drafts.
        max_batch_size: generator slots (sequences decoded at once); None: `rollout.max_num_seqs`, at most 256.
        kv_layout: "auto" (paged on a GPU, slots on a CPU), "paged" or "slots".
        kv_pool_blocks: paged: the KV pool's size in blocks of 16 tokens; None plans it from the free memory.
        cuda_graphs: "auto", True or False (`rollout.enforce_eager=True` turns them off).
        max_prefill_tokens: cap on padded prompt tokens per prefill forward; None: 16384, at least max_model_len.
    """

    speculative_config: dict | None = None
    max_batch_size: int | None = None
    kv_layout: str = "auto"
    kv_pool_blocks: int | None = None
    cuda_graphs: Any = "auto"
    max_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        self.spec = spec_config_from_dict(self.speculative_config)  # checks it now
        for name in ("max_batch_size", "kv_pool_blocks", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"engine_kwargs.rollout.{name} ({value!r}) must be a positive integer or null")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"engine_kwargs.rollout.kv_layout ({self.kv_layout!r}) must be one of {KV_LAYOUTS}")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):  # (not 1 or 0)
            raise ValueError(f"engine_kwargs.rollout.cuda_graphs ({self.cuda_graphs!r}) must be true, false or auto")

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None, fallback_spec: dict | None = None) -> EngineOptions:
        """From `engine_kwargs.rollout`; `fallback_spec` (a vLLM user's `engine_kwargs.vllm.speculative_config`) is
        used when `engine_kwargs.rollout` sets no `speculative_config`.

        Raises:
            ValueError: an unknown key (the valid ones are listed) or a value out of range.
        """
        options = _plain(options) or {}
        if not isinstance(options, dict):
            raise ValueError(f"engine_kwargs.rollout ({options!r}) must be a mapping")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"engine_kwargs.rollout has {unknown}; valid keys: {', '.join(names)}")
        values = {key: value for key, value in options.items() if value is not None}
        source = "engine_kwargs.rollout.speculative_config"
        if "speculative_config" not in options and fallback_spec:  # (set to None: no drafts, as documented)
            values["speculative_config"] = _plain(fallback_spec)
            source = (
                "engine_kwargs.vllm.speculative_config (taken where engine_kwargs.rollout sets none; "
                "engine_kwargs.rollout.speculative_config=null decodes without drafts)"
            )
        try:  # (built again by __post_init__: a config, nothing loaded)
            spec_config_from_dict(values.get("speculative_config"))
        except ValueError as err:  # the library's words, under the key the veRL user set
            raise ValueError(f"{source}: {err}") from None
        return cls(**values)


def _number(value: Any, key: str, default: Any, integer: bool = False) -> Any:
    """`value` (a request's `sampling_params[key]`) as a float (an int with `integer`), `default` where it is None.

    Raises:
        ValueError: a value that is not a number (or not a whole number with `integer`), naming the key.
    """
    if value is None:
        return default
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value) if integer else float(value)  # (an integer as it is: a float holds 53 bits)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, (bool, str)) or number is None or (integer and not number.is_integer()):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"sampling_params[{key!r}] ({value!r}) must be {kind}")
    return int(number) if integer else number


def _flag(value: Any, key: str, default: bool) -> bool:
    """`value` (a request's `sampling_params[key]`) as a bool, `default` where it is None.

    Raises:
        ValueError: anything but True, False (numpy's too) or None, naming the key (`bool("false")` is True).
    """
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"sampling_params[{key!r}] ({value!r}) must be true or false")


def _plain(value: Any) -> Any:
    """OmegaConf containers (veRL's configs) as plain dicts and lists; anything else unchanged."""
    if hasattr(value, "items") and not isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(item) for item in value]
    return value
