"""Continuous-batching generator over a slot KV cache.

Requests wait in a queue; prefill admits them in batches (one prefill per prompt, its KV copied to the prompt's n
samples); each decode step runs one forward over the active rows only, which are kept packed at the front of the
slots. A decode step feeds every row its pending token plus up to K draft tokens and commits the first m of them
(K = 0 without speculation). The host drives scheduling; the device returns one small packed tensor per step.
"""

from __future__ import annotations

import collections
import hashlib
import numbers
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rollout.memory_plan import check_kv_cache_fits
from rollout.model_runner import ModelRunner, eval_mode
from rollout.sampling import Completion, SamplingParams
from rollout.sequence import Sequence
from rollout.speculation import build_policy, build_proposers, default_route
from rollout.trace import StepRecord
from rollout.warm_up import warm_up
from specdec.auto_policy import AutoPolicy, StepObservation
from specdec.config import SpecConfig
from specdec.policies import Decision
from specdec.processing import RowSampling
from specdec.proposers.base import ProposalBatch
from specdec.proposers.suffix import SuffixProposer
from specdec.tree import layout_drafts
from specdec.verify import VerifyResult, verify


class Generator:
    """Batched generation for a transformers causal LM.

    Args:
        model: the model to run (its current weights are used on every call: no copy is kept).
        max_batch_size: slots, i.e. sequences decoded at once.
        max_seq_len: prompt + completion tokens a sequence may hold.
        spec: speculative decoding settings; None decodes one token per step.
        max_prefill_tokens: cap on padded prompt tokens per prefill forward (bounds prefill memory).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        spec: SpecConfig | None = None,
        max_prefill_tokens: int = 16384,
    ):
        if isinstance(model, (str, os.PathLike)):
            raise TypeError(
                f"Generator takes a loaded model, not the name or path {str(model)!r}: load it first with "
                "rollout.zoo.load_model(name) (shipped models) or transformers.AutoModelForCausalLM.from_pretrained"
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Generator takes a transformers causal LM (a torch.nn.Module), got {type(model).__name__}")
        for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        if not isinstance(max_prefill_tokens, int) or max_prefill_tokens < max_seq_len:
            raise ValueError(
                f"max_prefill_tokens ({max_prefill_tokens!r}) must be an integer >= max_seq_len ({max_seq_len}) "
                "so that the longest prompt fits one prefill"
            )
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ValueError(f"spec must be a specdec.SpecConfig or None, got {type(spec).__name__}")
        self.spec = spec
        # tokens fed per row per decode step: the pending token plus the largest K
        self.max_block = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        num_positions = max_seq_len + self.max_block
        self.runner = ModelRunner(model, num_slots=max_batch_size, num_positions=num_positions)  # checks the model
        self.kv_cache_bytes = check_kv_cache_fits(model, spec, max_batch_size, max_seq_len)  # allocated lazily
        self.device = self.runner.device
        self.proposers = build_proposers(spec, self.runner, max_batch_size, num_positions) if spec else None
        self._methods = spec.methods if spec else ()
        self._default_route = default_route(spec) if spec else ""
        self.policy = build_policy(spec, max_batch_size, self.proposers) if spec else None
        # host copy of every row's tokens (prompt + completion): proposers read it without a device transfer
        self.history = torch.zeros(max_batch_size, num_positions, dtype=torch.long)
        self.eos_token_ids = _eos_token_ids(model)
        self.last_trace: list[StepRecord] = []
        self._lock = threading.Lock()  # one generate call at a time
        self.warm_up_seconds = 0.0
        if isinstance(self.policy, AutoPolicy):  # seed its step-time model once per generator, as vLLM profiles
            start = time.perf_counter()
            warm_up(self, self.policy)
            self.proposers.reset()  # the warm-up's random rows are no drafting material
            self.warm_up_seconds = time.perf_counter() - start

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def draft_history(self) -> SuffixProposer | None:
        """The suffix proposer's history of earlier responses (`clear()`, `save(path)`, `load(path)`, `stats()`), kept
        across `generate` calls; None without `method="suffix"`."""
        return self.proposers.proposers.get("suffix") if self.proposers is not None else None

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_step: Callable[[StepRecord, int, int], None] | None = None,
        on_group: Callable[[list[Completion]], None] | None = None,
        seed_indices: list[int] | None = None,
    ) -> list[Completion]:
        """Sample `params.n` completions for every prompt.

        Args:
            prompt_ids: token ids of each prompt.
            params: sampling settings shared by all prompts, or one per prompt (a batch may mix them, speculation
                settings included: `SamplingParams(spec=SpecDecodeParams(enabled=False))` turns drafts off for one).
            on_step: called after every step with (its trace record, samples finished so far, samples in total),
                e.g. for a progress display.
            on_group: called with a prompt's completions as soon as its last sample finishes (to stream results:
                what it has received is kept whatever stops the call later).
            seed_indices: the index that seeds each prompt's samples with the params' seed (default: its position
                in this call); a caller that resumes a run passes each prompt's index in the whole run, so a
                prompt's samples do not depend on which other prompts share the call.
        Returns:
            `params.n` completions per prompt, prompt-major (all samples of prompt 0 first).
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "this Generator is already generating (a call from another thread): one Generator serves one call at "
                "a time; give each thread its own Generator"
            )
        try:
            return self._generate(prompt_ids, params, on_step, on_group, seed_indices)
        finally:
            self._lock.release()

    def _generate(self, prompt_ids, params, on_step, on_group, seed_indices) -> list[Completion]:
        prompt_ids = self._check_prompts(prompt_ids)
        if seed_indices is not None and len(seed_indices) != len(prompt_ids):
            raise ValueError(
                f"seed_indices holds {len(seed_indices)} values for {len(prompt_ids)} prompts: give one each"
            )
        per_prompt = self._check_params(params, len(prompt_ids))
        sequences = self._make_sequences(prompt_ids, per_prompt, seed_indices)
        self.last_trace = []
        if self.proposers is not None:
            self.proposers.begin()
        queue = deque(sequences)
        active: list[Sequence] = []
        num_finished = num_reported = 0
        unfinished = [p.n for p in per_prompt]  # samples of each prompt still running
        by_prompt: list[list[Sequence]] = [[] for _ in prompt_ids]
        for seq in sequences:
            by_prompt[seq.prompt_index].append(seq)

        def release() -> None:  # free finished rows, report the steps recorded since the last report, then groups
            nonlocal num_finished, num_reported
            done = [seq for seq in active if seq.finish_reason is not None]
            num_finished += self._release_finished(active)
            if on_step is not None:
                for record in self.last_trace[num_reported:]:
                    on_step(record, num_finished, len(sequences))
            num_reported = len(self.last_trace)
            for seq in done:
                unfinished[seq.prompt_index] -= 1
                if on_group is not None and unfinished[seq.prompt_index] == 0:
                    on_group([s.completion() for s in by_prompt[seq.prompt_index]])

        with torch.inference_mode(), eval_mode(self.model):
            while queue or active:
                if queue and len(active) < self.max_batch_size:
                    self._admit(queue, active)
                    release()
                if active:
                    self._decode_step(active)
                    release()
        return [seq.completion() for seq in sequences]

    # ---- scheduling -------------------------------------------------------------------------------------------

    def _admit(self, queue: deque[Sequence], active: list[Sequence]) -> None:
        """Move queued sequences into free slots, prefilling each distinct prompt once."""
        free = self.max_batch_size - len(active)
        admitted = [queue.popleft() for _ in range(min(free, len(queue)))]
        groups: list[list[Sequence]] = []
        for seq in admitted:  # samples of one prompt are consecutive in the queue
            if groups and groups[-1][0].prompt_index == seq.prompt_index:
                groups[-1].append(seq)
            else:
                groups.append([seq])
        chunk: list[list[Sequence]] = []
        for group in groups:
            longest = max([len(g[0].prompt) for g in chunk] + [len(group[0].prompt)])
            if chunk and longest * (len(chunk) + 1) > self.max_prefill_tokens:
                self._prefill(chunk, active)
                chunk = []
            chunk.append(group)
        if chunk:
            self._prefill(chunk, active)

    def _prefill(self, groups: list[list[Sequence]], active: list[Sequence]) -> None:
        """One left-padded forward over the groups' prompts; sample each sequence's first token."""
        start = time.perf_counter()
        prompts = [group[0].prompt for group in groups]
        row_start = len(active)
        logits = self.runner.prefill(row_start, prompts)
        sequences = [seq for group in groups for seq in group]
        group_of = torch.tensor([g for g, group in enumerate(groups) for _ in group], device=self.device)
        width = max(len(p) for p in prompts)
        if len(sequences) > len(groups):  # fan each prompt's KV out to its samples' slots
            dst = torch.arange(row_start, row_start + len(sequences), device=self.device)
            self.runner.copy_rows(row_start + group_of, dst, num_positions=width)
        if self.proposers is not None and self.proposers.needs_prefill:
            self.proposers.prefill(row_start, prompts, group_of, [seq.proposer_state for seq in sequences])
        for row, seq in enumerate(sequences, start=row_start):
            seq.cache_len = len(seq.prompt)
            self.history[row, : len(seq.prompt)] = torch.tensor(seq.prompt)
        uniforms = self._draw_uniforms(sequences, [0] * len(sequences))
        layout = layout_drafts([0] * len(sequences), None)
        no_tokens = torch.zeros(len(sequences), dtype=torch.long, device=self.device)
        sampling = self._row_sampling(sequences)
        result = verify(
            logits[group_of],
            no_tokens,
            layout,
            None,
            sampling,
            uniforms[:, 0].to(self.device),
            uniforms[:, -1].contiguous().to(self.device),
        )
        num_emitted, _ = self._commit(row_start, sequences, result)
        active.extend(sequences)
        self.last_trace.append(StepRecord("prefill", len(groups), 0, 0, 0, num_emitted, time.perf_counter() - start))

    def _decode_step(self, active: list[Sequence], force_k: int | None = None) -> None:
        """Feed each active row its pending token plus its drafts (a tree rooted at the pending token; a chain is the
        one-child tree), verify them all in the same forward, commit the accepted path. `force_k` overrides the
        policy (warm-up profiling)."""
        start = time.perf_counter()
        num_rows = len(active)
        # never draft past the length cap (those tokens could not be kept), nor past the request's own cap
        caps = [min(seq.spec_cap, seq.max_new_tokens - len(seq.token_ids) - 1) for seq in active]
        context = max(seq.cache_len for seq in active)  # rows attend over the longest row's cache (padded)
        decision = Decision(0)
        if force_k is not None:
            decision = Decision(force_k)
        elif self.proposers is not None:
            decision = self.policy.choose(num_rows, caps, [self._route(seq) for seq in active], context)
        asked = [max(0, min(decision.num_draft_tokens, cap)) for cap in caps]
        uniforms = self._draw_uniforms(active, asked)
        sampling = self._row_sampling(active)  # built once: the proposers and the verifier share it
        drafts, served = None, [None] * num_rows
        if max(asked) > 0:
            batch = ProposalBatch(
                token_ids=self.history[:num_rows],
                num_tokens=[seq.num_tokens for seq in active],
                num_draft_tokens=asked,
                sampling=sampling,
                draft_uniforms=uniforms[:, : max(asked)],
                states=[seq.proposer_state for seq in active],
            )
            drafts, served = self.proposers.propose(batch, [seq.params.spec.method for seq in active])
        elif self.proposers is not None:  # no drafts this step: proposers that learn from the text still take it in
            self.proposers.update(self.history[:num_rows], [seq.num_tokens for seq in active])
        layout = layout_drafts(
            drafts.num_draft_tokens if drafts is not None else [0] * num_rows,
            drafts.parents if drafts is not None else None,
        )
        input_ids = torch.tensor([[seq.pending] for seq in active]).to(self.device)
        if layout.width > 1:  # drafts stay where the proposer made them (a draft model's on the device): no round trip
            draft_ids = drafts.token_ids[:, : layout.width - 1].to(self.device).clamp(min=0)
            input_ids = torch.cat([input_ids, draft_ids], dim=1)
        cache_lens = [seq.cache_len for seq in active]
        logits = self.runner.decode(0, input_ids, layout.num_nodes, cache_lens, layout.depths, layout.ancestors)
        # flatten to the verifier's layout: row i's nodes (pending token first), rows back to back
        fed = torch.arange(layout.width)[None, :] < torch.tensor(layout.num_nodes)[:, None]
        flat_index = (torch.arange(num_rows)[:, None] * layout.width + torch.arange(layout.width))[fed]
        flat_index = flat_index.to(self.device)
        half = uniforms.shape[1] // 2  # node j > 0 takes the row's accept uniform j - 1
        node_uniforms = torch.cat([torch.zeros(num_rows, 1, dtype=torch.float64), uniforms[:, half : 2 * half]], 1)
        result = verify(
            logits.reshape(num_rows * layout.width, -1)[flat_index],
            input_ids.reshape(-1)[flat_index],
            layout,
            drafts.probs if drafts is not None else None,
            sampling,
            node_uniforms[:, : layout.width][fed].to(self.device),
            uniforms[:, -1].contiguous().to(self.device),
        )
        if not layout.is_chain:  # move accepted paths next to their roots (a chain's path is in place already)
            rows = torch.arange(num_rows, device=self.device)
            lens = torch.tensor(cache_lens, device=self.device)
            self.runner.cache.compact_paths(rows, lens, result.accepted_nodes.to(self.device))
        num_emitted, accepted = self._commit(0, active, result)
        seconds = time.perf_counter() - start
        if self.policy is not None:
            self._observe(active, asked, served, accepted, layout, seconds, context, force_k is not None)
        by_method = collections.Counter(m for m, k in zip(served, asked) if k > 0)
        self.last_trace.append(
            StepRecord(
                "decode",
                num_rows,
                decision.num_draft_tokens,
                sum(layout.num_nodes) - num_rows,
                sum(accepted),
                num_emitted,
                seconds,
                drafted_per_position=[sum(d > j for d in layout.row_depths) for j in range(layout.max_depth)],
                accepted_per_position=[sum(a > j for a in accepted) for j in range(layout.max_depth)],
                predicted_gain=decision.predicted_gain,
                measuring=decision.measuring,
                rows_by_method=dict(by_method),
            )
        )

    def _route(self, seq: Sequence) -> str:
        """Where a row's drafts come from: the proposer its request names, or the configured cascade."""
        return seq.params.spec.method or self._default_route

    def _observe(self, active, asked, served, accepted, layout, seconds, context: int, warm_up: bool) -> None:
        """Tell the policy what the step cost and what each route's drafts earned."""
        num_asked: dict[str, tuple[list[int], list[int]]] = {}
        for seq, k, a in zip(active, asked, accepted):
            if k > 0:
                rows = num_asked.setdefault(self._route(seq), ([], []))
                rows[0].append(k)
                rows[1].append(a)
        passes = max((k for k, s in zip(asked, served) if k > 0 and s == "draft_model"), default=0)
        observation = StepObservation(len(active), layout.width, passes, seconds, num_asked, context)
        self.policy.observe(observation, warm_up)

    # ---- verification and commit ------------------------------------------------------------------------------

    def _row_sampling(self, sequences: list[Sequence]) -> RowSampling:
        params = [seq.params for seq in sequences]
        greedy = [p.temperature == 0 for p in params]
        return RowSampling(
            temperature=torch.tensor([float(p.temperature) for p in params], device=self.device),
            top_k=torch.tensor([p.top_k for p in params], device=self.device),
            top_p=torch.tensor([float(p.top_p) for p in params], device=self.device),
            needs_filter=any(p.top_k > 0 or p.top_p < 1 for p in params),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
        )

    def _draw_uniforms(self, sequences: list[Sequence], num_draft: list[int]) -> Tensor:
        """`[rows, 2K + 1]` float64 from each row's own stream: K for drafting, K for acceptance, 1 for the
        recovered or bonus token (columns: draft | accept | sample). Greedy rows consume no randomness."""
        width = 2 * max(num_draft) + 1
        uniforms = torch.zeros(len(sequences), width, dtype=torch.float64)
        for row, (seq, k) in enumerate(zip(sequences, num_draft)):
            if seq.generator is not None:
                draws = seq.uniforms(2 * k + 1)
                uniforms[row, :k] = draws[:k]
                uniforms[row, width // 2 : width // 2 + k] = draws[k : 2 * k]
                uniforms[row, -1] = draws[2 * k]
        return uniforms

    def _commit(self, row_start: int, sequences: list[Sequence], result: VerifyResult) -> tuple[int, list[int]]:
        """Bring the step's result to the host in ONE transfer and append it.

        Returns the tokens kept (after stops and length caps) and the drafts accepted per row.
        """
        packed = torch.cat(
            [result.num_emitted[:, None], result.output_token_ids, result.logprobs.view(torch.long)], dim=1
        ).cpu()
        width = result.output_token_ids.shape[1]
        num_emitted = packed[:, 0].tolist()
        tokens = packed[:, 1 : 1 + width].tolist()
        logprobs = packed[:, 1 + width :].contiguous().view(torch.float64).tolist()
        kept_total = 0
        for row, (seq, n, row_tokens, row_logprobs) in enumerate(
            zip(sequences, num_emitted, tokens, logprobs), start=row_start
        ):
            if seq.token_ids:  # decode: the pending token and the accepted drafts now have KV in the cache
                seq.cache_len += n
            before = seq.num_tokens
            kept = seq.append(row_tokens[:n], row_logprobs[:n])
            self.history[row, before : before + kept] = torch.tensor(row_tokens[:kept])
            kept_total += kept
        return kept_total, [n - 1 for n in num_emitted]

    def _release_finished(self, active: list[Sequence]) -> int:
        """Drop finished rows and keep the active rows packed at the front: the last rows move into the holes.
        Returns the number of rows dropped."""
        finished = [i for i, seq in enumerate(active) if seq.finish_reason is not None]
        if not finished:
            return 0
        if self.proposers is not None:
            self.proposers.finish(finished, self.history, [active[i].num_tokens for i in finished])
        remaining = len(active) - len(finished)
        holes = [i for i in finished if i < remaining]
        movers = [i for i in range(remaining, len(active)) if active[i].finish_reason is None]
        assert len(holes) == len(movers), f"expected as many holes as movers, got {len(holes)} and {len(movers)}"
        if movers:
            longest = min(max(active[i].num_tokens for i in movers) + 1, self.runner.cache.num_positions)
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            self.runner.copy_rows(src, dst, num_positions=longest)
            if self.proposers is not None:
                self.proposers.copy_rows(src, dst, longest)
            self.history[holes] = self.history[movers]
            for hole, mover in zip(holes, movers):
                active[hole] = active[mover]
        del active[remaining:]
        return len(finished)

    # ---- input ------------------------------------------------------------------------------------------------

    def _check_prompts(self, prompt_ids) -> list[list[int]]:
        """The prompts as lists of Python ints (numpy / torch integer ids accepted), checked against the vocabulary
        and max_seq_len."""
        if isinstance(prompt_ids, str) or not hasattr(prompt_ids, "__len__") or len(prompt_ids) == 0:
            raise ValueError(
                "prompt_ids must be a non-empty list of prompts, each a list of token ids "
                "(tokenizer(texts)['input_ids']); Rollout takes text and chat messages"
            )
        vocab_size = self.vocab_size
        checked = []
        for index, prompt in enumerate(prompt_ids):
            if isinstance(prompt, str):
                raise ValueError(
                    f"prompt {index} is a string ({prompt!r:.40}): pass token ids (tokenizer(text)['input_ids']), "
                    "or use Rollout, which formats and tokenizes text"
                )
            values = prompt.tolist() if hasattr(prompt, "tolist") else prompt
            if not isinstance(values, (list, tuple)) or len(values) == 0:
                raise ValueError(f"prompt {index} is empty or not a list of token ids: got {prompt!r:.60}")
            ids = []
            for token in values:
                if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                    raise ValueError(
                        f"prompt {index} holds {token!r:.30} ({type(token).__name__}): token ids are integers"
                    )
                ids.append(int(token))
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {index} has token id {bad[0]} outside the model's vocabulary [0, {vocab_size}): "
                    "tokenize with the model's own tokenizer"
                )
            if len(ids) >= self.max_seq_len:
                raise ValueError(
                    f"prompt {index} has {len(ids)} tokens but max_seq_len is {self.max_seq_len}, leaving no room "
                    f"for a completion: shorten the prompt or raise max_seq_len above {len(ids)}"
                )
            checked.append(ids)
        return checked

    def _check_params(self, params, num_prompts: int) -> list[SamplingParams]:
        """One SamplingParams per prompt; a request's spec settings must name a configured proposer."""
        params = SamplingParams() if params is None else params
        per_prompt = [params] * num_prompts if isinstance(params, SamplingParams) else params
        if not isinstance(per_prompt, (list, tuple)) or len(per_prompt) != num_prompts:
            raise ValueError(
                f"params must be one SamplingParams or a list of one per prompt ({num_prompts}), got {params!r:.80}"
            )
        for index, p in enumerate(per_prompt):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{index}] ({p!r:.60}) must be a SamplingParams")
            method = p.spec.method
            if method is not None and method not in self._methods:
                raise ValueError(
                    f"params[{index}].spec.method ({method!r}) is not a configured proposer: the generator's spec has "
                    f"{list(self._methods) or 'no speculation'}; name one of those or leave method None"
                )
        return list(per_prompt)

    def _make_sequences(
        self, prompt_ids: list[list[int]], per_prompt: list[SamplingParams], seed_indices: list[int] | None = None
    ) -> list[Sequence]:
        call_seed = random.SystemRandom().getrandbits(62)
        max_k = self.spec.num_speculative_tokens if self.spec is not None else 0
        sequences = []
        for prompt_index, (prompt, params) in enumerate(zip(prompt_ids, per_prompt)):
            stop_ids = frozenset(self.eos_token_ids) | frozenset(params.stop_token_ids or ())
            base_seed = params.seed if params.seed is not None else call_seed
            max_new = min(params.max_new_tokens, self.max_seq_len - len(prompt))
            for sample_index in range(params.n):
                generator = None
                if params.temperature > 0:
                    seed_index = prompt_index if seed_indices is None else seed_indices[prompt_index]
                    generator = torch.Generator().manual_seed(_mix_seed(base_seed, seed_index, sample_index))
                seq = Sequence(prompt_index, sample_index, list(prompt), params, max_new, stop_ids, generator)
                seq.spec_cap = min(params.spec.cap(max_k), max_k)
                sequences.append(seq)
        return sequences


def _mix_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """A per-sample seed: independent of batch composition, so a sample's stream never depends on its neighbours."""
    digest = hashlib.blake2b(f"{base}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _eos_token_ids(model: PreTrainedModel) -> list[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
