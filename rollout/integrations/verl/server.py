"""veRL's server side of the `rollout` backend: `RolloutReplica` (what veRL's `LLMServerManager` starts, one per
trainer rank) and `RolloutServer`, the Ray actor that veRL's agent loop calls `generate` on.

The server loads the policy (random weights under veRL's default `load_format=dummy`: the trainer's first
`update_weights` brings the real ones), serves every concurrent `generate` call from one `ServingEngine`, and follows
veRL's memory protocol: `sleep` drops the KV cache and graphs (and moves the weights off the GPU),
`wake_up(["weights"])` brings the weights back, `update_weights` writes into them in place, and
`wake_up(["kv_cache"])` allocates the cache again.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import pathlib
from typing import Any

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from rollout.engine.memory_plan import DEFAULT_BLOCK_SIZE, draft_model_path, min_pool_blocks
from rollout.engine.model_checks import check_positions, check_rope_scaling
from rollout.integrations.verl.engine import ABORTED, ServingEngine
from rollout.integrations.verl.params import EngineOptions, RequestLimits, prompt_token_ids, sampling_params_from_verl

logger = logging.getLogger(__name__)

NAME = "rollout"  # actor_rollout_ref.rollout.name
ATTENTION = ("sdpa", "eager")  # the attention implementations the generator runs
LOGPROBS_MODE = "processed_logprobs"  # the one of vLLM's logprobs modes this backend returns (veRL's default)
MAX_BATCH_SIZE = 256  # slots when engine_kwargs.rollout.max_batch_size is unset (at most rollout.max_num_seqs)
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}  # fmt: skip


def server_name(replica_rank: int, name_suffix: str = "") -> str:
    """The Ray actor name of a replica's server: the trainer-side adapter finds its server by it."""
    return f"rollout_server_{replica_rank}{name_suffix}"


class RolloutServer:
    """One replica's generation server (a Ray actor: `ray.remote(RolloutServer)`), on one device.

    Args:
        config: veRL's `RolloutConfig` (temperature etc. arrive per request; lengths, dtype, `max_num_seqs`,
            `free_cache_engine`, `enforce_eager`, `seed` and `engine_kwargs.rollout` are read here).
        model_config: veRL's `HFModelConfig` (`local_path`, `trust_remote_code`).
        replica_rank: this replica's index: replicas sample from different streams of `rollout.seed`.

    It generates on the first CUDA device it sees (the replica starts it seeing only its trainer rank's GPU), else on
    the CPU.
    """

    def __init__(self, config, model_config, replica_rank: int = 0):
        # the replica hands over veRL's config objects or their OmegaConf form
        config = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        if config.logprobs_mode not in (None, LOGPROBS_MODE):
            raise ValueError(
                f"rollout.logprobs_mode ({config.logprobs_mode!r}) is not supported by the 'rollout' backend: it "
                f"returns {LOGPROBS_MODE} (the log-probs of the distribution each token was sampled from, after "
                f"temperature, top-k and top-p); set actor_rollout_ref.rollout.logprobs_mode={LOGPROBS_MODE}"
            )
        self.config = config
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        engine_kwargs = dict(config.engine_kwargs or {})
        vllm_kwargs = dict(engine_kwargs.get("vllm") or {})
        options = EngineOptions.from_dict(engine_kwargs.get(NAME), vllm_kwargs.get("speculative_config"))
        max_model_len = config.max_model_len or config.prompt_length + config.response_length
        self.limits = RequestLimits(config.prompt_length, config.response_length, max_model_len, config.ignore_eos)
        max_num_seqs = config.max_num_seqs
        if options.max_batch_size is None and (
            not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1
        ):  # (the generator's own check names its max_batch_size, a setting a veRL user never sees)
            raise ValueError(
                f"actor_rollout_ref.rollout.max_num_seqs ({max_num_seqs!r}) must be a positive integer: the most "
                f"sequences a replica generates at once (this backend uses up to {MAX_BATCH_SIZE})"
            )
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_policy(model_config, config.dtype, config.load_format, self.device)
        # at start, not at the first request (the generator is built then), and in veRL's names
        length = "rollout.max_model_len (or prompt_length + response_length)"
        check_positions(self.model, max_model_len, "the policy", length)
        check_rope_scaling(self.model, max_model_len, length)
        if options.cuda_graphs is True and not config.enforce_eager and self.device.type != "cuda":
            raise ValueError(
                f"engine_kwargs.rollout.cuda_graphs=true needs a CUDA device, and this replica runs on {self.device}: "
                "set it to auto (or false)"
            )
        fewest = min_pool_blocks(max_model_len, options.spec)
        if options.kv_pool_blocks is not None and options.kv_layout == "slots":
            raise ValueError(
                "engine_kwargs.rollout.kv_pool_blocks sizes a paged KV pool, and kv_layout slots has none: drop it, "
                "or set engine_kwargs.rollout.kv_layout=paged"
            )
        if options.kv_pool_blocks is not None and options.kv_pool_blocks < fewest:
            raise ValueError(
                f"engine_kwargs.rollout.kv_pool_blocks ({options.kv_pool_blocks}) must be at least {fewest}: one "
                f"sequence of {length} ({max_model_len}) plus one step's drafts takes that many blocks of "
                f"{DEFAULT_BLOCK_SIZE} tokens"
            )
        if options.spec is not None and isinstance(options.spec.model, (str, pathlib.Path)):
            try:
                draft_model_path(options.spec.model)
            except ValueError as err:
                raise ValueError(f"engine_kwargs.rollout.speculative_config.model: {err}") from None
        self.engine = ServingEngine(
            self.model,
            max_batch_size=options.max_batch_size or min(max_num_seqs, MAX_BATCH_SIZE),
            max_seq_len=max_model_len,
            spec=options.spec,
            kv_layout=options.kv_layout,
            kv_pool_blocks=options.kv_pool_blocks,
            cuda_graphs=False if config.enforce_eager else options.cuda_graphs,
            max_prefill_tokens=options.max_prefill_tokens,
            seed=int(config.seed),
            seed_offset=replica_rank,
        )
        logger.warning(
            "rollout backend: replica %d on %s, %s slots x %d positions, speculation %s",
            replica_rank, self.device, options.max_batch_size or min(max_num_seqs, MAX_BATCH_SIZE),
            max_model_len, options.spec,
        )  # fmt: skip

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: dict | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> TokenOutput:
        """One completion of `prompt_ids`: its token ids, their log-probabilities when `sampling_params["logprobs"]`
        asks (those of the distribution sampled from: after temperature, top-k and top-p) and the stop reason
        ("completed", or "aborted" when `abort_all_requests` dropped it)."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("the 'rollout' backend generates from text prompts only: multimodal data is not supported")
        prompt_ids = prompt_token_ids(prompt_ids)  # (not int() on each: 5.7 was taken as 5, True as 1)
        # as veRL's vLLM server under full_determinism: a request without a seed of its own takes the replica's
        if getattr(self.config, "full_determinism", False):
            sampling_params = {"seed": self.replica_rank + int(self.config.seed), **sampling_params}
        params, want_logprobs = sampling_params_from_verl(sampling_params, len(prompt_ids), self.limits)
        completion = await self.engine.generate(prompt_ids, params)
        extra_fields = {"global_steps": self.global_steps}
        if completion.finish_reason == ABORTED:
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields=extra_fields)
        return TokenOutput(
            token_ids=completion.token_ids,
            log_probs=completion.logprobs if want_logprobs else None,
            stop_reason="completed",
            extra_fields=extra_fields,
        )

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy a bucket of `(name, tensor)` pairs into the model in place (see `ServingEngine.update_weights`)."""
        return await asyncio.to_thread(self.engine.update_weights, named_tensors)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """`weights`: put the model back on its device; `kv_cache`: allocate the KV cache (and capture CUDA graphs);
        no tags: both."""
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and self.device.type == "cuda":
            await asyncio.to_thread(self.model.to, self.device)
        if "kv_cache" in tags:
            if self.device.type == "cuda":  # weights first: a graph captured now must read them where they live
                await asyncio.to_thread(self.model.to, self.device)
            await asyncio.to_thread(self.engine.wake_up)

    async def sleep(self) -> None:
        """With `free_cache_engine`: wait for the requests in flight, free the KV cache and graphs, and move the
        weights to the CPU (the trainer has the device to itself); otherwise nothing."""
        if not self.config.free_cache_engine:
            return
        await asyncio.to_thread(self.engine.sleep)
        if self.device.type == "cuda":
            await asyncio.to_thread(self.model.to, "cpu")
            torch.cuda.empty_cache()
        totals = self.engine.totals
        logger.warning(
            "rollout backend: replica %d asleep after %d steps; so far %d tokens emitted, %d draft tokens, %d accepted",
            self.replica_rank, totals["steps"], totals["num_emitted"], totals["num_drafted"], totals["num_accepted"],
        )  # fmt: skip

    async def release_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await asyncio.to_thread(self.engine.sleep)

    async def resume_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await asyncio.to_thread(self.engine.wake_up)

    async def clear_kv_cache(self) -> None:
        """Nothing to clear: this backend keeps no prefix cache across requests (the suffix drafter's history of
        earlier responses is kept on purpose: responses of earlier weights are still good drafts)."""

    async def wait_for_requests_to_drain(self) -> None:
        await asyncio.to_thread(self.engine.wait_idle)

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Drop every request queued or in flight (each returns stop_reason "aborted"); hold new ones until
        `resume_generation`, or with `reject_request` answer them "aborted" at once."""
        count = await asyncio.to_thread(self.engine.abort_all, reject_request)
        return {"aborted_count": count, "request_ids": []}

    async def resume_generation(self) -> None:
        self.engine.resume()

    async def start_profile(self, **kwargs: Any) -> None:
        """Profiling is not wired for this backend: the trace of steps is in the generator (`last_trace`)."""

    async def stop_profile(self) -> None:
        pass


class Replica(RolloutReplica):
    """veRL's replica for `rollout.name=rollout`: one `RolloutServer` per replica, on its trainer rank's node and
    device. Runs in veRL's hybrid mode (the trainer and the server take turns on the device)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.world_size != 1:
            raise ValueError(
                f"the 'rollout' backend runs each replica on one device, but tensor_model_parallel_size x "
                f"data_parallel_size x pipeline_model_parallel_size is {self.world_size}: set "
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1 (veRL then starts one replica per trainer rank)"
            )

    async def launch_servers(self) -> None:
        backend = self.config.checkpoint_engine.backend
        if backend != "naive":
            raise ValueError(
                f"the 'rollout' backend takes weights by veRL's in-process sync (checkpoint_engine.backend 'naive': "
                f"each trainer rank's adapter sends them to its server), not by {backend!r}: set "
                "actor_rollout_ref.rollout.checkpoint_engine.backend=naive"
            )
        if self.rollout_mode != RolloutMode.HYBRID:
            raise ValueError(
                f"the 'rollout' backend supports veRL's hybrid mode (trainer and rollout on the same devices), not "
                f"{self.rollout_mode.value}: keep actor_rollout_ref.hybrid_engine=True and "
                "rollout.checkpoint_engine.backend=naive"
            )
        worker = self.workers[0]
        node_id, device = await worker.__ray_call__.remote(_node_and_device)
        name = server_name(self.replica_rank, self.name_suffix)
        # the server shares its trainer rank's GPU: set before its process starts, so CUDA sees that one alone
        env_vars = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": device}
        server = (
            ray.remote(RolloutServer)
            .options(
                name=name,
                max_concurrency=self.max_concurrency,
                num_cpus=0,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id, soft=False),
                runtime_env={"env_vars": env_vars} if device is not None else None,
            )
            .remote(self.config, self.model_config, self.replica_rank)
        )
        await server.__ray_ready__.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name  # no HTTP endpoint: veRL's agent loop calls the actor's generate directly


def _node_and_device(worker) -> tuple[str, str | None]:
    """Run inside a trainer worker: its node and, with CUDA, the id of the GPU Ray gave it (veRL's workers may see
    every GPU of the node and pick theirs by rank, so their CUDA_VISIBLE_DEVICES does not say which)."""
    context = ray.get_runtime_context()
    gpus = context.get_accelerator_ids().get("GPU") or []
    device = str(gpus[0]) if gpus and torch.cuda.is_available() else None
    return context.get_node_id(), device


def load_policy(model_config, dtype: str, load_format: str, device: torch.device) -> torch.nn.Module:
    """The policy model in eval mode: from `model_config.local_path`, or with `load_format="dummy"` (veRL's default)
    built from its config with random weights, which the trainer's first `update_weights` replaces. Its config is
    `model_config.hf_config`, the one the trainer builds its actor from (`model.override_config` applied), with
    `sdpa` or `eager` attention as `override_config.attn_implementation` says, else transformers' default for the
    model (veRL's default asks flash-attn of its actor, which this library does not use)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"rollout.dtype ({dtype!r}) must be one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    path = model_config.local_path
    trust = bool(getattr(model_config, "trust_remote_code", False))
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    hf_config = copy.deepcopy(hf_config)  # (the trainer's own stays as it is)
    if hf_config._attn_implementation not in ATTENTION:
        hf_config._attn_implementation = None  # transformers picks sdpa, or eager for a model without it
    options = dict(dtype=torch_dtype, trust_remote_code=trust)
    if load_format == "dummy":
        model = AutoModelForCausalLM.from_config(hf_config, **options)
        # the checkpoint's generation settings, its stop ids among them (the config veRL builds holds the tokenizer's
        # one EOS), as a real load reads them
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: the checkpoint's own config says
            own = AutoConfig.from_pretrained(path, trust_remote_code=trust)
            model.generation_config = GenerationConfig.from_model_config(own)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, config=hf_config, **options)
    return model.to(device).eval()
