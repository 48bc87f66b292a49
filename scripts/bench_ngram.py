"""Time the n-gram proposer per step against one decode forward of the target model, at batch 64, one thread.

    python scripts/bench_ngram.py [--seq-lens 256 1024] [--num-rows 64]

The model is a random-weight Qwen2 of ~3.4M parameters (the size of the shipped tiny models). The forward feeds 64
rows x 1 new token over a DynamicCache prefilled once to the sequence length and cropped back after each timing, so it
includes the cache's concatenation; the floor line is a forward with no cache at all (weights only), the lower bound
of any decode step. The proposer runs on rows drawn i.i.d. from three token distributions: "uniform" over the vocabulary
(few matches), "zipf" (exponent 1.1, the unigram statistics of natural text: the last token recurs at 0.5-15% of
positions) and "4-token" (uniform over 4 tokens: the last token recurs at 25% of positions, a worst case for the
sparse search). A dense pure-torch search is timed as a baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

from rollout.engine.model_runner import cache_keyword
from specdec.proposers import NgramProposer


def median_ms(fn: Callable[[], object], num_repeats: int, num_warmup: int = 3) -> float:
    for _ in range(num_warmup):
        fn()
    times = []
    for _ in range(num_repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def dense_torch_propose(token_ids: torch.Tensor, num_tokens: torch.Tensor, k: int, min_n: int, max_n: int):
    """Baseline: match length at every position in [rows, positions] torch ops, best position by one argmax of the
    proposer's ranking: match length, then how many of the K tokens the occurrence supplies, then recency."""
    num_rows, width = token_ids.shape
    suffix_pos = num_tokens[:, None] - max_n + torch.arange(max_n)  # [num_rows, max_n]
    suffix = torch.where(suffix_pos >= 0, token_ids.gather(1, suffix_pos.clamp(min=0)), -2)
    padded = F.pad(token_ids, (max_n - 1, 0), value=-1)
    alive = padded[:, max_n - 1 :] == suffix[:, max_n - 1 :]
    match_lens = alive.to(torch.int64)
    for m in range(1, max_n):
        alive &= padded[:, max_n - 1 - m : max_n - 1 - m + width] == suffix[:, max_n - 1 - m : max_n - m]
        match_lens += alive
    positions = torch.arange(width)
    valid = (positions <= num_tokens[:, None] - 2) & (match_lens >= min_n)
    supply = (num_tokens[:, None] - 1 - positions).clamp(0, k)
    scores = torch.where(valid, (match_lens * (k + 1) + supply) * (width + 1) + positions, -1).max(1).values
    cont_pos = (scores % (width + 1))[:, None] + 1 + torch.arange(k)
    ok = (scores[:, None] >= 0) & (cont_pos < num_tokens[:, None])
    return torch.where(ok, token_ids.gather(1, cont_pos.clamp(max=width - 1)), -1)


def time_proposer(
    proposer: NgramProposer,
    token_ids: torch.Tensor,  # [num_rows, T]
    num_tokens: torch.Tensor,  # [num_rows]
    num_asked: torch.Tensor,  # [num_rows]
    num_candidates: int,
    num_repeats: int,
) -> tuple[float, float, float]:
    """Median ms of propose, propose_candidates and the dense torch baseline (checked to agree with propose)."""
    k, min_n, max_n = proposer.num_speculative_tokens, proposer.prompt_lookup_min, proposer.prompt_lookup_max
    dense = dense_torch_propose(token_ids, num_tokens, k, min_n, max_n)
    assert torch.equal(dense, proposer.propose(token_ids, num_tokens, num_asked)), "baseline disagrees"
    propose_ms = median_ms(lambda: proposer.propose(token_ids, num_tokens, num_asked), num_repeats)
    candidates_ms = median_ms(
        lambda: proposer.propose_candidates(token_ids, num_tokens, num_asked, num_candidates), num_repeats
    )
    dense_ms = median_ms(lambda: dense_torch_propose(token_ids, num_tokens, k, min_n, max_n), num_repeats)
    return propose_ms, candidates_ms, dense_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--num-rows", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--num-candidates", type=int, default=4)
    parser.add_argument("--num-repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    num_params = sum(p.numel() for p in model.parameters())
    proposer = NgramProposer(args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max)
    num_rows = args.num_rows
    next_ids = torch.randint(0, config.vocab_size, (num_rows, 1))
    num_asked = torch.full((num_rows,), args.num_speculative_tokens, dtype=torch.int64)
    distributions = {
        "uniform": torch.ones(config.vocab_size),
        "zipf": 1.0 / torch.arange(1, config.vocab_size + 1, dtype=torch.float64) ** 1.1,
        "4-token": torch.ones(4),
    }

    with torch.inference_mode():
        floor_ms = median_ms(lambda: model(input_ids=next_ids, use_cache=False), args.num_repeats)
    print(
        f"Qwen2 {num_params / 1e6:.1f}M params, batch {num_rows}, num_speculative_tokens {args.num_speculative_tokens}"
        f", prompt lookup {proposer.prompt_lookup_min}..{proposer.prompt_lookup_max}, {args.num_candidates} candidates"
        f", one thread\nforward floor ({num_rows} x 1 token, no cache): {floor_ms:.2f} ms\n"
    )
    print(
        f"{'seq_len':>7} {'tokens':>8} {'hits':>5} {'forward ms':>10} {'propose ms':>10} {'% fwd':>6} {'% floor':>7} "
        f"{'cands ms':>8} {'% fwd':>6} {'% floor':>7} {'dense torch ms':>14} {'dense/propose':>13}"
    )
    keyword = cache_keyword(model)  # `cache` from transformers 5.24, `past_key_values` before
    for seq_len in args.seq_lens:
        with torch.inference_mode():
            cache = DynamicCache(config=config)
            model(input_ids=torch.randint(0, config.vocab_size, (num_rows, seq_len)), **{keyword: cache})

            def step(cache: DynamicCache = cache) -> None:
                model(input_ids=next_ids, use_cache=True, logits_to_keep=1, **{keyword: cache})
                cache.crop(-1)

            forward_ms = median_ms(step, max(5, args.num_repeats // 3))
        # ragged lengths and 16 garbage columns past the longest row, as in a live batch
        num_tokens = seq_len - torch.randint(0, 16, (num_rows,))
        for name, probs in distributions.items():
            token_ids = torch.multinomial(probs, num_rows * (seq_len + 16), replacement=True).view(num_rows, -1)
            last_ids = token_ids.gather(1, num_tokens[:, None] - 1)
            hit_rate = (token_ids[:, : seq_len - 16] == last_ids).double().mean().item()
            propose_ms, cands_ms, dense_ms = time_proposer(
                proposer, token_ids, num_tokens, num_asked, args.num_candidates, args.num_repeats
            )
            print(
                f"{seq_len:>7} {name:>8} {hit_rate:>5.1%} {forward_ms:>10.2f} {propose_ms:>10.3f} "
                f"{propose_ms / forward_ms:>6.2%} {propose_ms / floor_ms:>7.2%} {cands_ms:>8.3f} "
                f"{cands_ms / forward_ms:>6.2%} {cands_ms / floor_ms:>7.2%} "
                f"{dense_ms:>14.3f} {dense_ms / propose_ms:>12.1f}x"
            )


if __name__ == "__main__":
    main()
