"""A CPU platform for veRL 0.9.1, for the end-to-end test only: veRL's trainer on gloo, FSDP2 on the CPU.

veRL imports it in every process through `VERL_USE_EXTERNAL_MODULES` (listed before the backend's plugin) with
`VERL_PLATFORM=cpu`. Everything goes through veRL's own extension points, plus one function replaced where veRL
builds a "cpu:gloo,cpu:gloo" backend string that torch refuses:

- `PlatformRegistry`: the `cpu` platform (gloo; Ray's logical `GPU` resource drives veRL's placement groups, since
  its resource manager counts only GPUs; the run declares as many as it has trainer ranks).
- `EngineRegistry`: veRL's FSDP engines for the device "cpu" (they are registered for cuda and npu only).
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


class _CpuDeviceModule(types.ModuleType):
    """What veRL calls `get_torch_device()`: `torch.cpu` where it has the function, memory and RNG calls answered for
    the host, and anything else (cache and memory statistics of an accelerator) a no-op returning 0."""

    def __init__(self):
        super().__init__("verl_e2e_cpu_device")

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        return lambda *args, **kwargs: 0


@PlatformRegistry.register(platform="cpu")
class CpuPlatform(PlatformBase):
    _module = _CpuDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # chosen only by VERL_PLATFORM=cpu, never auto-detected

    def current_device(self):
        return torch.device("cpu")  # veRL passes this to .to(): an integer would mean a CUDA index

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "VERL_E2E_VISIBLE_CPUS"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


# imported only now: these modules ask for the platform when they are imported
from verl.utils import distributed as _distributed  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead  # noqa: E402

_init_process_group = _distributed.initialize_global_process_group_ray


def _init_gloo_process_group(timeout_second=None, backend=None):
    return _init_process_group(timeout_second=timeout_second, backend=backend or "gloo")


_distributed.initialize_global_process_group_ray = _init_gloo_process_group  # before engine_workers imports it
EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)
EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithValueHead)
