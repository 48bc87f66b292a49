"""Token-tree speculation: tree building, exact greedy, exact log-probs, and compaction that keeps later steps exact."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_prompts
from test_generator import teacher_forced_logprobs

from rollout import Generator, SamplingParams
from rollout.engine.kv_cache import SlotKVCache
from specdec.config import SpecConfig
from specdec.proposers.base import Drafts, filled_drafts
from specdec.tree import depths_and_ancestors, merge_candidates, with_root


def test_merge_candidates_shares_prefixes_under_a_budget():
    candidates = torch.tensor(
        [
            [[5, 6, 7], [5, 8, -1], [9, 9, 9]],  # "5 6 7", then "5 8" shares the 5, then "9 9 9"
            [[-1, -1, -1], [-1, -1, -1], [-1, -1, -1]],  # no candidates: an empty tree
        ]
    )
    tokens, parents, counts = merge_candidates(candidates, budgets=[5, 3])
    assert counts == [5, 0]
    assert tokens[0].tolist() == [5, 6, 7, 8, 9] and parents[0].tolist() == [-1, 0, 1, 0, -1]
    kernel_parents = with_root(parents[:1])
    assert kernel_parents.tolist() == [[-1, 0, 1, 2, 1, 0]]
    depths, ancestors = depths_and_ancestors(kernel_parents, [6])
    assert depths.tolist() == [[0, 1, 2, 3, 2, 1]]
    assert ancestors[0, 4].nonzero().flatten().tolist() == [0, 1, 4]  # "8" sees the root, "5" and itself
    assert ancestors[0, 3].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_filled_drafts_chain_fillers_under_the_last_draft():
    tree = Drafts(
        torch.tensor([[5, 6, 8], [7, -1, -1], [-1, -1, -1]]),
        [3, 1, 0],
        parents=torch.tensor([[-1, 0, -1], [-1, -1, -1], [-1, -1, -1]]),
    )
    filled = filled_drafts(tree, torch.tensor([4, 3, 2]), filler=torch.tensor([1, 2, 3]))
    assert filled.num_drafted == [4, 3, 2]
    assert filled.token_ids.tolist() == [[5, 6, 8, 1], [7, 2, 2, -1], [3, 3, -1, -1]]
    assert filled.parents.tolist() == [[-1, 0, -1, 2], [-1, 0, 1, -1], [-1, 0, -1, -1]]
    chain = filled_drafts(Drafts(torch.tensor([[4, -1]]), [1]), torch.tensor([2]), filler=torch.tensor([9]))
    assert chain.token_ids.tolist() == [[4, 9]] and chain.parents is None and chain.num_drafted == [2]
    with_probs = Drafts(torch.tensor([[4]]), [1], probs=torch.ones(1, 3) / 3)
    assert filled_drafts(with_probs, torch.tensor([3]), filler=torch.tensor([9])) is with_probs


def count_moving_compactions(monkeypatch) -> list[int]:
    """Record how many compactions moved a path (some accepted node not already right after its parent)."""
    moved = [0]
    original = SlotKVCache.compact_paths

    def spy(self, rows, base, accepted):
        steps = torch.arange(1, accepted.shape[1] + 1)
        moved[0] += int(((accepted >= 0) & (accepted != steps)).any())
        original(self, rows, base, accepted)

    monkeypatch.setattr(SlotKVCache, "compact_paths", spy)
    return moved


@pytest.mark.parametrize("num_candidates,k", [(1, 1), (2, 2), (3, 4), (4, 8), (2, 8)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tree_speculation_equals_plain_greedy(arch, num_candidates, k):
    model = make_model(arch)
    prompts = [p * 3 for p in random_prompts(7, max_len=5, seed=3)] + random_prompts(4, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=32)
    plain = Generator(model, max_batch_size=4, max_seq_len=128).generate(prompts, params)
    spec = SpecConfig(num_speculative_tokens=k, num_candidates=num_candidates, prompt_lookup_min=1)
    gen = Generator(model, max_batch_size=4, max_seq_len=128, spec=spec)
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    assert sum(r.num_accepted for r in decode) > 0
    assert any(r.num_drafted < r.batch_size * r.num_draft_tokens for r in decode)  # rows with small or empty trees


def test_compaction_of_accepted_branches_keeps_later_steps_exact(monkeypatch):
    model = make_model("llama")
    prompts = [p * 3 for p in random_prompts(7, max_len=5, seed=3)] + random_prompts(4, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=32)
    plain = Generator(model, max_batch_size=4, max_seq_len=128).generate(prompts, params)
    moved = count_moving_compactions(monkeypatch)
    spec = SpecConfig(num_speculative_tokens=8, num_candidates=4, prompt_lookup_min=1)
    outs = Generator(model, max_batch_size=4, max_seq_len=128, spec=spec).generate(prompts, params)
    assert moved[0] > 0, "the test needs steps that accepted a branch off the first candidate"
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.5, max_new_tokens=20, seed=1, n=2),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=20, seed=2),
    ],
    ids=["t0.5-n2", "t0.8-topk-topp"],
)
def test_tree_logprobs_equal_teacher_forced_pass(params):
    model = make_model("llama")
    prompts = [p * 3 for p in random_prompts(7, max_len=5, seed=3)]
    spec = SpecConfig(num_speculative_tokens=6, num_candidates=3, prompt_lookup_min=1)
    gen = Generator(model, max_batch_size=4, max_seq_len=96, spec=spec)
    outs = gen.generate(prompts, params)
    assert sum(r.num_accepted for r in gen.last_trace) > 0
    for out in outs:
        expected = teacher_forced_logprobs(model, prompts[out.prompt_index], out.token_ids, params)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=1e-9, rtol=0)


def test_trees_need_ngram_candidates():
    with pytest.raises(
        ValueError, match=r"num_candidates \(3\) > 1 builds token trees from a single .ngram. or .suffix."
    ):
        SpecConfig(method="draft_model", model="tiny-draft", num_candidates=3)
    with pytest.raises(ValueError, match=r"num_candidates \(0\)"):
        SpecConfig(num_candidates=0)


def test_combined_drafts_keep_each_rows_tokens_and_q():
    """Several proposers' drafts in one layout: row i's tokens from the proposer that served it, with that proposer's
    q (a draft model's) or a one-hot q (n-gram), rows back to back."""
    from specdec.proposers.multi import _combine

    ngram = Drafts(torch.tensor([[5, 6], [-1, -1], [7, -1], [-1, -1]]), [2, 0, 1, 0])
    q = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), dim=-1)
    model = Drafts(torch.tensor([[-1, -1, -1], [8, 9, -1], [-1, -1, -1], [4, -1, -1]]), [0, 2, 0, 1], probs=q)
    combined = _combine({0: ngram, 1: model}, served=torch.tensor([0, 1, 0, 1]))
    assert combined.token_ids.tolist() == [[5, 6, -1], [8, 9, -1], [7, -1, -1], [4, -1, -1]]
    assert combined.num_drafted == [2, 2, 1, 1]
    one_hot = torch.nn.functional.one_hot(torch.tensor([5, 6, 7]), 10).to(q.dtype)
    assert torch.equal(combined.probs, torch.stack([one_hot[0], one_hot[1], q[0], q[1], one_hot[2], q[2]]))
