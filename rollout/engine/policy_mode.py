"""The mode a policy generates in, whatever mode the trainer left it in."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None):
    """Generate in eval mode (no dropout) and hand every module back in the mode the trainer left it (a module it
    keeps in eval inside a policy in train mode, say a frozen part, stays in eval). The switches go through the
    modules' own `train()`, which some override (transformers' re-selects its kernels, PEFT's DoRA clears a cache);
    a policy already in eval mode is left alone. `modules`: the model's modules, listed before (`model.modules()`
    walks the tree again)."""
    modules = list(model.modules()) if modules is None else modules
    flags = [module.training for module in modules]
    if not any(flags):
        yield
        return
    top = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(top)
        for module, flag in zip(modules, flags):  # parents before children: a parent's train() resets its children
            if module.training != flag:
                module.train(flag)
