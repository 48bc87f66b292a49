"""veRL's rollout backend `rollout`: `actor_rollout_ref.rollout.name=rollout` generates with this library.

- `rollout.integrations.verl.plugin` registers the backend with veRL when imported: veRL imports it through the
  `verl.plugins` entry point this package declares, or through
  `VERL_USE_EXTERNAL_MODULES=rollout.integrations.verl.plugin`.
- `rollout.integrations.verl.server`: the replica and its server actor (what veRL's agent loop calls `generate` on).
- `rollout.integrations.verl.adapter`: the trainer-side half (`BaseRollout`) that sends weights and sleep / wake.
- `rollout.integrations.verl.engine`: `ServingEngine`, one `Generator` behind concurrent requests (no veRL needed).
- `rollout.integrations.verl.params`: veRL's sampling params and engine options in this library's terms.
- `rollout.integrations.verl.weights`: the trainer's named tensors copied into the model in place.

Importing this package needs neither veRL nor Ray; the three modules that talk to veRL import it themselves.
"""

from rollout.integrations.verl.engine import ServingEngine
from rollout.integrations.verl.params import (
    EngineOptions,
    RequestLimits,
    sampling_params_from_verl,
    spec_config_from_dict,
)

__all__ = ["EngineOptions", "RequestLimits", "ServingEngine", "sampling_params_from_verl", "spec_config_from_dict"]
