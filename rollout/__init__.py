"""Fast RL rollout generation with speculative decoding over Hugging Face causal LMs.

The public names load on first use (PEP 562), so that the command line checks a recipe before torch and transformers
are imported.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "Completion": "rollout.engine.sampling",
    "Generator": "rollout.engine.generator",
    "Ranks": "rollout.distributed",
    "Rollout": "rollout.loop",
    "RolloutBatch": "rollout.batch",
    "SamplingParams": "rollout.engine.sampling",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
