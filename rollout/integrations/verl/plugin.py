"""Registers the `rollout` backend with veRL when imported: `actor_rollout_ref.rollout.name=rollout`.

veRL imports this module in each of its processes through the `verl.plugins` entry point that this package declares
(on by default: `VERL_USE_EXTERNAL_PLUGINS=auto`), or through
`VERL_USE_EXTERNAL_MODULES=rollout.integrations.verl.plugin`.
Two registrations, both keyed by the name: the trainer-side `BaseRollout` in veRL's rollout registry (by its import
path, resolved in the trainer workers) and the server-side replica in `RolloutReplicaRegistry`.
"""

from __future__ import annotations

from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

NAME = "rollout"
ADAPTER = "rollout.integrations.verl.adapter.RolloutAdapter"


def _load_replica():
    from rollout.integrations.verl.server import Replica

    return Replica


def register() -> None:
    """Make `rollout.name=rollout` known to veRL (idempotent)."""
    rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = ADAPTER  # veRL 0.9.1 has no public register call for this half
    RolloutReplicaRegistry.register(NAME, _load_replica)


register()
