"""RL rollout generation with lossless speculative decoding over Hugging Face causal LMs.

Every public name is importable from here, and only from here in the examples:

    from rollout import Rollout, SamplingParams, SpecConfig

- `Rollout`, `RolloutBatch`: the rollout loop a trainer calls, and the batch of scored samples it returns.
- `Generator`, `SamplingParams`, `Completion`: the batched generator underneath, what a call asks for and gets back.
- `SpecConfig`, `SpecDecodeParams`: speculative decoding settings (vLLM's field names), and one request's own.
- `trl_rollout_func`: TRL's `GRPOTrainer(rollout_func=...)` generating through this library.
- `RunTracker`, `Progress`: record a training run's rollouts the way `rollout run` does, and a live progress line.

The names load on first use (PEP 562), so that the command line checks a recipe before torch and transformers are
imported.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "Completion": "rollout.engine.sampling",
    "Generator": "rollout.engine.generator",
    "Progress": "rollout.cli.progress",
    "Rollout": "rollout.loop",
    "RolloutBatch": "rollout.batch",
    "RunTracker": "rollout.cli.tracking",
    "SamplingParams": "rollout.engine.sampling",
    "SpecConfig": "specdec.config",
    "SpecDecodeParams": "specdec.config",
    "trl_rollout_func": "rollout.integrations.trl",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
