"""Proposers: fill each row's draft tokens for one decode step."""

from specdec.proposers.ngram import NgramProposer

__all__ = ["NgramProposer"]
