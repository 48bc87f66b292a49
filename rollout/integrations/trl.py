"""TRL's GRPOTrainer generating through this library, in one line:

    from rollout.integrations.trl import trl_rollout_func
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=ds,
                          rollout_func=trl_rollout_func(spec=SpecConfig(method="suffix", num_speculative_tokens=4,
                                                                        num_speculative_tokens_per_batch_size="auto")))

TRL calls `rollout_func(prompts, trainer)` with the prompts of this process, each repeated `num_generations` times in
a row, and reads back `prompt_ids`, `completion_ids` and `logprobs` (one completion per prompt given, in order). The
adapter formats prompts as TRL does, samples with the trainer's temperature / top_p / top_k / max_completion_length
from the trainer's own model object (so every optimiser step is seen by the next rollout), seeds from the trainer's
seed and global step, and adds the rollout's per-phase metrics to the trainer's logged metrics (`rollout/...`).
Consecutive copies of a prompt are one GRPO group: one prefill, one suffix-drafting trie.

What TRL does with the returned log-probs (TRL 1.16): without vLLM they feed only `off_policy_mask_threshold`; the
loss's old log-probs are recomputed by the trainer. They are the log-probabilities of the sampling distribution after
temperature, top-k and top-p; TRL's recomputed ones apply the temperature only, so the two agree when top_k = 0 and
top_p = 1.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time

import torch

from rollout.distributed import ranks_of, share_responses
from rollout.engine.generator import Generator
from rollout.engine.memory_plan import fitting_batch_size
from rollout.engine.model_checks import learned_positions, rope_unscaled_length
from rollout.engine.model_runner import KV_LAYOUTS
from rollout.engine.sampling import SamplingParams
from rollout.phases import PHASES, PhaseLabeler, summarize
from specdec.config import SpecConfig

logger = logging.getLogger(__name__)

# the rollout's per-phase numbers added to the trainer's metrics each step, as rollout/<phase>/<key>
PHASE_METRICS = ("tokens_per_s", "mean_k", "acceptance_rate", "mean_accepted_length", "seconds")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EVAL_SEED_PART = 1  # the last part of an evaluation call's seed (a training call's has none)


def trl_rollout_func(
    spec: SpecConfig | None = None,
    *,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    tail_fraction: float = 0.25,
    log_metrics: bool = True,
    share_history: bool = True,
    kv_layout: str = "auto",
    cuda_graphs: bool | str = "auto",
    async_scheduling: bool | str = "auto",
    compile_forward: bool = False,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
) -> TRLRolloutFunc:
    """A `rollout_func` for TRL's `GRPOTrainer` that generates with this library's speculative generator.

    Args:
        spec: speculative decoding settings; None decodes without drafts.
        max_batch_size: generator slots; None takes the number of completions of the first call (at most 512),
            lowered to what the device's free memory holds.
        max_seq_len: prompt + completion tokens a sequence may hold; None sizes it from the longest prompt of the
            trainer's `train_dataset` (or of the first call, where the data set's prompts cannot be listed) plus
            `max_completion_length`, rounded up to a power of two, and grows it if a longer prompt comes.
        tail_fraction: decode steps below this fraction of the peak batch are the `tail` phase in the metrics.
        log_metrics: add the per-phase metrics (`rollout/<phase>/tokens_per_s`, ...) to the trainer's logs.
        share_history: with several processes (TRL under `accelerate launch`), all-gather each rollout's finished
            responses into every process's suffix drafting history, so each drafts from the whole run's responses.
        kv_layout, cuda_graphs, async_scheduling, compile_forward: the generator's engine settings (see `Generator`).
        stop_token_ids: stop tokens besides the trainer's EOS ids (`SamplingParams.stop_token_ids`); the first call
            adds them to the trainer's EOS ids, so that TRL counts a completion one ended as finished, not truncated.
        ignore_eos: generate past the trainer's EOS ids (`stop_token_ids` still stop), to `max_completion_length`.

    TRL warns at `GRPOTrainer(rollout_func=...)` that `rollout_func` is experimental unless TRL_EXPERIMENTAL_SILENCE
    is set; this sets it (unless it is set already): the adapter is tested against the newest and the oldest TRL this
    library supports.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout ({kv_layout!r}) must be one of {', '.join(KV_LAYOUTS)}")
    if not (isinstance(cuda_graphs, bool) or cuda_graphs == "auto"):  # (1 is not a switch: `1 in (True,)`)
        raise ValueError(f"cuda_graphs ({cuda_graphs!r}) must be True, False or 'auto'")
    SamplingParams(stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)  # checks them now
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    func = TRLRolloutFunc(spec, max_batch_size, max_seq_len, tail_fraction, log_metrics, share_history)
    func.generator_options = {
        "kv_layout": kv_layout,
        "cuda_graphs": cuda_graphs,
        "async_scheduling": async_scheduling,
        "compile_forward": compile_forward,
    }
    func.stop_token_ids, func.ignore_eos = list(stop_token_ids or []), ignore_eos
    return func


class TRLRolloutFunc:
    """The callable `trl_rollout_func` returns; its generator is built on the first call and reused.

    Attributes: `generator` (None before the first call), `dtype` (what generation computes in: the model's dtype,
    or bfloat16/float16 when accelerate's mixed precision wraps the model's forward in autocast), `last_summary` (the
    last rollout's per-phase summary), `history_to_load` (a path of a saved suffix drafting history the generator takes
    when it is first built; `rollout train` sets it when it resumes from a checkpoint).
    """

    def __init__(self, spec, max_batch_size, max_seq_len, tail_fraction, log_metrics, share_history=True):
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ValueError(f"spec must be a specdec.config.SpecConfig or None, got {type(spec).__name__}")
        for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} ({value!r}) must be a positive integer or None (sized from the first call)")
        PhaseLabeler(tail_fraction)  # checks the value now
        self.spec = spec
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.tail_fraction = tail_fraction
        self.log_metrics = log_metrics
        self.share_history = bool(share_history)
        self.generator: Generator | None = None
        self.dtype: torch.dtype | None = None
        self.last_summary: dict = {}
        self._calls: dict[tuple[int, bool], int] = {}  # calls made at this (global step, training?) so far
        self.generator_options: dict = {}  # more `Generator` arguments (kv_layout, cuda_graphs, ...)
        self.stop_token_ids: list[int] = []  # stop tokens besides the trainer's EOS ids
        self.ignore_eos = False  # generate past the trainer's EOS ids
        # a saved suffix drafting history (`draft_history.save`) the generator takes when it is first built: a resumed
        # training's, so that it drafts from what the stopped one held (one that fails to load is warned of and left)
        self.history_to_load: str | os.PathLike | None = None

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        check_trainer(trainer)
        self._stops_end_completions(trainer)
        prompt_ids = tokenize_prompts(prompts, trainer)
        groups = _groups(prompt_ids)
        step, training = int(trainer.state.global_step), bool(trainer.model.training)
        # calls are counted per step and per mode: an evaluation between two training calls (or none, in a training
        # resumed from a checkpoint) leaves the training's seeds as they are; evaluation draws from seeds of its own
        key = (step, training)
        call = self._calls.get(key, 0)
        self._calls = {k: v for k, v in self._calls.items() if k[0] == step} | {key: call + 1}
        parts = (trainer.args.seed, step, call, trainer.accelerator.process_index)
        seed = _mix_seed(*parts) if training else _mix_seed(*parts, EVAL_SEED_PART)
        params = [self._params(trainer, size, seed) for _, size in groups]
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        needed = max(len(ids) for ids in prompt_ids) + trainer.max_completion_length
        gen = self._generator(trainer, model, needed, len(prompt_ids))
        labeler = PhaseLabeler(self.tail_fraction)
        steps: list[dict] = []

        def record(record, num_finished: int, num_total: int) -> None:
            entry = record.to_dict()
            entry["phase"] = labeler.label(entry["kind"], entry["batch_size"])
            steps.append(entry)

        start = time.perf_counter()
        outs = gen.generate([ids for ids, _ in groups], params, on_step=record)
        seconds = time.perf_counter() - start
        assert len(outs) == len(prompt_ids), f"expected one completion per prompt ({len(prompt_ids)}), got {len(outs)}"
        ranks = ranks_of(trainer.accelerator)
        if ranks.distributed and gen.draft_history is not None and self.share_history:  # every process calls this
            prompts = [ids for ids, n in groups for _ in range(n)]
            share_responses(ranks, prompts, [o.token_ids for o in outs], gen.draft_history)
        self.last_summary = summarize(steps)
        if self.log_metrics:
            self._log(trainer, self.last_summary, seconds)
        return {
            "prompt_ids": [list(ids) for ids in prompt_ids],
            "completion_ids": [o.token_ids for o in outs],
            "logprobs": [o.logprobs for o in outs],
        }

    def _stops_end_completions(self, trainer) -> None:
        """TRL takes a completion that does not end in one of its EOS ids (or the pad id) as cut off at
        max_completion_length: it counts it in `completions/clipped_ratio`, and `mask_truncated_completions` masks it
        out of the loss. The stop ids it does not know are added to the trainer's EOS ids (once), so that a completion
        a stop id ended counts as finished there too."""
        unknown = [t for t in self.stop_token_ids if t not in trainer.eos_token_ids]
        if unknown:
            trainer.eos_token_ids = [*trainer.eos_token_ids, *unknown]
            logger.warning(
                "rollout: stop_token_ids %s added to the trainer's EOS ids, so that TRL counts the completions they "
                "end as finished, not truncated (completions/clipped_ratio, mask_truncated_completions)",
                unknown,
            )

    def _params(self, trainer, n: int, seed: int) -> SamplingParams:
        eos_ids = [] if self.ignore_eos else [t for t in trainer.eos_token_ids if t not in self.stop_token_ids]
        return SamplingParams(
            n=n,
            temperature=float(trainer.temperature),
            top_p=float(trainer.top_p if trainer.top_p is not None else 1.0),
            top_k=int(trainer.top_k or 0),
            max_new_tokens=int(trainer.max_completion_length),
            stop_token_ids=eos_ids + self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            seed=seed,
        )

    def _generator(self, trainer, model, needed: int, num_completions: int) -> Generator:
        """The generator over `model`, built on the first call with room for the longest prompt of the trainer's data
        set; rebuilt (drafting history kept) when a prompt needs more positions than it has (one from outside that
        data set), or when the trainer hands over another model object."""
        gen = self.generator
        if gen is not None and gen.model is model and gen.max_seq_len >= needed:
            return gen
        if gen is None and self.max_seq_len is None:  # room for the whole data set's prompts: built once
            needed = max(needed, longest_dataset_prompt(trainer) + trainer.max_completion_length)
        if self.max_seq_len is not None and needed > self.max_seq_len:
            raise ValueError(
                f"a prompt of this batch plus max_completion_length needs {needed} positions but max_seq_len is "
                f"{self.max_seq_len}: raise trl_rollout_func(max_seq_len=...) or shorten the prompts"
            )
        max_seq_len = self.max_seq_len or _room(needed, model, self.spec)
        history = _saved_history(gen) if gen is not None else self.history_to_load
        self.history_to_load = None
        if gen is not None:  # its KV pool and graphs go back before the new one is planned from the free memory
            self.generator = None
            gen.close()
        slots = self.max_batch_size or fitting_batch_size(model, self.spec, max_seq_len, min(num_completions, 512))
        self.generator = Generator(
            model, max_batch_size=slots, max_seq_len=max_seq_len, spec=self.spec, **self.generator_options
        )
        if history is not None and self.generator.draft_history is not None:
            try:
                self.generator.draft_history.load(history)
            except ValueError as err:  # a resumed training's saved history: drafting from none changes no sample
                if gen is not None:
                    raise
                logger.warning("rollout: drafting from an empty history: %s", err)
        mixed_precision = str(getattr(trainer.accelerator, "mixed_precision", "no"))
        self.dtype = generation_dtype(model, mixed_precision)
        autocast = self.dtype != next(model.parameters()).dtype
        logger.warning(
            "rollout: generating with %s slots x %s positions in %s%s",
            slots,
            max_seq_len,
            str(self.dtype).removeprefix("torch."),
            f" (accelerate's {mixed_precision} autocast around the model's forward)" if autocast else "",
        )
        return self.generator

    def _log(self, trainer, summary: dict, seconds: float) -> None:
        metrics = trainer._metrics["train" if trainer.model.training else "eval"]
        total = summary["total"]
        metrics["rollout/seconds"].append(seconds)
        metrics["rollout/tokens_per_s"].append(total["tokens"] / seconds if seconds > 0 else 0.0)
        metrics["rollout/mean_k"].append(total["mean_k"])
        metrics["rollout/acceptance_rate"].append(total["acceptance_rate"])
        history = self.generator.draft_history if self.generator is not None else None
        if history is not None:  # responses the drafter holds (under several processes: every process's, shared)
            metrics["rollout/history_responses"].append(len(history.history))
        for phase in PHASES:
            stats = summary["phases"][phase]
            if stats["num_steps"] == 0:  # a rollout with no tail leaves the tail's averages alone
                continue
            for key in PHASE_METRICS:
                metrics[f"rollout/{phase}/{key}"].append(stats[key])


def check_trainer(trainer) -> None:
    """Refuse a trainer setting the adapter cannot honour, naming it and the way out."""
    refusals = []
    args = trainer.args
    # GRPOConfig's own fields, as the trainer holds them (its copy, where it keeps one): a field gone from a later TRL
    # is said, not taken as off (a default here would drop the refusal without a word)
    missing = [name for name in ("use_vllm", "min_p", "temperature", "repetition_penalty") if not hasattr(args, name)]
    if missing:
        raise ValueError(
            f"this TRL's GRPOConfig has no {', '.join(missing)}: the rollout adapter is tested with TRL 1.16 and reads "
            "them to refuse what it cannot honour; use a TRL it supports"
        )
    setting = lambda name: getattr(trainer, name, getattr(args, name))  # noqa: E731
    if setting("use_vllm"):
        refusals.append("use_vllm=True (this rollout_func generates with rollout's generator: set use_vllm=False)")
    if setting("min_p"):  # None or 0.0: nothing filtered
        refusals.append(f"min_p={setting('min_p')} (not supported: set min_p=None)")
    temperature = setting("temperature")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        refusals.append(
            f"temperature={temperature!r} (GRPO samples: it must be above 0, and TRL divides its logits by it)"
        )
    if setting("repetition_penalty") != 1.0:
        refusals.append(f"repetition_penalty={setting('repetition_penalty')} (not supported: it breaks exact drafting)")
    if args.generation_kwargs:
        keys = sorted(args.generation_kwargs) if isinstance(args.generation_kwargs, dict) else args.generation_kwargs
        refusals.append(f"generation_kwargs={keys} (not applied by rollout: drop them, or set temperature/top_p/top_k)")
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        refusals.append("tools/environment_factory (multi-turn tool calls are not supported by this rollout_func)")
    if getattr(trainer, "_is_vlm", False):
        refusals.append("a vision-language processor (only text prompts are supported)")
    if getattr(trainer, "is_fsdp_enabled", False) or _is_zero3(trainer):
        refusals.append(
            "FSDP / DeepSpeed ZeRO-3 (sharded weights are not gathered by this rollout_func: use DDP or ZeRO-1/2, "
            "or TRL's own generation)"
        )
    if refusals:
        raise ValueError("trl_rollout_func cannot honour the trainer's " + "; ".join(refusals))


def tokenize_prompts(prompts: list, trainer) -> list[list[int]]:
    """Prompt token ids exactly as TRL's own generation path makes them: the chat template with the generation prompt
    and `chat_template_kwargs` for conversational prompts, the tokenizer's plain encoding for text."""
    if not prompts:
        raise ValueError("rollout_func was given no prompts")
    tokenizer = trainer.processing_class
    if _is_conversation(prompts[0]):
        encoded = tokenizer.apply_chat_template(
            conversation=prompts,
            chat_template=getattr(trainer, "chat_template", None),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(trainer.chat_template_kwargs or {}),
        )
    else:
        encoded = tokenizer(text=prompts)
    return [list(ids) for ids in encoded["input_ids"]]


def longest_dataset_prompt(trainer, num_longest: int = 16) -> int:
    """Tokens in the longest prompt of the trainer's `train_dataset`, measured on its `num_longest` longest by
    characters; 0 when its prompts cannot be listed (an iterable data set)."""
    data = getattr(trainer, "train_dataset", None)
    if not hasattr(data, "__len__"):  # none, or streamed (datasets' IterableDataset): listing it would read it all
        return 0
    try:
        prompts = list(data["prompt"])
    except (TypeError, KeyError, ValueError, AttributeError):
        return 0
    if not prompts:
        return 0
    longest = sorted(prompts, key=_num_chars, reverse=True)[:num_longest]
    return max(len(ids) for ids in tokenize_prompts(longest, trainer))


def _num_chars(prompt) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(str(m.get("content", ""))) for m in prompt if isinstance(m, dict))


def generation_dtype(model, mixed_precision: str = "no") -> torch.dtype:
    """What the forward computes in: accelerate's mixed-precision dtype when it wrapped `forward` in autocast (it
    keeps the plain forward as `_original_forward`), else the parameters' dtype."""
    if getattr(model, "_original_forward", None) is not None and mixed_precision in AUTOCAST_DTYPES:
        return AUTOCAST_DTYPES[mixed_precision]
    return next(model.parameters()).dtype


def _is_zero3(trainer) -> bool:
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and getattr(plugin, "zero_stage", 0) == 3


def _is_conversation(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)


def _groups(prompt_ids: list[list[int]]) -> list[tuple[list[int], int]]:
    """Runs of identical consecutive prompts as (prompt ids, count): TRL repeats each prompt num_generations times."""
    groups: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        if groups and groups[-1][0] == ids:
            groups[-1] = (ids, groups[-1][1] + 1)
        else:
            groups.append((ids, 1))
    return groups


def _room(needed: int, model, spec: SpecConfig | None) -> int:
    """Positions for a generator sized by its calls: `needed` rounded up to a power of two (fewer rebuilds as prompts
    grow), but no more than the policy's learned position table (or the draft model's) holds, or than its rotary
    scaling leaves unscaled, where `needed` fits within that."""
    room = 1 << (needed - 1).bit_length()
    models = [model, spec.model if spec is not None and isinstance(spec.model, torch.nn.Module) else None]
    limits = [t[0] for t in (learned_positions(m) for m in models if m is not None) if t is not None]
    rope = rope_unscaled_length(model)
    limits += [rope[0]] if rope is not None else []
    return max(needed, min([room, *limits]))


def _mix_seed(*parts: int) -> int:
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _saved_history(gen: Generator | None) -> io.BytesIO | None:
    if gen is None or gen.draft_history is None:
        return None
    buffer = io.BytesIO()
    gen.draft_history.save(buffer)
    buffer.seek(0)
    return buffer
