"""Reward functions: the built-in ones by name, any other by `module:function` import path, several summed with weights.

A reward function takes the decoded completions and, as keyword arguments, everything known about each sample,
one list entry per completion (TRL's convention), and returns one float per completion (None where it does not apply):

    def my_reward(completions: list[str], **kwargs) -> list[float]: ...

The keyword arguments are `prompts` (the formatted prompt text), `completion_ids` (token ids), `finish_reasons`
("stop" | "length") and every column of the dataset row the sample came from (e.g. `answer`), repeated once per
sample. Accept `**kwargs` so that new columns do not break the function (one that takes neither a keyword given nor
`**kwargs` is refused before anything is generated).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from rollout.tasks.arithmetic import arithmetic_reward

RewardFn = Callable[..., list[float]]
# what the rollout loop passes to every reward function itself (dataset columns of these names are left out)
RESERVED_REWARD_KWARGS = ("completions", "prompts", "completion_ids", "finish_reasons")


def arithmetic(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 where the number after the last `####` equals the `answer` column, else 0.0."""
    return arithmetic_reward(completions, [str(a) for a in answer])


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 where the completion's final number equals GSM8K's reference (the number after `####` in the `answer`
    column). The final number is the one after the completion's last `####` if it has one, else its last number."""
    rewards = []
    for completion, reference in zip(completions, answer):
        target = _to_number(str(reference).rsplit("####", 1)[-1])
        tail = completion.rsplit("####", 1)[-1] if "####" in completion else completion
        numbers = _NUMBER.findall(tail)
        found = numbers[0] if "####" in completion and numbers else (numbers[-1] if numbers else None)
        rewards.append(1.0 if target is not None and found is not None and _to_number(found) == target else 0.0)
    return rewards


def _to_number(text: str) -> float | None:
    match = _NUMBER.search(text)
    return float(match.group(0).replace(",", "")) if match else None


# read-only: register your own reward with a `module:function` path instead of mutating a global table
BUILTIN_REWARDS = MappingProxyType({"arithmetic": arithmetic, "gsm8k": gsm8k})


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """A reward function from a built-in name (see `BUILTIN_REWARDS`), a `module:function` path, or a callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward ({spec!r}) must be a built-in name, a 'module:function' path or a callable")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown reward name {spec!r}; built-in rewards: {', '.join(BUILTIN_REWARDS)}, "
            "or give an import path as 'module:function'"
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r} must be 'module:function', both named (e.g. 'my_rewards:format_reward')")
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `rollout` command: a module in this folder counts
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        top = module_name.split(".")[0]
        where = (
            f": it is looked for in the working directory ({os.getcwd()}) and on PYTHONPATH; run from the folder that "
            f"holds {top}.py, or add that folder to PYTHONPATH"
            if isinstance(err, ModuleNotFoundError) and err.name == top
            else ""
        )
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({err}){where}") from None
    except Exception as err:  # the module's own code failed (a SyntaxError, an error at import): say which, in one line
        raise ValueError(
            f"reward {spec!r}: importing module {module_name!r} raised {type(err).__name__}: {err}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


class RewardError(ValueError):
    """A reward function raised, or returned what a reward may not: the message names the reward."""


@dataclass
class WeightedReward:
    """One term of the total reward: `weight * fn(completions, **columns)`."""

    name: str  # how the term is reported (rollouts.jsonl, W&B): the built-in name, the path or the function name
    fn: RewardFn
    weight: float = 1.0


_ASYNC = (
    "rewards are called one after another, not awaited; give a plain function (one that runs the coroutine to its "
    "end: def reward(completions, **kwargs): return asyncio.run(my_async_reward(completions, **kwargs)))"
)


def build_rewards(specs: Sequence[tuple[str | RewardFn, float]]) -> list[WeightedReward]:
    """Resolve `(name or path or callable, weight)` pairs; raises ValueError naming an unknown reward."""
    terms = []
    for spec, weight in specs:
        fn = resolve_reward(spec)
        name = spec if isinstance(spec, str) else getattr(fn, "__name__", "reward")
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            raise ValueError(f"reward {name!r} is async: {_ASYNC}")
        if any(t.name == name for t in terms):  # the same function twice: keep the reported names apart
            name = f"{name}#{len(terms)}"
        try:
            value = math.nan if isinstance(weight, (str, bytes)) else float(weight)  # ("2" is a typo to name)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):  # every total would be NaN (or infinite)
            raise ValueError(f"the weight of reward {name!r} ({weight!r}) must be a finite number")
        terms.append(WeightedReward(name, fn, value))
    return terms


def required_arguments(fn) -> list[str]:
    """The names of `fn`'s parameters that have no default (positional or keyword); [] when it cannot be read."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty]


def _completions_by_name(fn, keywords) -> bool:
    """Whether the completions go to `fn` by name: its first parameter is one of the `keywords` it is given (TRL's
    convention, `f(prompts, completions, ...)`, all by name) and it has one named `completions`; else they go first,
    by position."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = next((p.name for p in parameters.values() if p.kind in kinds), None)
    named = parameters.get("completions")
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return first != "completions" and first in keywords and named is not None and named.kind in by_name


def unaccepted_arguments(fn, keywords) -> str | None:
    """What `fn` cannot take of what `score` passes it, said as the end of a sentence about it: the completions (first
    by position, or by name in TRL's convention) and `keywords` by name; None when it takes them all, or when its
    signature cannot be read (a builtin's: its call says)."""
    if inspect.isclass(fn):  # (called, it makes an instance, and that is no list of rewards)
        return "is a class: give a function, or an instance whose __call__ takes (completions, **kwargs)"
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    by_name = _completions_by_name(fn, keywords)
    if by_name:
        positional = None
    else:
        positional = next(
            (p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)), None
        )
        if positional is None and not any(p.kind is kinds.VAR_POSITIONAL for p in parameters):
            return (
                "takes no completions: its first parameter gets the decoded texts (def reward(completions, **kwargs))"
            )
    if any(p.kind is kinds.VAR_KEYWORD for p in parameters):
        return None
    names = {p.name for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    if positional is not None:
        names.discard(positional.name)  # (it holds the completions: given again by name, it fails)
    unknown = sorted(name for name in keywords if name not in names)
    if not unknown:
        return None
    return (
        f"does not take {unknown}, which it is given by name (every data column, prompts, completion_ids and "
        "finish_reasons): add **kwargs to its parameters"
    )


def check_reward_columns(terms: Sequence[WeightedReward], columns: Sequence[str], where: str = "the data") -> None:
    """Every reward's required keyword arguments are among `columns` or the ones the loop passes itself, and it takes
    all of those; raises ValueError naming the reward and the missing columns, or what it does not take."""
    # what each function is given by name: the columns (but one named `completions`, left out) and the loop's own
    available = (set(columns) | set(RESERVED_REWARD_KWARGS)) - {"completions"}
    for term in terms:
        required = required_arguments(term.fn)
        taken = "completions" if _completions_by_name(term.fn, available) else (required[0] if required else None)
        missing = [name for name in required if name != taken and name not in available]
        if missing:
            raise ValueError(
                f"reward {term.name!r} needs the column(s) {missing}, which {where} lacks; it has "
                f"{sorted(set(columns)) or 'no columns (bare prompts)'}: pass rows with those columns"
            )
        problem = unaccepted_arguments(term.fn, available)
        if problem:
            raise ValueError(f"reward {term.name!r} {problem}")


def mean_reward(values: Sequence[float | None]) -> float | None:
    """The mean of the rewards that are not None (None if there are none)."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def score(
    terms: Sequence[WeightedReward], completions: list[str], columns: dict[str, list], non_finite_as_null: bool = False
) -> tuple[list[float | None], dict[str, list[float | None]]]:
    """Run every reward term over the completions.

    Args:
        terms: the reward terms.
        completions: decoded completion texts, one per sample.
        columns: keyword arguments for the reward functions, each a list with one entry per sample (each term is
            given copies: what it does to them stays its own).
        non_finite_as_null: False raises on a NaN or infinite reward; True records it as None, and the sample's
            total too.
    Returns:
        (total, per_term): the weighted sum per sample, and each term's unweighted rewards by term name. A reward
        that returns None for a sample does not apply to it (TRL's convention): its term is None there and the total
        sums the terms that apply; a sample none applies to has a total of None.
    """
    total: list[float | None] = [0.0] * len(completions)  # None: a non-finite term nulled the sample
    applied = [False] * len(completions)  # some term gave the sample a value
    per_term: dict[str, list[float | None]] = {}
    for term in terms:
        # each term gets lists of its own: a reward that edits what it is given (strips an EOS id in place, cleans the
        # texts) edited the batch's completions and ids, and what the next term saw (a trainer's own arguments, TRL's
        # `trainer_state` and `log_metric`, go as they are)
        given = {name: list(values) if isinstance(values, list) else values for name, values in columns.items()}
        if isinstance(given.get("completion_ids"), list):
            given["completion_ids"] = [list(ids) if isinstance(ids, list) else ids for ids in given["completion_ids"]]
        try:
            if _completions_by_name(term.fn, given):  # TRL's take every argument by name: (prompts, completions, ...)
                values = term.fn(completions=list(completions), **given)
            else:
                values = term.fn(list(completions), **given)
        except TypeError as err:  # most often a reward that needs a column the dataset lacks
            raise RewardError(
                f"reward {term.name!r} raised TypeError: {err}; it was given the columns {sorted(columns)}"
            ) from err
        except Exception as err:  # the reward's own failure, whatever its type: name the reward and the type
            raise RewardError(f"reward {term.name!r} raised {type(err).__name__}: {err}") from err
        try:
            sized = not isinstance(values, (str, bytes, dict)) and len(values) >= 0
        except TypeError:  # a scalar, a generator, a coroutine, ...
            sized = False
        if inspect.iscoroutine(values):
            values.close()  # (never awaited: Python would warn of it)
            raise RewardError(f"reward {term.name!r} is async: {_ASYNC}")
        if not sized:
            raise RewardError(
                f"reward {term.name!r} returned {type(values).__name__} {values!r:.40}, not a list: return a list of "
                f"{len(completions)} floats, one per completion"
            )
        if len(values) != len(completions):
            num = len(completions)
            raise RewardError(
                f"reward {term.name!r} returned {len(values)} values for {num} completions: return one each"
            )
        text = next((v for v in values if isinstance(v, (str, bytes))), None)
        if text is not None:  # float() would read "1.0" as 1.0: a reward that returns its text is a bug to name
            raise RewardError(f"reward {term.name!r} returned {text!r:.40}, text, not a number: return floats")
        try:  # None: the reward does not apply to that sample (TRL's convention)
            values = [None if v is None else float(v) for v in values]
        except (TypeError, ValueError):
            odd = next(v for v in values if v is not None and not isinstance(v, (int, float)))
            raise RewardError(f"reward {term.name!r} returned {odd!r:.40}, not a number: return floats") from None
        except OverflowError:  # an int past a float's range
            raise RewardError(f"reward {term.name!r} returned a number past a float's range: return floats") from None
        bad = [i for i, v in enumerate(values) if v is not None and not math.isfinite(v)]
        if bad and not non_finite_as_null:
            raise RewardError(
                f"reward {term.name!r} returned {values[bad[0]]} for sample {bad[0]} ({len(bad)} non-finite values): "
                "a reward must be a finite number (or set non_finite_rewards_as_null to record such samples as null)"
            )
        per_term[term.name] = [None if v is None or not math.isfinite(v) else v for v in values]
        for i, v in enumerate(values):
            if v is not None:
                applied[i] = True
                total[i] = total[i] + term.weight * v if math.isfinite(v) and total[i] is not None else None
    # a sample no reward applies to has none (left out of the advantages, null on disk), as TRL leaves it NaN
    return [t if hit else None for t, hit in zip(total, applied)], per_term
