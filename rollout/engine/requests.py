"""A call's requests: its prompts and settings checked (one clear error each), then one Sequence per sample."""

from __future__ import annotations

import copy
import hashlib
import numbers
import operator
import os
import random
import sys
import warnings

import numpy as np
import torch
from transformers import PreTrainedModel

from rollout.engine.sampling import SamplingParams
from rollout.engine.sequence import Sequence
from specdec.config import SpecConfig


def check_prompts(prompt_ids, vocab_size: int, max_seq_len: int) -> list[list[int]]:
    """The prompts as lists of Python ints (numpy / torch integer ids accepted), checked against the vocabulary
    and max_seq_len."""
    if isinstance(prompt_ids, str) or not hasattr(prompt_ids, "__len__") or len(prompt_ids) == 0:
        raise ValueError(
            "prompt_ids must be a non-empty list of prompts, each a list of token ids "
            "(tokenizer(texts)['input_ids']); Rollout takes text and chat messages"
        )
    checked = []
    for index, prompt in enumerate(prompt_ids):
        if isinstance(prompt, str):
            raise ValueError(
                f"prompt {index} is a string ({prompt!r:.40}): pass token ids (tokenizer(text)['input_ids']), "
                "or use Rollout, which formats and tokenizes text"
            )
        values = prompt.tolist() if hasattr(prompt, "tolist") else prompt
        if isinstance(values, numbers.Integral) and not isinstance(values, bool):  # [5, 6, 7]: ids taken as prompts
            raise ValueError(
                f"prompt {index} is the token id {values}: prompt_ids is a list of prompts, so one prompt of token "
                "ids goes in a list of its own ([[5, 6, 7]])"
            )
        if not isinstance(values, (list, tuple)) or len(values) == 0:
            raise ValueError(f"prompt {index} is empty or not a list of token ids: got {prompt!r:.60}")
        ids = []
        for token in values:
            if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                raise ValueError(f"prompt {index} holds {token!r:.30} ({type(token).__name__}): token ids are integers")
            ids.append(int(token))
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {index} has token id {bad[0]} outside the model's vocabulary [0, {vocab_size}): "
                "tokenize with the model's own tokenizer"
            )
        if len(ids) >= max_seq_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens but max_seq_len is {max_seq_len}, leaving no room "
                f"for a completion: shorten the prompt or raise max_seq_len above {len(ids)}"
            )
        checked.append(ids)
    return checked


def check_params(
    params, num_prompts: int, methods: tuple[str, ...], vocab_size: int | None = None
) -> list[SamplingParams]:
    """One SamplingParams per prompt, each a copy of the caller's object as it is now (a field the caller sets later,
    while the request waits in the queue, does not change it); a request's spec settings must name a configured
    proposer, and its stop ids tokens of the model's vocabulary (`vocab_size`, when given)."""
    params = SamplingParams() if params is None else params
    per_prompt = [params] * num_prompts if isinstance(params, SamplingParams) else params
    if not isinstance(per_prompt, (list, tuple)) or len(per_prompt) != num_prompts:
        raise ValueError(
            f"params must be one SamplingParams or a list of one per prompt ({num_prompts}), got {params!r:.80}"
        )
    checked: set[int] = set()
    for index, p in enumerate(per_prompt):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params[{index}] ({p!r:.60}) must be a SamplingParams")
        if id(p) not in checked:  # again: a field set since construction (params.temperature = -1) is checked too
            p.check()
            checked.add(id(p))
        if vocab_size is not None:
            check_stop_ids(p.stop_token_ids, vocab_size, f"params[{index}].stop_token_ids")
        method = p.spec.method
        if method is not None and method not in methods:
            raise ValueError(
                f"params[{index}].spec.method ({method!r}) is not a configured proposer: the generator's spec has "
                f"{list(methods) or 'no speculation'}; name one of those or leave method None"
            )
    copies: dict[int, SamplingParams] = {}
    for p in per_prompt:
        if id(p) not in copies:
            copies[id(p)] = copy.deepcopy(p)
    return [copies[id(p)] for p in per_prompt]


def check_stop_ids(stop_token_ids: list[int] | None, vocab_size: int, name: str) -> None:
    """Stop ids of the model's vocabulary: one outside it would never be sampled, and its request would run to its
    length cap. `name` is how the caller's user spells them."""
    outside = [t for t in stop_token_ids or () if t >= vocab_size]
    if outside:
        raise ValueError(
            f"{name} holds {outside[0]}, outside the model's vocabulary [0, {vocab_size}): give the model's own token "
            "ids (tokenizer.convert_tokens_to_ids)"
        )


def make_sequences(
    prompt_ids: list[list[int]],
    per_prompt: list[SamplingParams],
    eos_token_ids: list[int],
    max_seq_len: int,
    max_k: int,
    seed_indices: list[int] | None = None,
) -> list[Sequence]:
    """One Sequence per sample, prompt-major. A sample's seed depends on (the call's seed, its prompt's index or
    `seed_indices` entry, its sample index) only: never on the batch around it."""
    call_seed = random.SystemRandom().getrandbits(62)
    sequences = []
    for prompt_index, (prompt, params) in enumerate(zip(prompt_ids, per_prompt)):
        stop_ids = frozenset(() if params.ignore_eos else eos_token_ids) | frozenset(params.stop_token_ids or ())
        base_seed = params.seed if params.seed is not None else call_seed
        max_new = min(params.max_new_tokens, max_seq_len - len(prompt))
        seed_index = prompt_index if seed_indices is None else seed_indices[prompt_index]
        spec_cap = min(params.spec.cap(max_k), max_k)
        for sample_index in range(params.n):
            seed = _mix_seed(base_seed, seed_index, sample_index)
            sequences.append(
                Sequence(prompt_index, sample_index, list(prompt), params, max_new, stop_ids, seed, spec_cap)
            )
    return sequences


def length_cap_note(prompt_ids: list[list[int]], max_new_tokens: list[int], max_seq_len: int) -> str | None:
    """What `max_seq_len` cuts off: None when every prompt leaves room for its `max_new_tokens`, else one sentence
    with the numbers and the fix. (A prompt that leaves no room at all is `check_prompts`' error.)"""
    capped = [i for i, (p, m) in enumerate(zip(prompt_ids, max_new_tokens)) if len(p) < max_seq_len < len(p) + m]
    if not capped:
        return None
    worst = max(capped, key=lambda i: len(prompt_ids[i]) + max_new_tokens[i])
    longest, wanted = len(prompt_ids[worst]), max_new_tokens[worst]
    return (
        f"max_new_tokens {wanted} does not fit in max_seq_len {max_seq_len} after the longest prompt ({longest} "
        f"tokens): its samples stop at {max_seq_len - longest} new tokens with finish reason 'length' ({len(capped)} "
        f"of {len(prompt_ids)} prompts are cut short); raise max_seq_len to {longest + wanted} or lower max_new_tokens"
    )


def _mix_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """A per-sample seed: independent of batch composition, so a sample's stream never depends on its neighbours."""
    digest = hashlib.blake2b(f"{base}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def eos_token_ids(model: PreTrainedModel) -> list[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def check_generator_args(
    model,
    max_batch_size,
    max_seq_len,
    max_prefill_tokens,
    cuda_graphs,
    spec,
    async_scheduling="auto",
    compile_forward=False,
) -> None:
    """Refuse a `Generator`'s arguments that it cannot take, with what to pass instead."""
    if isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"Generator takes a loaded model, not the name or path {str(model)!r}: load it first with "
            "rollout.models.zoo.load_model(name) (shipped models) or "
            "transformers.AutoModelForCausalLM.from_pretrained"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Generator takes a transformers causal LM (a torch.nn.Module), got {type(model).__name__}")
    if not hasattr(model, "config") and isinstance(getattr(model, "module", None), torch.nn.Module):
        raise TypeError(
            f"Generator takes the model itself, got it wrapped in {type(model).__name__}: pass model.module (or "
            "accelerator.unwrap_model(model))"
        )
    for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive integer")
    if max_seq_len < 2:  # (built, it refused every prompt at the first call)
        raise ValueError(f"max_seq_len ({max_seq_len}) must be >= 2: a prompt token and a completion token")
    if max_prefill_tokens is not None and (not isinstance(max_prefill_tokens, int) or max_prefill_tokens < max_seq_len):
        raise ValueError(
            f"max_prefill_tokens ({max_prefill_tokens!r}) must be an integer >= max_seq_len ({max_seq_len}) "
            "so that the longest prompt fits one prefill, or None (16384, or max_seq_len where that is larger)"
        )
    # (1 == True and 0 == False to `in`: an integer passed as a switch, then read by `is True`, did the other thing)
    if not (isinstance(cuda_graphs, bool) or cuda_graphs == "auto"):
        raise ValueError(f"cuda_graphs ({cuda_graphs!r}) must be True, False or 'auto'")
    if not isinstance(compile_forward, bool):
        raise ValueError(f"compile_forward ({compile_forward!r}) must be True or False")
    if not (isinstance(async_scheduling, bool) or async_scheduling == "auto"):
        raise ValueError(f"async_scheduling ({async_scheduling!r}) must be True, False or 'auto'")
    if spec is not None and not isinstance(spec, SpecConfig):
        raise ValueError(f"spec must be a specdec.SpecConfig or None, got {type(spec).__name__}")
    if spec is not None:
        spec.check()  # (again: a field set after construction, which a trainer's config code does, is checked here)
    if spec is not None and spec.methods:
        k = spec.num_speculative_tokens
        spec.check_room(max_seq_len)
        if spec.num_speculative_tokens_per_batch_size == "auto" and max_seq_len < k + 5:
            raise ValueError(
                f"max_seq_len ({max_seq_len}) is too short for the auto K policy's warm-up, which times steps of up to "
                f"K + 1 = {k + 1} tokens after a context of 4: raise max_seq_len to {k + 5} or more, lower "
                "num_speculative_tokens, or give a static K or a table"
            )


def integer_indices(values, name: str) -> list[int]:
    """`values` (any iterable of integers: Python's, numpy's, 0-d integer tensors) as a list of Python ints; a float,
    a bool or a text is refused, naming `name` (int() would cut 0.7 to 0, and an index seeds a prompt's samples)."""
    out = []
    for value in values:
        try:
            if isinstance(value, (bool, np.bool_)):
                raise TypeError
            out.append(operator.index(value))
        except TypeError:
            raise ValueError(f"{name} must be integers, one per prompt; got {value!r}") from None
    return out


def checked_sequences(
    prompt_ids,
    params,
    seed_indices: list[int] | None,
    vocab_size: int,
    max_seq_len: int,
    methods: tuple[str, ...],
    eos_ids: list[int],
    max_k: int,
) -> list[Sequence]:
    """A call's prompts and settings checked (one clear error each), then one Sequence per sample, prompt-major; a
    warning when a length cap cuts requests short (a silent cap looks like a model that stops early)."""
    prompt_ids = check_prompts(prompt_ids, vocab_size, max_seq_len)
    if seed_indices is not None:
        seed_indices = integer_indices(seed_indices, "seed_indices")
        if len(seed_indices) != len(prompt_ids):
            raise ValueError(
                f"seed_indices holds {len(seed_indices)} values for {len(prompt_ids)} prompts: give one each"
            )
    per_prompt = check_params(params, len(prompt_ids), methods, vocab_size)
    sequences = make_sequences(prompt_ids, per_prompt, eos_ids, max_seq_len, max_k, seed_indices)
    note = length_cap_note(prompt_ids, [p.max_new_tokens for p in per_prompt], max_seq_len)
    if note is not None:
        warnings.warn(note, stacklevel=_outside_the_engine())
    return sequences


def _outside_the_engine() -> int:
    """The `stacklevel` at which a warning raised by the caller points at the first frame outside the engine (the
    code that called `generate` or `add_requests`)."""
    frame, level = sys._getframe(2), 2  # the frame that calls `warnings.warn` is level 1
    engine = os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == engine:
        frame, level = frame.f_back, level + 1
    return level
