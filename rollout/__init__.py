"""Fast RL rollout generation with speculative decoding over Hugging Face causal LMs."""

from rollout.generator import Generator
from rollout.sampling import Completion, SamplingParams

__all__ = ["Completion", "Generator", "SamplingParams"]
