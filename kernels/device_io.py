"""Host-to-device copies that do not wait for the device, and host data that needs no copy back.

A plain `tensor.to("cuda")` from pageable host memory is a synchronising copy: the host waits until the GPU has run
everything queued before it, so the host cannot prepare the next step while the device works on this one (torch's
sync-debug mode counts each such copy). `upload` stages the tensor in pinned memory and copies asynchronously;
torch's caching host allocator keeps the pinned block until the copy has run, so the source may be reused at once.
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
