"""Continuous-batching generator over a slot KV cache.

Requests wait in a queue; prefill admits them in batches (one prefill per prompt, its KV copied to the prompt's n
samples); each decode step runs one forward over the active rows only, which are kept packed at the front of the
slots. A decode step feeds every row its pending token plus up to K draft tokens and commits the first m of them
(K = 0 without speculation). The host drives scheduling; the device returns one small packed tensor per step.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rollout.model_runner import ModelRunner
from rollout.sampling import Completion, SamplingParams
from rollout.sequence import Sequence
from rollout.speculation import build_policy, build_proposer
from rollout.trace import StepRecord
from specdec.config import SpecConfig
from specdec.processing import RowSampling
from specdec.proposers.base import ProposalBatch
from specdec.tree import depths_and_ancestors, with_root
from specdec.verify import VerifyResult, verify_chain, verify_tree


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
        self.runner = ModelRunner(model, num_slots=max_batch_size, num_positions=num_positions)
        self.device = self.runner.device
        self.proposer = build_proposer(spec, self.runner, max_batch_size, num_positions) if spec else None
        self.policy = build_policy(spec, max_batch_size) if spec else None
        # host copy of every row's tokens (prompt + completion): proposers read it without a device transfer
        self.history = torch.zeros(max_batch_size, num_positions, dtype=torch.long)
        self.eos_token_ids = _eos_token_ids(model)
        self.last_trace: list[StepRecord] = []

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | None = None,
        on_step: Callable[[StepRecord, int, int], None] | None = None,
    ) -> list[Completion]:
        """Sample `params.n` completions for every prompt.

        Args:
            prompt_ids: token ids of each prompt.
            params: sampling settings shared by all prompts.
            on_step: called after every step with (its trace record, samples finished so far, samples in total),
                e.g. for a progress display.
        Returns:
            `len(prompt_ids) * params.n` completions, prompt-major (all samples of prompt 0 first).
        """
        params = SamplingParams() if params is None else params
        self._check_prompts(prompt_ids)
        sequences = self._make_sequences(prompt_ids, params)
        self.last_trace = []
        queue = deque(sequences)
        active: list[Sequence] = []
        num_finished = num_reported = 0

        def release() -> None:  # free finished rows, then report every step recorded since the last report
            nonlocal num_finished, num_reported
            num_finished += self._release_finished(active)
            if on_step is not None:
                for record in self.last_trace[num_reported:]:
                    on_step(record, num_finished, len(sequences))
            num_reported = len(self.last_trace)

        with torch.inference_mode(), _eval_mode(self.model):
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
        if self.proposer is not None and self.proposer.needs_prefill:
            self.proposer.prefill(row_start, prompts, group_of, [seq.proposer_state for seq in sequences])
        for row, seq in enumerate(sequences, start=row_start):
            seq.cache_len = len(seq.prompt)
            self.history[row, : len(seq.prompt)] = torch.tensor(seq.prompt)
        num_draft = [0] * len(sequences)
        uniforms = self._draw_uniforms(sequences, num_draft)
        result = self._verify(logits[group_of], self._row_sampling(sequences), num_draft, uniforms)
        num_emitted, _ = self._commit(row_start, sequences, result, num_draft)
        active.extend(sequences)
        self.last_trace.append(StepRecord("prefill", len(groups), 0, 0, 0, num_emitted, time.perf_counter() - start))

    def _decode_step(self, active: list[Sequence]) -> None:
        """Feed each active row its pending token plus its drafts, verify them in the same forward, commit."""
        start = time.perf_counter()
        num_rows = len(active)
        k = self.policy.choose(num_rows) if self.proposer is not None else 0
        # never draft past the length cap: those tokens could not be kept
        asked = [max(0, min(k, seq.max_new_tokens - len(seq.token_ids) - 1)) for seq in active]
        uniforms = self._draw_uniforms(active, asked)
        sampling = self._row_sampling(active)  # built once: the proposer and the verifier share it
        drafts = None
        if max(asked) > 0:
            drafts = self.proposer.propose(
                ProposalBatch(
                    token_ids=self.history[:num_rows],
                    num_tokens=[seq.num_tokens for seq in active],
                    num_draft_tokens=asked,
                    sampling=sampling,
                    draft_uniforms=uniforms[:, : max(asked)],
                    states=[seq.proposer_state for seq in active],
                )
            )
        num_draft = drafts.num_draft_tokens if drafts is not None else [0] * num_rows
        width = 1 + max(num_draft)
        input_ids = torch.tensor([[seq.pending] for seq in active]).to(self.device)
        if width > 1:  # drafts stay where the proposer made them (a draft model's on the device): no round trip
            draft_ids = drafts.token_ids[:, : width - 1].to(self.device).clamp(min=0)
            input_ids = torch.cat([input_ids, draft_ids], dim=1)
        cache_lens = [seq.cache_len for seq in active]
        num_inputs = [1 + n for n in num_draft]
        tree = drafts is not None and drafts.parents is not None and width > 1
        if tree:
            parents = with_root(drafts.parents[:, : width - 1].cpu())
            depths, ancestors = depths_and_ancestors(parents, num_inputs)
            logits = self.runner.decode(0, input_ids, num_inputs, cache_lens, depths, ancestors)
        else:
            logits = self.runner.decode(0, input_ids, num_inputs, cache_lens)
        # flatten to the verifier's layout: row i's 1 + K_i target rows (pending token first), back to back
        offsets = torch.arange(width)
        fed = offsets[None, :] < torch.tensor(num_inputs)[:, None]
        flat_index = (torch.arange(num_rows)[:, None] * width + offsets)[fed].to(self.device)
        target_logits = logits.reshape(num_rows * width, -1)[flat_index]
        if tree:
            tree_tokens = input_ids.reshape(-1)[flat_index]
            result = self._verify_tree(target_logits, sampling, num_inputs, uniforms, tree_tokens, parents[fed], depths)
            if result.accepted_nodes.numel():  # move accepted paths next to their roots (a chain path stays put)
                rows = torch.arange(num_rows, device=self.device)
                lens = torch.tensor(cache_lens, device=self.device)
                self.runner.cache.compact_paths(rows, lens, result.accepted_nodes.to(self.device))
            per_depth = [int(((depths == j + 1) & fed).any(dim=1).sum()) for j in range(int(depths.max()))]
        else:
            result = self._verify(target_logits, sampling, num_draft, uniforms, drafts)
            per_depth = [sum(n > j for n in num_draft) for j in range(max(num_draft))]
        num_emitted, accepted = self._commit(0, active, result, num_draft)
        self.last_trace.append(
            StepRecord(
                "decode",
                num_rows,
                max(asked),
                sum(num_draft),
                sum(accepted),
                num_emitted,
                time.perf_counter() - start,
                drafted_per_position=per_depth,
                accepted_per_position=[sum(a > j for a in accepted) for j in range(len(per_depth))],
            )
        )

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

    def _verify(
        self,
        target_logits: Tensor,
        sampling: RowSampling,
        num_draft: list[int],
        uniforms: Tensor,
        drafts=None,
    ) -> VerifyResult:
        half = uniforms.shape[1] // 2
        drafted = torch.arange(half)[None, :] < torch.tensor(num_draft)[:, None]
        if drafts is not None and max(num_draft) > 0:
            width = max(num_draft)
            # flatten by an index built on the host (a boolean mask on the device would sync to count it)
            flat_index = (torch.arange(len(num_draft))[:, None] * width + torch.arange(width))[drafted[:, :width]]
            draft_ids = drafts.token_ids[:, :width].to(self.device)
            draft_token_ids = draft_ids.reshape(-1)[flat_index.to(self.device)]
            draft_probs = drafts.probs
        else:
            draft_token_ids = torch.zeros(0, dtype=torch.long, device=self.device)
            draft_probs = None
        counts = torch.tensor(num_draft, device=self.device)
        return verify_chain(
            target_logits,
            draft_token_ids,
            torch.cumsum(counts, 0),
            draft_probs,
            sampling,
            counts + 1,
            max(num_draft),
            uniforms[:, half : 2 * half][drafted].to(self.device),
            uniforms[:, -1].contiguous().to(self.device),
        )

    def _verify_tree(
        self,
        target_logits: Tensor,
        sampling: RowSampling,
        num_nodes: list[int],
        uniforms: Tensor,
        tree_token_ids: Tensor,
        tree_parents: Tensor,
        depths: Tensor,
    ) -> VerifyResult:
        """Verify token trees; node i > 0 of a row uses the row's i-th accept uniform (the root's is unused)."""
        half = uniforms.shape[1] // 2
        accept = torch.cat([torch.zeros(len(num_nodes), 1, dtype=torch.float64), uniforms[:, half : 2 * half]], 1)
        fed = torch.arange(accept.shape[1])[None, :] < torch.tensor(num_nodes)[:, None]
        counts = torch.tensor(num_nodes, device=self.device)
        return verify_tree(
            target_logits,
            tree_token_ids.to(self.device),
            tree_parents.to(self.device),
            torch.cumsum(counts, 0),
            sampling,
            counts,
            int(depths.max()),
            accept[fed].to(self.device),
            uniforms[:, -1].contiguous().to(self.device),
        )

    def _commit(
        self, row_start: int, sequences: list[Sequence], result: VerifyResult, num_draft: list[int]
    ) -> tuple[int, list[int]]:
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
        remaining = len(active) - len(finished)
        holes = [i for i in finished if i < remaining]
        movers = [i for i in range(remaining, len(active)) if active[i].finish_reason is None]
        assert len(holes) == len(movers), f"expected as many holes as movers, got {len(holes)} and {len(movers)}"
        if movers:
            longest = min(max(active[i].num_tokens for i in movers) + 1, self.runner.cache.num_positions)
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            self.runner.copy_rows(src, dst, num_positions=longest)
            if self.proposer is not None:
                self.proposer.copy_rows(src, dst, longest)
            self.history[holes] = self.history[movers]
            for hole, mover in zip(holes, movers):
                active[hole] = active[mover]
        del active[remaining:]
        return len(finished)

    # ---- input ------------------------------------------------------------------------------------------------

    def _check_prompts(self, prompt_ids: list[list[int]]) -> None:
        if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty: pass a non-empty list of prompts, each a list of token ids")
        vocab_size = self.vocab_size
        for index, prompt in enumerate(prompt_ids):
            if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: every prompt needs at least one token id")
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {index} has token id {bad[0]!r} outside the model's vocabulary [0, {vocab_size}): "
                    "tokenize with the model's own tokenizer"
                )
            if len(prompt) >= self.max_seq_len:
                raise ValueError(
                    f"prompt {index} has {len(prompt)} tokens but max_seq_len is {self.max_seq_len}, leaving no room "
                    f"for a completion: shorten the prompt or raise max_seq_len above {len(prompt)}"
                )

    def _make_sequences(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Sequence]:
        stop_ids = frozenset(self.eos_token_ids) | frozenset(params.stop_token_ids or ())
        base_seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
        sequences = []
        for prompt_index, prompt in enumerate(prompt_ids):
            max_new = min(params.max_new_tokens, self.max_seq_len - len(prompt))
            for sample_index in range(params.n):
                generator = None
                if params.temperature > 0:
                    generator = torch.Generator().manual_seed(_mix_seed(base_seed, prompt_index, sample_index))
                sequences.append(
                    Sequence(prompt_index, sample_index, list(prompt), params, max_new, stop_ids, generator)
                )
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


@contextlib.contextmanager
def _eval_mode(model: PreTrainedModel):
    """Generate in eval mode (no dropout) and hand the model back in the mode the trainer left it."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
