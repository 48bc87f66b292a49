"""Tasks with verifiable rewards for rollouts: prompts, datasets and reward functions."""

from rollout.tasks.arithmetic import (
    ArithmeticConfig,
    arithmetic_dataset,
    arithmetic_reward,
    format_completion,
    format_prompt,
    generate_problems,
)

__all__ = [
    "ArithmeticConfig",
    "arithmetic_dataset",
    "arithmetic_reward",
    "format_completion",
    "format_prompt",
    "generate_problems",
]
