"""Train the tokenizer, the tiny target and the tiny draft shipped in `rollout/models/assets/`.

Everything comes from the seeded arithmetic task (`rollout.tasks.arithmetic`): a byte-level BPE tokenizer with
single-digit tokens, a Llama target and a Llama draft with under a tenth of its parameters, both trained with
next-token loss on the solutions (prompt tokens are not scored). Deterministic for a seed: one torch thread,
fixed step counts (never a time budget) and seeded data order. At the end it prints the metrics of
`scripts/eval_tiny_models.py`.

    python scripts/train_tiny_models.py --out rollout/models/assets --seed 0
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import sys
import time
from dataclasses import dataclass

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rollout.tasks.arithmetic import format_completion, format_prompt, generate_problems

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # so the sibling eval script imports when run from anywhere
from eval_tiny_models import evaluate  # noqa: E402

EOS, PAD = "<|endoftext|>", "<|pad|>"
# GPT-2 style split, but every digit is its own piece (keeping one leading space), so "17" is "1" "7" and the
# model does column arithmetic over digit tokens instead of memorising a token per number.
PRE_TOKENIZER_PATTERN = r" ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+"


@dataclass
class ModelSpec:
    """Shape and training schedule of one model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    num_steps: int  # optimizer steps
    lr: float  # peak learning rate (linear warm-up, cosine decay to a tenth)
    tokens_per_batch: int  # padded tokens per optimizer step

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")


# Many small steps beat few large ones here: copying numbers out of the prompt appears only after about two
# thousand updates (one CPU thread affords about 10k tokens/s for the target). Training stops well short of
# perfect on purpose: at temperature 1.0 the samples of a prompt should disagree often, as in real RL rollouts.
TARGET = ModelSpec(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=352, num_steps=3000, lr=2e-3,
                   tokens_per_batch=2048)  # fmt: skip
# Two layers, the fewest that can copy from the prompt (previous-token head + induction head).
DRAFT = ModelSpec(hidden_size=48, num_layers=2, num_heads=2, intermediate_size=128, num_steps=4000, lr=3e-3,
                  tokens_per_batch=2048)  # fmt: skip


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer over `texts` with EOS and pad tokens, padding on the left for generation."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD, padding_side="left", model_max_length=2048
    )


def encode(tokenizer, problems) -> list[tuple[list[int], int]]:
    """(prompt + completion + EOS ids, number of prompt tokens) per problem."""
    examples = []
    for problem in problems:
        prompt_ids = tokenizer(format_prompt(problem.problem))["input_ids"]
        completion_ids = tokenizer(format_completion(problem.solution))["input_ids"]
        examples.append((prompt_ids + completion_ids + [tokenizer.eos_token_id], len(prompt_ids)))
    return examples


def make_batches(examples, tokens_per_batch: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of example indices; each batch holds examples of similar length, so little is padding."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), rng.random()))
    batches, current, longest = [], [], 0
    for i in order:
        length = len(examples[i][0])
        if current and max(longest, length) * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(examples, batch: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels (-100 on prompt and padding) for one right-padded batch.

    No attention mask: with right padding, causal attention never lets a real token see a pad, and the
    unmasked path is faster.
    """
    width = max(len(examples[i][0]) for i in batch)
    input_ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    for row, i in enumerate(batch):
        ids, num_prompt = examples[i]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, num_prompt : len(ids)] = torch.tensor(ids[num_prompt:])
    return input_ids, labels


def build_model(spec: ModelSpec, tokenizer) -> LlamaForCausalLM:
    """A Llama causal LM of `spec`'s shape with tied embeddings (they are most of a tiny model's parameters)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def train(model, spec: ModelSpec, examples, pad_id: int, seed: int, name: str) -> None:
    """Train `model` for `spec.num_steps` steps, cycling through freshly shuffled epochs of `examples`."""
    rng = random.Random(f"{name}-{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, spec.num_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return spec.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, spec.num_steps - warmup)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    batches: list[list[int]] = []
    start, running = time.time(), 0.0
    for step in range(spec.num_steps):
        if not batches:
            batches = make_batches(examples, spec.tokens_per_batch, rng)
        input_ids, labels = collate(examples, batches.pop(), pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running = loss.item() if step == 0 else 0.98 * running + 0.02 * loss.item()
        if step % 250 == 0 or step == spec.num_steps - 1:
            print(f"[{name}] step {step:5d} loss {running:.4f} lr {lr_at(step):.2e} {time.time() - start:.0f}s",
                  flush=True)  # fmt: skip
    model.eval()


def save(model, tokenizer, folder: pathlib.Path) -> None:
    """A self-contained Hugging Face folder: config, generation config, safetensors weights, tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for file in folder.iterdir():
        file.chmod(0o644)  # safetensors writes owner-only files; shipped package data must be world-readable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/tiny-models", help="writes <out>/tiny-target and <out>/tiny-draft")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, initialisation and data order")
    parser.add_argument("--num-train", type=int, default=30_000, help="distinct training problems")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size, special tokens included")
    parser.add_argument("--target-steps", type=int, default=TARGET.num_steps, help="optimizer steps of the target")
    parser.add_argument("--draft-steps", type=int, default=DRAFT.num_steps, help="optimizer steps of the draft")
    parser.add_argument("--skip-eval", action="store_true", help="do not measure the models at the end")
    args = parser.parse_args()
    # One thread: another core is busy, and a fixed thread count keeps float reductions in the same order.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    start = time.time()
    out = pathlib.Path(args.out)

    problems = generate_problems(args.num_train, split="train", seed=args.seed)
    tokenizer = train_tokenizer([format_prompt(p.problem) + format_completion(p.solution) for p in problems],
                                args.vocab_size)  # fmt: skip
    examples = encode(tokenizer, problems)
    print(f"{len(examples)} examples, {sum(len(e[0]) for e in examples)} tokens, vocab {len(tokenizer)}", flush=True)

    models_ = {}
    for name, spec, steps in (("tiny-target", TARGET, args.target_steps), ("tiny-draft", DRAFT, args.draft_steps)):
        spec = ModelSpec(**{**spec.__dict__, "num_steps": steps})
        torch.manual_seed(args.seed)
        model = build_model(spec, tokenizer)
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters", flush=True)
        train(model, spec, examples, tokenizer.pad_token_id, args.seed, name)
        save(model, tokenizer, out / name)
        models_[name] = model
    num_target = sum(p.numel() for p in models_["tiny-target"].parameters())
    num_draft = sum(p.numel() for p in models_["tiny-draft"].parameters())
    train_seconds = time.time() - start
    print(f"trained in {train_seconds:.0f}s; draft/target parameters {num_draft / num_target:.3f}", flush=True)
    if not args.skip_eval:
        metrics = evaluate(models_["tiny-target"], models_["tiny-draft"], tokenizer, seed=args.seed)
        for key, value in metrics.items():
            print(f"{key}: {value:.4f}")
    print(f"total {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
