"""The arithmetic task: problems, splits, long-tailed step counts, prompt template and reward."""

import re

import pytest

from rollout.tasks.arithmetic import (
    ArithmeticConfig,
    arithmetic_dataset,
    arithmetic_reward,
    format_completion,
    format_prompt,
    generate_problems,
    parse_answer,
    split_of,
)

EQUATION = re.compile(r"(\d+) ([+-]) (\d+) = (\d+)\.")


@pytest.fixture(scope="module")
def train_problems():
    return generate_problems(3000, split="train", seed=0)


def test_same_seed_same_problems_and_other_seed_differs():
    assert generate_problems(50, seed=3) == generate_problems(50, seed=3)
    assert generate_problems(50, seed=3) != generate_problems(50, seed=4)


def test_splits_never_share_a_problem(train_problems):
    eval_problems = generate_problems(1000, split="eval", seed=0)
    train_texts = {p.problem for p in train_problems}
    eval_texts = {p.problem for p in eval_problems}
    assert len(train_texts) == len(train_problems), "problems within a split must be distinct"
    assert not train_texts & eval_texts
    # Membership is decided by the text alone, so another seed cannot leak an eval problem into train.
    assert all(split_of(t) == "train" for t in train_texts)
    assert all(split_of(t) == "eval" for t in eval_texts)
    other_seed = generate_problems(1000, split="train", seed=1)
    assert not {p.problem for p in other_seed} & eval_texts


def test_eval_fraction_is_roughly_honoured():
    texts = [p.problem for p in generate_problems(4000, split="train", seed=5)]
    # Hashes are uniform: about 10% of arbitrary texts land in eval.
    fraction = sum(split_of(t + "x") == "eval" for t in texts) / len(texts)
    assert 0.07 < fraction < 0.13


def test_solutions_are_correct_step_by_step(train_problems):
    config = ArithmeticConfig()
    for p in train_problems:
        equations = EQUATION.findall(p.solution)
        assert len(equations) == p.num_steps
        count = int(re.search(r"has (\d+) ", p.problem).group(1))
        for a, sign, b, c in equations:
            # Each step restates the running count it works on, then computes.
            assert int(a) == count, p.solution
            count = int(a) + int(b) if sign == "+" else int(a) - int(b)
            assert int(c) == count
            assert 0 <= count <= config.max_value and 1 <= int(b) <= config.max_operand
            assert f"had {a} and" in p.solution
        assert p.solution.endswith(f"#### {count}") and p.answer == str(count)
        assert parse_answer(p.solution) == p.answer


def test_step_counts_have_a_long_tail(train_problems):
    steps = sorted(p.num_steps for p in train_problems)
    assert steps[0] == 1 and steps[-1] == 30
    median = steps[len(steps) // 2]
    p99 = steps[int(0.99 * len(steps))]
    assert median <= 4, "most problems must be short"
    assert p99 >= 20, "a few problems must be long"
    solution_lengths = sorted(len(p.solution) for p in train_problems)
    assert solution_lengths[int(0.99 * len(steps))] >= 4 * solution_lengths[len(steps) // 2]


def test_prompt_and_completion_template():
    p = generate_problems(1, seed=0)[0]
    prompt = format_prompt(p.problem)
    assert prompt == f"Question: {p.problem}\nAnswer:"
    assert format_completion(p.solution) == " " + p.solution


def test_dataset_columns():
    ds = arithmetic_dataset(20, split="eval", seed=0)
    assert len(ds) == 20
    assert {"prompt", "answer", "solution", "completion", "num_steps"} <= set(ds.column_names)
    row = ds[0]
    assert row["prompt"].startswith("Question: ") and row["prompt"].endswith("\nAnswer:")
    assert arithmetic_reward([row["completion"]], [row["answer"]]) == [1.0]


def test_reward_reads_the_number_after_the_last_marker():
    completions = [
        " so 3 + 4 = 7. #### 7",
        " so 3 + 4 = 7. #### 8",
        " so 3 + 4 = 7. 7",  # no marker: nothing to grade
        " #### 2 then #### 7<|endoftext|>",  # the last marker counts
        " #### 07",  # leading zero is the same integer
        " #### seven",
        " #### 71",
    ]
    assert arithmetic_reward(completions, ["7"] * len(completions)) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    # the whole number: not the 42 of 42.5 or the 4 of 4,200; a full stop after it is not a decimal point
    assert arithmetic_reward([" #### 42.5", " #### 4,200", " #### 42."], ["42", "4", "42"]) == [0.0, 0.0, 1.0]
    assert arithmetic_reward([" #### 42.0", " #### 42.05"], ["42", "42"]) == [1.0, 0.0]
    # nor the 1 of 1e3, the 7 of 7/2 or the 4 of 4_200; a sentence after the number is fine
    assert arithmetic_reward([" #### 1e3", " #### 7/2", " #### 4_200", " #### 1E-2"], ["1", "7", "4", "1"]) == [0.0] * 4
    assert arithmetic_reward([" #### 7 eggs", " #### 7, done", " #### 7/ day"], ["7"] * 3) == [1.0] * 3
    # an answer column read as floats (a CSV column with an empty cell): 6.0 is 6, and a missing answer grades 0
    assert arithmetic_reward([" #### 6", " #### 6", " #### 6"], [6.0, float("nan"), "6.5"]) == [1.0, 0.0, 0.0]


def test_reward_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        arithmetic_reward(["#### 1", "#### 2"], ["1"])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_steps": 0}, "min_steps"),
        ({"min_steps": 5, "max_steps": 4}, "max_steps"),
        ({"max_operand": 0}, "max_operand"),
        ({"max_value": 10, "max_operand": 20}, "max_value"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"steps_exponent": -1.0}, "steps_exponent"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticConfig(**kwargs)


def test_unknown_split_is_an_error():
    with pytest.raises(ValueError, match="split"):
        generate_problems(1, split="test")


def test_more_problems_than_a_config_makes_is_refused_quickly():
    # one step, counts in [0, 2], operands of 1: a few dozen distinct texts, not 1000 (it took 18 s to fail, and under
    # python -O returned the few it found)
    small = ArithmeticConfig(min_steps=1, max_steps=1, max_value=2, max_operand=1)
    with pytest.raises(
        ValueError, match=r"num_problems \(1000\) distinct eval problems .* makes only about \d+: ask f"
    ):
        generate_problems(1000, split="eval", config=small)
