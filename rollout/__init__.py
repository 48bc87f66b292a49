"""Fast RL rollout generation with speculative decoding over Hugging Face causal LMs."""

from rollout.batch import RolloutBatch
from rollout.generator import Generator
from rollout.loop import Rollout
from rollout.sampling import Completion, SamplingParams

__all__ = ["Completion", "Generator", "Rollout", "RolloutBatch", "SamplingParams"]
