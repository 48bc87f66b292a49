"""What the engine raises of its own that callers may catch by type (no torch import: the command line's error handling
names them before a model loads)."""


class NonFiniteLogits(FloatingPointError):
    """A step would sample from logits holding a NaN (or +inf): the policy's weights or activations are not finite."""
