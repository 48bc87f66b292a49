"""Recipes: YAML files loaded into typed dataclasses (OmegaConf structured configs), with `key.sub=value` overrides.

Unknown keys and values of the wrong type are errors naming the key path; values are checked in `__post_init__`
and by building the generator's own settings (`SamplingParams`, `SpecConfig`, the K table) before any model loads.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import pathlib
import threading
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import OmegaConf, StringNode
from omegaconf.errors import OmegaConfBaseException

from rollout.distributed import BALANCES
from rollout.engine.sampling import SamplingParams
from specdec.config import SpecConfig, SpecDecodeParams
from specdec.policies import TablePolicy

# TRL's GRPO losses (GRPOConfig.loss_type, TRL 1.16) and transformers' schedulers (SchedulerType): checked when the
# recipe loads, since TRL checks the loss only when it first computes it, after a whole rollout (tests/test_preflight.py
# compares both lists with the installed TRL and transformers)
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
LR_SCHEDULER_TYPES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
)

# transformers' schedulers that `rollout train` cannot run, and why (they failed once the model had loaded)
_NO_KWARGS = "needs lr_scheduler_kwargs, which a recipe does not pass"
UNUSABLE_SCHEDULERS = {
    "reduce_lr_on_plateau": "steps on an evaluation metric, and rollout train runs no evaluation",
    "greedy": "steps on an evaluation metric, and rollout train runs no evaluation",
    "cosine_with_min_lr": f"{_NO_KWARGS} (min_lr or min_lr_rate)",
    "cosine_warmup_with_min_lr": f"{_NO_KWARGS} (min_lr or min_lr_rate)",
    "warmup_stable_decay": f"{_NO_KWARGS} (num_decay_steps)",
}

WANDB_MODES = ("offline", "online", "disabled")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class ModelRecipe:
    """The `model` section: the policy to load.

    Attributes:
        name: a shipped short name (tiny-target, tiny-draft), a local folder, or a hub id org/name.
        dtype: float32 | float16 | bfloat16 | float64.
        device: cpu | cuda | cuda:N | auto (cuda when there is a GPU).
    """

    name: str = "tiny-target"
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        dtypes = ("float32", "float16", "bfloat16", "float64")
        _require(self.dtype in dtypes, f"model.dtype ({self.dtype!r}) must be one of {', '.join(dtypes)}")


@dataclass
class DataRecipe:
    """The `data` section: where the prompts come from and how they are formatted.

    Attributes:
        dataset: embedded "arithmetic", a .json/.jsonl/.csv/.parquet file, a saved dataset, a hub id.
        split: split to read (arithmetic: train | eval).
        config_name: hub dataset config, e.g. "main" for openai/gsm8k.
        prompt_column: the column holding the prompt (text, or chat messages with chat_template).
        template: str.format template over the row's columns; None uses the prompt column as is.
        chat_template: wrap the prompt as a user message in the tokenizer's chat template.
        system_prompt: system message for chat_template.
        num_prompts: first rows to use; None = all (the embedded arithmetic task, which is generated: 1000).
    """

    dataset: str = "arithmetic"
    split: str = "eval"
    config_name: str | None = None
    prompt_column: str = "prompt"
    template: str | None = None
    chat_template: bool = False
    system_prompt: str | None = None
    num_prompts: int | None = 32

    def __post_init__(self) -> None:
        n = self.num_prompts
        _require(n is None or n >= 1, f"data.num_prompts ({n}) must be >= 1, or null for every row")
        _require(
            self.system_prompt is None or self.chat_template,
            "data.system_prompt is a chat template's system message: set data.chat_template=true too (without it "
            "the system prompt is left out), or drop data.system_prompt",
        )


@dataclass
class RolloutRecipe:
    """The `rollout` section: the rollout loop and its generator.

    Attributes:
        max_batch_size: generator slots: sequences decoded at once; auto = a whole rollout, lowered to fit.
        max_seq_len: prompt + completion cap; null = longest prompt + sampling.max_new_tokens.
        tail_fraction: decode steps with batch < tail_fraction * peak decode batch are the tail phase.
        num_rollouts: rollout run: rollouts made one after another (drafting history grows between them).
        prompts_per_rollout: prompts per rollout, taken in order and cycled; null = all of them.
        non_finite_rewards_as_null: a NaN/inf reward: false = stop, naming it; true = record it as null.
        kv_layout: the KV cache: auto = paged on a GPU, slots on a CPU; paged = blocks that follow the tokens in
            flight, read by the attention function registered with transformers; slots = a dense cache and 4D masks.
        cuda_graphs: auto = decode steps replay CUDA graphs with the paged layout on a GPU; true or false.
        async_scheduling: auto = the host one step ahead of the device on a GPU, on the steps that draft nothing; true
            or false.
        compile_forward: true = the CUDA graphs capture the decoder compiled by torch.compile (needs the graphs).
    """

    max_batch_size: Any = 64
    max_seq_len: int | None = None
    tail_fraction: float = 0.25
    num_rollouts: int = 1
    prompts_per_rollout: int | None = None
    non_finite_rewards_as_null: bool = False
    kv_layout: str = "auto"
    cuda_graphs: Any = "auto"
    async_scheduling: Any = "auto"
    compile_forward: bool = False

    def __post_init__(self) -> None:
        _require(self.num_rollouts >= 1, f"rollout.num_rollouts ({self.num_rollouts}) must be >= 1")
        _require(
            self.kv_layout in ("auto", "paged", "slots"),
            f"rollout.kv_layout ({self.kv_layout!r}) must be one of auto, paged, slots",
        )
        _require(
            isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto",  # (1 == True to `in`)
            f"rollout.cuda_graphs ({self.cuda_graphs!r}) must be auto, true or false",
        )
        _require(
            isinstance(self.async_scheduling, bool) or self.async_scheduling == "auto",
            f"rollout.async_scheduling ({self.async_scheduling!r}) must be auto, true or false",
        )
        p = self.prompts_per_rollout
        _require(p is None or p >= 1, f"rollout.prompts_per_rollout ({p}) must be >= 1, or null for all prompts")
        m = self.max_seq_len
        _require(
            m is None or m >= 2,
            f"rollout.max_seq_len ({m}) must be >= 2 (a prompt token and a completion token), or null to size it "
            "from the longest prompt and sampling.max_new_tokens",
        )
        size = self.max_batch_size
        _require(
            size == "auto" or (isinstance(size, int) and not isinstance(size, bool) and size >= 1),
            f"rollout.max_batch_size ({size!r}) must be an integer >= 1, or auto (every sequence of a rollout at "
            "once, lowered to what the free memory holds)",
        )
        _require(
            0.0 <= self.tail_fraction <= 1.0,
            f"rollout.tail_fraction ({self.tail_fraction}) must be in [0, 1], e.g. 0.25 (0 = no tail phase)",
        )


@dataclass
class TrainRecipe:
    """`rollout train`: GRPO through TRL's GRPOTrainer, generating with this library (`rollout.integrations.trl`).

    Attributes:
        steps: optimiser steps; null = `epochs` passes over the data.
        epochs: passes over the data when steps is null.
        prompts_per_step: prompts per optimiser step (each sampled sampling.n times: one GRPO group each).
        learning_rate: the optimiser learning rate.
        lr_scheduler_type: transformers' schedulers: constant | linear | cosine | ...
        warmup_steps: linear warm-up steps; below 1, a fraction of all steps.
        weight_decay: AdamW weight decay.
        max_grad_norm: gradient clipping norm.
        beta: KL coefficient against the initial model; 0 = no reference model.
        loss_type: TRL's GRPO loss: grpo | dr_grpo | dapo | bnpo | ...
        gradient_checkpointing: trades compute for memory in the training forward.
        save_model: write the trained model and tokenizer to output_dir/model.
        save_steps: every this many optimiser steps, a checkpoint (model, optimiser, scheduler, RNG states) to
            output_dir/trainer/checkpoint-N, the last one kept; `resume=true` continues a stopped training from it.
            0 = none.
    """

    steps: int | None = 30
    epochs: float = 1.0
    prompts_per_step: int = 8
    learning_rate: float = 1e-5
    lr_scheduler_type: str = "constant"
    warmup_steps: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    beta: float = 0.0
    loss_type: str = "dapo"
    gradient_checkpointing: bool = False
    save_model: bool = False
    save_steps: int = 0

    def __post_init__(self) -> None:
        _require(self.steps is None or self.steps >= 1, f"train.steps ({self.steps}) must be >= 1, or null for epochs")
        _require(self.save_steps >= 0, f"train.save_steps ({self.save_steps}) must be >= 0 (0 = no checkpoints)")
        _require(self.epochs > 0, f"train.epochs ({self.epochs}) must be > 0")
        _require(self.prompts_per_step >= 1, f"train.prompts_per_step ({self.prompts_per_step}) must be >= 1")
        _require(self.learning_rate > 0, f"train.learning_rate ({self.learning_rate}) must be > 0, e.g. 1e-5")
        _require(self.warmup_steps >= 0, f"train.warmup_steps ({self.warmup_steps}) must be >= 0")
        _require(
            self.warmup_steps < 1 or float(self.warmup_steps).is_integer(),
            f"train.warmup_steps ({self.warmup_steps}) must be a whole number of steps, or below 1 for a fraction of "
            "all steps",
        )
        _require(self.beta >= 0, f"train.beta ({self.beta}) must be >= 0 (0 = no KL term)")
        _require(self.max_grad_norm > 0, f"train.max_grad_norm ({self.max_grad_norm}) must be > 0")
        _require(
            self.loss_type in TRL_LOSS_TYPES,
            f"train.loss_type ({self.loss_type!r}) must be one of TRL's GRPO losses: {', '.join(TRL_LOSS_TYPES)}",
        )
        usable = [name for name in LR_SCHEDULER_TYPES if name not in UNUSABLE_SCHEDULERS]
        _require(
            self.lr_scheduler_type in LR_SCHEDULER_TYPES,
            f"train.lr_scheduler_type ({self.lr_scheduler_type!r}) must be one of {', '.join(usable)}",
        )
        _require(
            self.lr_scheduler_type not in UNUSABLE_SCHEDULERS,
            f"train.lr_scheduler_type {self.lr_scheduler_type} {UNUSABLE_SCHEDULERS.get(self.lr_scheduler_type)}: "
            f"choose one of {', '.join(usable)}",
        )
        _require(  # (transformers' constant schedule takes no warm-up: it was left out without a word)
            self.warmup_steps == 0 or self.lr_scheduler_type != "constant",
            f"train.warmup_steps ({self.warmup_steps}) does nothing with train.lr_scheduler_type constant: use "
            "constant_with_warmup for a warm-up then a constant rate, or leave warmup_steps at 0",
        )


@dataclass
class RewardRecipe:
    """One entry of the `rewards` list.

    Attributes:
        name: a built-in reward (arithmetic, gsm8k) or a module:function import path.
        weight: the total reward is the weighted sum of all rewards.
    """

    name: str = "arithmetic"
    weight: float = 1.0


@dataclass
class LoggingRecipe:
    """The `logging` section: Weights & Biases, the progress line and the plot.

    Attributes:
        wandb_mode: offline | online | disabled; the WANDB_MODE environment variable wins when set.
        project: W&B project.
        run_name: W&B run name; null lets W&B pick one.
        num_table_rows: samples in the W&B table of completions and rewards.
        progress: live progress line on stderr (when it is a terminal).
        plot: write the PNG plot at the end.
    """

    wandb_mode: str = "offline"
    project: str = "rollout"
    run_name: str | None = None
    num_table_rows: int = 32
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        _require(
            self.wandb_mode in WANDB_MODES,
            f"logging.wandb_mode ({self.wandb_mode!r}) must be one of {', '.join(WANDB_MODES)}",
        )
        _require(
            self.num_table_rows >= 0,
            f"logging.num_table_rows ({self.num_table_rows}) must be >= 0 (0 = no table of completions)",
        )


@dataclass
class BenchRecipe:
    """The `bench` section: what `rollout bench` runs besides the recipe's own policy.

    Attributes:
        static_k: K values run as static-K rows.
        baseline: include model.generate in padded batches as the baseline row.
    """

    static_k: list[int] = field(default_factory=lambda: [1, 3, 5])
    baseline: bool = True

    def __post_init__(self) -> None:
        _require(all(k >= 1 for k in self.static_k), f"bench.static_k ({self.static_k}) must hold K values >= 1")


@dataclass
class DistributedRecipe:
    """Under `accelerate launch --num_processes N`: how the ranks split and share the work (one process: unused).

    Attributes:
        balance: work: shards of equal expected tokens (prompt + predicted completion); count: equal counts.
        share_history: all-gather finished responses once per rollout into every rank's suffix history.
        history_scope: all: every response; next: only those to the prompts the rank generates next.
    """

    balance: str = "work"
    share_history: bool = True
    history_scope: str = "all"

    def __post_init__(self) -> None:
        _require(
            self.balance in BALANCES, f"distributed.balance ({self.balance!r}) must be one of {', '.join(BALANCES)}"
        )
        _require(
            self.history_scope in ("all", "next"),
            f"distributed.history_scope ({self.history_scope!r}) must be all (every response) or next (only those "
            "to the prompts a rank generates next)",
        )


@dataclass
class Recipe:
    """A whole recipe: the sections of a YAML file and the top-level keys.

    Attributes:
        model: the policy: which model, in which dtype, on which device.
        data: the prompts: dataset, split, prompt column, template.
        sampling: the library's own `SamplingParams` (n = the GRPO group size); seed 0 unless set, so that a
            recipe's rollouts reproduce and resume.
        spec: the library's own `SpecConfig` (vLLM's field names); method null (the default here) = no speculation.
        rollout: the rollout loop: generator slots, sequence length, phases, several rollouts.
        rewards: the rewards, summed with their weights.
        logging: W&B, progress line and plot.
        bench: `rollout bench`: the static-K rows and the baseline.
        train: `rollout train`: GRPO through TRL.
        distributed: under `accelerate launch`: sharding and history sharing.
        output_dir: where the run writes rollouts.jsonl, steps.jsonl, summary.json, ...
        overwrite: replace a run already in output_dir (its files removed first), or write among other files there;
            false: refuse a folder that holds either.
        resume: continue the interrupted run in output_dir (same recipe): finished groups are kept.
        threads: torch CPU threads (1 gives stable timings); 0 keeps torch's default.
    """

    model: ModelRecipe = field(default_factory=ModelRecipe)
    data: DataRecipe = field(default_factory=DataRecipe)
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(seed=0))
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(method=None))
    rollout: RolloutRecipe = field(default_factory=RolloutRecipe)
    rewards: list[RewardRecipe] = field(default_factory=lambda: [RewardRecipe()])
    logging: LoggingRecipe = field(default_factory=LoggingRecipe)
    bench: BenchRecipe = field(default_factory=BenchRecipe)
    train: TrainRecipe = field(default_factory=TrainRecipe)
    distributed: DistributedRecipe = field(default_factory=DistributedRecipe)
    output_dir: str = "outputs/rollout"
    overwrite: bool = False
    resume: bool = False
    threads: int = 1

    def __post_init__(self) -> None:
        _require(self.threads >= 0, f"threads ({self.threads}) must be >= 0 (0 keeps torch's default)")
        _require(len(self.rewards) >= 1, "rewards is empty: give at least one reward, e.g. [{name: arithmetic}]")
        _require(not (self.resume and self.overwrite), "resume and overwrite are both true: choose one")
        _require(
            isinstance(self.sampling.seed, int),
            f"sampling.seed ({self.sampling.seed!r}) must be an integer: a recipe's rollouts are seeded, so that they "
            "reproduce and a stopped run resumes",
        )
        # torch (and, under rollout train, numpy) are seeded with it, rollout i of a run with seed + i
        top = 2**32 - 1 - (self.rollout.num_rollouts - 1)
        _require(
            0 <= self.sampling.seed <= top,
            f"sampling.seed ({self.sampling.seed}) must be in [0, {top}] (2**32 - rollout.num_rollouts: torch and "
            "numpy are seeded with it, rollout i with seed + i)",
        )
        _require(
            self.sampling.spec == SpecDecodeParams(),
            "sampling.spec (a request's own speculation settings) is not set from a recipe: set the spec section "
            "instead, e.g. spec.method=ngram or spec.num_speculative_tokens=2",
        )


def _error(err: OmegaConfBaseException, source: str, config=None, given=None) -> ValueError:
    """OmegaConf's multi-line message as one line that names the key path. With the recipe so far (`config`) and
    what was merged into it (`given`, a key=value override or a file's values): a value of the wrong shape (a text for
    a list or a section, a mapping for a list) says what the key takes instead."""
    key = getattr(err, "full_key", None)
    message = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    shape = None
    if config is not None:
        try:
            shape = _shape_mismatch(config, given)
        except (OmegaConfBaseException, ValueError, TypeError, KeyError, AttributeError):
            shape = None  # (values that do not resolve yet, a value the grammar refuses): OmegaConf's message stands
    if shape is not None:
        key, message = shape
    elif key and "is not a ListConfig" in message:  # a list field whose default is None
        message = f"takes a list, e.g. '{key}=[...]'"
    elif key and "Invalid type assigned" in message and "is not a subclass of" in message:  # `rewards: [arithmetic]`
        kind = message.partition("assigned: ")[2].partition(" is not")[0]
        message = f"each entry is a mapping of fields, e.g. {{name: arithmetic}} (in YAML: '- name: ...'), got a {kind}"
    return ValueError(f"{source}: {key}: {message}" if key else f"{source}: {message}")


def _shape_mismatch(config, given, prefix: str = "") -> tuple[str, str] | None:
    """The first key where `given` (an override's text, or a file's values) has another shape than the recipe's list
    or section there, and what that key takes; None if the shapes agree."""
    if isinstance(given, str):  # key=value: the value as the command line parses it
        key, _, text = given.partition("=")
        node = OmegaConf.select(config, key.strip(), default=None)
        value = OmegaConf.from_dotlist([f"value={text}"])["value"] if node is not None else None
        pairs = [(key.strip(), node, value)]
    else:
        pairs = [(f"{prefix}{k}", config[k], given[k]) for k in given if OmegaConf.is_dict(config) and k in config]
    for key, node, value in pairs:
        if OmegaConf.is_list(node) and not OmegaConf.is_list(value) and not isinstance(value, (list, tuple)):
            example = "[{name: ...}]" if any(OmegaConf.is_dict(entry) for entry in node) else "[...]"
            return key, f"takes a list, e.g. '{key}={example}'"
        if OmegaConf.is_dict(node) and not OmegaConf.is_dict(value) and not isinstance(value, dict):
            field = next(iter(node), "...")
            return key, f"is a section: set its fields, e.g. {key}.{field}=..."
        if OmegaConf.is_dict(node) and OmegaConf.is_dict(value) and not isinstance(given, str):
            found = _shape_mismatch(node, value, f"{key}.")
            if found is not None:
                return found
    return None


def load_recipe(path: str | pathlib.Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe: the defaults, then the YAML file at `path`, then `key.sub=value` overrides (later wins).

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: invalid YAML, an unknown key, a value of the wrong type or out of range, naming the key.
    """
    with _DEFAULTS_LOCK:  # OmegaConf's deepcopy unhooks each child from the source while it copies it
        config = copy.deepcopy(_defaults())  # a copy: an override through a list updates the config in place
    sources = []
    if path is not None:
        path = pathlib.Path(path)
        if path.is_dir():
            raise FileNotFoundError(f"recipe file not found: {path} is a folder; name a YAML file in it")
        if not path.is_file():
            hint = "; the recipe file comes first, then the key=value overrides" if "=" in path.name else ""
            raise FileNotFoundError(f"recipe file not found: {path}{hint}")
        try:
            values = OmegaConf.load(path)
        except Exception as err:  # the YAML parser's own error types
            if "Invalid loaded object type" in str(err):  # valid YAML: one number, text or bool, not a mapping
                raise ValueError(
                    f"{path}: a recipe is a mapping of sections (model:, data:, sampling:, ...), got one value; start "
                    "from recipes/quickstart.yaml"
                ) from None
            mark = getattr(err, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{where}: invalid YAML: {problem}") from None
        if not OmegaConf.is_dict(values) or not values:
            got = "nothing (an empty file)" if not values else "a list"
            raise ValueError(
                f"{path}: a recipe is a mapping of sections (model:, data:, sampling:, ...), got {got}; start from "
                "recipes/quickstart.yaml"
            )
        _texts_as_written(path.read_text(), values, config)
        sources.append((str(path), values))
    for source, values in sources:
        try:
            config = OmegaConf.merge(config, values)
        except (OmegaConfBaseException, TypeError) as err:  # (a mapping merged into a list is a TypeError)
            raise _error(err, source, config, values) from None
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must be key=value, e.g. sampling.n=8")
        try:
            config = _override(config, item)
        except yaml.YAMLError as err:  # the value is parsed as YAML: e.g. a list a shell split at its spaces
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(
                f"override {item!r}: its value is not valid YAML ({problem}); a value with spaces, brackets or braces "
                "must reach rollout as one argument: quote the whole override, e.g. 'spec.method=[suffix, draft_model]'"
            ) from None
        except (OmegaConfBaseException, TypeError) as err:
            error = _error(err, f"override {item!r}", config, item)
            text = item.partition("=")[2]
            if (text.startswith("{") or ": " in text) and "DictConfig" in str(error):  # e.g. data.template=Q: {x}
                error = ValueError(
                    f"{error}; a text that starts with a brace or holds ': ' needs quotes: key='\"...\"'"
                )
            raise error from None
    try:
        recipe = OmegaConf.to_object(config)
    except OmegaConfBaseException as err:
        raise _error(err, str(path) if path else "recipe") from None
    except ValueError as err:  # SamplingParams' and SpecConfig's own checks name the field, not the section
        section = _failing_section(config)
        raise ValueError(f"{section}: {err}" if section in ("sampling", "spec") else str(err)) from None
    check_recipe(recipe)
    return recipe


_DEFAULTS_LOCK = threading.Lock()


@functools.cache
def _defaults():
    """The recipe's defaults as OmegaConf's structured config, built once: building it from the dataclasses takes 15 ms,
    copying it 3 ms (the fuzz tests load recipes hundreds of times)."""
    return OmegaConf.structured(Recipe)


def _list_example(node) -> str:
    """A list written as an override: its entries (each mapping as `{...}`) and one more."""
    entries = ["{...}" if OmegaConf.is_dict(entry) else str(entry) for entry in node]
    return f"[{', '.join([*entries, '...'])}]"


def _override(config, item: str):
    """`config` with one `key.sub=value` override; a key through a list names an entry by its index
    (`rewards.0.weight=2`), which must exist."""
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    node, through_list = config, False
    for depth, part in enumerate(parts):
        if OmegaConf.is_list(node):
            if not part.isdigit() or int(part) >= len(node):
                where = ".".join(parts[:depth])
                entries = f"{len(node)} entr{'y' if len(node) == 1 else 'ies'}"
                raise ValueError(
                    f"override {item!r}: {where} is a list of {entries}, so {part!r} must be an index from 0 to "
                    f"{len(node) - 1}; to add entries, give the whole list, e.g. {where}={_list_example(node)}"
                )
            node, through_list = node[int(part)], True
        elif depth < len(parts) - 1 and OmegaConf.is_dict(node) and part in node:
            node = node[part]
        else:
            break  # a key that is not there: the merge names it
    if _is_text(config, parts) and isinstance(_parsed(text), (bool, int, float)):
        # a text field takes the text as written: output_dir=007 is not 7, logging.run_name=yes not True
        OmegaConf.update(config, key.strip(), text.strip(), merge=True)
        return config
    if not through_list:
        return OmegaConf.merge(config, OmegaConf.from_dotlist([item]))
    value = OmegaConf.from_dotlist([f"value={text}"])["value"]  # parsed as the command line parses any value
    OmegaConf.update(config, key.strip(), value, merge=True)
    return config


def _parsed(text: str) -> Any:
    """An override's value as the command line parses it, unresolved (an interpolation stays its text); None where it
    does not parse (the override's own merge then names the key)."""
    try:
        return OmegaConf.from_dotlist([f"value={text}"])._get_node("value")._value()
    except (OmegaConfBaseException, yaml.YAMLError):
        return None


def _is_text(config, parts: list[str]) -> bool:
    """Whether the recipe's key `parts` (a list entry by its index) holds text (a `str` field)."""
    node = config
    for part in parts:
        if OmegaConf.is_list(node) and part.isdigit() and int(part) < len(node):
            node = node._get_node(int(part))
        elif OmegaConf.is_dict(node) and part in node:
            node = node._get_node(part)
        else:
            return False
    return isinstance(node, StringNode)


def _texts_as_written(text: str, values, schema) -> None:
    """Set back, in a recipe file's loaded `values`, each text field (a `str` of `schema`) that YAML read as a number
    or a bool to the text as written: `output_dir: 0123` is 0123, not 83 (an octal number to YAML 1.1), `run_name:
    yes` is yes, not True (which the structured config would then hold as 'True')."""

    def walk(node, loaded, fields) -> None:
        if isinstance(node, yaml.MappingNode) and OmegaConf.is_dict(loaded) and OmegaConf.is_dict(fields):
            for key_node, value_node in node.value:
                key = key_node.value
                if key not in loaded or key not in fields:
                    continue  # an unknown key: the merge names it
                field_node, loaded_node = fields._get_node(key), loaded._get_node(key)
                # (unresolved: an interpolation or ??? stays as written, for the merge and its checks)
                value = None if OmegaConf.is_config(loaded_node) else loaded_node._value()
                if isinstance(value, (bool, int, float)) and isinstance(field_node, StringNode):
                    loaded[key] = value_node.value
                else:
                    walk(value_node, loaded_node, field_node)
        elif isinstance(node, yaml.SequenceNode) and OmegaConf.is_list(loaded) and OmegaConf.is_list(fields):
            entry_type = fields._metadata.element_type
            if dataclasses.is_dataclass(entry_type):
                entry = OmegaConf.structured(entry_type)
                for item_node, item in zip(node.value, loaded):
                    walk(item_node, item, entry)

    walk(yaml.compose(text, Loader=yaml.SafeLoader), values, schema)


def _failing_section(config) -> str | None:
    """The top-level section whose own checks fail (None: the recipe's cross-section checks)."""
    for name in config:
        if OmegaConf.is_config(config[name]) and not OmegaConf.is_list(config[name]):
            try:
                OmegaConf.to_object(config[name])
            except ValueError:
                return str(name)
    return None


def recipe_dict(recipe: Recipe) -> dict:
    """The resolved recipe as plain dicts and lists (config.yaml, W&B config)."""
    return OmegaConf.to_container(OmegaConf.structured(recipe), resolve=True)


def method_name(method: Any) -> str:
    """A spec method for display: "none", "ngram", "suffix", "suffix+draft_model"."""
    if method in (None, "none"):
        return "none"
    return method if isinstance(method, str) else "+".join(method)


def spec_config(recipe: Recipe, draft_model: Any = None, **changes) -> SpecConfig | None:
    """The recipe's `SpecConfig` (None when spec.method is null or "none"); `changes` replace fields (bench rows).

    Args:
        draft_model: what to pass as `SpecConfig.model` instead of spec.model (e.g. a model loaded from the hub).
    """
    if draft_model is not None:
        changes["model"] = draft_model
    try:
        spec = dataclasses.replace(recipe.spec, **changes)
    except ValueError as err:
        raise ValueError(f"spec: {err}") from None
    return spec if spec.methods else None


def check_recipe(recipe: Recipe) -> None:
    """Build the generator's settings from the recipe so that their errors come before any model loads."""
    _check_finite(recipe_dict(recipe))
    spec = spec_config(recipe)
    if spec is not None and recipe.rollout.max_seq_len is not None:  # (null: sized from the data, checked then)
        spec.check_room(recipe.rollout.max_seq_len, key="rollout.max_seq_len", prefix="spec.")
    table = spec.num_speculative_tokens_per_batch_size if spec is not None else None
    if isinstance(table, (list, tuple)) and recipe.rollout.max_batch_size != "auto":  # auto: checked once resolved
        try:
            TablePolicy(table, spec.num_speculative_tokens, recipe.rollout.max_batch_size)
        except ValueError as err:
            raise ValueError(f"spec: {err}") from None


def _check_finite(values: Any, key: str = "") -> None:
    """No setting may be NaN or infinite: name the first that is."""
    if isinstance(values, dict):
        for name, value in values.items():
            _check_finite(value, f"{key}.{name}" if key else str(name))
    elif isinstance(values, list):
        for index, value in enumerate(values):
            _check_finite(value, f"{key}[{index}]")
    elif isinstance(values, float) and not math.isfinite(values):
        raise ValueError(f"{key} ({values}) must be a finite number")
