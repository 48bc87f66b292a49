"""The mode a policy generates in, whatever mode the trainer left it in."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Generate in eval mode (no dropout) and hand the model back in the mode the trainer left it."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
