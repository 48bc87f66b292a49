"""TRL's GRPOTrainer generating through `rollout.integrations.trl` on the shipped tiny model, CPU, float32."""

from __future__ import annotations

import copy
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="the trl extra is not installed")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rollout.integrations.trl import check_trainer, tokenize_prompts, trl_rollout_func  # noqa: E402
from rollout.models.zoo import load_model  # noqa: E402
from rollout.tasks import arithmetic_dataset, arithmetic_reward  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402


def arithmetic(completions, answer, **kwargs):
    return arithmetic_reward(completions, answer)


def length(completions, **kwargs):
    """A reward that differs between the samples of a group (arithmetic alone may not: then every advantage is 0, the
    loss has no gradient and the weights never change)."""
    return [len(c) / 100 for c in completions]


def make_trainer(tmp_path, rollout_func, dataset=None, tokenizer=None, reward_funcs=(arithmetic,), **config):
    model, tok = load_model("tiny-target")
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,  # completions per step: 2 prompts x 4
        num_generations=4,
        max_completion_length=40,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=7,
    )
    settings.update(config)
    dataset = dataset if dataset is not None else arithmetic_dataset(16, split="train", seed=0)
    return GRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=GRPOConfig(**settings),
        train_dataset=dataset,
        processing_class=tokenizer or tok,
        rollout_func=rollout_func,
    )


class Recorder:
    """Wraps the trainer's batch preparation: keeps what the adapter returned and TRL's own recomputed log-probs
    under the weights of that moment, and under the weights before training (to tell stale weights apart)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.initial = copy.deepcopy(trainer.model).eval()
        self.batches = []
        self.inner = trainer._generate_and_score_completions
        trainer._generate_and_score_completions = self

    def __call__(self, inputs):
        out = self.inner(inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        width = out["completion_ids"].shape[1]
        with torch.no_grad():
            current, _, _ = self.trainer._get_per_token_logps_and_entropies(self.trainer.model, ids, mask, width)
            stale, _, _ = self.trainer._get_per_token_logps_and_entropies(self.initial, ids, mask, width)
        self.batches.append(
            {**out, "trl_logps": current, "stale_logps": stale, "prompts": [x["prompt"] for x in inputs]}
        )
        return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    func = trl_rollout_func(spec=SpecConfig(method="suffix", num_speculative_tokens=3))
    trainer = make_trainer(tmp_path_factory.mktemp("grpo"), func, reward_funcs=(arithmetic, length))
    recorder = Recorder(trainer)
    trainer.train()
    return trainer, func, recorder


def test_grpo_trainer_runs_with_gradient_checkpointing_one_completion_per_prompt(trained):
    trainer, func, recorder = trained
    assert trainer.args.gradient_checkpointing and trainer.model.training
    assert len(recorder.batches) == 3
    for batch in recorder.batches:
        prompts = batch["prompts"]
        assert len(prompts) == 8 and len(set(prompts)) == 2  # TRL repeats each prompt num_generations times
        assert batch["completion_ids"].shape[0] == len(prompts)
        expected = trainer.processing_class(text=prompts)["input_ids"]
        for row, ids in enumerate(expected):
            assert batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist() == ids
    assert func.generator.model is trainer.accelerator.unwrap_model(trainer.model)
    assert func.dtype == torch.float32


def test_returned_logprobs_match_trls_recomputed_ones_and_the_updated_weights(trained):
    _, _, recorder = trained
    for step, batch in enumerate(recorder.batches):
        mask = batch["completion_mask"].bool()
        ours = batch["sampling_per_token_logps"][mask]
        assert (ours - batch["trl_logps"][mask]).abs().max().item() < 1e-4, step
    # the optimiser changed the weights, and the last rollout was sampled from the changed ones
    last = recorder.batches[-1]
    mask = last["completion_mask"].bool()
    assert (last["sampling_per_token_logps"][mask] - last["stale_logps"][mask]).abs().max().item() > 1e-3


def test_rollout_metrics_are_logged_with_the_trainers(trained):
    trainer, func, _ = trained
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3
    for entry in logged:
        assert entry["rollout/tokens_per_s"] > 0 and entry["rollout/bulk/tokens_per_s"] > 0
        assert entry["rollout/mean_k"] == pytest.approx(3.0, abs=1e-6)  # static K=3 on every decode step
        assert 0 <= entry["rollout/bulk/acceptance_rate"] <= 1
    assert func.last_summary["total"]["tokens"] > 0


def test_same_seed_same_rewards(tmp_path):
    def run(folder):
        trainer = make_trainer(tmp_path / folder, trl_rollout_func(), max_steps=2)
        recorder = Recorder(trainer)
        trainer.train()
        rewards = [entry["reward"] for entry in trainer.state.log_history if "loss" in entry]
        return rewards, [b["completion_ids"].tolist() for b in recorder.batches]

    first, second, third = run("a"), run("b"), None
    assert first == second
    third = make_trainer(tmp_path / "c", trl_rollout_func(), max_steps=2, seed=8)
    recorder = Recorder(third)
    third.train()
    assert [b["completion_ids"].tolist() for b in recorder.batches] != first[1]


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Answer' + (' briefly' if brief else '') + ':' }}{% endif %}"
)


def test_conversational_prompts_are_formatted_as_trl_does(tmp_path):
    _, tokenizer = load_model("tiny-target")
    tokenizer.chat_template = CHAT_TEMPLATE
    rows = arithmetic_dataset(8, split="train", seed=1)
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p}] for p in rows["problem"]], "answer": rows["answer"]}
    )
    func = trl_rollout_func()
    trainer = make_trainer(
        tmp_path, func, dataset=dataset, tokenizer=tokenizer, max_steps=1, chat_template_kwargs={"brief": True}
    )
    recorder = Recorder(trainer)
    trainer.train()
    batch = recorder.batches[0]
    expected = tokenize_prompts(batch["prompts"], trainer)
    text = tokenizer.decode(expected[0])
    assert text.startswith("<user>") and text.endswith("Answer briefly:")
    for row, ids in enumerate(expected):
        assert batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist() == ids


def test_lora_model_generates_with_its_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    func = trl_rollout_func()
    trainer = make_trainer(tmp_path, func, max_steps=2, learning_rate=5e-2)
    trainer = GRPOTrainer(
        model=trainer.model,
        reward_funcs=[arithmetic],
        args=trainer.args,
        train_dataset=trainer.train_dataset,
        processing_class=trainer.processing_class,
        rollout_func=func,
        peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    recorder = Recorder(trainer)
    trainer.train()
    assert type(func.generator.model).__name__ == "PeftModel"
    for batch in recorder.batches:
        mask = batch["completion_mask"].bool()
        assert (batch["sampling_per_token_logps"][mask] - batch["trl_logps"][mask]).abs().max().item() < 1e-4


def test_bf16_generation_states_its_dtype(tmp_path, caplog):
    func = trl_rollout_func()
    trainer = make_trainer(tmp_path, func, max_steps=1, bf16=True, max_completion_length=16)
    with caplog.at_level("WARNING", logger="rollout.integrations.trl"):
        trainer.train()
    assert func.dtype == torch.bfloat16
    assert "in bfloat16 (accelerate's bf16 autocast" in caplog.text


@pytest.mark.parametrize(
    "config, match",
    [
        ({"min_p": 0.1}, "min_p=0.1"),
        ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"),
        ({"generation_kwargs": {"do_sample": False}}, r"generation_kwargs=\['do_sample'\]"),
        # refused before the first rollout: TRL failed after it, dividing its logits by 0 (ZeroDivisionError)
        ({"temperature": 0.0}, r"temperature=0.0 \(GRPO samples: it must be above 0"),
    ],
)
def test_settings_it_cannot_honour_are_refused_by_name(tmp_path, config, match):
    trainer = make_trainer(tmp_path, trl_rollout_func(), max_steps=1, **config)
    with pytest.raises(ValueError, match=f"trl_rollout_func cannot honour the trainer's {match}"):
        trainer.train()


@pytest.mark.parametrize(
    "attribute, value, match",
    [
        ("use_vllm", True, "use_vllm=True"),
        ("is_fsdp_enabled", True, "FSDP / DeepSpeed ZeRO-3"),
        ("tools", [len], "tools"),
    ],
)
def test_backends_it_does_not_drive_are_refused(tmp_path, attribute, value, match):
    trainer = make_trainer(tmp_path, trl_rollout_func(), max_steps=1)
    setattr(trainer, attribute, value)  # these need vLLM, several GPUs or a tool-calling template to set for real
    with pytest.raises(ValueError, match=match):
        check_trainer(trainer)


def test_a_setting_a_later_trl_drops_is_said_not_taken_as_off(tmp_path):
    """The refusals read the trainer's settings with defaults (use_vllm False, min_p None, ...): a TRL that moved one
    would have dropped its refusal without a word. A GRPOConfig without one of them is said."""
    from types import SimpleNamespace

    trainer = make_trainer(tmp_path, trl_rollout_func(), max_steps=1)
    trainer.args = SimpleNamespace(**{k: v for k, v in vars(trainer.args).items() if k != "min_p"})
    with pytest.raises(ValueError, match="this TRL's GRPOConfig has no min_p: the rollout adapter is tested with TRL"):
        check_trainer(trainer)


def test_a_min_p_of_zero_filters_nothing_and_is_taken(tmp_path):
    trainer = make_trainer(tmp_path, trl_rollout_func(), max_steps=1, min_p=0.0)
    check_trainer(trainer)


def test_an_evaluation_call_leaves_the_training_calls_seeds_as_they_are(tmp_path):
    """A training resumed from a checkpoint makes no evaluation call before its first step's training call, where the
    uninterrupted one evaluated after the step before: both must draw the same samples. Evaluation draws its own."""
    trainer = make_trainer(tmp_path, None, max_steps=1)
    prompts = [p for p in trainer.train_dataset["prompt"][:2] for _ in range(4)]
    resumed = trl_rollout_func()
    trainer.model.train()
    alone = resumed(prompts, trainer)["completion_ids"]
    evaluated = trl_rollout_func()
    trainer.model.eval()
    evaluation = evaluated(prompts, trainer)["completion_ids"]
    trainer.model.train()
    assert evaluated(prompts, trainer)["completion_ids"] == alone  # the training call after an evaluation call
    assert evaluation != alone


def test_bad_adapter_arguments_name_the_argument():
    with pytest.raises(ValueError, match="max_batch_size .0. must be a positive integer"):
        trl_rollout_func(max_batch_size=0)
    with pytest.raises(ValueError, match="spec must be a specdec.config.SpecConfig"):
        trl_rollout_func(spec={"method": "suffix"})
    with pytest.raises(ValueError, match="kv_layout .'blocks'. must be one of auto, paged, slots"):
        trl_rollout_func(kv_layout="blocks")
    with pytest.raises(ValueError, match="cuda_graphs .'on'. must be True, False or 'auto'"):
        trl_rollout_func(cuda_graphs="on")


def test_stop_ids_ignore_eos_and_engine_settings_reach_the_generator(tmp_path):
    """What `rollout train` passes from its recipe (sampling.stop_token_ids / ignore_eos, the rollout section's engine
    settings) is what the generator runs with: a stop id ends a completion besides the trainer's EOS; past the EOS
    every completion runs to max_completion_length."""
    prompts = ["Question: Ann has 3 apples and buys 2 more. How many?\nAnswer:"] * 4
    period = 15  # "." in the shipped tokenizer (EOS is 0)
    func = trl_rollout_func(stop_token_ids=[period], kv_layout="paged", async_scheduling=True)
    trainer = make_trainer(tmp_path, func, max_steps=1)
    out = func(prompts, trainer)
    assert func.generator.config.kv_layout == "paged" and func.generator.config.async_scheduling
    for ids in out["completion_ids"]:
        stops = [i for i, t in enumerate(ids) if t in (period, 0)]
        assert stops == [len(ids) - 1] or (not stops and len(ids) == 40), ids  # cut at its first stop, or at the cap
    assert any(ids[-1] == period for ids in out["completion_ids"]), "no completion stopped at the stop id"
    func = trl_rollout_func(ignore_eos=True)
    out = func(prompts, make_trainer(tmp_path, func, max_steps=1))
    assert [len(ids) for ids in out["completion_ids"]] == [40] * 4
    with pytest.raises(ValueError, match="stop_token_ids .5. must be a list"):
        trl_rollout_func(stop_token_ids=5)


def test_a_completion_a_stop_id_ended_counts_as_finished_for_trl(tmp_path):
    """TRL counts a completion that does not end in its EOS ids as truncated: mask_truncated_completions masked every
    completion a stop id ended, and the loss was 0. The adapter adds its stop ids to the trainer's EOS ids: those
    completions keep their loss mask, and only those cut at max_completion_length are masked and counted clipped."""
    period = 15  # "." in the shipped tokenizer (EOS is 0)
    inner = trl_rollout_func(stop_token_ids=[period])
    returned = []

    def func(prompts, trainer):
        out = inner(prompts, trainer)
        returned.extend(out["completion_ids"])
        return out

    # 20 tokens: some completions reach a "." within them, the others are cut there
    settings = dict(max_steps=1, mask_truncated_completions=True, max_completion_length=20)
    trainer = make_trainer(tmp_path, func, reward_funcs=(length,), **settings)
    eos_before = list(trainer.eos_token_ids)
    masks = []
    inner_score = trainer._generate_and_score_completions

    def recorded(inputs):
        out = inner_score(inputs)
        masks.extend(out["completion_mask"].sum(1).tolist())
        return out

    trainer._generate_and_score_completions = recorded
    trainer.train()
    assert trainer.eos_token_ids == [*eos_before, period]
    ended = [ids[-1] in (period, 0) for ids in returned]
    assert any(ended) and not all(ended), f"expected completions of both kinds: {[len(ids) for ids in returned]}"
    for ids, stopped, kept in zip(returned, ended, masks):
        assert kept == (len(ids) if stopped else 0)  # masked only where cut at max_completion_length
    log = next(e for e in trainer.state.log_history if "completions/clipped_ratio" in e)
    assert log["completions/clipped_ratio"] == pytest.approx(1 - sum(ended) / len(ended))


def test_a_streamed_data_set_is_not_read_to_size_the_generator(tmp_path):
    """The generator is sized from the longest prompt of a data set that can be listed; a streamed one (an
    IterableDataset, which may be endless or remote) is not read for it: the first call's prompts size it."""
    from datasets import IterableDataset

    pulled = []

    def rows():
        for i in range(5000):
            pulled.append(i)
            yield {"prompt": f"Question: Ann has {i} apples and buys 1 more. How many?\nAnswer:", "answer": str(i + 1)}

    func = trl_rollout_func()
    trainer = make_trainer(tmp_path, func, dataset=IterableDataset.from_generator(rows), max_steps=1)
    pulled.clear()
    out = func(["Question: Ann has 3 apples.\nAnswer:"] * 4, trainer)
    assert len(out["completion_ids"]) == 4
    assert not pulled, f"the adapter read {len(pulled)} rows of the stream"
    assert func.generator.max_seq_len >= len(out["prompt_ids"][0]) + 40


def test_a_longer_prompt_grows_the_generator_and_keeps_the_drafting_history(tmp_path):
    func = trl_rollout_func(spec=SpecConfig(method="suffix", num_speculative_tokens=3))
    trainer = make_trainer(tmp_path, func, max_steps=1)
    short = ["Question: Ann has 3 apples.\nAnswer:"] * 2
    out = func(short, trainer)
    assert len(out["completion_ids"]) == 2 and out["prompt_ids"][0] == out["prompt_ids"][1]
    first = func.generator
    assert func.generator.max_seq_len >= len(out["prompt_ids"][0]) + 40
    before = first.draft_history.stats()["responses"]
    assert before == 2
    long_prompt = "Question: " + "Ann has 3 apples and buys 2 more. " * 80 + "\nAnswer:"  # longer than the data set's
    out = func([long_prompt, *short], trainer)
    assert [len(ids) for ids in out["completion_ids"]] and len(out["completion_ids"]) == 3
    assert func.generator is not first and func.generator.max_seq_len >= len(out["prompt_ids"][0]) + 40
    assert func.generator.draft_history.stats()["responses"] == before + 3  # the old history came along
    bounded = trl_rollout_func(max_seq_len=64)
    with pytest.raises(ValueError, match="needs .* positions but max_seq_len is 64"):
        bounded([long_prompt], trainer)


def test_a_saved_history_is_taken_by_the_first_generator_and_a_damaged_one_left_with_a_warning(tmp_path, caplog):
    """`history_to_load` (a resumed `rollout train` sets it from its checkpoint) goes into the generator when it is
    first built; a file that does not load is warned of and drafting starts from none (it changes no sample) rather
    than stopping every resume of the training."""
    spec = SpecConfig(method="suffix", num_speculative_tokens=3)
    source = trl_rollout_func(spec=spec)
    prompts = ["Question: Ann has 3 apples.\nAnswer:"] * 2
    source(prompts, make_trainer(tmp_path / "a", source, max_steps=1))
    source.generator.draft_history.save(tmp_path / "history.npz")
    func = trl_rollout_func(spec=spec)
    func.history_to_load = tmp_path / "history.npz"
    func(prompts, make_trainer(tmp_path / "b", func, max_steps=1))
    assert func.generator.draft_history.stats()["responses"] == 2 + 2 and func.history_to_load is None
    (tmp_path / "damaged.npz").write_bytes(b"not an archive")
    damaged = trl_rollout_func(spec=spec)
    damaged.history_to_load = tmp_path / "damaged.npz"
    with caplog.at_level("WARNING", logger="rollout.integrations.trl"):
        out = damaged(prompts, make_trainer(tmp_path / "c", damaged, max_steps=1))
    assert len(out["completion_ids"]) == 2 and damaged.generator.draft_history.stats()["responses"] == 2
    assert "drafting from an empty history" in caplog.text and "damaged.npz" in caplog.text


def test_a_learned_position_table_bounds_the_room_rounded_up_for_the_data_set(tmp_path):
    """The generator's positions are rounded up to a power of two, but never past a learned position table that holds
    the data set's longest prompt and its completion: GPT-2 with a table of that size plus one trains."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = load_model("tiny-target")
    dataset = arithmetic_dataset(16, split="train", seed=0)
    needed = max(len(tok(p)["input_ids"]) for p in dataset["prompt"]) + 40  # max_completion_length
    num_positions = needed + 1
    assert num_positions < 1 << (num_positions - 1).bit_length(), "pick a size the rounding would pass"
    config = GPT2Config(vocab_size=len(tok), n_positions=num_positions, n_embd=32, n_layer=1, n_head=2)
    config.eos_token_id = config.bos_token_id = tok.eos_token_id
    func = trl_rollout_func()
    trainer = make_trainer(tmp_path, func, max_steps=1)
    trainer = GRPOTrainer(
        model=GPT2LMHeadModel(config),
        reward_funcs=[arithmetic],
        args=trainer.args,
        train_dataset=dataset,
        processing_class=tok,
        rollout_func=func,
    )
    trainer.train()  # it failed: the table held fewer positions than max_seq_len (the power of two above)
    assert func.generator.max_seq_len == num_positions


def test_the_room_rounded_up_stops_where_rotary_scaling_would_begin():
    """A longrope policy leaves 48 positions unscaled: a call needing 40 gets 48, not 64 (which it would refuse)."""
    from test_generator import rope_scaled_model

    from rollout.integrations.trl import _room

    model = rope_scaled_model("longrope")
    assert (_room(40, model, None), _room(48, model, None), _room(40, load_model("tiny-target")[0], None)) == (
        48,
        48,
        64,
    )


def test_the_generator_is_built_once_with_room_for_the_datasets_longest_prompt(tmp_path):
    func = trl_rollout_func(spec=SpecConfig(method="suffix", num_speculative_tokens=3))
    short = "Question: Ann has 3 apples.\nAnswer:"
    long_prompt = "Question: " + "Ann has 3 apples and buys 2 more. " * 20 + "\nAnswer:"
    dataset = Dataset.from_dict({"prompt": [short] * 7 + [long_prompt], "answer": ["3"] * 8})
    trainer = make_trainer(tmp_path, func, dataset=dataset, max_steps=1)
    func([short] * 4, trainer)
    first = func.generator
    long_ids = tokenize_prompts([long_prompt], trainer)[0]
    assert first.max_seq_len >= len(long_ids) + 40  # sized from the data set, not from the first call's prompts
    func([long_prompt] * 4, trainer)
    assert func.generator is first


def test_a_rebuilt_generator_is_planned_after_the_old_one_is_freed(tmp_path, monkeypatch):
    """The old generator's KV pool (and on a GPU its graphs) must be gone when the new one is planned from the free
    memory: two at once would plan the new pool smaller, or refuse it."""
    import weakref

    import rollout.integrations.trl as adapter

    func = trl_rollout_func(spec=SpecConfig(method="suffix", num_speculative_tokens=3))
    trainer = make_trainer(tmp_path, func, max_steps=1)
    short = "Question: Ann has 3 apples.\nAnswer:"
    func([short] * 2, trainer)
    old = weakref.ref(func.generator.runner.cache)  # the old generator's KV cache (its graphs go with it)
    alive_when_planned = []
    planner = adapter.fitting_batch_size

    def planning(*args, **kwargs):
        alive_when_planned.append(old() is not None)
        return planner(*args, **kwargs)

    monkeypatch.setattr(adapter, "fitting_batch_size", planning)
    long_prompt = "Question: " + "Ann has 3 apples and buys 2 more. " * 80 + "\nAnswer:"
    func([long_prompt], trainer)  # needs more positions than the first generator has: a rebuild
    assert alive_when_planned == [False]
    assert func.generator.draft_history.stats()["responses"] == 3  # the history still came along
