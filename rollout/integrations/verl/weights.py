"""A trainer's named tensors copied into a generation model in place: the model's tensors keep their storage, so
CUDA graphs captured over them stay valid and nothing is allocated."""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def copy_weights(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False
) -> int:
    """Copy `(name, tensor)` pairs into `model`'s parameters and buffers, cast to each one's dtype and device. Names
    are the model's `state_dict` keys (what veRL's trainer sends).

    Returns the number of tensors copied.
    Raises:
        ValueError: a name the model does not have, or a shape that differs (pairs are copied as they come, so the
            ones before it are written); with `strict`, also a model tensor that received nothing (a tensor tied to
            one that was set, such as tied embeddings, counts as set).
    """
    targets = dict(model.state_dict(keep_vars=True))
    seen: set[str] = set()
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            raise ValueError(
                f"update_weights got {name!r}, which the rollout model does not have (it has {len(targets)} tensors, "
                f"e.g. {next(iter(targets))!r}): send the model's state_dict names"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"update_weights got {name!r} of shape {tuple(tensor.shape)} for a tensor of shape "
                f"{tuple(target.shape)}: the trainer's model and the rollout model differ"
            )
        target.data.copy_(tensor.to(device=target.device, dtype=target.dtype, non_blocking=True))
        seen.add(name)
    if strict:
        missing = sorted(set(targets) - seen - _tied_names(targets, seen))
        if missing:
            raise ValueError(f"update_weights left {len(missing)} tensors unset, e.g. {missing[:3]}")
    return len(seen)


def _tied_names(targets: dict[str, torch.Tensor], seen: set[str]) -> set[str]:
    """Names that share storage with a tensor that was set (tied embeddings appear twice in a state_dict)."""
    by_pointer: dict[int, set[str]] = {}
    for name, tensor in targets.items():
        by_pointer.setdefault(tensor.data_ptr(), set()).add(name)
    return {name for names in by_pointer.values() if names & seen for name in names}
