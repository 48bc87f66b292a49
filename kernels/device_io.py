"""Copies between host and device that do not wait for the device, and host data that needs no copy back.

A plain `tensor.to("cuda")` from pageable host memory is a synchronising copy: the host waits until the GPU has run
everything queued before it, so the host cannot prepare the next step while the device works on this one (torch's
sync-debug mode counts each such copy). `upload` stages a pageable tensor in pinned memory and copies asynchronously;
torch's caching host allocator keeps the pinned block until the copy has run, so a pageable source may be changed at
once. A source that is pinned already is copied from directly: it must not change until the copy has run.
`start_read` starts a device-to-host copy into pinned memory; its `wait()` is the one place a step waits for the
device.
"""

from __future__ import annotations

import torch
from torch import Tensor


def upload(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device`, copied without waiting for the device (a host tensor to CUDA); otherwise `.to(device)`."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def upload_into(target: Tensor, tensor: Tensor) -> None:
    """Copy host `tensor` into the device tensor `target` (same shape) without waiting for the device."""
    if target.device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    target.copy_(tensor, non_blocking=target.device.type == "cuda")


def host(tensor: Tensor) -> Tensor:
    """`tensor` on the host: itself when it is there already, else copied back, which waits for the device. The engine
    reads the device once per step (`.cpu()` on the step's packed results); host-side data goes through here."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


class PendingRead:
    """A device tensor on its way to the host (`start_read`): `wait()` returns it there, waiting for the device then
    and not before, so that the host can queue more work in between."""

    def __init__(self, tensor: Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.cpu()  # the engine's marker of a read (a host tensor is itself)

    def wait(self) -> Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def start_read(tensor: Tensor) -> PendingRead:
    """Start copying `tensor` to the host without waiting for the device; `.wait()` on the result waits for the copy.
    The engine's one read of the device a step."""
    return PendingRead(tensor)
