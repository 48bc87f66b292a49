"""veRL's own `main_ppo` trains GRPO on this CPU with `actor_rollout_ref.rollout.name=rollout`: the shipped
tiny-target model, the arithmetic task, a greedy validation, then 3 steps of 4 prompts x 4 samples, suffix drafting on.

Run by `scripts/verl_e2e.sh` (which makes veRL's environment: veRL 0.9.1 pins transformers below this project's
main environment's); skips where veRL is not installed. Every veRL process imports `verl_e2e.cpu_platform` (veRL on
gloo, FSDP2 on the CPU) and the backend's plugin through `VERL_USE_EXTERNAL_MODULES`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="veRL is not installed: scripts/verl_e2e.sh makes its environment")

from verl_e2e.prepare import write_data, write_model  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
STEPS = 3
PROMPTS_PER_STEP = 4
SAMPLES_PER_PROMPT = 4
# veRL's training/rollout_probs_diff_max: the largest |exp(rollout log-prob) - exp(trainer's log-prob)| over the
# step's tokens; both are the same float32 model (the backend's, the trainer's FSDP forward), so rounding only
PROB_TOLERANCE = 1e-4


def overrides(data: dict, model: pathlib.Path, out: pathlib.Path) -> list[str]:
    n = SAMPLES_PER_PROMPT
    fp32 = "float32"
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data['train']}",
        f"data.val_files={data['val']}",
        f"data.train_batch_size={PROMPTS_PER_STEP}",
        "data.max_prompt_length=128",
        "data.max_response_length=64",
        "data.dataloader_num_workers=0",
        "data.shuffle=False",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"actor_rollout_ref.actor.fsdp_config.dtype={fp32}",
        f"actor_rollout_ref.ref.fsdp_config.dtype={fp32}",
        # FSDP computes in bfloat16 unless told otherwise: float32, as the rollout does, so log-probs compare
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.ref.use_torch_compile=False",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={PROMPTS_PER_STEP * n}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.rollout.name=rollout",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.dtype={fp32}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={PROMPTS_PER_STEP * n}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "+actor_rollout_ref.rollout.engine_kwargs.rollout.speculative_config.method=suffix",
        "+actor_rollout_ref.rollout.engine_kwargs.rollout.speculative_config.num_speculative_tokens=4",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={PROMPTS_PER_STEP * n}",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={HERE / 'reward.py'}",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={STEPS}",
        "trainer.logger=[console]",
        "trainer.val_before_train=True",  # validation first: greedy (val_kwargs temperature 0) through the backend
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.rollout_data_dir={out / 'rollouts'}",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        "trainer.project_name=rollout_e2e",
        "trainer.experiment_name=cpu_grpo",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "+ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.num_gpus=1",
        f"hydra.run.dir={out / 'hydra'}",
    ]


def run_main_ppo(out: pathlib.Path) -> tuple[subprocess.CompletedProcess, str]:
    data = write_data(out / "data", num_train=PROMPTS_PER_STEP * STEPS, num_val=4)
    model = write_model(out / "tiny-target")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
        "VERL_PLATFORM": "cpu",
        "VERL_USE_EXTERNAL_MODULES": "verl_e2e.cpu_platform,rollout.integrations.verl.plugin",
        "TOKENIZERS_PARALLELISM": "false",
        "HYDRA_FULL_ERROR": "1",
        "OMP_NUM_THREADS": "1",
    }
    log = out / "main_ppo.log"
    with log.open("w") as stream:
        result = subprocess.run(
            [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(data, model, out)],
            env=env,
            cwd=out,
            stdout=stream,
            stderr=subprocess.STDOUT,
            timeout=1200,
            check=False,
        )
    return result, log.read_text(errors="replace")


def step_metrics(text: str) -> dict[int, dict[str, float]]:
    """veRL's console logger: one line per step, `step:N - key:value - key:value ...` (step 0: the validation before
    training); values may be printed as `np.float64(1.0)`."""
    steps: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        match = re.search(r"step:(\d+) - (.*)$", line)
        if not match:
            continue
        values = steps.setdefault(int(match.group(1)), {})
        for pair in match.group(2).split(" - "):
            key, _, value = pair.partition(":")
            number = re.fullmatch(r"(?:np\.\w+\()?(-?[\d.]+(?:e[-+]?\d+)?)\)?", value.strip())
            if number:
                values[key.strip()] = float(number.group(1))
    return steps


def failure(text: str) -> str:
    lines = text.splitlines()
    errors = [line for line in lines if any(m in line for m in ("Error", "Traceback", "error:", "Killed"))]
    return "\n".join(["--- error lines ---", *errors[:60], "--- log tail ---", *lines[-80:]])


@pytest.mark.slow
def test_grpo_with_the_rollout_backend_trains_three_steps(tmp_path):
    result, text = run_main_ppo(tmp_path)
    assert result.returncode == 0, failure(text)
    steps = step_metrics(text)
    assert sorted(steps) == list(range(STEPS + 1)), failure(text)
    # step 0, the validation before training: greedy (veRL's val_kwargs, temperature 0) on the trained model
    assert steps.pop(0)["val-core/rollout/arithmetic/acc/mean@1"] > 0.5
    for step, metrics in steps.items():
        # the log-probs the backend returned equal the trainer's recomputation: every step, so after every update
        assert metrics["training/rollout_probs_diff_max"] < PROB_TOLERANCE, (step, metrics)
        # the server starts from random weights (load_format=dummy): the trained model's scores mean the update came
        assert metrics["critic/score/mean"] > 0.3, (step, metrics)
    drafted = [int(m) for m in re.findall(r"rollout backend: .* (\d+) draft tokens", text)]
    assert drafted and drafted[-1] > 0, "the server reported no drafting: " + failure(text)
    # every sample was generated and scored: veRL dumps each step's samples with their scores
    dumps = sorted((tmp_path / "rollouts").glob("*.jsonl"))
    assert len(dumps) == STEPS
    for dump in dumps:
        rows = [json.loads(line) for line in dump.read_text().splitlines()]
        assert len(rows) == PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
        assert all(row["score"] in (0.0, 1.0) for row in rows)
