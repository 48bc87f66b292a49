"""The rollout loop: RolloutBatch fields line up with a teacher-forced forward, rewards, advantages, conversions,
phase labels, and reuse of one generator over the trainer's live model."""

import copy
import dataclasses
import functools
import io
import json
import math

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from rollout.batch import RolloutBatch, group_advantages
from rollout.cli.progress import Progress
from rollout.cli.sources import load_dataset
from rollout.cli.tracking import RunTracker
from rollout.loop import Rollout
from rollout.models.zoo import load_model
from rollout.phases import PhaseLabeler, summarize
from rollout.prompts import PromptFormatter
from rollout.rewards import build_rewards, resolve_reward, score
from rollout.tasks import arithmetic_dataset, arithmetic_reward
from specdec.config import SpecConfig


def completion_length(completions: list[str], **kwargs) -> list[float]:
    """A `module:function` reward for the tests: the completion's length in characters."""
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-target")


@pytest.fixture(scope="module")
def data():
    return arithmetic_dataset(4, split="eval", seed=0)


@pytest.fixture(scope="module")
def rollout(tiny):
    model, tokenizer = tiny
    return Rollout(
        model,
        tokenizer,
        rewards=[("arithmetic", 2.0), ("test_rollout_loop:completion_length", 0.5)],
        sampling=SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=0),
        spec=SpecConfig(method="ngram", num_speculative_tokens=2),
        max_batch_size=8,
        max_seq_len=256,
    )


@pytest.fixture(scope="module")
def batch(rollout, data):
    return rollout(data)


def test_batch_is_prompt_major_with_one_entry_per_sample(batch, data):
    assert len(batch) == 3 * len(data)
    assert batch.group_index == [g for g in range(len(data)) for _ in range(3)]
    assert batch.sample_index == [0, 1, 2] * len(data)
    assert all(len(lp) == len(ids) for lp, ids in zip(batch.logprobs, batch.completion_ids))
    assert batch.truncated == [r == "length" for r in batch.finish_reason]
    assert "length" in batch.finish_reason  # max_new_tokens 40 truncates the longer problems
    for ids, reason in zip(batch.completion_ids, batch.finish_reason):
        assert (ids[-1] == 0) == (reason == "stop"), "a stopped completion ends with EOS (id 0), a truncated one not"


def test_padded_tensors_line_up_with_a_teacher_forced_forward(batch, tiny):
    model, _ = tiny
    t = batch.to_padded()
    lengths = torch.tensor([len(ids) for ids in batch.completion_ids])
    assert torch.equal(t["completion_mask"].sum(1), lengths)
    assert torch.equal(t["prompt_mask"].sum(1), torch.tensor([len(p) for p in batch.prompt_ids]))
    assert (t["logprobs"][t["completion_mask"] == 0] == 0).all()
    assert (t["completion_ids"][t["completion_mask"] == 0] == batch.pad_token_id).all()
    # left-padded prompt + right-padded completion: each row's tokens are contiguous, so one forward scores them
    input_ids = torch.cat([t["prompt_ids"], t["completion_ids"]], dim=1)
    mask = torch.cat([t["prompt_mask"], t["completion_mask"]], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits.double()
    width = t["prompt_ids"].shape[1]
    # temperature 1, no top-k/top-p: the behaviour log-prob is the plain log-softmax of the token's logits
    logp = torch.log_softmax(logits[:, width - 1 : -1], dim=-1).gather(2, t["completion_ids"][..., None])[..., 0]
    real = t["completion_mask"].bool()
    assert torch.allclose(logp[real].float(), t["logprobs"][real], atol=1e-4)


def test_rewards_are_the_weighted_sum_of_the_terms(batch, data):
    answers = [data["answer"][g] for g in batch.group_index]
    correct = arithmetic_reward(batch.completion, answers)
    assert batch.reward_terms["arithmetic"] == correct
    assert batch.reward_terms["test_rollout_loop:completion_length"] == [float(len(c)) for c in batch.completion]
    expected = [2.0 * c + 0.5 * len(text) for c, text in zip(correct, batch.completion)]
    assert batch.reward == pytest.approx(expected)
    assert sum(correct) > 0, "the tiny model solves some of the short problems"


def test_arithmetic_reward_on_known_answers():
    rows = arithmetic_dataset(6, split="eval", seed=1)
    gold = list(rows["completion"])
    wrong = [c.rsplit("####", 1)[0] + f"#### {int(a) + 1}" for c, a in zip(gold, rows["answer"])]
    terms = build_rewards([("arithmetic", 1.0)])
    total, _ = score(terms, gold + wrong + ["no answer"], {"answer": list(rows["answer"]) * 2 + ["3"]})
    assert total == [1.0] * 6 + [0.0] * 6 + [0.0]


def test_gsm8k_reward_reads_the_reference_after_the_marker():
    gsm8k = resolve_reward("gsm8k")
    answers = ["... #### 1,234", "#### 72", "#### 5", "#### 3"]
    assert gsm8k(["so 1,234 #### 1234", "It is 72.", "#### 5 not 6", "no number"], answer=answers) == [1, 1, 1, 0]


def test_unknown_rewards_name_the_choices(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown reward name 'nope'.*arithmetic"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="reward ':f' must be 'module:function', both named"):
        resolve_reward(":f")
    (tmp_path / "broken_rewards.py").write_text("def f(completions, **kw)\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="importing module 'broken_rewards' raised SyntaxError"):
        resolve_reward("broken_rewards:f")
    with pytest.raises(ValueError, match="no function 'missing'"):
        resolve_reward("test_rollout_loop:missing")
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        score(build_rewards([(lambda completions, **kw: [1.0], 1.0)]), ["a", "b"], {})
    for weight in (float("nan"), float("inf"), "heavy"):
        with pytest.raises(ValueError, match=r"the weight of reward 'arithmetic' \(.*\) must be a finite number"):
            build_rewards([("arithmetic", weight)])


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups, eps=1e-12)
    assert adv[:2].tolist() == pytest.approx([1.0, -1.0])
    assert adv[2:].tolist() == pytest.approx([0.0, 0.0, 0.0])  # equal rewards and groups of one: no signal
    assert group_advantages(rewards, groups, scale=False).tolist() == pytest.approx([0.5, -0.5, 0, 0, 0])
    # TRL's GRPOTrainer divides by the sample std (Bessel-corrected); a group of one still gets 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    sample = group_advantages(rewards, groups, eps=0.0, std="sample")
    assert sample[:3].tolist() == pytest.approx(((rewards[:3] - rewards[:3].mean()) / rewards[:3].std()).tolist())
    assert sample[3:5].tolist() == pytest.approx(((rewards[3:5] - 3.5) / rewards[3:5].std()).tolist())
    assert group_advantages(rewards, groups, std="sample")[5].item() == 0.0
    with pytest.raises(ValueError, match="std .'ddof'. must be 'population'"):
        group_advantages(rewards, groups, std="ddof")
    # a non-finite reward is missing: advantage 0, left out of its group's mean and std
    rewards = torch.tensor([1.0, float("nan"), 0.0, float("inf"), 2.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1]), eps=0.0)
    assert adv.tolist() == [1.0, 0.0, -1.0, 0.0, 0.0]
    # equal rewards whose mean rounds off them (3 x 0.1 sums to 0.30000000000000004): still exactly 0, at eps 0 too
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.7, 0.7, 0.7], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    for std in ("population", "sample"):
        adv = group_advantages(rewards, groups, eps=0.0, std=std)
        assert adv[[0, 1, 2, 5, 6, 7]].tolist() == [0.0] * 6 and adv[3] > 0 > adv[4]
    assert group_advantages(rewards, groups, scale=False)[[0, 1, 2, 5, 6, 7]].tolist() == [0.0] * 6
    # and `to_padded` masks a reward the advantages leave out, a NaN or infinite one a trainer set too (it said True,
    # and a trainer's masked mean of the rewards came out NaN)
    batch = RolloutBatch(
        group_index=[0, 0, 0], sample_index=[0, 1, 2], prompt=["p"] * 3, completion=["c"] * 3,
        prompt_ids=[[5]] * 3, completion_ids=[[6]] * 3, logprobs=[[-0.5]] * 3, finish_reason=["stop"] * 3,
        reward=[1.0, float("nan"), float("inf")], pad_token_id=0,
    )  # fmt: skip
    tensors = batch.to_padded()
    assert tensors["reward_mask"].tolist() == [True, False, False] and tensors["rewards"].tolist() == [1.0, 0.0, 0.0]


def test_non_finite_rewards_recorded_as_null(tiny):
    model, tokenizer = tiny

    def half_nan(completions, **kwargs):
        return [float("nan") if i % 2 else 1.0 + i for i in range(len(completions))]

    kwargs = dict(sampling=SamplingParams(n=4, max_new_tokens=4, seed=0), max_batch_size=8, max_seq_len=64)
    prompts = ["1 + 1 = ", "2 + 3 = "]
    with pytest.raises(ValueError, match=r"prompt 0: reward 'half_nan' returned nan .*non_finite_rewards_as_null"):
        Rollout(model, tokenizer, rewards=half_nan, **kwargs)(prompts)
    batch = Rollout(model, tokenizer, rewards=half_nan, non_finite_rewards_as_null=True, **kwargs)(prompts)
    assert batch.reward == [1.0, None, 3.0, None] * 2 and batch.reward_terms["half_nan"] == batch.reward
    assert batch.summary["num_null_rewards"] == 4 and batch.summary["reward_mean"] == 2.0
    assert batch.advantages().tolist() == [-1.0 / (1.0 + 1e-4), 0.0, 1.0 / (1.0 + 1e-4), 0.0] * 2
    tensors = batch.to_padded()
    assert tensors["reward_mask"].tolist() == [True, False] * 4 and tensors["rewards"].tolist() == [1, 0, 3, 0] * 2
    json.dumps(batch.records(), allow_nan=False)
    assert RolloutBatch.from_dataset(batch.to_dataset()).reward == batch.reward


CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{{ 'Answer:' }}"


def test_prompts_as_text_chat_messages_or_token_ids_with_n_per_call(tiny, data):
    import copy

    import numpy as np

    model, tokenizer = tiny
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    rollout = Rollout(model, tokenizer, rewards=None, sampling=SamplingParams(n=3, max_new_tokens=12), max_batch_size=8)
    texts = list(data["prompt"][:2])
    by_text = rollout(texts, seed=5, n=2)
    assert len(by_text) == 4 and by_text.group_index == [0, 0, 1, 1] and by_text.sample_index == [0, 1, 0, 1]
    assert by_text.prompt == [texts[0]] * 2 + [texts[1]] * 2
    assert by_text.prompt_ids[0] == tokenizer(texts[0])["input_ids"]
    # the same prompt tokens and seed give the same samples, whichever way the prompts came in
    by_rows = rollout(list(data.select(range(2))), seed=5, n=2)
    by_ids = rollout([np.array(tokenizer(t)["input_ids"]) for t in texts], seed=5, n=2)
    assert by_rows.completion_ids == by_text.completion_ids == by_ids.completion_ids
    assert by_ids.prompt_ids == by_text.prompt_ids
    assert len(rollout(texts, seed=5)) == 6  # n from the sampling settings when the call names none
    chat = rollout([[{"role": "user", "content": "3 + 4?"}]], seed=0, n=1)
    assert chat.prompt == ["<user>3 + 4?Answer:"]
    assert chat.prompt_ids[0] == tokenizer("<user>3 + 4?Answer:", add_special_tokens=False)["input_ids"]
    # no rewards: the trainer scores; advantages need the rewards first
    assert by_text.reward is None and by_text.summary["reward_mean"] is None
    assert "rewards" not in by_text.to_padded() and "advantages" not in by_text.to_padded()
    with pytest.raises(ValueError, match="no rewards"):
        by_text.advantages()
    by_text.reward = [1.0, 0.0, 2.0, 2.0]
    assert by_text.advantages(std="sample").tolist() == pytest.approx([2**-0.5, -(2**-0.5), 0.0, 0.0], abs=1e-3)
    with pytest.raises(ValueError, match="mixes kinds of prompt .chat, text."):
        rollout([texts[0], [{"role": "user", "content": "x"}]])
    with pytest.raises(ValueError, match="list of prompts or rows"):
        rollout(texts[0])
    with pytest.raises(ValueError, match="empty prompt"):
        rollout([[]])
    # a tokenizer's encoding iterated its keys: two prompts, 'input_ids' and 'attention_mask'
    with pytest.raises(ValueError, match=r"^data is a tokenizer's encoding \(input_ids, ...\): pass a list of prompts"):
        rollout(tokenizer(texts))
    with pytest.raises(ValueError, match="^data must be a list of prompts or rows"):  # a text naming input_ids
        rollout("what are input_ids?")
    with pytest.raises(ValueError, match=r"^data holds float64 np.float64\(2\.0\): a prompt is a row"):  # not an id
        rollout(np.array([2.0]))
    # one prompt not wrapped in a list: each id taken as a prompt (an int, or a 0-d array failing in Python's words)
    for flat in ([5, 6, 7], np.array([5, 6, 7]), torch.tensor([5, 6, 7])):
        with pytest.raises(
            ValueError, match=r"^data holds the token id .*goes in a list of its own \(\[\[5, 6, 7\]\]\)"
        ):
            rollout(flat)
    # ids outside the vocabulary are named before the tokenizer decodes them (it raised OverflowError)
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match=rf"prompt 0 has token id {bad} outside the model's vocabulary"):
            rollout([[5, bad, 7]])
    # settings changed on the loop's SamplingParams are checked by the call (it sampled at temperature -1)
    rollout.sampling.temperature = -1.0
    with pytest.raises(ValueError, match=r"temperature \(-1.0\) must be 0"):
        rollout(texts)
    with pytest.raises(ValueError, match="no chat template"):
        Rollout(model, tiny[1], rewards=None, max_batch_size=2)([[{"role": "user", "content": "x"}]])


def test_dataset_round_trip(batch):
    dataset = batch.to_dataset()
    assert len(dataset) == len(batch)
    assert dataset["advantage"] == pytest.approx(batch.advantages().tolist())
    back = RolloutBatch.from_dataset(dataset, pad_token_id=batch.pad_token_id)
    for name in ("group_index", "prompt", "completion", "prompt_ids", "completion_ids", "finish_reason", "reward"):
        assert getattr(back, name) == getattr(batch, name), name
    assert [lp for row in back.logprobs for lp in row] == pytest.approx([lp for row in batch.logprobs for lp in row])
    assert back.reward_terms.keys() == batch.reward_terms.keys()
    a, b = batch.to_padded(), back.to_padded()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # plain lists, as the fields say: they go to JSON and take item assignment (a trainer setting rewards)
    assert all(type(getattr(back, name)) is list for name in ("group_index", "completion_ids", "logprobs", "reward"))
    assert all(type(values) is list for values in back.reward_terms.values())
    json.dumps({"reward": back.reward, "terms": back.reward_terms})
    back.reward[0] = 0.5
    # scored with every reward null (non-finite ones recorded as null): still scored after the round trip
    nulls = dataclasses.replace(batch, reward=[None] * len(batch), reward_terms={})
    again = RolloutBatch.from_dataset(nulls.to_dataset(), pad_token_id=batch.pad_token_id)
    assert again.reward == [None] * len(batch) and again.advantages().tolist() == [0.0] * len(batch)
    assert (
        RolloutBatch.from_dataset(dataclasses.replace(batch, reward=None, reward_terms={}).to_dataset()).reward is None
    )


def test_one_generator_runs_the_trainers_live_model(data):
    model, tokenizer = load_model("tiny-target")  # its own copy: the test changes its weights
    rollout = Rollout(model, tokenizer, sampling=SamplingParams(n=2, max_new_tokens=8, seed=0), max_batch_size=4)
    generator = rollout.generator
    first = rollout(data.select(range(2)))
    assert first.summary["reward_mean"] >= 0
    with torch.no_grad():
        model.model.norm.weight.zero_()  # an in-place "training step": every logit becomes 0
    second = rollout(data.select(range(2)), seed=1)
    assert rollout.generator is generator
    uniform = -math.log(model.config.vocab_size)
    assert all(lp == pytest.approx(uniform, abs=1e-5) for row in second.logprobs for lp in row)


def test_steps_are_labelled_and_summarised(batch):
    phases = [s["phase"] for s in batch.steps]
    assert phases[0] == "prefill" and set(phases) <= {"prefill", "bulk", "tail"}
    assert sum(s["num_emitted"] for s in batch.steps) == batch.num_tokens == batch.summary["total"]["tokens"]
    elapsed = [s["elapsed"] for s in batch.steps]
    assert elapsed == sorted(elapsed)


def test_phase_labels_follow_the_peak_decode_batch():
    labeler = PhaseLabeler(tail_fraction=0.25)
    trace = [("prefill", 3), ("decode", 8), ("decode", 2), ("decode", 1), ("prefill", 1), ("decode", 2)]
    assert [labeler.label(p, b) for p, b in trace] == ["prefill", "bulk", "bulk", "tail", "prefill", "bulk"]
    for bad in (1.5, True):  # (True was taken as 1.0)
        with pytest.raises(ValueError, match="tail_fraction"):
            PhaseLabeler(bad)


def test_summary_definitions():
    def step(phase, batch_size, k, drafted, accepted, emitted, seconds):
        keys = ("phase", "batch_size", "num_draft_tokens", "num_drafted", "num_accepted", "num_emitted", "seconds")
        return dict(zip(keys, (phase, batch_size, k, drafted, accepted, emitted, seconds)))

    steps = [step("prefill", 2, 0, 0, 0, 4, 1.0), step("bulk", 4, 3, 12, 6, 10, 0.5), step("tail", 1, 2, 2, 2, 3, 0.5)]
    s = summarize(steps)
    assert s["phases"]["bulk"] == {
        "seconds": 0.5,
        "tokens": 10,
        "tokens_per_s": 20.0,
        "mean_batch_size": 4.0,
        "mean_k": 3.0,
        "acceptance_rate": 0.5,
        "mean_accepted_length": 1.5,
        "num_steps": 1,
    }
    total = s["total"]
    assert (total["tokens"], total["seconds"], total["tokens_per_s"]) == (17, 2.0, 8.5)
    assert total["mean_batch_size"] == 2.5 and total["mean_k"] == 2.5  # decode steps only
    assert total["acceptance_rate"] == 8 / 14 and total["mean_accepted_length"] == 8 / 5
    assert s["phases"]["prefill"]["mean_accepted_length"] == 0.0
    # tokens rows preempted had emitted are taken off where they were discarded: the total is the completions'
    discarding = [*steps, {**step("bulk", 3, 3, 9, 3, 6, 0.5), "num_preempted": 1, "num_discarded": 5}]
    s = summarize(discarding)
    assert s["phases"]["bulk"]["tokens"] == 10 + 6 - 5 and s["total"]["tokens"] == 17 + 6 - 5
    # no decode step: total's per-step means are over decode steps only, so 0 (not the prefill's prompts)
    only_prefill = summarize([step("prefill", 4, 0, 0, 0, 4, 1.0)])["total"]
    assert only_prefill["mean_batch_size"] == only_prefill["mean_k"] == 0.0 and only_prefill["tokens"] == 4


def test_progress_draws_one_updating_line():
    stream = io.StringIO()
    progress = Progress(stream=stream, enabled=True, min_interval=0.0)
    keys = ("phase", "batch_size", "num_draft_tokens", "num_drafted", "num_accepted", "num_emitted", "elapsed")
    progress(dict(zip(keys, ("bulk", 6, 3, 18, 9, 15, 0.5))), 2, 8)
    progress.close()
    text = stream.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    assert "2/8 samples" in text and "30 tokens/s" in text and "batch 6" in text and "K 3" in text
    assert "acceptance 0.50" in text
    quiet = io.StringIO()
    Progress(stream=quiet)(dict(zip(keys, ("bulk", 6, 3, 18, 9, 15, 0.5))), 2, 8)  # not a terminal: silent
    assert quiet.getvalue() == ""


def test_progress_fits_a_narrow_terminal_and_a_dumb_one(monkeypatch):
    """A line wider than the terminal wraps, and the carriage return then redraws only its last row: every redraw left
    the rows before it behind (a 40-column terminal stacked 8 stale lines above the table). TERM=dumb takes no
    escape: the line is erased by spaces."""
    keys = ("phase", "batch_size", "num_draft_tokens", "num_drafted", "num_accepted", "num_emitted", "elapsed")
    step = dict(zip(keys, ("bulk", 6, 3, 18, 9, 15, 0.5)))
    monkeypatch.setenv("COLUMNS", "40")
    stream = io.StringIO()
    progress = Progress(stream=stream, enabled=True, min_interval=0.0)
    progress(step, 2, 8)
    progress(step, 3, 8)
    drawn = stream.getvalue().split("\r")[1:]
    assert len(drawn) == 2 and all(len(line.replace("\x1b[K", "")) <= 39 for line in drawn), drawn
    monkeypatch.setenv("TERM", "dumb")
    stream = io.StringIO()
    Progress(stream=stream, enabled=True, min_interval=0.0)(step, 2, 8)
    assert "\x1b" not in stream.getvalue() and stream.getvalue().startswith("\rrollout 2/8 samples")


def test_local_data_files_and_templates(tmp_path, tiny, capfd):
    _, tokenizer = tiny
    path = tmp_path / "problems.jsonl"
    path.write_text('{"question": "1 + 1?", "answer": "2"}\n{"question": "2 + 3?", "answer": "5"}\n')
    capfd.readouterr()
    rows = load_dataset(str(path), num_prompts=1)
    assert rows.column_names == ["question", "answer"] and len(rows) == 1
    assert capfd.readouterr() == ("", "")  # a new file, prepared without a progress bar (a run's error stays one line)
    formatter = PromptFormatter(tokenizer, "question", template="Question: {question}\nAnswer:")
    texts, ids = formatter(list(rows))
    assert texts == ["Question: 1 + 1?\nAnswer:"] and ids[0] == tokenizer(texts[0])["input_ids"]
    with pytest.raises(ValueError, match="'missing'.*question, answer"):
        PromptFormatter(tokenizer, "question", template="{missing}")(list(rows))
    with pytest.raises(ValueError, match="no chat template"):
        PromptFormatter(tokenizer, chat_template=True)
    with pytest.raises(ValueError, match=r"system_prompt .* is a chat template's system message"):
        PromptFormatter(tokenizer, "question", system_prompt="Be brief.")
    # a template names its own columns: the prompt column ("prompt" by default) need not be there
    assert PromptFormatter(tokenizer, template="Q: {question}")(list(rows))[0] == ["Q: 1 + 1?"]
    with pytest.raises(ValueError, match=r"data.template \('Q: \{question\[9\]\}'\) cannot be filled from a row"):
        PromptFormatter(tokenizer, template="Q: {question[9]}")(list(rows))
    # an attribute would format a method's repr ("<built-in method upper ...>") into every prompt: refused up front
    with pytest.raises(ValueError, match=r"reads the attribute .upper in \{question.upper\}: a template takes columns"):
        PromptFormatter(tokenizer, template="Q: {question.upper}")
    assert PromptFormatter(tokenizer, template="Q: {question[0]}")(list(rows))[0] == ["Q: 1"]  # an item is taken
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    own = [{"role": "system", "content": "Be long."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="system_prompt is set and a conversation in the data has a system message"):
        PromptFormatter(chat, chat_template=True, system_prompt="Be brief.")([{"prompt": own}])
    # a conversation as a DataFrame or parquet cell holds it (an array of dicts), or as a tuple: it was formatted as
    # the text of its repr, in one user message, without a word
    expected = PromptFormatter(chat, chat_template=True)([{"prompt": own}])[0]
    for held in (np.array(own, dtype=object), tuple(own)):
        assert PromptFormatter(chat, chat_template=True)([{"prompt": held}])[0] == expected


def test_tracker_appends_rollouts_of_a_training_loop(batch, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the environment would win over wandb_mode
    tracker = RunTracker(tmp_path, config={"lr": 1e-6}, wandb_mode="disabled")
    tracker.log_rollout(batch)
    tracker.log_rollout(batch)
    summary = tracker.finish()
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [s["rollout"] for s in steps] == [0] * len(batch.steps) + [1] * len(batch.steps)
    assert [s["elapsed"] for s in steps] == sorted(s["elapsed"] for s in steps), "run time keeps counting"
    assert len(rows) == 2 * len(batch) and summary["num_rollouts"] == 2
    assert summary["total"]["tokens"] == 2 * batch.num_tokens == sum(len(r["completion_ids"]) for r in rows)
    assert (tmp_path / "config.yaml").read_text() == "lr: 1.0e-06\n"
    assert (tmp_path / "rollout.png").is_file() and not (tmp_path / "wandb").exists()


def test_a_resumed_run_drops_the_stopped_runs_summary_until_it_writes_its_own(batch, tmp_path, monkeypatch):
    # the stopped run's summary counts only its own steps: a resumed run killed before its end must leave `rollout
    # report` to rebuild the table from steps.jsonl, not print the old summary as the whole run's
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracker = RunTracker(tmp_path, config={"lr": 1e-6}, wandb_mode="disabled")
    tracker.log_rollout(batch, 0)
    tracker.finish(complete=False, reason="interrupted (SIGINT)")
    assert (tmp_path / "summary.json").is_file()
    resumed = RunTracker(tmp_path, config={"lr": 1e-6}, wandb_mode="disabled", resume=True)
    assert not (tmp_path / "summary.json").exists()
    resumed.log_rollout(batch, 1)
    summary = resumed.finish()
    assert json.loads((tmp_path / "summary.json").read_text())["total"] == summary["total"]
    assert summary["complete"] and summary["total"]["tokens"] == 2 * batch.num_tokens


def test_padded_advantages_take_the_std_asked_for(batch):
    """to_padded() gave the population std's advantages only, beside a doc line that computes TRL's (sample std):
    a loop that took the tensor got advantages sqrt(n / (n - 1)) larger than TRL's."""
    for std in ("population", "sample"):
        assert torch.equal(batch.to_padded(std=std)["advantages"], batch.advantages(std=std).to(torch.float32))
    assert not torch.equal(batch.to_padded()["advantages"], batch.to_padded(std="sample")["advantages"])


def _rollouts_on_disk(folder) -> dict[int, list[tuple[int, int]]]:
    rows = [json.loads(line) for line in (folder / "rollouts.jsonl").read_text().splitlines()]
    found: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        found.setdefault(row["rollout"], []).append((row["prompt_index"], row["sample_index"]))
    return found


def test_a_loop_logging_without_an_index_goes_on_after_a_resume(batch, tmp_path, monkeypatch):
    """From a helper's probe of the tracker in one's own loop: after resume=True the default index ("the rollout in
    progress") started from 0 again, so the next rollout went into rollout 0, and a second resume dropped both as a
    cut group. It goes on from the rollouts the stopped run closed (its summary), or, after a kill (no summary), past
    every rollout on disk. A tracker made without a config resumes too (it wrote no config.yaml, and resume was
    refused as 'holds no run')."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    expected = sorted(zip(batch.group_index, batch.sample_index))
    first = RunTracker(tmp_path, wandb_mode="disabled", plot=False)  # no config
    first.log_rollout(batch)
    first.finish(complete=False, reason="stopped in the update")
    second = RunTracker(tmp_path, wandb_mode="disabled", plot=False, resume=True, group_size=3)
    assert second.num_rollouts == 1
    second.log_rollout(batch)  # then killed: no summary
    third = RunTracker(tmp_path, wandb_mode="disabled", plot=False, resume=True, group_size=3)
    assert third.num_rollouts == 2
    third.log_rollout(batch)
    summary = third.finish()
    assert {index: sorted(keys) for index, keys in _rollouts_on_disk(tmp_path).items()} == dict.fromkeys(
        (0, 1, 2), expected
    )
    assert summary["num_rollouts"] == 3 and summary["num_samples"] == 3 * len(batch)


def test_a_rollout_run_again_whole_after_a_resume_keeps_its_groups_on_disk_once(batch, tmp_path, monkeypatch):
    """A loop that streamed a rollout's groups, stopped, and after resume=True runs the rollout again and logs it
    whole: the groups on disk from before the stop are not written twice (they were: 3 samples more per group, and a
    second resume then took each as cut short and dropped it)."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    first = RunTracker(tmp_path, {"lr": 1e-6}, wandb_mode="disabled", plot=False)
    first.log_records(batch.records()[:3])  # group 0, streamed, then the stop
    first.finish(complete=False, reason="interrupted")
    resumed = RunTracker(tmp_path, {"lr": 1e-6}, wandb_mode="disabled", plot=False, resume=True, group_size=3)
    assert resumed.num_rollouts == 0 and resumed.done == {0: {0}}
    resumed.log_rollout(batch)
    summary = resumed.finish()
    assert sorted(_rollouts_on_disk(tmp_path)[0]) == sorted(zip(batch.group_index, batch.sample_index))
    assert summary["num_samples"] == len(batch) and summary["num_rollouts"] == 1


def test_rewards_a_trainer_set_reach_the_files_and_wandb_nan_as_null(batch, tmp_path, monkeypatch):
    """A trainer that scores sets batch.reward after the call: a NaN there (which the advantages leave out) failed
    the tracker's line in json ('Out of range float values'), and the rollout's W&B reward_mean was None (taken from
    the call's summary, made before the rewards). NaN is null in rollouts.jsonl, and the mean is the finite ones'."""
    from test_cli import wandb_run_contents

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    scored = dataclasses.replace(batch, reward=[math.nan] + [2.0] * (len(batch) - 1), reward_terms={})
    scored.summary = {**batch.summary, "reward_mean": None}
    tracker = RunTracker(tmp_path, {"lr": 1e-6}, wandb_mode="offline", plot=False)
    tracker.log_rollout(scored)
    summary = tracker.finish()
    rewards = [json.loads(line)["reward"] for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert rewards == [None] + [2.0] * (len(batch) - 1)
    assert summary["reward_mean"] == 2.0 and summary["num_null_rewards"] == 1
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, _, _ = wandb_run_contents(run)
    (row,) = [row for row in history if "rollout/reward_mean" in row]
    assert row["rollout/reward_mean"] == 2.0


def test_threads_sets_torchs_cpu_threads_and_refuses_a_bad_count(tiny):
    model, tokenizer = tiny
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        Rollout(model, tokenizer, threads=1, max_batch_size=2, max_seq_len=64)
        assert torch.get_num_threads() == 1
        Rollout(model, tokenizer, max_batch_size=2, max_seq_len=64)  # None: torch's setting left as it is
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match=r"threads \(0\) must be an integer >= 1, or None"):
            Rollout(model, tokenizer, threads=0)
    finally:
        torch.set_num_threads(before)


def test_misused_arguments_are_named_before_anything_runs(tiny):
    """The README's example with a wrong argument: one clear error naming it, never an AttributeError from inside."""
    model, tokenizer = tiny
    with pytest.raises(TypeError, match=r"tokenizer must be the model's transformers tokenizer .* got NoneType"):
        Rollout(model, None)
    with pytest.raises(TypeError, match=r"tokenizer must be .* got str"):
        Rollout(model, "tiny-target")
    with pytest.raises(TypeError, match=r"sampling must be a SamplingParams, e\.g\. SamplingParams\(n=4\), got dict"):
        Rollout(model, tokenizer, sampling=dict(n=4))
    with pytest.raises(ValueError, match=r"rewards\[0\] \(\('arithmetic',\)\) must be a reward or a \(reward, weight"):
        Rollout(model, tokenizer, rewards=[("arithmetic",)])
    with pytest.raises(ValueError, match=r"the weight of reward 'arithmetic' \('2'\) must be a finite number"):
        Rollout(model, tokenizer, rewards=[("arithmetic", "2")])
    with pytest.raises(ValueError, match=r"num_problems \('16'\) must be an integer >= 1"):
        arithmetic_dataset("16")
    params = SamplingParams(n=2, max_new_tokens=4)
    rollout = Rollout(model, tokenizer, sampling=params, max_batch_size=2, max_seq_len=64)
    with pytest.raises(ValueError, match=r"data must be a list of prompts .* got one NoneType"):
        rollout(None)
    with pytest.raises(TypeError, match=r"on_step must be a function or None, got int"):
        rollout(["1 + 1 ="], on_step=5)
    with pytest.raises(ValueError, match=r"group_indices holds 5 more than once: give each prompt a group of its own"):
        rollout(["1 + 1 =", "2 + 2 ="], group_indices=[5, 5])
    # a fraction was cut to an integer (0.7 -> 0), and the index seeds the prompt's samples
    with pytest.raises(ValueError, match=r"group_indices must be integers, one per prompt; got 0\.7"):
        rollout(["1 + 1 =", "2 + 2 ="], group_indices=[0.7, 1.2])
    with pytest.raises(ValueError, match=r"seed_indices must be integers, one per prompt; got 1\.0"):
        rollout.generator.generate([[1, 2]], params, seed_indices=[1.0])
    # integers of any kind are taken, from any iterable: the same samples as a list of ints
    rows = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "2 + 2 =", "answer": "4"}]
    plain = rollout(rows, seed=0, group_indices=[3, 4]).completion_ids
    for indices in ((i for i in (3, 4)), torch.tensor([3, 4]), np.array([3, 4])):
        assert rollout(rows, seed=0, group_indices=indices).completion_ids == plain
    seeded_params = dataclasses.replace(params, seed=0)
    seeded = rollout.generator.generate([[1, 2]], seeded_params, seed_indices=[7])
    for indices in (torch.tensor([7]), np.array([7]), iter([7])):
        again = rollout.generator.generate([[1, 2]], seeded_params, seed_indices=indices)
        assert [o.token_ids for o in again] == [o.token_ids for o in seeded]
    with pytest.raises(TypeError, match=r"on_group must be a function or None, got str"):
        rollout.generator.generate([[1, 2]], params, on_group="print")
    with pytest.raises(ValueError, match=r"data.template \('Q: A:'\) names no column, so every prompt would be"):
        Rollout(model, tokenizer, sampling=params, template="Q: A:")


def test_data_that_list_takes_is_taken(tiny):
    """Any data `list()` takes: a sequence with `__getitem__` and `__len__` only (a torch map-style data set)."""

    class Prompts:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            if i >= 1:
                raise IndexError(i)
            return "1 + 1 ="

    model, tokenizer = tiny
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    batch = Rollout(model, tokenizer, rewards=None, sampling=params, max_batch_size=2, max_seq_len=64)(Prompts())
    assert len(batch) == 2


def test_a_pandas_data_frame_is_taken_as_its_rows(tiny):
    """Iterated, a DataFrame yields its column names: those were the prompts. Its rows are now."""
    import pandas

    model, tokenizer = tiny
    frame = pandas.DataFrame({"prompt": ["1 + 1 =", "2 + 3 ="], "answer": ["2", "5"]})
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    rollout = Rollout(model, tokenizer, rewards=["arithmetic"], sampling=params, max_batch_size=4, max_seq_len=64)
    batch = rollout(frame)
    assert batch.prompt == ["1 + 1 =", "1 + 1 =", "2 + 3 =", "2 + 3 ="]
    assert batch.completion_ids == rollout(frame.to_dict("records")).completion_ids


def test_rewards_as_a_dict_of_weights_weigh_as_pairs(tiny):
    def one(completions, **kwargs):
        return [1.0] * len(completions)

    model, tokenizer = tiny
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    batch = Rollout(model, tokenizer, rewards={one: 0.5}, sampling=params, max_batch_size=2, max_seq_len=64)(["1 ="])
    assert batch.reward == [0.5, 0.5]


def test_a_raising_reward_is_named_with_its_type(tiny, data):
    def explodes(completions, **kwargs):
        raise KeyError("no such field")

    model, tokenizer = tiny
    rollout = Rollout(model, tokenizer, rewards=[explodes], sampling=SamplingParams(n=2, max_new_tokens=4, seed=0))
    with pytest.raises(ValueError, match=r"^prompt 0: reward 'explodes' raised KeyError: 'no such field'$"):
        rollout(data.select([0]))


@pytest.mark.parametrize(
    "returned, message",
    [
        (1.0, r"returned float 1\.0, not a list: return a list of 2 floats, one per completion"),
        ((v for v in (1.0, 0.0)), r"returned generator .*, not a list"),
        (None, r"returned NoneType None, not a list"),
        ([1.0], r"returned 1 values for 2 completions: return one each"),
        (["yes", "no"], r"returned 'yes', text, not a number: return floats"),
        ([1.0, "1.0"], r"returned '1\.0', text, not a number: return floats"),  # float() read it as 1.0
        ([b"1", 0.0], r"returned b'1', text, not a number"),
    ],
    ids=["scalar", "generator", "none", "short", "text", "numeric text", "bytes"],
)
def test_a_reward_returning_other_than_one_number_each_is_named(returned, message):
    from rollout.rewards import RewardError, WeightedReward, score

    def mine(completions, **kwargs):
        return returned

    with pytest.raises(RewardError, match=rf"^reward 'mine' {message}"):
        score([WeightedReward("mine", mine, 1.0)], ["a", "b"], {})


def test_rewards_and_callbacks_run_outside_the_generators_inference_mode(tiny):
    """From a helper's probe: rewards and `on_group` callbacks ran inside the generator's inference mode, so what they
    made were inference tensors (a learned scorer built on first use, a group's `to_padded()` for a loss), and a later
    backward through them failed ("Inference tensors cannot be saved for backward"). They run in the caller's grad mode
    now, and `on_step` too; the policy is in eval mode there, and handed back in its mode."""
    model, tokenizer = tiny
    scorer, seen = {}, []

    def learned(completions, **kwargs):
        scorer.setdefault("head", torch.nn.Linear(4, 1))  # built on first use
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled(), model.training))
        return [0.0] * len(completions)

    rollout = Rollout(model, tokenizer, rewards=[learned], sampling=SamplingParams(n=2, max_new_tokens=8, seed=0))
    padded, steps = [], {True: [], False: []}

    def record(grad):
        return lambda *args: steps[grad].append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    model.train()
    try:
        rollout(["1+1=", "2+2="], on_group=lambda group: padded.append(group.to_padded()), on_step=record(True))
        assert model.training  # handed back
        with torch.no_grad():  # the caller's grad mode, whatever it is
            rollout(["3+3="], on_step=record(False))
        with torch.inference_mode():  # and its inference mode: its own inference tensors stay writable there
            total = torch.zeros(1)
            rollout(["4+4="], on_group=lambda group: total.add_(len(group.completion)))
        assert total.item() == 2
    finally:
        model.eval()
    assert seen == [(False, True, False)] * 2 + [(False, False, False), (True, False, False)]
    assert steps[True] and set(steps[True]) == {(False, True)} and set(steps[False]) == {(False, False)}
    head = scorer["head"]
    assert not head.weight.is_inference()
    head(torch.randn(3, 4, requires_grad=True)).sum().backward()  # trains: it failed in backward
    logprobs = padded[0]["logprobs"]
    assert not logprobs.is_inference()
    (logprobs * torch.ones_like(logprobs, requires_grad=True)).sum().backward()


def test_every_rows_prompt_is_checked_before_generating(tiny):
    """From a helper's probe of prompts: a later row without the prompt column failed in a bare KeyError; under a chat
    template a row without its prompt (None) or one message dict (not in a list) became the text of its repr in a user
    message, without a word; a conversation passed unwrapped (its messages taken for rows) was told to set
    data.prompt_column to 'content', which makes each message a prompt; an empty text, where the tokenizer adds no
    BOS, was named as 'not a list of token ids'. Each is one line now, before anything is generated."""
    import copy

    model, tokenizer = tiny
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    steps = []
    plain = Rollout(model, tokenizer, rewards=None, sampling=params, max_seq_len=96)
    chat = Rollout(model, tokenizer, rewards=None, sampling=params, max_seq_len=96, chat_template=True)
    with pytest.raises(ValueError, match=r"^data.prompt_column: row 1 has no column 'prompt'; its columns: question;"):
        plain([{"prompt": "1+1="}, {"question": "2+2="}], on_step=lambda *args: steps.append(args))
    with pytest.raises(ValueError, match=r"^data.prompt_column 'prompt' holds NoneType None, not text: every row nee"):
        plain([{"prompt": "1+1="}, {"prompt": None}])  # (a JSON line without it: datasets fills None)
    for rollout in (plain, chat):
        with pytest.raises(ValueError, match=r"^row 0 is a chat message \(role, content\), not a row .* in a list of"):
            rollout([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}])
    with pytest.raises(ValueError, match=r"^data.prompt_column 'prompt' holds NoneType None, not text or a list of"):
        chat([{"prompt": "1+1="}, {"prompt": None}], on_step=lambda *args: steps.append(args))
    with pytest.raises(ValueError, match=r"^data.prompt_column 'prompt' holds float nan, not text or a list of"):
        chat([{"prompt": float("nan")}])  # (pandas' missing value)
    with pytest.raises(ValueError, match=r"holds one chat message \(a dict\), not a conversation: .*\(\[message\]\)$"):
        chat([{"prompt": {"role": "user", "content": "1+1="}}])
    assert tokenizer("")["input_ids"] == []  # (this tokenizer adds no BOS)
    with pytest.raises(ValueError, match=r"^prompt 1 \(''\) has no tokens: every prompt needs some text"):
        plain(["1+1=", ""], on_step=lambda *args: steps.append(args))
    assert steps == [], "refused after generating"
    # what the refusals point to runs
    assert len(chat([[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]])) == 2
    assert len(chat([{"prompt": [{"role": "user", "content": "1+1="}]}])) == 2


def test_a_column_a_reward_needs_is_checked_in_every_row_and_a_completions_column_is_left_out(tiny):
    """Rows given as dicts may differ: a reward needing `answer` that only the first row has was refused after the
    whole rollout was generated; now before. A data column named `completions` went to every reward beside the texts
    (TypeError: got multiple values for argument 'completions', after generating); it is left out, as `prompts` is."""
    model, tokenizer = tiny
    seen = []

    def needs_answer(completions, answer, **kwargs):
        seen.append(kwargs)
        return [float(c.strip().endswith(str(a))) for c, a in zip(completions, answer)]

    rollout = Rollout(
        model, tokenizer, rewards=[needs_answer], sampling=SamplingParams(n=2, max_new_tokens=8, seed=0), max_seq_len=96
    )
    steps = []
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}]
    with pytest.raises(ValueError, match=r"needs the column\(s\) \['answer'\], which row 1 of the data lacks"):
        rollout(rows, on_step=lambda *args: steps.append(args))
    assert steps == [], "refused after generating"
    rows = [
        {"prompt": "1+1=", "answer": "2", "completions": "x"},
        {"prompt": "2+2=", "answer": "4", "completions": "y"},
    ]
    batch = rollout(rows)
    assert len(batch) == 4 and all("completions" not in kwargs for kwargs in seen)

    def texts_then_completions(
        texts, completions, **kwargs
    ):  # `completions` by keyword: the loop passes it by position
        return [0.0] * len(texts)

    positional = Rollout(model, tokenizer, rewards=[texts_then_completions], sampling=SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"needs the column\(s\) \['completions'\], which the data lacks"):
        positional(rows, on_step=lambda *args: steps.append(args))
    assert steps == [], "refused after generating"


def test_a_reward_in_trls_convention_takes_every_argument_by_name():
    # TRL calls rewards as f(prompts=..., completions=..., **columns): one whose first parameter is `prompts` works
    # here too, and its columns are checked as such
    from rollout.rewards import RewardError, WeightedReward, check_reward_columns, score

    def trl_style(prompts, completions, answer, **kwargs):
        return [float(c.endswith(a)) for c, a in zip(completions, answer)]

    terms = [WeightedReward("trl_style", trl_style, 1.0)]
    check_reward_columns(terms, ["answer"])
    with pytest.raises(ValueError, match=r"needs the column\(s\) \['answer'\]"):
        check_reward_columns(terms, [])
    total, _ = score(terms, ["x 4", "x 5"], {"prompts": ["p", "q"], "answer": ["4", "4"]})
    assert total == [1.0, 0.0]
    # and what worked by position still does: a wrapper taking the texts first, whatever name its signature shows,
    # and a first parameter of another name beside an optional `completions`

    def positional(fn):
        @functools.wraps(fn)
        def wrapper(texts, **kwargs):
            return fn(texts, **kwargs)

        return wrapper

    @positional
    def wrapped(completions, **kwargs):
        return [1.0] * len(completions)

    def texts_first(texts, completions=None, **kwargs):
        return [2.0] * len(texts)

    for fn, expected in ((wrapped, [1.0, 1.0]), (texts_first, [2.0, 2.0])):
        terms = [WeightedReward(fn.__name__, fn, 1.0)]
        check_reward_columns(terms, ["answer"])
        assert score(terms, ["a", "b"], {"prompts": ["p", "q"], "answer": ["4", "4"]})[0] == expected
    with pytest.raises(RewardError, match="returned a number past a float's range"):
        score([WeightedReward("huge", lambda completions, **kw: [10**400, 1], 1.0)], ["a", "b"], {})


def test_each_sample_has_prompt_ids_of_its_own(batch):
    """A group's samples shared one prompt-ids list: prepending a BOS to each sample's made every prompt of the
    group n tokens longer."""
    assert len({id(ids) for ids in batch.prompt_ids}) == len(batch)
    before = [len(ids) for ids in batch.prompt_ids]
    edited = copy.deepcopy(batch)
    for ids in edited.prompt_ids:
        ids.insert(0, 1)
    assert [len(ids) for ids in edited.prompt_ids] == [n + 1 for n in before]


def test_a_batchs_repr_is_one_short_line(batch):
    """The dataclass repr wrote every token, log-prob and step (425,144 characters for 64 samples): what a notebook
    cell, a debugger and a failed assertion print."""
    text = repr(batch)
    mean = sum(batch.reward) / len(batch)
    assert text == (
        f"RolloutBatch({len(batch)} samples of 4 prompts, {batch.num_tokens} completion tokens, reward mean "
        f"{mean:.4g}, {len(batch.steps)} steps)"
    )


def test_to_padded_refuses_per_sample_lists_out_of_step(batch):
    """A log-prob list shorter than its completion was padded with 0.0 under a mask of 1 (probability 1 for a token
    the policy drew), and lists of other lengths were cut by zip, without a word."""
    short = copy.deepcopy(batch)
    short.logprobs[2] = short.logprobs[2][:-1]
    with pytest.raises(ValueError, match=r"^batch.logprobs\[2\] holds \d+ values for \d+ completion tokens"):
        short.to_padded()
    fewer = copy.deepcopy(batch)
    fewer.prompt_ids.pop()
    with pytest.raises(ValueError, match=rf"^batch.prompt_ids holds {len(batch) - 1} entries for {len(batch)} samples"):
        fewer.to_padded()


def test_a_tracker_refuses_to_log_after_it_finished(batch, tmp_path, monkeypatch):
    """Lines logged after `finish()` went into rollouts.jsonl while summary.json, already written, counted without
    them (3 rollouts on disk, `num_rollouts: 2`)."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracker = RunTracker(tmp_path, wandb_mode="disabled", plot=False)
    tracker.log_rollout(batch)
    tracker.finish()
    lines = (tmp_path / "rollouts.jsonl").read_text()
    for log in (lambda: tracker.log_rollout(batch), lambda: tracker.log_group(batch), lambda: tracker.log_step({})):
        with pytest.raises(RuntimeError, match="this RunTracker finished .*: log before finish"):
            log()
    assert (tmp_path / "rollouts.jsonl").read_text() == lines


def test_a_reward_that_edits_what_it_is_given_leaves_the_batch_and_the_next_reward_as_they_were(tiny):
    """The ids and texts a reward got were the batch's own lists: a reward that stripped the EOS id in place, or
    upper-cased the texts, rewrote the training data (the EOS dropped out of the completion mask) and what the next
    reward saw."""
    model, tokenizer = tiny
    seen = []

    def strips_eos(completions, completion_ids, **kwargs):
        for ids in completion_ids:
            ids.pop()
        completions[:] = [c.upper() for c in completions]
        return [0.0] * len(completions)

    def looks(completions, completion_ids, **kwargs):
        seen.append(([list(ids) for ids in completion_ids], list(completions)))
        return [1.0] * len(completions)

    params = SamplingParams(n=2, max_new_tokens=12, seed=0)
    batch = Rollout(model, tokenizer, rewards=[strips_eos, looks], sampling=params, max_seq_len=96)(["1+1=", "2+3="])
    plain = Rollout(model, tokenizer, rewards=None, sampling=params, max_seq_len=96)(["1+1=", "2+3="])
    assert batch.completion_ids == plain.completion_ids and batch.completion == plain.completion
    assert [len(ids) for ids in batch.completion_ids] == [len(lps) for lps in batch.logprobs]
    assert [ids for group in seen for ids in group[0]] == plain.completion_ids
    assert [text for group in seen for text in group[1]] == plain.completion
    # what is not a list (a trainer's own arguments: TRL's `trainer_state`, `log_metric`) goes as it is (`list()` of a
    # TrainerState failed every `rollout train`)
    from rollout.rewards import WeightedReward, score

    state = object()
    given = {}
    total, _ = score(
        [WeightedReward("r", lambda completions, **kw: given.update(kw) or [1.0], 1.0)],
        ["a"],
        {"trainer_state": state, "completion_ids": [[1]], "prompts": ["p"]},
    )
    assert total == [1.0] and given["trainer_state"] is state and given["completion_ids"] == [[1]]


@pytest.mark.parametrize(
    "reward, message",
    [
        (lambda completions, answer: [0.0] * len(completions), r"does not take \['completion_ids', 'finish_reasons', "),
        (lambda: [], r"takes no completions: its first parameter gets the decoded texts"),
        (dict, r"is a class: give a function"),
    ],
    ids=["no kwargs", "no parameters", "a class"],
)
def test_a_reward_that_cannot_take_what_it_is_given_is_refused_before_generating(tiny, reward, message):
    """Only a reward's required parameters were checked: one without **kwargs (TRL's own signature, minus the
    kwargs), one of no parameters, or a class, was refused after the model generated the first group."""
    model, tokenizer = tiny
    steps = []
    rollout = Rollout(model, tokenizer, rewards=[reward], sampling=SamplingParams(max_new_tokens=4), max_seq_len=96)
    with pytest.raises(ValueError, match=message):
        rollout([{"prompt": "1+1=", "answer": "2"}], on_step=lambda *args: steps.append(args))
    assert steps == [], "refused after generating"


def test_a_reward_returning_none_does_not_apply_to_that_sample_as_in_trl():
    """TRL lets a reward return None for a sample it does not apply to (one task's reward beside another's): the
    total sums the rewards that apply. It was refused ("returned None, not a number")."""
    from rollout.rewards import WeightedReward, score

    def math_only(completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    def code_only(completions, task, **kwargs):
        return [0.5 if t == "code" else None for t in task]

    terms = [WeightedReward("math", math_only, 2.0), WeightedReward("code", code_only, 1.0)]
    total, per_term = score(terms, ["a", "b", "c"], {"task": ["math", "code", "chat"]})
    assert total == [2.0, 0.5, None]
    assert per_term == {"math": [1.0, None, None], "code": [None, 0.5, None]}


def test_an_async_reward_is_refused_when_built_and_says_how_to_run_it():
    import asyncio

    from rollout.rewards import RewardError, WeightedReward, build_rewards, score

    async def judged(completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    class Judge:
        async def __call__(self, completions, **kwargs):
            return [1.0] * len(completions)

    for fn in (judged, Judge()):
        with pytest.raises(ValueError, match=r"is async: rewards are called one after another, not awaited; .*asyncio"):
            build_rewards([(fn, 1.0)])
    wrapped = functools.partial(judged)  # (a partial hides it: the coroutine it returns is named then)
    with pytest.raises(RewardError, match=r"^reward 'wrapped' is async"):
        score([WeightedReward("wrapped", wrapped, 1.0)], ["a"], {})


def test_a_chat_template_that_fails_is_named_in_one_line(tiny):
    """The template's own refusal (Gemma's 'System role not supported') and one that does not parse came through
    as jinja's exception, naming neither the chat template nor the system prompt."""
    _, tokenizer = tiny
    refusing = copy.deepcopy(tokenizer)
    refusing.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    formatter = PromptFormatter(refusing, prompt_column="q", chat_template=True, system_prompt="Be brief.")
    with pytest.raises(ValueError, match=r"^the tokenizer's chat template failed on a prompt's messages \(data\."):
        formatter([{"q": "1+1"}])
    broken = copy.deepcopy(tokenizer)
    broken.chat_template = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(ValueError, match=r"chat template failed on a prompt's messages: TemplateSyntaxError: "):
        PromptFormatter(broken, prompt_column="q", chat_template=True)([{"q": "1+1"}])


# ---- pinned by a mutation review (2026-11-29): each of these changed what a user sees and no test caught it ----


def test_phase_labels_at_the_bounds_and_the_default_fraction():
    # a prefill's batch counts prompts: it does not move the peak a decode step is judged against
    labeler = PhaseLabeler()
    assert [labeler.label(p, b) for p, b in [("prefill", 8), ("decode", 1)]] == ["prefill", "bulk"]
    default = PhaseLabeler()  # a quarter of the peak, as documented
    assert [default.label("decode", b) for b in (8, 3, 2, 1)] == ["bulk", "bulk", "bulk", "tail"]
    none = PhaseLabeler(0.0)  # 0: no tail phase
    assert [none.label("decode", b) for b in (8, 1)] == ["bulk", "bulk"]
    every = PhaseLabeler(1.0)  # 1: any step below the peak is the tail
    assert [every.label("decode", b) for b in (8, 7, 8)] == ["bulk", "tail", "bulk"]


def test_the_summary_of_a_paged_cache_and_of_prefill_phases():
    def step(phase, batch_size, used, allocated, preempted):
        return {
            "phase": phase,
            "batch_size": batch_size,
            "num_draft_tokens": 0,
            "num_drafted": 0,
            "num_accepted": 0,
            "num_emitted": batch_size,
            "seconds": 0.1,
            "kv_blocks_used": used,
            "kv_blocks_allocated": allocated,
            "num_preempted": preempted,
        }

    s = summarize([step("prefill", 2, 4, 10, 0), step("prefill", 4, 6, 12, 1), step("bulk", 3, 5, 8, 2)])
    assert s["kv_cache"] == {"peak_blocks_used": 6, "blocks_allocated": 12, "num_preempted": 3}
    # a prefill phase's means are over its own steps (prompts admitted a step), the total's over decode steps only
    assert s["phases"]["prefill"]["mean_batch_size"] == 3.0 and s["total"]["mean_batch_size"] == 3.0
    assert "kv_cache" not in summarize([{**step("bulk", 1, 1, 1, 0), "kv_blocks_used": None}])


def test_the_straggler_ratio_of_nothing_to_wait_on_is_one():
    from rollout.phases import straggler_ratio

    assert straggler_ratio([]) == straggler_ratio([[0.0, 0.0]]) == 1.0
    assert straggler_ratio([[1.0, 3.0], [2.0, 2.0]]) == (3.0 + 2.0) / (2.0 + 2.0)


def test_a_batchs_records_dataset_and_padding_carry_every_field(batch):
    records = batch.records()
    assert [r["truncated"] for r in records] == batch.truncated
    for name, values in batch.reward_terms.items():
        assert [r[f"reward_{name}"] for r in records] == values
    dataset = batch.to_dataset()
    assert "truncated" in dataset.column_names and dataset["truncated"] == batch.truncated
    padded = batch.to_padded(pad_token_id=7)  # the argument, not the batch's own pad id
    assert batch.pad_token_id != 7
    short = min(range(len(batch)), key=lambda i: len(batch.prompt_ids[i]))
    width = padded["prompt_ids"].shape[1] - len(batch.prompt_ids[short])
    if width:
        assert padded["prompt_ids"][short, :width].tolist() == [7] * width
    shortest = min(range(len(batch)), key=lambda i: len(batch.completion_ids[i]))
    assert padded["completion_ids"][shortest, len(batch.completion_ids[shortest]) :].tolist() == [7] * (
        padded["completion_ids"].shape[1] - len(batch.completion_ids[shortest])
    )
    short_rewards = copy.deepcopy(batch)
    short_rewards.reward = short_rewards.reward[:1]
    with pytest.raises(ValueError, match=rf"batch.reward holds 1 values for {len(batch)} samples"):
        short_rewards.advantages()


def test_rewards_keep_apart_what_each_is_given_and_their_names():
    from rollout.rewards import RewardError, WeightedReward, build_rewards, check_reward_columns, score

    def one(completions, **kwargs):
        return [1.0] * len(completions)

    terms = build_rewards([(one, 1.0), (one, 2.0)])  # the same function twice: two terms, two names
    assert [t.name for t in terms] == ["one", "one#1"]
    total, per_term = score(terms, ["a"], {})
    assert total == [3.0] and list(per_term) == ["one", "one#1"]

    def spoils(completions, answer, **kwargs):  # edits a data column and the texts in place
        answer[0] = "WRONG"
        completions[:] = [c.upper() for c in completions]
        return [0.0]

    def checks(completions, answer, **kwargs):
        return [float(answer[0] == "4" and completions[0] == "abc")]

    columns = {"answer": ["4"]}
    total, _ = score([WeightedReward("spoils", spoils, 1.0), WeightedReward("checks", checks, 1.0)], ["abc"], columns)
    assert total == [1.0] and columns == {"answer": ["4"]}

    def long(completions, **kwargs):
        return [1.0] * (len(completions) + 1)

    with pytest.raises(RewardError, match=r"returned 2 values for 1 completions"):
        score([WeightedReward("long", long, 1.0)], ["a"], {})

    def anything(*args, **kwargs):
        return [0.0] * len(args[0])

    check_reward_columns([WeightedReward("anything", anything, 1.0)], ["answer"])  # takes it all

    def answer_first(answer, prompts, completion_ids, finish_reasons):  # the texts would go to `answer` by position
        return [0.0]

    with pytest.raises(ValueError, match=r"reward 'answer_first' does not take \['answer'\]"):
        check_reward_columns([WeightedReward("answer_first", answer_first, 1.0)], ["answer"])


def test_a_tracker_resumed_after_a_stop_redoes_the_cut_group_and_keeps_the_clock_and_rewards(tmp_path, monkeypatch):
    """Resumed with `group_size`, a group a stop cut short (1 of 2 samples) is dropped and redone, the kept samples'
    rewards count in the summary, and the run clock goes on from the stopped run's last step."""
    monkeypatch.delenv("WANDB_MODE", raising=False)

    def record(prompt, sample, reward):
        return {"prompt_index": prompt, "sample_index": sample, "completion_ids": [1, 2], "reward": reward}

    tracker = RunTracker(tmp_path, wandb_mode="disabled", plot=False)
    tracker.log_records([record(0, 0, 0.0), record(0, 1, 1.0), record(1, 0, 1.0)], rollout=0)
    step = {"phase": "bulk", "batch_size": 2, "num_draft_tokens": 0, "num_drafted": 0, "num_accepted": 0}
    tracker.log_step({**step, "num_emitted": 4, "seconds": 2.5, "elapsed": 2.5}, rollout=0)
    tracker.finish(complete=False, reason="interrupted (SIGINT)")
    resumed = RunTracker(tmp_path, wandb_mode="disabled", plot=False, resume=True, group_size=2)
    assert resumed.done == {0: {0}} and resumed.num_samples == 2
    kept = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in kept] == [(0, 0), (0, 1)]
    resumed.log_step({**step, "num_emitted": 2, "seconds": 2.5, "elapsed": 2.5}, rollout=0)
    summary = resumed.finish()
    assert [s["elapsed"] for s in resumed.steps] == [2.5, 5.0]
    assert summary["wall_seconds"] == 2.5  # (the clock moves on a rollout at a time: this run closed none)
    assert summary["reward_mean"] == 0.5
