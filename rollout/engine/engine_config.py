"""The engine's settings resolved once, at construction: the KV layout the model really runs on, CUDA graphs on or
off, the widest step and the memory planned. The rest of the engine reads them instead of deciding again."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from rollout.engine.memory_plan import check_kv_cache_fits, min_pool_blocks, plan_kv_cache, pool_budget
from rollout.engine.model_checks import check_positions, check_rope_scaling
from rollout.engine.model_runner import ModelRunner
from specdec.config import SpecConfig


@dataclass(frozen=True)
class EngineConfig:
    """What a `Generator` runs with, every "auto" decided."""

    max_batch_size: int  # rows held at once
    max_seq_len: int  # prompt + completion tokens a row may hold
    max_prefill_tokens: int  # padded prompt tokens per prefill forward at most
    max_width: int  # tokens a decode step feeds a row at most: the pending token plus the largest K
    num_positions: int  # positions a row holds: max_seq_len plus one step's width
    kv_layout: str  # "paged" or "slots": the layout the model runs on (after "auto" and the model's checks)
    cuda_graphs: bool  # chain decode and verification steps replay CUDA graphs
    kv_cache_bytes: int  # planned for the KV caches, the target's and a draft model's
    async_scheduling: bool  # steps without drafts launched before the last one is read (`rollout.engine.run_ahead`)
    compile_forward: bool  # the graphs capture the decoder's forward compiled by torch.compile
    exact: bool  # every sampled token is the exponential race's at its position (not rejection sampling)


def resolve_engine(
    model: PreTrainedModel,
    spec: SpecConfig | None,
    max_batch_size: int,
    max_seq_len: int,
    max_prefill_tokens: int,
    kv_layout: str,
    kv_pool_blocks: int | None,
    cuda_graphs: bool | str,
    async_scheduling: bool | str = "auto",
    compile_forward: bool = False,
) -> tuple[EngineConfig, ModelRunner]:
    """Plan the KV memory, build the target's model runner (which checks the model and settles the layout) and
    capture its CUDA graphs where they are on; the arguments are the `Generator`'s, already checked."""
    check_positions(model, max_seq_len)
    max_width = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    exact = spec is None or spec.verification == "exact"
    num_positions = max_seq_len + max_width
    check_rope_scaling(model, max_seq_len)
    # planned before anything is allocated: the slot cache must fit, a paged pool is sized to what is free
    kv_cache_bytes, max_kv_blocks = plan_kv_cache(model, spec, max_batch_size, max_seq_len, kv_layout, kv_pool_blocks)
    every_slot = max_batch_size * min_pool_blocks(max_seq_len, spec)
    budget = pool_budget(model, max_kv_blocks, every_slot, pinned=kv_pool_blocks is not None)
    runner = ModelRunner(model, max_batch_size, num_positions, kv_layout, max_kv_blocks, kv_byte_budget=budget)
    if max_kv_blocks is not None and not runner.paged:  # planned paged, but the model runs on slots
        kv_cache_bytes = check_kv_cache_fits(model, spec, max_batch_size, max_seq_len)
    elif runner.paged:  # the pool's bytes in the dtype it holds (a bf16 autocast's over float32 weights), as planned
        weights = runner.cache.block_bytes(runner.dtype) * max_kv_blocks
        kv_cache_bytes += runner.cache.block_bytes(runner.cache.dtype) * runner.cache.max_blocks - weights
    graphs_possible = runner.paged and runner.device.type == "cuda"
    if cuda_graphs is True and not graphs_possible:
        raise ValueError(
            f"cuda_graphs=True needs a CUDA device and the paged KV layout; this generator has {runner.device} and "
            f"kv_layout {runner.kv_layout!r}: pass cuda_graphs='auto' or False"
        )
    use_graphs = cuda_graphs is not False and graphs_possible
    if compile_forward and not use_graphs:
        raise ValueError(
            f"compile_forward=True compiles the forward the CUDA graphs capture; this generator has none ("
            f"{runner.device}, kv_layout {runner.kv_layout!r}, cuda_graphs={cuda_graphs!r}): pass compile_forward=False"
        )
    if use_graphs:  # before the auto policy's warm-up, so that it times the captured steps; under exact verification
        # (the default) the verifying graphs, the ones its chain steps take
        runner.use_graphs(max_width, compile=compile_forward).capture_all(max_batch_size, verifying=exact)
    # "auto": where the host and the device run side by side (on a CPU it gains nothing, and a finished row rides
    # one step further)
    run_ahead = async_scheduling is True or (async_scheduling == "auto" and runner.device.type == "cuda")
    config = EngineConfig(
        max_batch_size, max_seq_len, max_prefill_tokens, max_width, num_positions, runner.kv_layout, use_graphs,
        kv_cache_bytes, run_ahead, compile_forward, exact,
    )  # fmt: skip
    return config, runner
