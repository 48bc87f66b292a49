"""veRL's trainer side of the `rollout` backend: the `BaseRollout` each trainer rank holds.

veRL calls it around every rollout: `resume(["weights"])`, `update_weights(...)` with the trainer's full named
tensors, `resume(["kv_cache"])`, and `release()`. Every rank iterates the weights (gathering them is a collective);
the first rank of each replica sends them, in buckets, to its replica's `RolloutServer`, which copies them into its
model in place.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from rollout.integrations.verl.server import server_name

logger = logging.getLogger(__name__)


class RolloutAdapter(BaseRollout):
    """The trainer rank's handle on its replica's server (registered as `("rollout", "async")`)."""

    def __init__(self, config, model_config, device_mesh, *args, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world_size if replica_rank == -1 else replica_rank
        self.owns_server = rank % world_size == 0
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self._server = None

    def _handle(self):
        if self._server is None:  # looked up late: veRL starts the servers after the trainer workers
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        """Bring back what `release` freed: `weights` (onto the device) or `kv_cache`."""
        if self.config.free_cache_engine and self.owns_server:
            await self._handle().wake_up.remote(tags=list(tags))

    async def release(self):
        """Free the server's KV cache and graphs and move its weights off the device."""
        if self.config.free_cache_engine and self.owns_server:
            await self._handle().sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        peft_config=None,
        **kwargs,
    ) -> None:
        """Send the trainer's `(name, full tensor)` pairs to the server in buckets of
        `checkpoint_engine.update_weights_bucket_megabytes`; every rank consumes the iterator.

        Raises:
            ValueError: `wire_format` other than "named_tensors", or LoRA adapters sent unmerged.
        """
        if wire_format != "named_tensors":
            raise ValueError(
                f"the 'rollout' backend takes wire_format 'named_tensors', got {wire_format!r}: use "
                "rollout.checkpoint_engine.backend=naive"
            )
        if peft_config is not None:
            raise ValueError(
                "the 'rollout' backend takes full weights, not LoRA adapters: set "
                "actor_rollout_ref.model.lora.merge=True"
            )
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        async for name, tensor in _items(weights):
            if not self.owns_server:  # still consumed: producing the tensors is a collective
                continue
            tensor = tensor.detach().to("cpu")
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                await self._handle().update_weights.remote(bucket)
                bucket, size = [], 0
        if self.owns_server:
            if bucket:
                await self._handle().update_weights.remote(bucket)
            if global_steps is not None:
                await self._handle().set_global_steps.remote(global_steps)


async def _items(weights):
    """The pairs of a sync or async iterator."""
    if inspect.isasyncgen(weights) or hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
