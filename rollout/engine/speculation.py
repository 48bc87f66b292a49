"""Builds what a SpecConfig asks for: the proposers (loading a draft model where named) and the K policy."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, PreTrainedModel

from rollout.engine.memory_plan import draft_model_path
from rollout.engine.model_checks import check_positions
from rollout.engine.model_runner import ModelRunner
from specdec.auto_policy import AutoPolicy
from specdec.config import SpecConfig
from specdec.policies import StaticPolicy, TablePolicy
from specdec.proposers.base import Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.multi import ProposerSet
from specdec.proposers.ngram import NgramAdapter
from specdec.proposers.suffix import SuffixProposer
from specdec.step_time import StepTimeTable


def build_proposers(spec: SpecConfig, target: ModelRunner, num_slots: int, num_positions: int) -> ProposerSet:
    proposers: dict[str, Proposer] = {}
    for method in spec.methods:
        if method == "ngram":
            proposers[method] = NgramAdapter(spec)
        elif method == "suffix":
            proposers[method] = SuffixProposer(
                spec.num_speculative_tokens,
                vocab_size=target.vocab_size,
                num_slots=num_slots,
                num_positions=num_positions,
                max_tree_depth=spec.suffix_decoding_max_tree_depth,
                max_cached_requests=spec.suffix_decoding_max_cached_requests,
                max_spec_factor=spec.suffix_decoding_max_spec_factor,
                min_token_prob=spec.suffix_decoding_min_token_prob,
                num_candidates=spec.num_candidates,
                # a GPU's plain steps are host-bound (they run ahead of the device): take tokens in on a thread
                background=target.device.type == "cuda",
            )
            proposers[method].compile_kernels()  # (before the run's steps: their time is the rollout's)
        else:
            draft = load_draft_model(spec.model, target)
            device = next(draft.parameters()).device
            if device != target.device:  # (drafts are verified on the target's device; a meta draft has no weights)
                raise ValueError(
                    f"the draft model is on {device} and the target on {target.device}: put the draft on the target's "
                    f"device (draft.to({str(target.device)!r}))"
                )
            check_positions(draft, num_positions - 1 - spec.num_speculative_tokens, "the draft model")  # max_seq_len
            # the target's KV layout (a draft that cannot page falls back to slots, with a warning), and its graphs
            runner = ModelRunner(draft, num_slots=num_slots, num_positions=num_positions, kv_layout=target.kv_layout)
            if target.graphs is not None and runner.paged:
                graphs = target.graphs
                runner.use_graphs(graphs.max_width, graphs.capture, graphs.compiled is not None).capture_all(num_slots)
            proposers[method] = DraftModelProposer(runner, spec.num_speculative_tokens, target.vocab_size)
    return ProposerSet(proposers, max_k=spec.num_speculative_tokens)


def build_policy(spec: SpecConfig, max_batch_size: int, proposers: ProposerSet, plain_ahead: bool = False):
    """The K policy the spec names. `plain_ahead`: plain steps may be launched ahead of the device (async scheduling
    with exact verification), so that auto prices a plain step it has not measured at half its warm-up time (the warm-up
    times steps in lockstep; `StepTimeTable`'s `plain_prior`)."""
    table = spec.num_speculative_tokens_per_batch_size
    if table is None:
        return StaticPolicy(spec.num_speculative_tokens)
    if table != "auto":
        return TablePolicy(table, spec.num_speculative_tokens, max_batch_size)
    passes = {name: isinstance(p, DraftModelProposer) for name, p in proposers.proposers.items()}
    route = default_route(spec)
    passes[route] = "draft_model" in spec.methods
    # a cascade that starts with a model-free proposer runs the draft model only in the steps where it pays
    optional = frozenset([route] if passes[route] and spec.methods[0] != "draft_model" else [])
    step_times = StepTimeTable(plain_prior=0.5 if plain_ahead else 1.0)
    return AutoPolicy(spec.num_speculative_tokens, passes, step_times, optional_passes=optional)


def default_route(spec: SpecConfig) -> str:
    """The route of a request that names no proposer: the single configured one, or the cascade of all of them."""
    return "+".join(spec.methods)


def load_draft_model(model, target: ModelRunner) -> PreTrainedModel:
    """A loaded model as is (in the mode its owner keeps it: each call runs it in eval mode and hands it back); a zoo
    name (shipped or widened) or a local path loaded in the target's dtype, on its device, in eval mode."""
    if isinstance(model, PreTrainedModel):
        return model
    from rollout.models import zoo

    if str(model) in zoo.WIDENED_NAMES:
        return zoo.load_model(str(model), target.dtype, device=target.device)[0]
    path = draft_model_path(model)
    # the attention transformers picks for it (sdpa where the model has it, else eager), as for a target by name: an
    # eager-only draft (Gemma2) was refused by transformers when sdpa was asked for, and so was one this library
    # refuses for its own reason (ALiBi, local attention), in transformers' words
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype)
    return draft.to(target.device).eval()
