"""Arithmetic word problems with step-by-step solutions and a verifiable reward.

Each problem tracks one running count (a person's apples, stickers, ...) through a number of days; each day adds
or removes a few. Solutions restate the numbers they work on, one sentence per day, and end with `#### <answer>`.
The number of days is drawn from a truncated power law, so most problems are short and a few are long: sampled
completion lengths then have the long tail that real reasoning rollouts have.

Everything is stdlib-only and seeded; `datasets` is imported only to build the `Dataset`.
"""

from __future__ import annotations

import hashlib
import numbers
import random
import re
from dataclasses import dataclass

PROMPT_TEMPLATE = "Question: {problem}\nAnswer:"
ANSWER_MARKER = "####"

_NAMES = [
    ("Mia", "she"), ("Tom", "he"), ("Ava", "she"), ("Leo", "he"), ("Zoe", "she"), ("Sam", "he"),
    ("Lily", "she"), ("Max", "he"), ("Emma", "she"), ("Ben", "he"), ("Nora", "she"), ("Jack", "he"),
    ("Ruby", "she"), ("Owen", "he"), ("Ella", "she"), ("Finn", "he"),
]  # fmt: skip
_ITEMS = [
    "apples", "stickers", "marbles", "coins", "books", "cards", "shells", "pencils",
    "cookies", "stamps", "beads", "toys", "eggs", "flowers", "rocks", "buttons",
]  # fmt: skip
# (present tense for the question, past tense for the solution); the first list adds, the second removes.
_GAIN_VERBS = [("buys", "bought"), ("finds", "found"), ("gets", "got"), ("wins", "won")]
_LOSS_VERBS = [("gives away", "gave away"), ("loses", "lost"), ("sells", "sold"), ("uses", "used")]


@dataclass
class ArithmeticConfig:
    """How arithmetic problems are drawn."""

    min_steps: int = 1  # fewest days (solution steps) in a problem
    max_steps: int = 30  # most days in a problem
    steps_exponent: float = 1.0  # P(num_steps = s) ~ s ** -steps_exponent: larger means fewer long problems
    max_value: int = 99  # the running count stays in [0, max_value], so every number has at most 2 digits
    max_operand: int = 20  # each day adds or removes between 1 and max_operand
    eval_fraction: float = 0.1  # share of all possible problem texts that belong to the eval split

    def __post_init__(self) -> None:
        if self.min_steps < 1:
            raise ValueError(f"min_steps ({self.min_steps}) must be at least 1: a problem needs one step")
        if self.max_steps < self.min_steps:
            raise ValueError(f"max_steps ({self.max_steps}) must be >= min_steps ({self.min_steps})")
        if self.steps_exponent < 0:
            raise ValueError(f"steps_exponent ({self.steps_exponent}) must be >= 0 (0 draws steps uniformly)")
        if self.max_operand < 1:
            raise ValueError(f"max_operand ({self.max_operand}) must be at least 1")
        if self.max_value < 2 * self.max_operand:
            raise ValueError(
                f"max_value ({self.max_value}) must be at least 2 * max_operand ({2 * self.max_operand}) so that "
                "every count can move up or down; raise max_value or lower max_operand"
            )
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction ({self.eval_fraction}) must be in (0, 1), e.g. 0.1")


@dataclass(frozen=True)
class Problem:
    """One problem: the question text, its worked solution (ending in `#### <answer>`) and the answer."""

    problem: str
    solution: str
    answer: str
    num_steps: int


def format_prompt(problem: str) -> str:
    """The prompt a model sees for `problem`; the completion starts with a space and ends with EOS."""
    return PROMPT_TEMPLATE.format(problem=problem)


def format_completion(solution: str) -> str:
    """The completion text (without EOS) a model is trained to produce after `format_prompt`."""
    return " " + solution


def split_of(problem: str, eval_fraction: float = 0.1) -> str:
    """ "train" or "eval", decided by a hash of the problem text alone, so no text can land in both splits."""
    digest = int(hashlib.sha256(problem.encode("utf-8")).hexdigest()[:12], 16)
    return "eval" if digest % 1_000_000 < eval_fraction * 1_000_000 else "train"


def _draw_num_steps(rng: random.Random, config: ArithmeticConfig) -> int:
    steps = list(range(config.min_steps, config.max_steps + 1))
    weights = [s**-config.steps_exponent for s in steps]
    return rng.choices(steps, weights=weights)[0]


def make_problem(rng: random.Random, config: ArithmeticConfig) -> Problem:
    """Draw one problem from `rng`."""
    name, pronoun = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    num_steps = _draw_num_steps(rng, config)
    count = rng.randint(1, config.max_value)
    sentences = [f"{name} has {count} {item}."]
    steps = []
    for day in range(1, num_steps + 1):
        # Pick a direction that keeps the count in range; near either bound only one direction fits.
        can_gain = count + 1 <= config.max_value
        can_lose = count >= 1
        gain = can_gain and (not can_lose or rng.random() < 0.5)
        limit = min(config.max_operand, config.max_value - count) if gain else min(config.max_operand, count)
        operand = rng.randint(1, limit)
        present, past = rng.choice(_GAIN_VERBS if gain else _LOSS_VERBS)
        new_count = count + operand if gain else count - operand
        sign = "+" if gain else "-"
        more = " more" if gain else ""
        sentences.append(f"On day {day} {pronoun} {present} {operand}{more}.")
        # Restate the numbers worked on, the way chain-of-thought does, then compute.
        steps.append(
            f"Day {day}: {pronoun.capitalize()} had {count} and {past} {operand}{more}, "
            f"so {count} {sign} {operand} = {new_count}."
        )
        count = new_count
    sentences.append(f"How many {item} does {name} have after day {num_steps}?")
    solution = " ".join(steps) + f" {ANSWER_MARKER} {count}"
    return Problem(problem=" ".join(sentences), solution=solution, answer=str(count), num_steps=num_steps)


# draws in a row that find no new problem of the split, at least, after which the config has run out of them (100 a
# problem found: near a small config's last problems, rare ones come a few hundred thousand draws apart)
MAX_MISSES = 20_000


def generate_problems(
    num_problems: int, split: str = "train", seed: int = 0, config: ArithmeticConfig | None = None
) -> list[Problem]:
    """`num_problems` distinct problems of `split` ("train" or "eval"), the same for the same seed and config."""
    if split not in ("train", "eval"):
        raise ValueError(f"split ({split!r}) must be 'train' or 'eval'")
    if num_problems < 0:
        raise ValueError(f"num_problems ({num_problems}) must be >= 0")
    config = config or ArithmeticConfig()
    # The split is part of the seed so the two splits draw different streams; the hash still decides membership.
    rng = random.Random(f"arithmetic-{split}-{seed}")
    problems: list[Problem] = []
    seen: set[str] = set()
    max_draws, misses = 1000 * (num_problems + 10), 0
    for _ in range(max_draws):
        if len(problems) == num_problems or misses > max(MAX_MISSES, 100 * len(seen)):  # (or the config ran out)
            break
        problem = make_problem(rng, config)
        if problem.problem in seen or split_of(problem.problem, config.eval_fraction) != split:
            misses += 1
            continue
        seen.add(problem.problem)
        problems.append(problem)
        misses = 0
    if len(problems) < num_problems:
        raise ValueError(
            f"num_problems ({num_problems}) distinct {split} problems were asked, and this config makes only about "
            f"{len(problems)}: ask fewer, or widen the config (max_value, max_operand, min_steps..max_steps)"
        )
    return problems


# the columns of `arithmetic_dataset` (what a recipe's template and rewards may name, checked before it builds)
ARITHMETIC_COLUMNS = ("prompt", "answer", "solution", "completion", "num_steps", "problem")


def arithmetic_dataset(num_problems: int, split: str = "train", seed: int = 0, config: ArithmeticConfig | None = None):
    """A `datasets.Dataset` with columns prompt, answer, solution, completion, num_steps, problem.

    `prompt` is `format_prompt(problem)`; `completion` is the target text after the prompt (without EOS).
    """
    import datasets  # imported here: the generator itself needs only the standard library

    if not isinstance(num_problems, numbers.Integral) or isinstance(num_problems, bool) or num_problems < 1:
        raise ValueError(f"num_problems ({num_problems!r}) must be an integer >= 1")
    num_problems = int(num_problems)
    problems = generate_problems(num_problems, split=split, seed=seed, config=config)
    data = datasets.Dataset.from_dict(
        {
            "prompt": [format_prompt(p.problem) for p in problems],
            "answer": [p.answer for p in problems],
            "solution": [p.solution for p in problems],
            "completion": [format_completion(p.solution) for p in problems],
            "num_steps": [p.num_steps for p in problems],
            "problem": [p.problem for p in problems],
        }
    )
    assert tuple(data.column_names) == ARITHMETIC_COLUMNS, f"expected {ARITHMETIC_COLUMNS}, got {data.column_names}"
    return data


# a whole number, 42.0 included: not the 42 of 42.5, the 4 of 4,200 or 4_200, the 1 of 1e3 or the 7 of 7/2
_FINAL_NUMBER = re.compile(r"^\s*(-?\d+)(?:\.0+)?(?![.,_/]?\d|[eE][-+]?\d)")


def parse_answer(completion: str) -> str | None:
    """The integer after the last `####` in `completion` (as a string without leading zeros), or None."""
    if ANSWER_MARKER not in completion:
        return None
    match = _FINAL_NUMBER.match(completion.rsplit(ANSWER_MARKER, 1)[1])
    return str(int(match.group(1))) if match else None


def arithmetic_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the number after the last `####` equals the answer, else 0.0; one reward per completion."""
    if len(completions) != len(answers):
        raise ValueError(
            f"completions ({len(completions)}) and answers ({len(answers)}) must have the same length: "
            "repeat each answer once per sample"
        )
    rewards = []
    for completion, answer in zip(completions, answers):
        parsed, expected = parse_answer(completion), _integer(answer)
        rewards.append(1.0 if parsed is not None and parsed == expected else 0.0)
    return rewards


def _integer(answer) -> str | None:
    """An answer as `parse_answer` writes integers; None where it is none (a float column's empty cell, NaN)."""
    try:
        return str(int(str(answer)))
    except ValueError:
        pass
    try:
        value = float(answer)  # a CSV column with an empty cell reads as floats: 6.0
    except (TypeError, ValueError):
        return None
    return str(int(value)) if value.is_integer() else None
