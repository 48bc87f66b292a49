"""Pathwise-exact sampling: a sample is a function of (weights, prompt, seed, prompt index, sample index). With
exact verification (the default) the same seed gives the same tokens and log-probs with speculation off, with every
proposer, token trees, every static K, the table policy and `auto`, at any slot count and in any batch."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_prompts

import specdec.verify
from rollout import Generator, SamplingParams
from rollout.models import zoo
from rollout.tasks import arithmetic_dataset
from rollout_kernels.race_logits import race_logits
from specdec.config import SpecConfig
from specdec.processing import RowSampling
from specdec.tree import layout_drafts
from specdec.verify import RaceKeys, verify_exact

torch.set_num_threads(1)

SAMPLINGS = {
    "t1": dict(temperature=1.0),
    "t0.7-topk-topp": dict(temperature=0.7, top_k=20, top_p=0.9),
}


def specs(draft) -> dict[str, SpecConfig | None]:
    out: dict[str, SpecConfig | None] = {"off": None}
    for k in range(1, 9):
        out[f"ngram K={k}"] = SpecConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1)
    out["suffix K=4"] = SpecConfig(method="suffix", num_speculative_tokens=4)
    out["draft K=3"] = SpecConfig(method="draft_model", num_speculative_tokens=3, model=draft)
    out["ngram tree"] = SpecConfig(method="ngram", num_speculative_tokens=6, num_candidates=3, prompt_lookup_min=1)
    out["suffix+draft"] = SpecConfig(method=["suffix", "draft_model"], num_speculative_tokens=4, model=draft)
    out["table"] = SpecConfig(
        method="ngram", num_speculative_tokens=4, num_speculative_tokens_per_batch_size=[[1, 2, 4], [3, 64, 1]]
    )
    out["auto"] = SpecConfig(method="ngram", num_speculative_tokens=4, num_speculative_tokens_per_batch_size="auto")
    return out


ACCEPTED: dict[str, int] = {}  # drafts accepted per spec, over the runs of a test


def run(model, spec, prompts, params, max_batch_size, seed_indices=None, max_seq_len=80):
    gen = Generator(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len, spec=spec)
    outs = gen.generate(prompts, params, seed_indices=seed_indices)
    if spec is not None:  # drafts were verified, some accepted: the equality is not that of plain decoding
        ACCEPTED[repr(spec)] = ACCEPTED.get(repr(spec), 0) + sum(r.num_accepted for r in gen.last_trace)
    return {(o.prompt_index if seed_indices is None else seed_indices[o.prompt_index], o.sample_index): o for o in outs}


def assert_same(reference, other, label):
    assert reference.keys() == other.keys(), label
    for key, ref in reference.items():
        out = other[key]
        assert out.token_ids == ref.token_ids, f"{label}: sample {key} differs"
        torch.testing.assert_close(
            torch.tensor(out.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-9, msg=f"{label}: {key}"
        )


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_seed_same_samples_whatever_the_speculation(arch, sampling):
    # a small vocabulary: n-gram drafts are accepted often enough at temperature 1
    model = make_model(arch, seed=2, vocab_size=23)
    draft = make_model(arch, seed=3, num_hidden_layers=1, vocab_size=23)
    prompts = [p * 3 for p in random_prompts(3, vocab_size=23, max_len=4, seed=5)]
    prompts += random_prompts(2, vocab_size=23, seed=6)
    params = SamplingParams(n=3, max_new_tokens=20, seed=11, **SAMPLINGS[sampling])
    reference = run(model, None, prompts, params, max_batch_size=64)
    for name, spec in specs(draft).items():
        for max_batch_size in (1, 7, 64):
            if max_batch_size == 1 and name not in ("off", "ngram K=3", "draft K=3", "auto"):
                continue  # one row at a time is slow; these cover it
            assert_same(reference, run(model, spec, prompts, params, max_batch_size), f"{name} at {max_batch_size}")
        assert ACCEPTED.pop(repr(spec), 1) > 0, f"{name}: no draft accepted, the comparison would be plain decoding's"


def test_a_sample_does_not_depend_on_the_batch_around_it():
    model = make_model("qwen2", seed=4, vocab_size=23)
    prompts = [p * 2 for p in random_prompts(6, vocab_size=23, max_len=5, seed=7)]
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=5)
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    whole = run(model, None, prompts, params, max_batch_size=12)
    # the same prompts (same indices) in another order, in two calls, with other slot counts and speculation on
    order = [4, 1, 5, 0, 3, 2]
    part = run(model, spec, [prompts[i] for i in order[:3]], params, 3, seed_indices=order[:3])
    part |= run(model, spec, [prompts[i] for i in order[3:]], params, 5, seed_indices=order[3:])
    assert_same(whole, part, "reordered and split")
    assert ACCEPTED.pop(repr(spec)) > 0
    # and another seed gives other samples
    other = run(model, None, prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=6), 12)
    assert any(other[key].token_ids != whole[key].token_ids for key in whole)


def test_shipped_models_same_seed_same_samples():
    model, tokenizer = zoo.load_model("tiny-target", dtype=torch.float64)
    draft, _ = zoo.load_model("tiny-draft", dtype=torch.float64)
    data = arithmetic_dataset(4, split="eval", seed=3)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in data["prompt"]]
    params = SamplingParams(n=4, max_new_tokens=48, temperature=1.0, seed=3)
    reference = run(model, None, prompts, params, max_batch_size=16, max_seq_len=512)
    for spec in (
        SpecConfig(method="draft_model", num_speculative_tokens=4, model=draft),
        SpecConfig(method="suffix", num_speculative_tokens=4),
        SpecConfig(method=["suffix", "draft_model"], num_speculative_tokens=4, model=draft),
    ):
        assert_same(reference, run(model, spec, prompts, params, 7, max_seq_len=512), str(spec.method))
        assert ACCEPTED.pop(repr(spec)) > 0, spec.method


def test_rejection_verification_is_still_available_and_differs_pathwise():
    model = make_model("llama", seed=2)
    draft = make_model("llama", seed=3, num_hidden_layers=1)
    prompts = random_prompts(4, seed=9)
    params = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, seed=1)
    reference = run(model, None, prompts, params, max_batch_size=16)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=3, model=draft, verification="rejection")
    rejection = run(model, spec, prompts, params, max_batch_size=16)
    assert any(rejection[key].token_ids != reference[key].token_ids for key in reference)
    with pytest.raises(ValueError, match=r"verification \('gumbel'\) must be one of exact, rejection"):
        SpecConfig(method="ngram", verification="gumbel")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
def test_racing_every_node_at_once_draws_what_racing_depth_by_depth_draws(tree, dtype, monkeypatch):
    """Exact verification races a small step's nodes in one draw and a large step's path depth by depth; both must
    emit the same tokens, log-probs and accepted nodes (greedy, plain and top-k/top-p rows in one step), whether the
    nodes' logits come back to back or are read in place from the model's padded output, walked as a GPU walks
    (every row at every depth) or not (a chain whose every node was raced: by its first mismatch, `_walk_chain`), and
    with the Triton kernel drawing (under the interpreter) as on a GPU."""
    generator = torch.Generator().manual_seed(0)
    num_drafted = [4, 0, 3, 4, 1, 4]
    rows, vocab = len(num_drafted), 37
    draft_ids = torch.randint(0, vocab, (rows, 4), generator=generator)
    parents = None
    if tree:  # node 2 hangs off the pending token beside node 1, node 3 off node 1 (one sibling pair per row)
        parents = torch.tensor([[-1, -1, 0, 2]] * rows)
        draft_ids[:, 1] = (draft_ids[:, 0] + 1) % vocab  # siblings hold distinct tokens
    layout = layout_drafts(num_drafted, parents)
    fed = torch.arange(layout.width)[None, :] < torch.tensor(layout.num_nodes)[:, None]
    tokens = torch.cat([torch.zeros(rows, 1, dtype=torch.long), draft_ids], dim=1)[:, : layout.width]
    logits = torch.randn(rows, layout.width, vocab, generator=generator, dtype=torch.float64)
    # each node's logits favour its first child's token, so that walks go deep
    for node in range(layout.width - 1):
        child = (layout.parents == node).float().argmax(dim=1)
        logits[torch.arange(rows), node, tokens[torch.arange(rows), child]] += 8.0
    logits = logits.to(dtype)
    sampling = RowSampling(
        temperature=torch.tensor([0.0, 1.0, 0.7, 1.0, 1.3, 0.9], dtype=torch.float64),
        top_k=torch.tensor([0, 0, 5, 0, 0, 12]),
        top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 0.8], dtype=torch.float64),
        needs_filter=True,
        all_greedy=False,
        any_greedy=True,
    )
    race = RaceKeys(torch.randint(0, 2**62, (rows,), generator=generator), torch.randint(0, 300, (rows,)))
    results = [
        verify_exact(logits[fed], tokens[fed], layout, sampling, race, race_every_node=every) for every in (True, False)
    ]
    # the same nodes read in place from the padded logits (as the generator passes them), both ways of racing
    logit_rows = (torch.arange(rows)[:, None] * layout.width + torch.arange(layout.width))[fed]
    padded = logits.reshape(rows * layout.width, vocab)
    results += [
        verify_exact(padded, tokens[fed], layout, sampling, race, race_every_node=every, logit_rows=logit_rows)
        for every in (True, False)
    ]
    # a GPU's verification: every node in one launch of the kernel, every row walked at every depth
    monkeypatch.setattr(specdec.verify, "race_logits_ref", race_logits)
    results.append(verify_exact(padded, tokens[fed], layout, sampling, race, logit_rows=logit_rows, static_walk=True))
    for other in results[1:]:
        assert torch.equal(results[0].output_token_ids, other.output_token_ids)
        assert torch.equal(results[0].num_emitted, other.num_emitted)
        assert torch.equal(results[0].accepted_nodes, other.accepted_nodes)
        torch.testing.assert_close(
            results[0].logprobs, other.logprobs, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5
        )
    assert int((results[0].num_emitted > 2).sum()) >= 3  # walks went past the first drafts: not vacuous
