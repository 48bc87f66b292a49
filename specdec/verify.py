"""Verification: target logits + drafts -> emitted tokens and their log-probabilities.

`verify` is the decode step's entry point: it takes every row's drafts as a tree rooted at the pending token. Given
race keys (`RaceKeys`: each sample's seed and the completion position of the token its root draws), sampled rows are
verified exactly (`verify_exact`): every node draws the race's token at its position, and a draft is accepted when it
equals the token drawn at its parent. Otherwise the chain kernels run when every row is a chain (they also take a
draft model's q, rejection sampling), the tree kernels when not; greedy batches always take the greedy kernels (the
race over a one-hot distribution is its argmax).

Rows are flattened the way the kernels take them (see `kernels/rejection_sample.py`): row i feeds its pending token
plus K_i drafts, so it owns K_i + 1 target rows starting at `cu_num_draft_tokens[i - 1] + i`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollout_kernels.device_io import upload
from rollout_kernels.greedy_verify import greedy_verify, greedy_verify_ref
from rollout_kernels.race_logits import race_logits, race_logits_ref
from rollout_kernels.rejection_sample import rejection_sample, rejection_sample_ref
from rollout_kernels.tree_greedy_verify import tree_greedy_verify, tree_greedy_verify_ref
from rollout_kernels.tree_rejection_sample import tree_rejection_sample, tree_rejection_sample_ref
from specdec.processing import RowSampling, keep_thresholds, processed_logprobs, target_probs
from specdec.tree import DraftLayout


@dataclass
class VerifyResult:
    output_token_ids: Tensor  # [rows, max_num_draft_tokens + 1] int64, -1 after the emitted tokens
    num_emitted: Tensor  # [rows] int64: accepted drafts + 1
    logprobs: Tensor  # [rows, max_num_draft_tokens + 1] float64, 0 after the emitted tokens
    accepted_nodes: Tensor | None = None  # [rows, max_depth] tree-local accepted path (trees only), -1 padded
    # [rows, 1 + 2 (max_num_draft_tokens + 1)] int64 the same results in one tensor (emitted count, tokens, log-probs'
    # bits) where the verifier wrote them so (a replayed graph), for the step's one read; None: packed by the reader
    packed: Tensor | None = None


@dataclass
class RaceKeys:
    """What keys a row's race noise: its sample's seed and the completion position of the token its root draws."""

    seeds: Tensor  # [rows] int64
    positions: Tensor  # [rows] int64


def verify(
    target_logits: Tensor,  # [num_nodes, V], a row per node, each row's root first (or any rows: logit_rows)
    node_token_ids: Tensor,  # [num_nodes] (the root's entry is unused)
    layout: DraftLayout,
    draft_probs: Tensor | None,  # [num_nodes - rows, V] q of every non-root node, rows back to back; None = n-gram
    sampling: RowSampling,  # per row
    node_uniforms: Tensor,  # [num_nodes] float64 acceptance uniform of each node (the root's is unused)
    sample_uniforms: Tensor,  # [rows] float64
    race: RaceKeys | None = None,  # given: exact verification of one-hot drafts (draft_probs must be None)
    logit_rows: Tensor | None = None,  # [num_nodes] the row of target_logits holding each node; None: row i
) -> VerifyResult:
    """Verify each row's drafts against the target and emit the accepted ones plus one more token per row.

    `logit_rows` lets `target_logits` be the model's padded output (`[rows * width, V]`, a view): exact verification
    reads only the nodes it walks from it; the chain and tree kernels take the nodes gathered back to back."""
    if race is not None and not sampling.all_greedy:
        assert draft_probs is None, "expected one-hot drafts: exact verification takes no draft probabilities"
        return verify_exact(target_logits, node_token_ids, layout, sampling, race, logit_rows=logit_rows)
    if logit_rows is not None:
        target_logits = target_logits[logit_rows]
    device = target_logits.device
    num_nodes = upload(layout.node_counts, device)
    if layout.is_chain:
        # draft nodes = every node but each row's root; indexed on the host (a device mask would sync to count)
        is_draft = torch.ones(sum(layout.num_nodes), dtype=torch.bool)
        is_draft[torch.cumsum(layout.node_counts, 0) - layout.node_counts] = False  # each row's first node
        drafts = upload(torch.nonzero(is_draft)[:, 0], device)
        counts = num_nodes - 1
        return verify_chain(
            target_logits,
            node_token_ids[drafts],
            torch.cumsum(counts, 0),
            draft_probs,
            sampling,
            num_nodes,
            layout.max_depth,
            node_uniforms[drafts],
            sample_uniforms,
        )
    assert draft_probs is None, "expected n-gram trees: tree verification takes no draft probabilities"
    parents = layout.parents[torch.arange(layout.width)[None, :] < layout.node_counts[:, None]]
    return verify_tree(
        target_logits,
        node_token_ids,
        upload(parents, device),
        torch.cumsum(num_nodes, 0),
        sampling,
        num_nodes,
        layout.max_depth,
        node_uniforms,
        sample_uniforms,
    )


def verify_chain(
    target_logits: Tensor,  # [total_drafts + rows, V]
    draft_token_ids: Tensor,  # [total_drafts]
    cu_num_draft_tokens: Tensor,  # [rows]
    draft_probs: Tensor | None,  # [total_drafts, V], processed like the target; None for n-gram drafts
    sampling: RowSampling,  # per row
    num_target_rows_per_row: Tensor,  # [rows] K_i + 1
    max_num_draft_tokens: int,
    accept_uniforms: Tensor,  # [total_drafts] float64
    sample_uniforms: Tensor,  # [rows] float64
) -> VerifyResult:
    """Accept or reject each row's drafts losslessly and emit one more token (recovered or bonus) per row."""
    token_sampling, logprobs, use_triton = _process(target_logits, sampling, num_target_rows_per_row)
    if sampling.all_greedy:
        op = greedy_verify if use_triton else greedy_verify_ref
        out, num_emitted = op(draft_token_ids, cu_num_draft_tokens, target_logits, max_num_draft_tokens)
    else:
        probs = target_probs(target_logits, logprobs, token_sampling)
        op = rejection_sample if use_triton else rejection_sample_ref
        out, num_emitted = op(
            draft_token_ids,
            cu_num_draft_tokens,
            draft_probs,
            probs,
            accept_uniforms,
            sample_uniforms,
            max_num_draft_tokens,
        )
    rows = out.shape[0]
    starts = cu_num_draft_tokens - num_target_rows_per_row + 1 + torch.arange(rows, device=out.device)
    index = starts[:, None] + torch.arange(max_num_draft_tokens + 1, device=out.device)
    return VerifyResult(out, num_emitted, _emitted_logprobs(logprobs, index, out))


def verify_tree(
    target_logits: Tensor,  # [num_nodes, V]: one target row per node, the root (pending token) first in each row
    tree_token_ids: Tensor,  # [num_nodes]
    tree_parents: Tensor,  # [num_nodes] local, -1 for the root
    cu_num_nodes: Tensor,  # [rows]
    sampling: RowSampling,  # per row
    num_nodes_per_row: Tensor,  # [rows]
    max_depth: int,
    accept_uniforms: Tensor,  # [num_nodes] float64 (root entries unused)
    sample_uniforms: Tensor,  # [rows] float64
) -> VerifyResult:
    """Accept the longest path the target agrees with (greedy) or samples (candidates tried in order, rejected
    siblings removed from p); emit one more token per row. Log-probs come from the path's target rows."""
    token_sampling, logprobs, use_triton = _process(target_logits, sampling, num_nodes_per_row)
    if sampling.all_greedy:
        op = tree_greedy_verify if use_triton else tree_greedy_verify_ref
        out, num_emitted, accepted = op(tree_token_ids, tree_parents, cu_num_nodes, target_logits, max_depth)
    else:
        probs = target_probs(target_logits, logprobs, token_sampling)
        op = tree_rejection_sample if use_triton else tree_rejection_sample_ref
        out, num_emitted, accepted = op(
            tree_token_ids, tree_parents, cu_num_nodes, probs, accept_uniforms, sample_uniforms, max_depth
        )
    rows = out.shape[0]
    starts = cu_num_nodes - num_nodes_per_row
    # emitted token j was drawn at the path's node j - 1 (the root for j = 0)
    path = torch.cat([torch.zeros(rows, 1, dtype=accepted.dtype, device=out.device), accepted.clamp(min=0)], dim=1)
    return VerifyResult(out, num_emitted, _emitted_logprobs(logprobs, starts[:, None] + path, out), accepted)


def verify_exact(
    target_logits: Tensor,  # [num_nodes, V], a row per node, each row's root first (or any rows: logit_rows)
    node_token_ids: Tensor,  # [num_nodes] (the root's entry is unused)
    layout: DraftLayout,
    sampling: RowSampling,  # per row
    race: RaceKeys,
    race_every_node: bool | None = None,
    logit_rows: Tensor | None = None,  # [num_nodes] the row of target_logits holding each node; None: row i
    static_walk: bool | None = None,  # walk every row at every depth (None: on a GPU; see `_walk_static`)
) -> VerifyResult:
    """Walk each row's tree from the root: draw the race's token at the current node (position: root position +
    depth); a child holding that token is accepted and the walk moves to it, else the row stops. The row emits the
    tokens drawn along its path (the accepted drafts, then the token drawn at the last node): the tokens plain
    decoding draws. Each draw is `race_logits` (its Triton kernel on a GPU, its reference elsewhere): it reads the
    nodes' rows of `target_logits` where they are, in the model's dtype, and returns the drawn tokens with their
    log-probabilities. On a GPU every node of every row is raced in one launch (`race_every_node`), and the walk only
    compares tokens (chains: in a few whole-tensor ops, `_walk_chain`). Elsewhere a large step races only the nodes on
    the path, one batched draw per depth; a small one (`race_every_node`; None: on a GPU, or when all nodes x vocabulary
    fit in `_SMALL_STEP_ELEMENTS`) every node in one draw, where the per-depth calls would cost more than the extra
    nodes. Both draw the same tokens."""
    device = target_logits.device
    num_nodes = layout.node_counts
    rows, width, max_depth = len(layout.num_nodes), layout.width, layout.max_depth
    fed = torch.arange(width)[None, :] < num_nodes[:, None]  # [rows, width] on the host: indexing by it never waits
    fed_cells = upload(torch.nonzero(fed.reshape(-1))[:, 0], device)  # [num_nodes] the fed cells of [rows, width]
    tokens = torch.full((rows * width,), -1, dtype=torch.long, device=device)
    tokens[fed_cells] = node_token_ids
    tokens = tokens.view(rows, width)
    parents = upload(layout.parents, device)  # [rows, width] row-local, -1 for the root and padding
    starts = upload(torch.cumsum(num_nodes, 0) - num_nodes, device)
    seeds, positions = upload(race.seeds, device), upload(race.positions, device)

    def draw(nodes: Tensor, node_rows: Tensor, node_depths: Tensor | int) -> tuple[Tensor, Tensor]:
        """The race's token at each of `nodes` (global indices; rows `node_rows`, depths `node_depths`) under its
        row's processing, and its float64 log-prob."""
        node_logit_rows = nodes if logit_rows is None else logit_rows[nodes]
        node_sampling = sampling.select(node_rows)
        keep = keep_thresholds(target_logits, node_sampling, node_logit_rows) if sampling.needs_filter else ()
        op = race_logits if target_logits.is_cuda else race_logits_ref
        return op(
            target_logits,
            node_logit_rows.contiguous(),
            node_sampling.temperature.contiguous(),
            seeds[node_rows].contiguous(),
            (positions[node_rows] + node_depths).contiguous(),
            *keep,
        )

    if race_every_node is None:
        race_every_node = target_logits.is_cuda or len(node_token_ids) * target_logits.shape[1] <= _SMALL_STEP_ELEMENTS
    if race_every_node:
        depths = layout.depths if layout.depths is not None else torch.arange(width)[None, :]
        node_rows = torch.arange(rows)[:, None].expand(rows, width)[fed]  # [num_nodes]
        node_depths = upload(depths.expand(rows, width)[fed], device)
        every = torch.arange(len(node_token_ids), device=device)
        all_drawn, all_drawn_logprobs = draw(every, upload(node_rows, device), node_depths)
    if race_every_node and layout.is_chain:  # every draw made: a chain's walk is a first mismatch, found at once
        return _walk_chain(all_drawn, all_drawn_logprobs, fed_cells, tokens)
    out = torch.full((rows, max_depth + 1), -1, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, max_depth + 1, dtype=torch.float64, device=device)
    accepted = torch.full((rows, max_depth), -1, dtype=torch.long, device=device)
    current = torch.zeros(rows, dtype=torch.long, device=device)
    if static_walk is None:
        static_walk = target_logits.is_cuda
    walk = _walk_static if static_walk else _walk_shrinking
    all_drawn = (all_drawn, all_drawn_logprobs) if race_every_node else None
    walk(draw, all_drawn, starts, parents, tokens, out, logprobs, accepted, current, max_depth)
    num_accepted = (accepted >= 0).sum(dim=1)
    return VerifyResult(out, num_accepted + 1, logprobs, accepted)


def _walk_chain(drawn: Tensor, drawn_logprobs: Tensor, fed_cells: Tensor, tokens: Tensor) -> VerifyResult:
    """The walk of chains whose every node was raced, as a few whole-tensor ops instead of a loop over depths (the
    draws scattered to their cells of `[rows, width]`, then `_walk_cells`)."""
    rows, width = tokens.shape
    cells = torch.full((rows * width,), -1, dtype=torch.long, device=tokens.device)
    cells[fed_cells] = drawn
    cell_logprobs = torch.zeros(rows * width, dtype=torch.float64, device=tokens.device)
    cell_logprobs[fed_cells] = drawn_logprobs.to(torch.float64)
    return _walk_cells(cells.view(rows, width), cell_logprobs.view(rows, width), tokens)


def _walk_cells(drawn: Tensor, drawn_logprobs: Tensor, tokens: Tensor) -> VerifyResult:
    """The walk of chains from the draws at every cell of `[rows, width]` (`drawn`, `drawn_logprobs` float64; a
    padded cell's draw is never emitted): the draft at depth d + 1 is accepted when it is the token raced at depth d
    and every draft before it was; a row emits the tokens raced at depths 0..accepted. The same tokens and log-probs
    as the walks (the draws are the same), in a number of launches that does not grow with K (a GPU's host time) and
    no shape that depends on the device's values (a graph may hold it)."""
    rows, width = tokens.shape
    # a padded cell holds token -1 and never matches a draw (draws are >= 0): a row stops at its last node
    match = tokens[:, 1:] == drawn[:, :-1]  # [rows, width - 1]
    num_accepted = torch.cumprod(match.long(), dim=1).sum(dim=1)
    depth = torch.arange(width, device=tokens.device)[None, :]
    emitted = depth <= num_accepted[:, None]
    out = torch.where(emitted, drawn, -1)
    logprobs = torch.where(emitted, drawn_logprobs, 0.0)
    accepted = torch.where(depth[:, 1:] <= num_accepted[:, None], depth[:, 1:], -1)
    return VerifyResult(out, num_accepted + 1, logprobs, accepted)


def verify_padded_chains(
    logits: Tensor,  # [rows * width, V]: cell (i, j) is row i's node j (its pending token, then its drafts)
    token_ids: Tensor,  # [rows, width] int64 the nodes' tokens, -1 in a row's cells past its last node
    temperatures: Tensor,  # [rows] float32/float64, 0 for a greedy row
    race: RaceKeys,  # [rows] each row's seed and the completion position of the token its root draws
) -> VerifyResult:
    """Exact verification of chains fed as one padded `[rows, width]` block, with nothing from the host: every cell
    is raced in one `race_logits` call (a padded cell races row 0's root, in bounds, and its draw is never
    emitted), then the chains are walked (`_walk_cells`). No shape depends on the device's values and nothing is
    read back, so a CUDA graph captures it after the forward (`rollout.engine.graph_runner`). A race is keyed by its
    own seed, position and logits only, so each row draws the tokens and log-probs `verify_exact` draws for it; a
    row of all padding (token -1 at its root) emits garbage, for the caller to drop."""
    rows, width = token_ids.shape
    device = logits.device
    fed = token_ids.reshape(-1) >= 0
    cells = torch.arange(rows * width, device=device)
    depth = torch.arange(width, device=device)[None, :]
    op = race_logits if logits.is_cuda else race_logits_ref
    drawn, drawn_logprobs = op(
        logits,
        torch.where(fed, cells, 0),
        temperatures[:, None].expand(rows, width).contiguous().view(-1),
        race.seeds[:, None].expand(rows, width).contiguous().view(-1),
        (race.positions[:, None] + depth).reshape(-1),
    )
    return _walk_cells(drawn.view(rows, width), drawn_logprobs.view(rows, width).to(torch.float64), token_ids)


def _walk_shrinking(draw, all_drawn, starts, parents, tokens, out, logprobs, accepted, current, max_depth) -> None:
    """The walk over the rows still walking only: fewer draws as rows stop, but each depth's row count is read
    from the device (the CPU's walk, where that read is free)."""
    walking = torch.arange(len(current), device=current.device)  # rows whose every draft so far was accepted
    for depth in range(max_depth + 1):
        node = current[walking]
        at = starts[walking] + node  # the walking rows' current nodes, as global indices
        drawn, drawn_logprobs = (all_drawn[0][at], all_drawn[1][at]) if all_drawn else draw(at, walking, depth)
        out[walking, depth] = drawn
        logprobs[walking, depth] = drawn_logprobs
        if depth == max_depth:
            break
        # siblings hold distinct tokens: at most one child of the node holds the drawn token
        child = (parents[walking] == node[:, None]) & (tokens[walking] == drawn[:, None])
        found = child.any(dim=1)
        walking, child_node = walking[found], child[found].long().argmax(dim=1)
        accepted[walking, depth] = child_node
        current[walking] = child_node
        if not len(walking):
            break


def _walk_static(draw, all_drawn, starts, parents, tokens, out, logprobs, accepted, current, max_depth) -> None:
    """The same walk over every row at every depth, rows that stopped masked out: no shape depends on the device's
    values, so nothing waits for it (a GPU's walk). It draws what the shrinking walk draws at every walking row,
    keyed the same way, so the tokens are the same."""
    rows = torch.arange(len(current), device=current.device)
    walking = torch.ones(len(current), dtype=torch.bool, device=current.device)
    for depth in range(max_depth + 1):
        at = starts + current
        drawn, drawn_logprobs = (all_drawn[0][at], all_drawn[1][at]) if all_drawn else draw(at, rows, depth)
        out[:, depth] = torch.where(walking, drawn, -1)
        logprobs[:, depth] = torch.where(walking, drawn_logprobs, 0.0)
        if depth == max_depth:
            break
        child = (parents == current[:, None]) & (tokens == drawn[:, None])
        walking = walking & child.any(dim=1)
        child_node = child.long().argmax(dim=1)
        accepted[:, depth] = torch.where(walking, child_node, -1)
        current = torch.where(walking, child_node, current)


_SMALL_STEP_ELEMENTS = 1 << 18  # nodes x vocabulary up to which exact verification races every node at once


def _process(target_logits: Tensor, sampling: RowSampling, target_rows_per_row: Tensor):
    """Per-row settings expanded to target rows, the processed log-probs, and whether the Triton kernels run
    (CUDA tensors) or their torch references (anything else)."""
    token_sampling = sampling.repeat(target_rows_per_row, target_logits.shape[0])
    return token_sampling, processed_logprobs(target_logits, token_sampling), target_logits.is_cuda


def _emitted_logprobs(logprobs: Tensor, index: Tensor, out: Tensor) -> Tensor:
    """`[rows, W]` float64 log-prob of each emitted token `out` under the target row `index` it was drawn from;
    0 after the emitted tokens (padding indices are clamped into range and masked)."""
    index = index.clamp(max=logprobs.shape[0] - 1)
    token_logprobs = logprobs[index, out.clamp(min=0)].to(torch.float64)
    return torch.where(out >= 0, token_logprobs, 0.0)
