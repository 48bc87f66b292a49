"""One decode step in its stages: schedule (K and the drafts asked of each row), propose, forward, verify, commit.

A step is launched (`_launch_decode`: everything up to the verification, queued on the device, and the copy of its
results to the host started), then finished (`_finish_decode`: the results read, committed, learned from, recorded).
Between the two the host may launch the next step behind it (`rollout.engine.run_ahead`): a step of one token a row
needs only the tokens already on the device.

A mixin over the `Generator`'s state (scheduler, slots, runner, proposers, K policy); the generator is the only user.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch
from torch import Tensor

from rollout.engine.errors import NonFiniteLogits
from rollout.engine.run_ahead import LaunchedStep
from rollout.engine.sequence import Sequence
from rollout.engine.trace import StepRecord
from rollout_kernels.device_io import start_read, upload
from specdec.auto_policy import StepObservation
from specdec.policies import Decision
from specdec.proposers.base import Drafts, ProposalBatch
from specdec.tree import DraftLayout, layout_drafts
from specdec.verify import RaceKeys, VerifyResult, verify

Ahead = tuple[Decision, float, list[str]]  # a step launched ahead: its K policy's choice (K = 0), its seconds, routes


class DecodeStep:
    """The decode step's stages (see the module docstring)."""

    def _launch_decode(self, after: LaunchedStep | None = None, ahead: Ahead | None = None) -> LaunchedStep:
        """Feed each row in flight its pending token plus its drafts (a tree rooted at the pending token; a chain is
        the one-child tree) and verify them all in the same forward, on the device; start the results' copy to the
        host. `after`: a step still in flight, whose sampled tokens (on the device) this one feeds, one token a row
        (no drafts: the host has not seen the tokens they would follow), and `ahead` what let it run ahead
        (`_decision_ahead`)."""
        start = time.perf_counter()
        num_rows = self.scheduler.num_active
        rows = slice(0, num_rows)
        context = int(self.slots.cache_len[:num_rows].max())  # rows attend over the longest row's cache (padded)
        if after is None:
            observed = self.policy is not None  # a policy learns from the step
            routes = self._routes(num_rows) if observed else []
            decision, asked, policy_seconds = self._schedule(num_rows, context, routes)
        else:
            decision, policy_seconds, routes = ahead
            asked = torch.zeros(num_rows, dtype=torch.long)
        uniforms = self._uniforms(rows, asked)
        sampling = self.slots.row_sampling(rows, self.device)  # shared by the proposers and the verifier
        race = self._race_keys(rows, ahead=after is not None)  # shared by the draft model and the verifier
        propose_start = time.perf_counter()
        drafts, served = self._propose(num_rows, asked, sampling, uniforms, race) if after is None else (None, [])
        propose_seconds = time.perf_counter() - propose_start
        layout = self._plain_layout(num_rows) if drafts is None else layout_drafts(drafts.num_drafted, drafts.parents)
        self.scheduler.reserve(layout.node_counts)  # blocks before the forward that writes them
        pending = after.next_input_ids(num_rows, self.device) if after is not None else None
        input_ids = self._input_ids(num_rows, drafts, layout, pending)
        cache_lens = self.slots.cache_len[:num_rows]
        if self._verified_in_graph(num_rows, layout, sampling, race):  # the forward and the race in one replay
            temperatures = self.slots.temperature[:num_rows]
            result = self.runner.decode_verified(input_ids, layout.node_counts, cache_lens, race, temperatures)
        else:
            logits = self.runner.decode(0, input_ids, layout.node_counts, cache_lens, layout.depths, layout.ancestors)
            result = self._verify(num_rows, input_ids, logits, layout, drafts, sampling, uniforms, race)
        base_positions = self.slots.cache_len[:num_rows].clone()  # where each root was written (the commit moves it)
        tree = not layout.is_chain
        # the step's one read of the device, started here and waited for in `_finish_decode`
        read = start_read(_packed(result, tree))
        if after is None and drafts is None:  # no drafts: the proposers take the text in while the device computes
            propose_seconds += self._take_in_text(num_rows)
        advanced = layout.width == 1 and self.config.async_scheduling
        if advanced:  # one token a row: each row's pending token is in the cache now, whatever it samples
            self.slots.cache_len[:num_rows] += 1
            self._ahead.unread += 1
        return LaunchedStep(
            start, num_rows, context, decision, asked, routes, served or [None] * num_rows, drafts is not None,
            layout, propose_seconds, result, read, base_positions, advanced, policy_seconds=policy_seconds,
            behind=after is not None, launch_seconds=time.perf_counter() - start,
        )  # fmt: skip

    def _finish_decode(self, step: LaunchedStep) -> tuple[StepRecord, StepObservation | None]:
        """Read a launched step's results (waiting for the device), commit them to the rows they belong to now, let
        the proposers and the K policy learn from them, and record the step."""
        layout = step.layout
        # rows moved since the launch: only a one-token chain without drafts (the results are remapped, the launch's
        # per-row records are not: they say that no row drafted, whichever row it is now)
        assert step.row_of is None or (layout.width == 1 and not step.drafted), "a remapped step"
        wait_start = time.perf_counter()
        packed = step.read.wait()
        wait_seconds = time.perf_counter() - wait_start
        source = step.source_rows(self.scheduler.num_active)
        if source is not None:  # rows released since the launch: the others' results, in today's row order
            packed = packed[torch.from_numpy(source)]
        num_rows = len(packed)
        num_emitted, accepted_per_row, emitted_ids, accepted_nodes = self._commit_packed(
            0, packed, step.result.output_token_ids.shape[1], in_cache=not step.advanced, tree=not layout.is_chain
        )
        self._ahead.unread -= step.advanced
        if self._ahead.in_flight is not None:
            # a step runs behind this one, without drafts: the proposers take in this step's tokens now, while the
            # device computes it, rather than at the next launch (their time counts as this step's proposing)
            step.propose_seconds += self._take_in_text(num_rows)
        if accepted_nodes is not None:  # move accepted paths next to their roots (a chain's path is in place already)
            self.runner.compact_paths(torch.arange(num_rows), step.base_positions, accepted_nodes)  # host: no read
        plain = step.decision.num_draft_tokens == 0  # no row was asked for drafts: every per-row count below is 0
        accepted = [0] * step.num_rows if plain else accepted_per_row.tolist()
        now = time.perf_counter()
        # a step launched ahead counts from the last read (it started before it). With the host ahead of the device
        # (async_scheduling) a step in lockstep counts from it too, so that a drafting step is priced with the
        # bookkeeping between two reads, as the steps run ahead are; unless a prefill came between (it resets it)
        since = max(step.start, self._ahead.last_finish)
        if self.config.async_scheduling and self._ahead.last_finish and not getattr(self.policy, "lockstep", False):
            since = self._ahead.last_finish  # (a calibration's forced steps are timed from their own launch)
        seconds = now - since
        self._ahead.last_finish = now
        if step.drafted:  # a cascade learns which proposer earns what, at what cost
            self.proposers.observe(accepted, seconds, emitted_ids)
        asked_list = accepted if plain else step.asked.tolist()
        drafting = [False] * step.num_rows if plain else [k > 0 for k in asked_list]
        observation = None
        if step.routes:
            observation = self._observation(
                asked_list, drafting, step.routes, step.served, accepted, layout, seconds, step.context
            )
            observe_start = time.perf_counter()
            self.policy.observe(observation)
            step.policy_seconds += time.perf_counter() - observe_start
        drafted_per_position, accepted_per_position = [], []  # rows that reached / accepted draft j
        if not plain:
            depths = layout.node_counts.numpy() - 1 if layout.is_chain else np.array(layout.row_depths)
            position = np.arange(layout.max_depth)
            drafted_per_position = (depths[:, None] > position).sum(0).tolist()
            accepted_per_position = (accepted_per_row.numpy()[:, None] > position).sum(0).tolist()
        decision = step.decision
        record = StepRecord(
            "decode",
            step.num_rows,
            decision.num_draft_tokens,
            sum(layout.num_nodes) - step.num_rows,
            sum(accepted),
            num_emitted,
            seconds,
            step.propose_seconds,
            step.policy_seconds,
            drafted_per_position=drafted_per_position,
            accepted_per_position=accepted_per_position,
            predicted_gain=decision.predicted_gain,
            measuring=decision.measuring,
            ran_ahead=step.behind,
            rows_by_method=_count_by(step.served, drafting),
            launch_seconds=step.launch_seconds,
            wait_seconds=wait_seconds,
        )
        return record, observation

    def _schedule(self, num_rows: int, context: int, routes: list[str]) -> tuple[Decision, Tensor, float]:
        """The step's K (the policy's, given each row's route), `[rows]` the drafts asked of each row under its
        caps, and the seconds the policy took to choose."""
        caps = self.slots.draft_caps(num_rows)
        decision, seconds = Decision(0), 0.0
        stashed, self._ahead.decision = self._ahead.decision, None
        if stashed is not None and stashed[2] is self.policy:  # chosen when this step could not run ahead
            decision, seconds = stashed[:2]
        elif self.policy is not None:
            start = time.perf_counter()
            decision = self.policy.choose(num_rows, caps.tolist(), routes, context)
            seconds = time.perf_counter() - start
        return decision, caps.clamp(0, decision.num_draft_tokens), seconds

    def _decision_ahead(self) -> Ahead | None:
        """Whether the next decode step may be launched behind the one in flight, before it is read: if so, the K
        policy's choice of K = 0 for it, the seconds the choice took and the rows' routes (the policy learns from the
        step), else None. Nothing may be admitted or preempted first (`Scheduler.can_run_ahead`); with a K policy, it
        chooses the step's K from the rows as the host knows them, a step behind: at K = 0 the step runs ahead, a K > 0
        waits for the next launch (its drafts follow the tokens in flight). A policy that times forced steps
        (`lockstep`) is never run ahead of, nor is drafting under rejection sampling."""
        if not self.scheduler.can_run_ahead():
            return None
        if self.policy is None:
            return Decision(0), 0.0, []
        # under rejection sampling a row's uniforms are drawn by count (2K + 1 a step): a K chosen on rows a step
        # behind (rows finishing in flight counted) would shift its stream, and the samples would differ from
        # lockstep's; exact verification keys its randomness by position, whatever K
        if getattr(self.policy, "lockstep", False) or not self.exact:
            return None
        num_rows = self.scheduler.num_active
        context = int(self.slots.cache_len[:num_rows].max())
        routes = self._routes(num_rows)
        decision, asked, seconds = self._schedule(num_rows, context, routes)
        if int(asked.max()) == 0:
            return decision, seconds, routes
        self._ahead.decision = (decision, seconds, self.policy)  # for the next launch, by this policy only
        return None

    def _take_in_text(self, num_rows: int) -> float:
        """The proposers that learn from the text take in the rows' tokens as they stand (a step without drafts);
        returns the seconds it took."""
        if self.proposers is None:
            return 0.0
        start = time.perf_counter()
        self.proposers.update(self.slots.token_ids[:num_rows], self.slots.num_tokens[:num_rows].tolist())
        return time.perf_counter() - start

    def _propose(
        self,
        num_rows: int,
        asked: Tensor,
        sampling,
        uniforms: Tensor,
        race: RaceKeys | None,
    ) -> tuple[Drafts | None, list]:
        """The proposers' drafts for rows asked for some (None if none were); what each row was served by."""
        if self.proposers is None:
            return None, [None] * num_rows
        if int(asked.max()) == 0:  # no drafts this step (the proposers take its text in after the launch)
            return None, [None] * num_rows
        num_tokens = self.slots.num_tokens[:num_rows].tolist()
        sequences = self.slots.sequences[:num_rows]
        batch = ProposalBatch(
            token_ids=self.slots.token_ids[:num_rows],
            num_tokens=num_tokens,
            num_asked=asked.tolist(),
            sampling=sampling,
            draft_uniforms=uniforms[:, : int(asked.max())],
            race=race,
            states=[seq.proposer_state for seq in sequences],
        )
        return self.proposers.propose(batch, [seq.params.spec.method for seq in sequences])

    def _input_ids(
        self, num_rows: int, drafts: Drafts | None, layout: DraftLayout, pending: Tensor | None = None
    ) -> Tensor:
        """`[rows, width]` on the device: the pending tokens (the slots', or `pending [rows, 1]` on the device), then
        the drafts (0 past a row's last)."""
        input_ids = self.slots.pending(num_rows)[:, None] if pending is None else pending
        if layout.width > 1:  # joined where the drafts are (a draft model's on the device: no round trip; a host
            # proposer's on the host, going up with the pending tokens in one upload)
            draft_ids = drafts.token_ids[:, : layout.width - 1]
            if draft_ids.device.type == "cpu" and input_ids.device.type == "cpu":  # numpy: cheaper calls
                joined = np.concatenate([input_ids.numpy(), np.maximum(draft_ids.numpy(), 0)], axis=1)
                input_ids = torch.from_numpy(joined)
            else:
                input_ids = torch.cat([upload(input_ids, draft_ids.device), draft_ids.clamp(min=0)], dim=1)
        return upload(input_ids, self.device)

    def _verified_in_graph(self, num_rows: int, layout: DraftLayout, sampling, race: RaceKeys | None) -> bool:
        """Whether the step's verification replays with its forward (`ModelRunner.decode_verified`): chains under
        exact verification, some row sampled and none filtered by top-k / top-p, at a shape the graphs serve. The
        others verify eagerly after the forward (`verify`): all-greedy batches take the greedy kernels, filters their
        thresholds, rejection sampling its uniforms, trees their walk."""
        if race is None or not layout.is_chain or sampling.all_greedy or sampling.needs_filter:
            return False
        return self.runner.verifies(num_rows, layout.width)

    def _verify(
        self, num_rows, input_ids, logits, layout: DraftLayout, drafts, sampling, uniforms, race: RaceKeys | None
    ) -> VerifyResult:
        """Verify in the verifier's layout: row i's nodes, pending token first, rows back to back (the logits stay the
        model's padded output, each node's row named by `logit_rows` when some row is narrower than the widest)."""
        fed = torch.arange(layout.width)[None, :] < layout.node_counts[:, None]
        node_ids, logit_rows = input_ids.reshape(-1), None
        if sum(layout.num_nodes) < num_rows * layout.width:  # rows of fewer nodes (a full batch is back to back)
            logit_rows = (torch.arange(num_rows)[:, None] * layout.width + torch.arange(layout.width))[fed]
            logit_rows = upload(logit_rows, self.device)
            node_ids = node_ids[logit_rows]
        half = uniforms.shape[1] // 2  # node j > 0 takes the row's accept uniform j - 1
        node_uniforms = torch.cat([torch.zeros(num_rows, 1, dtype=torch.float64), uniforms[:, half : 2 * half]], 1)
        return verify(
            logits.reshape(num_rows * layout.width, -1),  # a view: verification reads the nodes it needs
            node_ids,
            layout,
            drafts.probs if drafts is not None else None,
            sampling,
            upload(node_uniforms[:, : layout.width][fed], self.device),
            upload(uniforms[:, -1].contiguous(), self.device),
            race,
            logit_rows,
        )

    def _uniforms(self, rows: slice, asked: Tensor) -> Tensor:
        """`[rows, 2K + 1]` the rows' uniforms for rejection sampling (`SlotState.uniforms`); zeros under exact
        verification, whose randomness is the race's, keyed by position, so that the rows' streams are not drawn."""
        if self.exact:
            max_k = int(asked.max()) if asked.numel() else 0
            return torch.zeros(rows.stop - rows.start, 2 * max_k + 1, dtype=torch.float64)
        return self.slots.uniforms(rows, asked)

    def _race_keys(self, rows: slice, ahead: bool = False) -> RaceKeys | None:
        """Each row's sample seed and the completion position of the token its root draws (None: rejection);
        `ahead`: for a step launched behind one whose token the rows have not taken in yet."""
        if not self.exact:
            return None
        s = self.slots
        positions = s.num_tokens.numpy()[rows] - s.prompt_len.numpy()[rows] + int(ahead)
        return RaceKeys(s.seed[rows, 0], torch.from_numpy(positions))

    def _commit_prefill(self, rows: slice, result: VerifyResult) -> int:
        """Bring a prefill's result to the host (its one read of the device) and append it to the rows (the prompts'
        KV is in the cache, their sampled tokens pending); returns the tokens kept."""
        packed = start_read(_packed(result, tree=False)).wait()
        return self._commit_packed(rows.start, packed, result.output_token_ids.shape[1], False, tree=False)[0]

    def _commit_packed(
        self, row_start: int, packed: Tensor, width: int, in_cache: bool, tree: bool
    ) -> tuple[int, Tensor, Tensor, Tensor | None]:
        """Append a step's results (`_packed`, read to the host) to the rows from `row_start` on.

        Returns the tokens kept (after stops and length caps), the drafts accepted per row `[rows]`, the emitted
        tokens `[rows, max depth + 1]` (row i's first `accepted[i] + 1` are its own) and a token tree's accepted
        nodes `[rows, max depth]` (with `tree`, else None), all on the host.
        """
        num_emitted = packed[:, 0]
        tokens = packed[:, 1 : 1 + width]
        logprobs = packed[:, 1 + width : 1 + 2 * width].contiguous().view(torch.float64)
        accepted_nodes = packed[:, 1 + 2 * width :].contiguous() if tree else None
        if np.isnan(logprobs.numpy()).any():  # (a few microseconds: the step's emitted log-probabilities only)
            self._refuse_non_finite(row_start, num_emitted, logprobs)
        kept = self.slots.commit(row_start, num_emitted, tokens, logprobs, in_cache)
        return int(kept.sum()), num_emitted - 1, tokens, accepted_nodes

    def _refuse_non_finite(self, row_start: int, num_emitted: Tensor, logprobs: Tensor) -> None:
        """Raise where a token the step emitted has a NaN log-probability: the race drew it from logits that hold a
        NaN (or a +inf, whose log-softmax is NaN), so nothing may be sampled from them."""
        values = logprobs.numpy()
        emitted = np.isnan(values) & (np.arange(values.shape[1]) < num_emitted.numpy()[:, None])
        if not emitted.any():
            return  # past the tokens the rows emitted: never read
        row, col = (int(i) for i in np.argwhere(emitted)[0])
        seq = self.slots.sequences[row_start + row]
        where = "" if seq is None else f" of prompt {seq.prompt_index}, sample {seq.sample_index}"
        position = int(self.slots.num_tokens[row_start + row] - self.slots.prompt_len[row_start + row]) + col
        raise NonFiniteLogits(
            f"the policy's logits are not finite (NaN or inf) at completion token {position}{where} of the call, on "
            f"{int(emitted.any(1).sum())} of the step's {len(values)} rows: its weights or activations overflowed or "
            "diverged, so nothing can be sampled from them; check the last update (learning rate, gradient clipping) "
            "or run the policy in bfloat16 or float32 rather than float16"
        )

    def _plain_layout(self, num_rows: int) -> DraftLayout:
        """The layout of a step without drafts (one node a row), made once per row count: nothing changes it."""
        layout = self._plain_layouts.get(num_rows)
        if layout is None:
            layout = self._plain_layouts[num_rows] = layout_drafts([0] * num_rows, None)
        return layout

    def _routes(self, num_rows: int) -> list[str]:
        """Each of the first `num_rows` rows' route (`_route`), worked out again only after rows were admitted or
        moved (a list over every row each step cost 0.1-0.2 ms at 256-512 rows); the caller does not change it."""
        cached = self._routes_cache
        if cached is not None and cached[0] == self.slots.version and len(cached[1]) >= num_rows:
            routes = cached[1]
            return routes if len(routes) == num_rows else routes[:num_rows]
        routes = [self._route(seq) for seq in self.slots.sequences[:num_rows]]
        self._routes_cache = (self.slots.version, routes)
        return routes

    def _route(self, seq: Sequence) -> str:
        """Where a row's drafts come from: the proposer its request names, or the configured cascade."""
        return seq.params.spec.method or self._default_route

    def _observation(self, asked, drafting, routes, served, accepted, layout, seconds, context: int) -> StepObservation:
        """What the step cost and what each route's drafts earned (`drafting[i]`: row i was asked for drafts,
        `routes[i]` its route)."""
        num_asked: dict[str, tuple[list[int], list[int]]] = {}
        distinct = _distinct(routes)
        for route in distinct:
            rows = drafting if len(distinct) == 1 else [d and r == route for d, r in zip(drafting, routes)]
            if any(rows):
                num_asked[route] = (list(itertools.compress(asked, rows)), list(itertools.compress(accepted, rows)))
        passes = 0
        if "draft_model" in served:
            passes = max((k for k, s in zip(asked, served) if k > 0 and s == "draft_model"), default=0)
        return StepObservation(len(asked), layout.width, passes, seconds, num_asked, context)


def _distinct(values: list) -> list:
    """The distinct values in first-seen order (one pass in C when they are all the same)."""
    if values and values.count(values[0]) == len(values):
        return [values[0]]
    return list(dict.fromkeys(values))


def _count_by(values: list, keep: list[bool]) -> dict:
    """How many kept entries hold each value, in first-seen order (the step record's rows by proposer)."""
    kept = list(itertools.compress(values, keep))
    return {value: kept.count(value) for value in _distinct(kept)}


def _packed(result: VerifyResult, tree: bool) -> Tensor:
    """A step's results in one int64 tensor `[rows, 1 + 2 W (+ depth)]` (emitted count, tokens, log-probs' bits, a
    tree's accepted nodes), so that they come back to the host in one copy."""
    if result.packed is not None:  # packed where it was computed (a replayed graph)
        return result.packed
    parts = [result.num_emitted[:, None], result.output_token_ids, result.logprobs.view(torch.long)]
    if tree:
        parts.append(result.accepted_nodes.to(torch.long))
    return torch.cat(parts, dim=1)
