"""The engine: a batched generator with speculative decoding over a Hugging Face causal LM.

`generator` runs the loop (admit, decode step, release) and is the public engine; `requests` checks a call's input
and makes its sequences (`sequence`, with the settings of `sampling`); `slots` holds every row's state in persistent
tensors; `model_runner` feeds the model through the slot KV cache (`kv_cache`) with the masks of `attention_mask`;
`speculation` builds the proposers and the K policy a `SpecConfig` asks for; `step_timer` times steps for a policy's
calibration (`auto`); `memory_plan` sizes the KV caches before they are allocated; `trace` is the per-step record.
Imports `specdec`, `kernels` and `rollout.models` below it, never the rollout loop or the command line above it.
"""
