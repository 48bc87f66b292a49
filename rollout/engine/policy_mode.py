"""The mode a policy generates in, whatever mode the trainer left it in."""

from __future__ import annotations

import contextlib
import threading

import torch

_LOCK = threading.Lock()
_HELD: dict[int, list] = {}  # id(model) -> [calls inside, its modules, their modes before the first, the model's]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None):
    """Generate in eval mode (no dropout) and hand every module back in the mode the trainer left it (a module it
    keeps in eval inside a policy in train mode, say a frozen part, stays in eval). The switches go through the
    modules' own `train()`, which some override (transformers' re-selects its kernels, PEFT's DoRA clears a cache);
    a policy already in eval mode is left alone. `modules`: the model's modules, listed before (`model.modules()`
    walks the tree again).

    Calls over one model that overlap (two generators on two threads, a generator called from another's callback)
    share one switch: the first takes the modes down and switches, the last one out hands them back. (Each restoring
    what it found let the first to finish put the policy back in train mode under the other's steps: sampled with
    dropout, without a word.)"""
    key = id(model)
    with _LOCK:
        held = _HELD.get(key)
        if held is not None:
            held[0] += 1
        else:
            modules = list(model.modules()) if modules is None else modules
            flags = [module.training for module in modules]
            held = _HELD[key] = [1, modules, flags, model.training]
            if any(flags):
                model.eval()
    try:
        yield
    finally:
        with _LOCK:
            held[0] -= 1
            if held[0] == 0:
                del _HELD[key]
                _, modules, flags, top = held
                if any(flags):
                    model.train(top)
                    for module, flag in zip(modules, flags):  # parents first: a parent's train() resets its children
                        if module.training != flag:
                            module.train(flag)
