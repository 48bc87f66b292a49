"""The mode a policy generates in, whatever mode the trainer left it in."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Generate in eval mode (no dropout) and hand every module back in the mode the trainer left it (a module it
    keeps in eval inside a policy in train mode, say a frozen part, stays in eval)."""
    training = [module for module in model.modules() if module.training]
    for module in training:
        module.training = False
    try:
        yield
    finally:
        for module in training:
            module.training = True
