"""veRL's custom reward function for the arithmetic task: 1.0 when the number after the last `####` is the answer."""

from rollout.tasks.arithmetic import parse_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return 1.0 if parse_answer(solution_str) == str(int(ground_truth)) else 0.0
