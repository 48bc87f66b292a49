"""Tensor ops for sampling, verification and the paged KV cache: Triton kernels, their launchers and a pure-torch
reference for each."""

from rollout_kernels.greedy_verify import greedy_verify, greedy_verify_ref
from rollout_kernels.keep_threshold import keep_threshold, keep_threshold_ref
from rollout_kernels.kv_compact import compact_kv_, compact_kv_ref_
from rollout_kernels.paged_attention import paged_attention, paged_attention_ref
from rollout_kernels.race_logits import race_logits, race_logits_ref
from rollout_kernels.race_sample import race_sample, race_sample_ref
from rollout_kernels.rejection_sample import rejection_sample, rejection_sample_ref
from rollout_kernels.store_kv import store_kv_, store_kv_ref_
from rollout_kernels.tree_greedy_verify import tree_greedy_verify, tree_greedy_verify_ref
from rollout_kernels.tree_rejection_sample import tree_rejection_sample, tree_rejection_sample_ref

__all__ = [
    "compact_kv_",
    "compact_kv_ref_",
    "greedy_verify",
    "greedy_verify_ref",
    "keep_threshold",
    "keep_threshold_ref",
    "paged_attention",
    "paged_attention_ref",
    "race_logits",
    "race_logits_ref",
    "race_sample",
    "race_sample_ref",
    "rejection_sample",
    "rejection_sample_ref",
    "store_kv_",
    "store_kv_ref_",
    "tree_greedy_verify",
    "tree_greedy_verify_ref",
    "tree_rejection_sample",
    "tree_rejection_sample_ref",
]
