"""CUDA graphs for chain decode steps (`rollout.engine.graph_runner`) and the walk exact verification takes on a GPU.

A CPU runs the graph runner's padded forward without capturing it (`capture=False`): rows padded to their bucket,
narrower rows padded to the step's width, the metadata staged through its buffers. That must generate exactly what
the plain paged forward generates. Capture and replay themselves need CUDA (`tests/test_gpu.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_model, random_prompts
from test_generator import teacher_forced_logprobs

from rollout import Generator, SamplingParams
from rollout.engine.graph_runner import row_buckets
from rollout.engine.step_batch import StepBatch
from specdec.config import SpecConfig
from specdec.processing import RowSampling
from specdec.tree import layout_drafts
from specdec.verify import RaceKeys, verify_exact, verify_padded_chains


def padded_generator(model, graphs: bool, **kwargs) -> Generator:
    gen = Generator(model, kv_layout="paged", cuda_graphs=False, **kwargs)
    if graphs:  # the target's runner, and a draft model's
        for runner in gen._runners():
            runner.use_graphs(gen.max_width, capture=False)
    return gen


def count_verified_steps(gen: Generator) -> list[int]:
    """The rows of each step the target's graph runner verified with its forward (a counting wrapper around the
    real method)."""
    graphs, calls = gen.runner.graphs, []
    verified = graphs.forward_verified

    def counting(batch, race, temperatures):
        calls.append(batch.num_rows)
        return verified(batch, race, temperatures)

    graphs.forward_verified = counting
    return calls


@pytest.mark.parametrize("case", ["some greedy rows", "all greedy", "top-k", "top-p", "rejection", "switched off"])
def test_which_steps_verify_in_the_replay(case):
    """Chains under exact verification with a sampled row verify in the replay, greedy rows among them included; a
    batch of greedy rows only, top-k / top-p, rejection sampling and a runner switched off verify eagerly after it.
    Each generates what the plain paged forward generates, log-probs included."""
    model = make_model("llama")
    verification = "rejection" if case == "rejection" else "exact"
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, verification=verification)
    prompts = random_prompts(6, max_len=12, seed=8)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=9)
    params = {
        "some greedy rows": [  # and temperatures other than 1 (staged as float32 bits)
            SamplingParams(n=2, temperature=t, max_new_tokens=16, seed=9) for t in (0.0, 0.7, 1.3, 0.0, 1.0, 2.0)
        ],
        "all greedy": SamplingParams(n=2, temperature=0, max_new_tokens=16),
        "top-k": SamplingParams(n=2, temperature=1.0, top_k=5, max_new_tokens=16, seed=9),
        "top-p": SamplingParams(n=2, temperature=1.0, top_p=0.8, max_new_tokens=16, seed=9),
        "rejection": sampled,
        "switched off": sampled,  # `ModelRunner.verify_in_graph` off (a benchmark's comparison): after the replay
    }[case]
    plain = padded_generator(model, False, max_batch_size=6, max_seq_len=48, spec=spec).generate(prompts, params)
    gen = padded_generator(model, True, max_batch_size=6, max_seq_len=48, spec=spec)
    gen.runner.verify_in_graph = case != "switched off"
    verified = count_verified_steps(gen)
    padded = gen.generate(prompts, params)
    assert [o.token_ids for o in padded] == [o.token_ids for o in plain]
    for a, b in zip(padded, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-12, rtol=0)
    num_decode = sum(r.kind == "decode" for r in gen.last_trace)
    if case == "some greedy rows":  # every step while a sampled row is in flight
        assert 0 < len(verified) <= num_decode
    else:
        assert verified == []
    assert any(r.num_drafted for r in gen.last_trace), "expected drafted steps"


def test_row_buckets():
    assert row_buckets(1) == [1]
    assert row_buckets(6) == [1, 2, 4, 6]
    buckets = row_buckets(1024)
    assert buckets[:6] == [1, 2, 4, 8, 16, 32] and buckets[-1] == 1024
    assert buckets == sorted(set(buckets)) and len(buckets) == 32
    # past 64 rows (where a step starts to cost per row) a bucket pads at most 25%
    assert all(b - a <= a // 4 for a, b in zip(buckets, buckets[1:]) if a >= 64)
    assert row_buckets(100)[-2:] == [96, 100]


@pytest.mark.parametrize(
    "spec",
    [
        None,
        SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1),
        SpecConfig(method="suffix", num_speculative_tokens=4),
        SpecConfig(method="suffix", num_speculative_tokens=3, num_speculative_tokens_per_batch_size="auto"),
        "draft",
    ],
    ids=["none", "ngram", "suffix", "suffix-auto", "draft"],
)
def test_the_padded_forward_generates_what_the_paged_forward_generates(spec):
    """Rows padded to their bucket (6 slots: buckets 1, 2, 4, 6; rows finish and refill) and to the step's width."""
    model = make_model("llama")
    if spec == "draft":
        spec = SpecConfig(method="draft_model", num_speculative_tokens=3, model=make_model("qwen2", seed=4))
    prompts = random_prompts(11, max_len=14, seed=3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=5)
    plain_gen = padded_generator(model, False, max_batch_size=6, max_seq_len=64, spec=spec)
    plain = plain_gen.generate(prompts, params)
    gen = padded_generator(model, True, max_batch_size=6, max_seq_len=64, spec=spec)
    verified = count_verified_steps(gen)
    padded = gen.generate(prompts, params)
    # every decode step (all rows sampled, exact verification) verified in the replay, none after it
    assert len(verified) == sum(r.kind == "decode" for r in gen.last_trace)
    if spec is None or spec.num_speculative_tokens_per_batch_size is None:  # auto K follows measured step times
        # the same drafts step by step (a draft model's own forwards are padded too)
        trace = [(r.batch_size, r.num_drafted, r.num_accepted) for r in gen.last_trace]
        assert trace == [(r.batch_size, r.num_drafted, r.num_accepted) for r in plain_gen.last_trace]
    assert [o.token_ids for o in padded] == [o.token_ids for o in plain]
    for a, b in zip(padded, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-12, rtol=0)
    for out in padded[:4]:
        expected = teacher_forced_logprobs(model, prompts[out.prompt_index], out.token_ids, params)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=1e-9, rtol=0)
    assert gen.runner.cache.manager.num_used == 0  # padding rows held no blocks
    assert all(g.head_in_graph for g in gen.graph_runners), "expected the LM head in the graph (a plain linear head)"
    if spec is not None:
        assert any(r.num_drafted for r in gen.last_trace), "expected drafted steps"


def test_an_lm_head_the_graph_cannot_compute_as_eager_runs_after_it():
    """A head with a bias (or under another autocast dtype, `tests/test_policy_state.py`) runs eagerly over the
    hidden states, and the padded forward still generates what the plain one does."""
    model = make_model("llama")
    head = model.get_output_embeddings()
    noise = torch.Generator().manual_seed(0)
    head.bias = torch.nn.Parameter(torch.randn(head.out_features, dtype=head.weight.dtype, generator=noise))
    prompts = random_prompts(5, max_len=10, seed=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    plain = padded_generator(model, False, max_batch_size=4, max_seq_len=48).generate(prompts, params)
    gen = padded_generator(model, True, max_batch_size=4, max_seq_len=48)
    assert gen.runner.graphs.logits is None
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in plain]
    assert not gen.runner.graphs.head_in_graph


def test_padding_rows_write_no_kv():
    """A step of 3 rows padded to 4: the padding row's slot is -1, so every pool block but the rows' own is
    untouched."""
    model = make_model("qwen2")
    gen = padded_generator(model, True, max_batch_size=4, max_seq_len=32)
    gen.add_requests(random_prompts(3, seed=7), SamplingParams(temperature=0, max_new_tokens=8))
    cache = gen.runner.cache
    with torch.inference_mode():
        gen.step()  # the prefill
        pools = [p.clone() for p in cache.k_pools + cache.v_pools]
        held = {int(b) for row in range(3) for b in cache.manager.tables[row][: cache.manager.blocks_for(32)]}
        gen.step()
    for before, after in zip(pools, cache.k_pools + cache.v_pools):
        changed = {int(b) for b in torch.nonzero((before != after).flatten(1).any(1))[:, 0]}
        assert changed and changed <= held


def test_a_steps_metadata_lands_in_the_views_its_graph_reads():
    """A shape's metadata lies back to back in one buffer and goes up in one copy: what a step stages for a shape is
    what that shape's views (those its graph reads) hold, padding rows with no queries and slot -1, whatever shape was
    staged before; a forward-only step stages the first six parts."""
    spec = SpecConfig(method="ngram", num_speculative_tokens=2)  # steps up to 3 tokens wide
    gen = padded_generator(make_model("llama"), True, max_batch_size=8, max_seq_len=48, spec=spec)
    graphs = gen.runner.graphs
    assert graphs.max_width == 3
    rng = np.random.default_rng(0)
    for rows, width, real, num_parts in ((8, 3, 5, 9), (4, 2, 4, 9), (2, 1, 1, 6), (8, 3, 8, 9), (4, 3, 3, 6)):
        parts = [
            torch.from_numpy(rng.integers(1, 999, (real, width))),  # positions: a host tensor
            rng.integers(0, 999, (real, width)),  # the slot mapping: a numpy array
            rng.integers(0, 999, (real, graphs.table_width)),
        ] + [torch.from_numpy(rng.integers(1, 999, real)) for _ in range(6)]
        graphs._stage(rows, width, parts[:num_parts])
        views = graphs._views(rows, width)
        offsets = [view.data_ptr() for view in views]
        assert offsets == sorted(offsets), "the regions in order"
        for region, (view, part) in enumerate(zip(views[:num_parts], parts)):
            assert torch.equal(view[:real], torch.as_tensor(part)), f"region {region} of {rows} x {width}"
            assert (view[real:] == (-1 if region == 1 else 0)).all(), f"region {region}'s padding"


@pytest.mark.parametrize("race_every_node", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_the_static_walk_draws_what_the_shrinking_walk_draws(seed, race_every_node):
    """Exact verification on a GPU walks every row at every depth (nothing waits for the device); it must emit the
    same tokens, log-probs and paths as the walk over the rows still walking."""
    gen = torch.Generator().manual_seed(seed)
    rows, vocab, max_k = 7, 13, 4
    num_drafted = torch.randint(0, max_k + 1, (rows,), generator=gen).tolist()
    tree = seed % 2 == 1
    parents = None
    if tree:  # random trees: draft j's parent is an earlier draft of the row, or the pending token (-1)
        parents = torch.full((rows, max_k), -1, dtype=torch.long)
        for r, k in enumerate(num_drafted):
            for j in range(k):
                parents[r, j] = int(torch.randint(-1, j, (1,), generator=gen))
    layout = layout_drafts(num_drafted, parents)
    num_nodes = sum(layout.num_nodes)
    # a node holds token i when it is its parent's (i+1)-th child (siblings differ); tokens 0 and 1 are likely
    # everywhere, so drafts are often accepted and the walks go deep, or stop at random
    node_ids = []
    for r, count in enumerate(layout.num_nodes):
        parents_of = layout.parents[r, :count].tolist()
        node_ids += [0] + [parents_of[1:j].count(parents_of[j]) for j in range(1, count)]
    node_ids = torch.tensor(node_ids)
    logits = torch.randn(num_nodes, vocab, generator=gen, dtype=torch.float64)
    logits[:, 0] += 5
    logits[:, 1] += 4
    sampling = RowSampling(
        torch.full((rows,), 0.8, dtype=torch.float64), torch.zeros(rows, dtype=torch.long),
        torch.ones(rows, dtype=torch.float64), False, False, False,
    )  # fmt: skip
    race = RaceKeys(torch.randint(0, 2**40, (rows,), generator=gen), torch.randint(0, 50, (rows,), generator=gen))
    results = [
        verify_exact(logits, node_ids, layout, sampling, race, race_every_node, static_walk=static)
        for static in (False, True)
    ]
    for name in ("output_token_ids", "num_emitted", "logprobs", "accepted_nodes"):
        assert torch.equal(getattr(results[0], name), getattr(results[1], name)), name
    assert int(results[0].num_emitted.max()) > 1, "expected some accepted drafts"


def test_cuda_graphs_argument():
    model = make_model("llama")
    with pytest.raises(ValueError, match="cuda_graphs \\('yes'\\) must be True, False or 'auto'"):
        Generator(model, max_batch_size=2, max_seq_len=16, cuda_graphs="yes")
    # 1 and 0 passed the check (1 == True to `in`) and were then read by `is True` / `is not False` as the other switch
    with pytest.raises(ValueError, match="cuda_graphs \\(0\\) must be True, False or 'auto'"):
        Generator(model, max_batch_size=2, max_seq_len=16, cuda_graphs=0)
    with pytest.raises(ValueError, match="async_scheduling \\(1\\) must be True, False or 'auto'"):
        Generator(model, max_batch_size=2, max_seq_len=16, async_scheduling=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device and the paged KV layout"):
            Generator(model, max_batch_size=2, max_seq_len=16, cuda_graphs=True)
    gen = Generator(model, max_batch_size=2, max_seq_len=16, kv_layout="paged")
    assert gen.runner.graphs is None  # auto: on a GPU only
    with pytest.raises(ValueError, match="CUDA graphs need the paged KV layout"):
        Generator(model, max_batch_size=2, max_seq_len=16, kv_layout="slots").runner.use_graphs(2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_padded_chain_verification_draws_what_exact_verification_draws(seed, dtype):
    """A verifying graph races every cell of the padded `[rows, width]` block, padding included; each real row must
    emit the tokens and log-probs `verify_exact` gives it over its own nodes (greedy rows among sampled ones, rows of
    0..K drafts, padding rows at the end)."""
    gen = torch.Generator().manual_seed(seed)
    rows, padding, vocab, max_k = 6, 2, 29, 4
    num_drafted = torch.randint(0, max_k + 1, (rows,), generator=gen).tolist()
    num_drafted[0] = max_k  # the block is as wide as the widest row
    layout = layout_drafts(num_drafted, None)
    width = layout.width
    # drafts mostly tokens 0 and 1, which the logits favour: some are accepted, some not
    tokens = torch.full((rows + padding, width), -1, dtype=torch.long)
    for r, k in enumerate(num_drafted):
        tokens[r, : k + 1] = torch.randint(0, 2, (k + 1,), generator=gen)
    logits = torch.randn((rows + padding) * width, vocab, generator=gen, dtype=torch.float64)
    logits[:, 0] += 3
    logits[:, 1] += 3
    logits = logits.to(dtype)
    temperatures = torch.tensor([0.7, 0.0, 1.0, 1.3, 0.0, 1.0, 0.0, 0.0], dtype=torch.float32)
    seeds = torch.randint(0, 2**40, (rows + padding,), generator=gen)
    positions = torch.randint(0, 50, (rows + padding,), generator=gen)
    padded = verify_padded_chains(logits, tokens, temperatures, RaceKeys(seeds, positions))

    fed = torch.arange(width)[None, :] < layout.node_counts[:, None]
    logit_rows = (torch.arange(rows)[:, None] * width + torch.arange(width))[fed]
    sampling = RowSampling(
        temperatures[:rows], torch.zeros(rows, dtype=torch.long), torch.ones(rows), False, False, True
    )  # fmt: skip
    race = RaceKeys(seeds[:rows], positions[:rows])
    # the walk over the rows still walking, depth by depth: not the chain walk the padded verification shares
    exact = verify_exact(logits, tokens[:rows][fed], layout, sampling, race, False, logit_rows, static_walk=False)
    assert torch.equal(padded.output_token_ids[:rows], exact.output_token_ids)
    assert torch.equal(padded.num_emitted[:rows], exact.num_emitted)
    assert torch.equal(padded.logprobs[:rows], exact.logprobs)
    assert int(exact.num_emitted.max()) > 1 and int(exact.num_emitted.min()) == 1, "expected accepts and rejects"


def test_a_capture_never_changes_the_tokens_a_step_feeds():
    """A step launched ahead feeds the tokens of the step before it as a view of that step's packed results, in the
    buffer a verifying graph writes; a capture first runs the padded body once (and so writes that buffer). The step
    must still feed its own tokens: the graph runner copies them in before it captures."""
    model = make_model("llama")
    gen = padded_generator(model, True, max_batch_size=4, max_seq_len=48)
    graphs = gen.runner.graphs
    gen.add_requests(random_prompts(3, seed=2), SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))
    with torch.inference_mode():
        for _ in range(3):
            gen.step()
        rows = gen.num_active
        lens = gen.slots.cache_len[:rows].clone()
        race = RaceKeys(gen.slots.seed[:rows, 0].clone(), torch.arange(rows))
        temperatures = torch.ones(rows)
        results = graphs.packed[: rows * 3].view(rows, 3)  # [emitted, token, log-prob bits] of a width-1 step
        results[:, 1] = torch.tensor([11, 12, 13])[:rows]
        fed = results[:, 1:2]  # what `LaunchedStep.next_input_ids` hands a step launched ahead

        def capturing(rows, width, verifying):  # a capture's first move: a warm-up run of the padded body
            staged = [np.zeros((0, width))] * 2 + [np.zeros((0, graphs.table_width))] + [np.zeros(0)] * 6
            graphs._stage(rows, width, staged)
            graphs._body(rows, width, verifying)
            return None

        graphs._graph = capturing
        batch = StepBatch.build(0, fed, lens, torch.zeros_like(lens), torch.ones(rows, dtype=torch.long))
        graphs.forward_verified(batch, race, temperatures)
    assert graphs.ids[:rows].tolist() == [11, 12, 13][:rows], "the step fed what the warm-up left in the buffer"
