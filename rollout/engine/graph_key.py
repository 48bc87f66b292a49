"""What a captured CUDA graph depends on besides its shape: one key, compared whole once per call (`generate`,
`add_requests`) and in its cheap part (all but the tensors' addresses) every `step`.

A graph replays the kernels its capture launched, on the tensors at the addresses it saw, with the Python numbers
(scales, flags) baked in. It computes what the eager step computes only while the policy is as it was at capture:

- `training`: any module in train mode. Captures run in eval mode; a step in train mode would draw dropout masks
  that no replay can reproduce, so such a step runs eagerly.
- `adapters`: each PEFT tuner layer's state (adapters disabled, merged, active, their scaling). `disable_adapter()`
  (how TRL computes a reference model), `merge_adapter()` or a new LoRA scale change the forward without touching an
  address.
- `autocast`: the dtype the policy's forward computes in under autocast, its own (accelerate wraps a trainer's
  `forward` in autocast: TRL's `bf16=True`) or the caller's, None without autocast.
- `forward`: which forward the policy's instance holds, if any (`accelerator.prepare` sets one, `unwrap_model` takes
  it back): a change has its own autocast observed again.
- `pools`: the KV pools' generation (raised when they are reallocated).
- `tensors`: the addresses of the parameters and buffers (weights replaced rather than updated in place).
- `epoch`: a counter the user raises (`Generator.invalidate_graphs()`) for what no key can see.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class GraphKey:
    """The state a captured graph holds (see the module docstring)."""

    training: bool
    adapters: tuple
    autocast: torch.dtype | None
    forward: int
    pools: int
    tensors: tuple[int, ...]
    epoch: int

    def changes(self, other: GraphKey) -> list[str]:
        """The fields in which `other` differs from this key, in field order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's adapter layers: PEFT's tuner layers, recognised by the state they keep (PEFT is not imported)."""
    return [m for m in model.modules() if hasattr(m, "merged_adapters") and hasattr(m, "disable_adapters")]


def adapter_state(layers: list[torch.nn.Module]) -> tuple:
    """Each tuner layer's (disabled, merged adapters, active adapters, scaling): what its forward branches on."""
    state = []
    for layer in layers:
        scaling = getattr(layer, "scaling", None)
        scales = tuple(sorted(scaling.items())) if isinstance(scaling, dict) else scaling
        state.append((bool(layer.disable_adapters), tuple(layer.merged_adapters), tuple(layer.active_adapters), scales))
    return tuple(state)


def current_autocast(device: torch.device, forward_autocast: torch.dtype | None) -> torch.dtype | None:
    """The dtype a forward of the policy computes in now: its own autocast's (it wins over the caller's, being
    entered inside), else the caller's, else None."""
    if forward_autocast is not None:
        return forward_autocast
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def graph_key(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    device: torch.device,
    forward_autocast: torch.dtype | None,
    pools: int,
    epoch: int,
    previous: GraphKey | None = None,
    modules: list[torch.nn.Module] | None = None,
) -> GraphKey:
    """The key of the policy as it is now (`layers`: its `tuner_layers`). With `previous` the tensors' addresses are
    taken from it instead of walked (the walk over every parameter and buffer is the key's costly part: about 3 ms for
    a 1B model with LoRA on every projection), and `modules` (the model's, listed before) serve the training flag."""
    if previous is None:
        tensors = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    else:
        tensors = previous.tensors
    return GraphKey(
        training=any(m.training for m in (model.modules() if modules is None else modules)),
        adapters=adapter_state(layers),
        autocast=current_autocast(device, forward_autocast),
        forward=id(model.__dict__.get("forward")),  # (the object stays referenced by the model while it is set)
        pools=pools,
        tensors=tensors,
        epoch=epoch,
    )


@contextlib.contextmanager
def observing_autocast(model: torch.nn.Module, device: torch.device, seen: list):
    """Run what the block runs with the caller's autocast off, appending to `seen` the autocast dtype the decoder
    is called under (None without): the policy's own autocast, such as accelerate's wrapper around `forward`."""

    def record(module, args):
        enabled = torch.is_autocast_enabled(device.type)
        seen.append(torch.get_autocast_dtype(device.type) if enabled else None)

    handle = model.get_decoder().register_forward_pre_hook(record)
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        handle.remove()
