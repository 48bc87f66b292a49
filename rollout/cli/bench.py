"""`rollout bench`: the same prompts through `model.generate` in padded batches (the baseline), the generator without
speculation, with static K values, and with the recipe's own speculation policy; one row each.

Rows (also written to `bench.json` in the output folder): `name`, `seconds` (wall time of the generate call),
`tokens` (completion tokens), `tokens_per_s`, `tokens_per_s_per_phase` ({prefill, bulk, tail}; null for the
baseline, which has no step trace), `mean_k`, `acceptance_rate`, `reward_mean`. Every row gets a short warm-up
first. Time with one torch thread and read the ratios: absolute times move with the machine's load.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from dataclasses import replace

import torch
from transformers import GenerationConfig

from rollout.cli.files import write_atomic
from rollout.cli.recipe import Recipe, method_name, spec_config
from rollout.cli.runs import (
    RecipeInputs,
    batch_size,
    header_warning,
    load_inputs,
    make_rollout,
    on_rank_device,
    recipe_spec,
)
from rollout.distributed import Ranks, group_costs, shard_groups
from rollout.engine.sampling import SamplingParams
from rollout.phases import PHASES
from rollout.rewards import RESERVED_REWARD_KWARGS, build_rewards, mean_reward, score
from specdec.config import SpecConfig
from specdec.policies import TablePolicy

BASELINE = "model.generate (padded)"


def run_bench(recipe: Recipe, log=None, ranks: Ranks | None = None, on_write=None) -> list[dict]:
    """Run every row of the benchmark on the recipe's prompts; write bench.json (again after each row, `complete`
    false until the last: a stopped benchmark keeps the rows that finished); return the rows. `log(line)` hears of
    each configuration as it starts and ends (the command line prints them); `on_write(path)` of each writing.

    Under `accelerate launch` (`ranks` of several processes) each rank runs every row on its shard of the prompt
    groups (`distributed.balance`), the ranks start each row together, and rank 0 combines them: tokens summed,
    seconds of the slowest rank, tokens/s = tokens / those seconds. Rank 0 writes bench.json; the others return []."""
    ranks = ranks or Ranks()
    log = log if log is not None and ranks.is_main else (lambda line: None)
    recipe = on_rank_device(recipe, ranks)
    # every prompt in one call, on each rank its own shard: `max_batch_size=auto` sizes the slots for that
    recipe = replace(recipe, rollout=replace(recipe.rollout, prompts_per_rollout=None))
    method = recipe.spec.method if recipe.spec.method not in (None, "none") else "ngram"
    configured = None if recipe.spec.method in (None, "none") else recipe.spec
    plain_recipe_k = configured is not None and configured.num_speculative_tokens_per_batch_size is None
    runs = [("no speculation", None)]
    for k in recipe.bench.static_k:
        is_recipe = plain_recipe_k and configured.num_speculative_tokens == k
        name = f"{method_name(method)} K={k}" + (" (recipe)" if is_recipe else "")
        changes = dict(method=method, num_speculative_tokens=k, num_speculative_tokens_per_batch_size=None)
        if configured is None:  # n-gram rows for a recipe without speculation: its spec.model drafts nothing
            changes["model"] = None
        runs.append((name, changes))
    if configured is not None and not (plain_recipe_k and configured.num_speculative_tokens in recipe.bench.static_k):
        runs.append((f"recipe ({_policy_name(configured)})", {}))
    for _, changes in runs[1:]:  # every row's settings refused here, before the model loads
        spec_config(recipe, **changes)
    inputs = load_inputs(recipe)
    too_wide = [k for k in recipe.bench.static_k if k >= inputs.max_seq_len]
    if too_wide:  # refused before any row runs
        raise ValueError(
            f"bench.static_k ({too_wide[0]}) must be below max_seq_len ({inputs.max_seq_len}): a step feeds K drafts "
            "after a row's last token"
        )
    if (warning := header_warning(recipe, inputs)) is not None:
        log(warning)
    num_prompts = len(inputs.prompt_ids)
    if ranks.distributed:
        costs = group_costs(inputs.prompt_ids, recipe.sampling.n, prior=recipe.sampling.max_new_tokens)
        shard = shard_groups(costs, ranks.world_size, recipe.distributed.balance)[ranks.rank]
        inputs = shard_inputs(inputs, shard)
    for _, changes in runs[1:]:  # what needs the loaded data (max_seq_len, max_batch_size=auto): before any row too
        _check_row_fits(recipe, inputs, spec_config(recipe, **changes))
    params = recipe.sampling
    rows = []
    workload = {
        "model": recipe.model.name,
        "dataset": recipe.data.dataset,
        "num_prompts": num_prompts,
        "num_processes": ranks.world_size,
        "n": recipe.sampling.n,
        "max_new_tokens": recipe.sampling.max_new_tokens,
        "temperature": recipe.sampling.temperature,
        "max_batch_size": batch_size(recipe, inputs, None),
        "threads": torch.get_num_threads(),
    }
    num_rows = len(runs) + bool(recipe.bench.baseline)

    def keep(rows: list[dict]) -> None:
        """bench.json with the rows finished so far (rank 0): a stopped benchmark keeps them, marked incomplete."""
        if ranks.is_main:
            out = pathlib.Path(recipe.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            report = {"workload": workload, "rows": rows, "complete": len(rows) == num_rows}
            write_atomic(out / "bench.json", json.dumps(report, indent=2) + "\n")
            if on_write is not None:
                on_write(out / "bench.json")

    if ranks.is_main:  # an earlier benchmark's (overwrite=true: preflight refused it otherwise) goes as the rows
        # begin (one whose new run fails on its inputs stays): a stop leaves this one's rows or none, not the old ones
        (pathlib.Path(recipe.output_dir) / "bench.json").unlink(missing_ok=True)

    if recipe.bench.baseline:
        log(f"[1] {BASELINE} ...")
        ranks.barrier()
        rows.append(combine_rows(ranks.gather(_baseline_row(recipe, inputs, params) if inputs.prompt_ids else None)))
        if ranks.is_main:  # said before it is written: a file that cannot be written loses no figure
            log(f"    {rows[-1]['seconds']:.1f} s, {rows[-1]['tokens_per_s']:.0f} tokens/s")
        keep(rows)
    for name, changes in runs:
        log(f"[{len(rows) + 1}] {name} ...")
        spec = recipe_spec(recipe, **changes) if changes is not None else None
        row = None
        if inputs.prompt_ids:  # a rank with no prompts (more ranks than groups) sits the rows out
            rollout = make_rollout(recipe, inputs, spec)  # (the inputs are this rank's shard already)
            rollout.generator.generate(inputs.prompt_ids[:2], replace(params, n=1, max_new_tokens=8))  # warm-up
            if rollout.generator.draft_history is not None:  # a first rollout's drafting has no history: forget it
                rollout.generator.draft_history.clear()
        ranks.barrier()
        if inputs.prompt_ids:
            batch = rollout(inputs.data, group_indices=inputs.group_indices)
            seconds = batch.summary["wall_seconds"]
            phases = batch.summary["phases"]
            row = {
                "name": name,
                "seconds": seconds,
                "tokens": batch.num_tokens,
                "tokens_per_s": batch.num_tokens / seconds if seconds > 0 else 0.0,
                "tokens_per_s_per_phase": {p: phases[p]["tokens_per_s"] for p in PHASES},
                "mean_k": batch.summary["total"]["mean_k"],
                "acceptance_rate": batch.summary["total"]["acceptance_rate"],
                "reward_mean": batch.summary["reward_mean"],
                "num_drafted": sum(s["num_drafted"] for s in batch.steps),
                "num_accepted": sum(s["num_accepted"] for s in batch.steps),
                "num_samples": len(batch),
            }
        rows.append(combine_rows(ranks.gather(row)))
        if ranks.is_main:
            row = rows[-1]
            log(f"    {row['seconds']:.1f} s, {row['tokens_per_s']:.0f} tokens/s, K {row['mean_k']:.2f}")
        keep(rows)
    return rows if ranks.is_main else []


def shard_inputs(inputs: RecipeInputs, shard: list[int]) -> RecipeInputs:
    """The recipe's inputs cut to the prompt groups `shard` (their indices in the data); `group_indices` keeps each
    group's index, which seeds its samples."""
    return dataclasses.replace(
        inputs,
        data=inputs.data.select(shard),
        prompts=[inputs.prompts[i] for i in shard],
        prompt_ids=[inputs.prompt_ids[i] for i in shard],
        group_indices=list(shard),
    )


def combine_rows(rows: list[dict | None] | None) -> dict | None:
    """One benchmark row from every rank's (None on all but rank 0; a rank without prompts gives None): tokens
    summed, the slowest rank's seconds, tokens/s of the whole, per-phase tokens/s summed, acceptance over every
    draft, K and reward averaged over the ranks' samples."""
    if rows is None:
        return None
    rows = [r for r in rows if r is not None]
    if len(rows) == 1:
        return {k: v for k, v in rows[0].items() if k not in ("num_drafted", "num_accepted", "num_samples")}
    seconds = max(r["seconds"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    weights = [r.get("num_samples", 1) for r in rows]
    drafted = sum(r.get("num_drafted", 0) for r in rows)
    phases = None
    if rows[0]["tokens_per_s_per_phase"] is not None:
        phases = {p: sum(r["tokens_per_s_per_phase"][p] for r in rows) for p in PHASES}
    return {
        "name": rows[0]["name"],
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tokens_per_s_per_phase": phases,
        "mean_k": sum(r["mean_k"] * w for r, w in zip(rows, weights)) / sum(weights),
        "acceptance_rate": sum(r.get("num_accepted", 0) for r in rows) / drafted if drafted else 0.0,
        "reward_mean": _weighted_mean([(r["reward_mean"], w) for r, w in zip(rows, weights)]),
        "rank_seconds": [r["seconds"] for r in rows],
    }


def _weighted_mean(pairs: list[tuple[float | None, float]]) -> float | None:
    """The weighted mean of the values that are not None (a rank whose rewards were all null); None if none is."""
    kept = [(value, weight) for value, weight in pairs if value is not None]
    weight = sum(w for _, w in kept)
    return sum(v * w for v, w in kept) / weight if weight else None


def _policy_name(spec) -> str:
    table = spec.num_speculative_tokens_per_batch_size
    if table is None:
        return f"{method_name(spec.method)} K={spec.num_speculative_tokens}"
    return f"{method_name(spec.method)} {'auto' if table == 'auto' else 'table'} K<={spec.num_speculative_tokens}"


def _baseline_row(recipe: Recipe, inputs: RecipeInputs, params: SamplingParams) -> dict:
    """`model.generate` over left-padded batches of `max_batch_size` rows, each prompt repeated n times: the work the
    generator rows do (their stop tokens, `ignore_eos`, each completion's cap at `max_seq_len`, the recipe's sampling
    and nothing of the model's own `generation_config`, such as a repetition penalty, which the generator does not
    apply)."""
    model, tokenizer = inputs.model, inputs.tokenizer
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    stop_ids = (set() if params.ignore_eos else eos_ids) | set(params.stop_token_ids or [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids | stop_ids), 0)
    prompts = [p for p in inputs.prompt_ids for _ in range(params.n)]
    caps = [min(params.max_new_tokens, inputs.max_seq_len - len(p)) for p in prompts]  # the generator's
    size = batch_size(recipe, inputs, None)
    sampling = dict(do_sample=params.temperature > 0, pad_token_id=pad, eos_token_id=sorted(stop_ids) or None)
    if params.temperature > 0:
        # top_k 0 is "off" for transformers too; None would take its default of 50 and sample another distribution
        sampling.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)

    def generate(batch: list[list[int]], batch_caps: list[int]) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(batch_caps), **sampling)
        return [_cut(row, stop_ids)[:cap] for row, cap in zip(out[:, width:].tolist(), batch_caps)]

    own, model.generation_config = model.generation_config, GenerationConfig()  # transformers' defaults under ours
    try:
        generate(prompts[:2], [8, 8])  # warm-up
        torch.manual_seed(recipe.sampling.seed)
        start = time.perf_counter()
        completions = [
            c for i in range(0, len(prompts), size) for c in generate(prompts[i : i + size], caps[i : i + size])
        ]
        seconds = time.perf_counter() - start
    finally:
        model.generation_config = own
    tokens = sum(len(c) for c in completions)
    reward = _baseline_reward(recipe, inputs, completions, stop_ids)
    return {
        "name": BASELINE,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tokens_per_s_per_phase": None,
        "mean_k": 0.0,
        "acceptance_rate": 0.0,
        "reward_mean": reward,
        "num_samples": len(completions),
    }


def _cut(row: list[int], stop_ids: set[int]) -> list[int]:
    """A completion up to and including its first stop token (the padding after it is not output)."""
    for i, token in enumerate(row):
        if token in stop_ids:
            return row[: i + 1]
    return row


def _check_row_fits(recipe: Recipe, inputs: RecipeInputs, spec: SpecConfig) -> None:
    """Refuse a row whose generator would refuse its K or its table at the sizes the data gives (rows run one after
    another: found at its own row, the rows before it had run for nothing)."""
    spec.check_room(inputs.max_seq_len, prefix="spec.")
    table = spec.num_speculative_tokens_per_batch_size
    if isinstance(table, (list, tuple)) and inputs.prompt_ids:  # (a rank without a group builds no generator)
        try:
            TablePolicy(table, spec.num_speculative_tokens, batch_size(recipe, inputs, spec))
        except ValueError as err:
            raise ValueError(f"spec: {err}") from None


def _baseline_reward(
    recipe: Recipe, inputs: RecipeInputs, completions: list[list[int]], stop_ids: set[int]
) -> float | None:
    """The mean reward of the baseline's completions, with the keyword arguments the rollout loop passes."""
    n = recipe.sampling.n
    rows = list(inputs.data)
    texts = inputs.tokenizer.batch_decode(completions, skip_special_tokens=True)
    columns = {
        name: [rows[i // n][name] for i in range(len(texts))] for name in rows[0] if name not in RESERVED_REWARD_KWARGS
    }
    columns["prompts"] = [inputs.prompts[i // n] for i in range(len(texts))]
    columns["completion_ids"] = completions
    columns["finish_reasons"] = ["stop" if c and c[-1] in stop_ids else "length" for c in completions]
    terms = build_rewards([(r.name, r.weight) for r in recipe.rewards])
    total, _ = score(terms, texts, columns, non_finite_as_null=recipe.rollout.non_finite_rewards_as_null)
    return mean_reward(total)


def format_bench(rows: list[dict]) -> str:
    """The benchmark table, with speed-ups against the first row."""
    base = rows[0]["tokens_per_s"] if rows else 0.0
    header = f"{'name':32s}{'seconds':>9s}{'tokens':>8s}{'tokens/s':>10s}{'speed-up':>9s}"
    header += "".join(f"{p + '/s':>10s}" for p in PHASES) + f"{'K':>6s}{'accept':>8s}{'reward':>8s}"
    lines = [header]
    for row in rows:
        per_phase = row["tokens_per_s_per_phase"]
        cells = "".join(f"{per_phase[p]:10.1f}" if per_phase else f"{'-':>10s}" for p in PHASES)
        speedup = row["tokens_per_s"] / base if base else 0.0
        reward = f"{row['reward_mean']:8.3f}" if row["reward_mean"] is not None else f"{'-':>8s}"  # all null
        lines.append(
            f"{row['name']:32s}{row['seconds']:9.2f}{row['tokens']:8d}{row['tokens_per_s']:10.1f}{speedup:8.2f}x"
            f"{cells} {row['mean_k']:5.2f}{row['acceptance_rate']:8.3f}{reward}"
        )
    return "\n".join(lines)
