"""Running a recipe: load what it names (model, data, rewards), build the rollout loop, record the run."""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass

import torch

from rollout.cli.files import iter_jsonl
from rollout.cli.progress import Progress
from rollout.cli.recipe import Recipe, recipe_dict, spec_config
from rollout.cli.sources import check_draft_tokenizer, draft_model_spec, load_dataset, load_model
from rollout.cli.tracking import RunTracker, stop_reason
from rollout.distributed import Ranks
from rollout.engine.memory_plan import fitting_batch_size
from rollout.engine.requests import check_prompts, check_stop_ids, length_cap_note
from rollout.loop import Rollout
from rollout.prompts import PromptFormatter, check_prompt_column
from rollout.rewards import build_rewards
from specdec.config import SpecConfig


@dataclass
class RecipeInputs:
    """What a recipe loads once: shared by every generator a run or a benchmark builds."""

    model: torch.nn.Module
    tokenizer: object
    data: object  # datasets.Dataset
    prompts: list[str]  # the formatted prompts
    prompt_ids: list[list[int]]  # their token ids
    max_seq_len: int
    group_indices: list[int] | None = None  # each prompt's index in the whole data when these are a rank's share


def load_inputs(recipe: Recipe) -> RecipeInputs:
    """Check the rewards, load the data (checking its prompt column), then the model; format the prompts.

    Cheap checks come first so that a bad recipe fails before a model loads.
    """
    build_rewards([(r.name, r.weight) for r in recipe.rewards])
    d = recipe.data
    data = load_dataset(d.dataset, d.split, d.config_name, d.num_prompts)
    if d.template is None:  # (a template names its own columns)
        check_prompt_column(data.column_names, d.prompt_column)
    if len(data) == 0:
        raise ValueError(f"data.dataset {d.dataset!r} split {d.split!r} has no rows")
    torch.manual_seed(recipe.sampling.seed)
    model, tokenizer = load_model(recipe.model.name, recipe.model.dtype, recipe.model.device)
    if "draft_model" in _methods(recipe.spec.method):
        check_draft_tokenizer(recipe.spec.model, tokenizer)
    formatter = PromptFormatter(tokenizer, d.prompt_column, d.template, d.chat_template, d.system_prompt)
    prompts, prompt_ids = formatter(list(data))
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    max_seq_len = recipe.rollout.max_seq_len
    if max_seq_len is None:
        max_seq_len = len(prompt_ids[longest]) + recipe.sampling.max_new_tokens
    elif len(prompt_ids[longest]) >= max_seq_len:  # refused here, before the output folder is made
        raise ValueError(
            f"rollout.max_seq_len ({max_seq_len}) leaves no room for a completion after prompt {longest} "
            f"({len(prompt_ids[longest])} tokens): raise it above {len(prompt_ids[longest])} (e.g. "
            f"{len(prompt_ids[longest]) + recipe.sampling.max_new_tokens}), or null to size it from the prompts"
        )
    # what the generator would refuse at its first call, refused before the output folder is made
    vocab_size = model.get_output_embeddings().weight.shape[0]
    check_prompts(prompt_ids, vocab_size, max_seq_len)
    check_stop_ids(recipe.sampling.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    return RecipeInputs(model, tokenizer, data, prompts, prompt_ids, max_seq_len)


def header_warning(recipe: Recipe, inputs: RecipeInputs) -> str | None:
    """The header's warnings, a line each, or None: rollout.max_seq_len cuts completions shorter than
    sampling.max_new_tokens; the data holds fewer rows than data.num_prompts asks for."""
    lines = []
    wanted = [recipe.sampling.max_new_tokens] * len(inputs.prompt_ids)
    note = length_cap_note(inputs.prompt_ids, wanted, inputs.max_seq_len)
    if note is not None:
        lines.append(f"warning: {note} (sampling.max_new_tokens, rollout.max_seq_len)")
    asked = recipe.data.num_prompts
    if asked is not None and len(inputs.prompt_ids) < asked:
        lines.append(
            f"warning: data.num_prompts is {asked} but the data holds {len(inputs.prompt_ids)} rows: using them all"
        )
    return "\n".join(lines) or None


def on_rank_device(recipe: Recipe, ranks: Ranks) -> Recipe:
    """The recipe with `model.device` this rank's own (`Ranks.device`: "cuda" becomes cuda:LOCAL_RANK)."""
    device = ranks.device(recipe.model.device)
    return dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, device=device))


def kept_responses(tracker: RunTracker, recipe: Recipe, inputs: RecipeInputs) -> tuple[list, list]:
    """(prompt ids, completion ids) of the samples a resumed run keeps on disk: the drafting history starts there."""
    records = getattr(tracker, "kept_records", [])
    return [inputs.prompt_ids[_data_row(r, recipe, inputs)] for r in records], [r["completion_ids"] for r in records]


def _data_row(record: dict, recipe: Recipe, inputs: RecipeInputs) -> int:
    """The data row a `rollouts.jsonl` record was sampled from: rollouts take the next `prompts_per_rollout` prompts,
    cycling."""
    per_rollout = recipe.rollout.prompts_per_rollout or len(inputs.prompts)
    return (record["rollout"] * per_rollout + record["prompt_index"]) % len(inputs.prompts)


def check_same_prompts(recipe: Recipe, inputs: RecipeInputs) -> None:
    """Refuse to resume a run whose samples on disk were made from other prompts than the data gives now: a data file
    changed behind the same path (the recipe's text, which resume compares, is the same), so the run would hold
    samples of both."""
    for r in iter_jsonl(pathlib.Path(recipe.output_dir) / "rollouts.jsonl"):
        row = _data_row(r, recipe, inputs)
        if "prompt" in r and r["prompt"] != inputs.prompts[row]:
            raise ValueError(
                f"resume=true but the data changed since the run in {recipe.output_dir} began: rollout "
                f"{r['rollout']}'s group {r['prompt_index']} was sampled from {r['prompt']!r:.60} and the data now "
                f"gives {inputs.prompts[row]!r:.60}: resume with the same data, or start afresh with overwrite=true"
            )


def recipe_spec(recipe: Recipe, **changes) -> SpecConfig | None:
    """The recipe's SpecConfig (with `changes`), a hub draft model loaded here."""
    method = changes.get("method", recipe.spec.method)
    methods = _methods(method)
    model = changes.get("model", recipe.spec.model)
    draft = draft_model_spec(model, recipe.model.dtype, recipe.model.device) if "draft_model" in methods else None
    return spec_config(recipe, draft_model=draft if not isinstance(draft, str) else None, **changes)


def _methods(method) -> list[str]:
    """A recipe's `spec.method` (a name, a list of names or null) as a list."""
    return [method] if isinstance(method, str) else list(method or [])


def batch_size(recipe: Recipe, inputs: RecipeInputs, spec: SpecConfig | None, num_ranks: int = 1) -> int:
    """rollout.max_batch_size; for auto, every sequence of one rollout (prompts per rollout x n, split over
    `num_ranks` processes) at once, lowered to the largest size whose KV caches fit the device's free memory."""
    size = recipe.rollout.max_batch_size
    if size != "auto":
        return size
    num_prompts = min(recipe.rollout.prompts_per_rollout or len(inputs.prompt_ids), len(inputs.prompt_ids))
    num_prompts = -(-num_prompts // num_ranks)
    return fitting_batch_size(inputs.model, spec, inputs.max_seq_len, num_prompts * recipe.sampling.n)


def make_rollout(recipe: Recipe, inputs: RecipeInputs, spec: SpecConfig | None, num_ranks: int = 1) -> Rollout:
    """The rollout loop over the loaded model, with `spec` for speculation (None: plain decoding)."""
    d = recipe.data
    return Rollout(
        inputs.model,
        inputs.tokenizer,
        rewards=[(r.name, r.weight) for r in recipe.rewards],
        sampling=recipe.sampling,
        spec=spec,
        max_batch_size=batch_size(recipe, inputs, spec, num_ranks),
        max_seq_len=inputs.max_seq_len,
        prompt_column=d.prompt_column,
        template=d.template,
        chat_template=d.chat_template,
        system_prompt=d.system_prompt,
        tail_fraction=recipe.rollout.tail_fraction,
        non_finite_rewards_as_null=recipe.rollout.non_finite_rewards_as_null,
        **engine_options(recipe),
    )


def engine_options(recipe: Recipe) -> dict:
    """The generator's engine settings from the recipe's rollout section (`Generator`'s keyword arguments)."""
    r = recipe.rollout
    return dict(
        kv_layout=r.kv_layout, cuda_graphs=r.cuda_graphs, async_scheduling=r.async_scheduling,
        compile_forward=r.compile_forward,
    )  # fmt: skip


def run_recipe(recipe: Recipe) -> tuple[dict, RunTracker]:
    """Run the recipe's rollouts (`rollout.num_rollouts`, each over the next `rollout.prompts_per_rollout` prompts,
    cycling, with seed `seed + index`) on one generator, streaming each finished group and each step to the output
    folder; returns (summary, tracker). With `resume`, the groups already on disk are skipped (a prompt's samples
    are seeded by its index, so the rest come out as they would have). Whatever stops the run (an error, Ctrl-C,
    SIGTERM), the folder keeps what finished and a summary marked incomplete, and the exception goes on up."""
    inputs = load_inputs(recipe)
    rollout = make_rollout(recipe, inputs, recipe_spec(recipe))
    print(kv_cache_header(rollout.generator, inputs.max_seq_len), flush=True)
    if (warning := header_warning(recipe, inputs)) is not None:
        print(warning, flush=True)
    log = recipe.logging
    tracker = make_tracker(recipe, inputs)
    rows = list(inputs.data)
    per_rollout = recipe.rollout.prompts_per_rollout or len(rows)
    history = rollout.generator.draft_history
    if recipe.resume and history is not None and tracker.kept_records:  # the drafting history of what is on disk
        history.add_responses(*kept_responses(tracker, recipe, inputs))
    progress = Progress(enabled=None if log.progress else False)
    index = None
    try:
        for index in range(recipe.rollout.num_rollouts):
            first = index * per_rollout
            todo = [j for j in range(per_rollout) if j not in tracker.done.get(index, set())]
            if not todo:  # all on disk already (resume)
                tracker.num_rollouts = max(tracker.num_rollouts, index + 1)
                continue

            def on_step(step, finished, total, index=index):
                tracker.log_step(step, index)
                progress(step, finished, total)

            batch = rollout(
                [rows[(first + j) % len(rows)] for j in todo],
                recipe.sampling.seed + index,
                on_step,
                on_group=lambda group, index=index: tracker.log_group(group, index),
                group_indices=todo,
            )
            tracker.log_rollout(batch, index)
            progress.close()  # each rollout its own line: its tokens/s over its own steps and clock
    except BaseException as err:
        progress.close()
        try:
            tracker.close_if_whole(index, per_rollout)  # stopped after its last group was written
        finally:
            tracker.finish(complete=False, reason=stop_reason(err))
        raise
    progress.close()
    return tracker.finish(), tracker


def kv_cache_header(gen, max_seq_len: int) -> str:
    """The run header's KV-cache line: the planned bytes, and how they are laid out."""
    size = f"KV cache {gen.kv_cache_bytes / 2**20:.1f} MiB"
    if gen.runner.paged:
        cache, graphs = gen.runner.cache, [g for g in gen.graph_runners if g.capture]
        size = f"{size} (paged: {cache.max_blocks} blocks of {cache.block_size} tokens, {gen.max_batch_size} slots)"
        errors = [g.error for g in graphs if g.error is not None]
        if errors:
            size += f"; CUDA graphs off: {errors[0]}"
        elif graphs:
            memory = sum(g.memory_bytes for g in graphs) / 2**20
            size += f"; CUDA graphs: {sum(len(g.graphs) for g in graphs)} captured in {gen.graph_seconds:.1f} s, "
            size += f"{memory:.0f} MiB"
            compiled = [g.compiled for g in graphs if g.compiled is not None]
            if compiled:  # the decoder compiled by torch.compile, or why not
                failed = next((c.error for c in compiled if c.error), None)
                seconds = sum(c.seconds for c in compiled)
                size += f", compile failed: {failed}" if failed else f", compiled in {seconds:.1f} s"
        return size
    return f"{size} ({gen.max_batch_size} slots x {max_seq_len} tokens)"


def make_tracker(recipe: Recipe, inputs: RecipeInputs) -> RunTracker:
    """The run's output folder and W&B run, as the recipe's logging section and output settings say (with `resume`,
    once the samples on disk are checked to come from the prompts `inputs` gives)."""
    if recipe.resume:
        check_same_prompts(recipe, inputs)
    log = recipe.logging
    return RunTracker(
        recipe.output_dir,
        recipe_dict(recipe),
        wandb_mode=log.wandb_mode,
        project=log.project,
        run_name=log.run_name,
        num_table_rows=log.num_table_rows,
        plot=log.plot,
        overwrite=recipe.overwrite,
        resume=recipe.resume,
        group_size=recipe.sampling.n,
    )
