"""Speculative decoding without a model: the spec config, proposers, token trees, verification and K policies."""

from specdec.config import SpecConfig, SpecDecodeParams

__all__ = ["SpecConfig", "SpecDecodeParams"]
