"""Tensor ops for verification: Triton kernels, their launchers and a pure-torch reference for each."""

from kernels.greedy_verify import greedy_verify, greedy_verify_ref
from kernels.rejection_sample import rejection_sample, rejection_sample_ref

__all__ = ["greedy_verify", "greedy_verify_ref", "rejection_sample", "rejection_sample_ref"]
