"""Function-preserving widening: a shipped tiny Llama embedded in a large Llama shape.

`widen(small, shape)` returns a `LlamaForCausalLM` of `shape` (e.g. Llama-3.2-1B's) that computes what `small`
computes, and costs what a model of `shape` costs: the same matmul shapes, KV bytes and LM head. What is promised:

- On any input of real tokens (ids below the small vocabulary), the log-probabilities of the real tokens equal the
  small model's up to rounding, so greedy tokens are the small model's. Exact in exact arithmetic; in floats, HF's
  RMSNorm sums squares in float32 whatever the dtype, so float64 agrees to ~1e-13 where torch sums n numbers and
  the same n among H - n zeros alike (n = 128 in H = 512 or 2048 on a CPU), else to float32 rounding (~1e-5 in
  log-probs for tiny-draft's n = 48); float32 agrees to ~5e-5, as close as the shipped model's float32 is to its
  float64.
- An added vocabulary row (id >= the small vocabulary) has probability exactly 0 after softmax (float32, bfloat16,
  float64): its logit is below the real ones by about 2^20 / rms of the final hidden state.
- Everything that can be random without changing the function is random (uniform, std `initializer_range`):
  extra query heads, extra KV heads, unused key and value dims, extra MLP units, extra layers, the padded input
  columns of every read projection and the real dims of added vocabulary rows. Zero are only the writes into the
  residual stream that must be (o_proj and down_proj outside the small model's block, all of them in added layers).

How (the residual stream holds the small model's `n` dims, then zeros, then one guard coordinate G = hidden - 1):
- RMSNorm over H dims of which n are non-zero sees mean(x^2) scaled by n / H: norm weights are scaled by
  sqrt(n / H) and `rms_norm_eps` by n / H (both exact in binary when H / n is a power of 4, as 2048 / 128 is).
- Small head dim d -> wide head dim D = r * d: HF's rotary pairs dim i with i + d/2 at frequency theta^(-2i/d), so
  small dim i goes to r * i and i + d/2 to D/2 + r * i (identical frequencies, bit for bit). Queries are zero on
  the other dims and scaled by sqrt(r) to undo the wider head's 1/sqrt(D). Small KV head h is wide KV head h,
  small query head (h, m) is wide query head h * group + m; values sit in the first d dims of their head.
- G holds 2^-40 for every real token (its embedding entry; no projection writes it and every inner norm weight at
  G is 0, so nothing reads it). Its square, 2^-80, vanishes in every norm's float32 sum of squares. The final norm
  weight at G is 2^30 and every added vocabulary row has -2^30 at G, so its logit gets -2^20 / rms, while a real
  token's shift is 2^-50 / rms (shift-invariant softmax, and below float rounding anyway).
float16 is refused: its range cannot hold the guard.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

_GUARD_VALUE = 2.0**-40  # G's entry in a real token's embedding; squared it is lost in any norm's sum
_GUARD_GAIN = 2.0**30  # final-norm weight at G
_GUARD_EMBED = -(2.0**30)  # G's entry in every added vocabulary row


@dataclass(frozen=True)
class WideShape:
    """The Llama shape to widen into."""

    hidden_size: int  # residual width; more than the small model's (one coordinate is the vocabulary guard)
    num_hidden_layers: int  # at least the small model's
    num_attention_heads: int  # query heads; query heads per KV head at least the small model's
    num_key_value_heads: int  # at least the small model's
    head_dim: int  # a multiple of the small model's, so that rotary frequencies match
    intermediate_size: int  # MLP width, at least the small model's
    vocab_size: int  # more than the small model's

    def num_parameters(self) -> int:
        """Parameters with tied embeddings, as `model.num_parameters()` counts them."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """KV-cache bytes one token takes over all layers (keys and values), at `itemsize` bytes a number."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize


LLAMA_3_2_1B = WideShape(2048, 16, 32, 8, 64, 8192, 128256)
# A draft at a draft's cost for a 1B Llama-3 target: same vocabulary, 768 wide; head_dim 48 = 2 x tiny-draft's 24.
DRAFT_150M = WideShape(768, 8, 16, 4, 48, 2048, 128256)
# widened name -> (shipped model it computes, shape)
WIDENED = {"tiny-target-1b": ("tiny-target", LLAMA_3_2_1B), "tiny-draft-150m": ("tiny-draft", DRAFT_150M)}


def check_widenable(config, shape: WideShape) -> None:
    """Raise ValueError naming the first field of `shape` (or of the small `config`) the construction cannot serve."""
    if config.model_type != "llama":
        raise ValueError(f"only Llama models can be widened, got model_type {config.model_type!r}")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" or config.attention_bias or config.mlp_bias:
        raise ValueError("the small model must use default rotary embeddings and no attention or MLP bias")
    if not config.tie_word_embeddings:
        raise ValueError("the small model must tie its input and output embeddings")
    d = config.head_dim
    small_group = config.num_attention_heads // config.num_key_value_heads
    checks = [
        ("hidden_size", shape.hidden_size > config.hidden_size, f"more than {config.hidden_size}"),
        ("num_hidden_layers", shape.num_hidden_layers >= config.num_hidden_layers, f">= {config.num_hidden_layers}"),
        (
            "num_key_value_heads",
            shape.num_key_value_heads >= config.num_key_value_heads,
            f">= {config.num_key_value_heads}",
        ),
        (
            "num_attention_heads",
            shape.num_attention_heads % shape.num_key_value_heads == 0
            and shape.num_attention_heads // shape.num_key_value_heads >= small_group,
            f"a multiple of num_key_value_heads with >= {small_group} query heads per KV head",
        ),
        ("head_dim", shape.head_dim % d == 0 and d % 2 == 0, f"a multiple of {d}"),
        ("intermediate_size", shape.intermediate_size >= config.intermediate_size, f">= {config.intermediate_size}"),
        ("vocab_size", shape.vocab_size > config.vocab_size, f"more than {config.vocab_size}"),
    ]
    for field, ok, need in checks:
        if not ok:
            raise ValueError(f"{field} ({getattr(shape, field)}) must be {need} to widen this model")


def wide_config(config, shape: WideShape):
    """The `LlamaConfig` of the widened model: `shape`, with the small model's rotary, activation and token ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps * config.hidden_size / shape.hidden_size,
        rope_parameters=dict(config.rope_parameters),
        tie_word_embeddings=True,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def layer_positions(num_small: int, num_wide: int) -> list[int]:
    """Where the small model's layers go among the wide ones: spread evenly, the first at 0."""
    return [i * num_wide // num_small for i in range(num_small)]


@torch.no_grad()
def widen(
    small,
    shape: WideShape,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    seed: int = 0,
):
    """A `LlamaForCausalLM` of `shape` that computes what the small Llama `small` computes (see the module docstring).

    Args:
        small: a loaded Llama causal LM (any dtype; its weights are read in float64).
        shape: the wide shape; `check_widenable` says what it must satisfy.
        dtype: the wide model's dtype (float32, bfloat16 or float64).
        device: where the wide model is built (random init runs there); None is the CPU.
        seed: seed of the random parts.
    Returns:
        The wide model in eval mode, with `small`'s generation config.
    """
    from transformers import LlamaForCausalLM

    if dtype not in (torch.float32, torch.bfloat16, torch.float64):
        why = ": float16 cannot hold the vocab guard" if dtype == torch.float16 else ""
        raise ValueError(f"dtype ({dtype}) must be torch.float32, torch.bfloat16 or torch.float64{why}")
    config = small.config
    check_widenable(config, shape)
    device = torch.device(device or "cpu")
    with torch.device("meta"):  # no init: every parameter is written below
        model = LlamaForCausalLM._from_config(wide_config(config, shape), dtype=dtype)
    model.to_empty(device=device)
    # to_empty leaves buffers unset: rotary frequencies are computed on the CPU, as for a loaded model
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)
    model.tie_weights()  # to_empty gives the tied lm_head its own tensor
    n, H = config.hidden_size, shape.hidden_size
    small_params = _scaled_params(small, shape, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    bound = model.config.initializer_range * math.sqrt(3)  # uniform: 5x faster than normal on a CPU, same std
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(math.sqrt(n / H))  # padded dims multiply zeros; G is set below
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            param.zero_()  # writes into the residual stream: only the small model's block is non-zero
        else:
            param.uniform_(-bound, bound, generator=generator)

    guard = H - 1
    small_vocab = config.vocab_size
    embed = model.model.embed_tokens.weight  # [vocab, H], tied with lm_head
    embed[:small_vocab] = 0
    embed[:small_vocab, :n] = small_params["model.embed_tokens.weight"]
    embed[:small_vocab, guard] = _GUARD_VALUE
    embed[small_vocab:, guard] = _GUARD_EMBED
    final_norm = model.model.norm.weight
    final_norm[:n] = small_params["model.norm.weight"]
    final_norm[guard] = _GUARD_GAIN
    for layer in model.model.layers:
        layer.input_layernorm.weight[guard] = 0  # nothing reads G
        layer.post_attention_layernorm.weight[guard] = 0
    for small_index, wide_index in enumerate(layer_positions(config.num_hidden_layers, shape.num_hidden_layers)):
        prefix = f"model.layers.{small_index}."
        layer_params = {k[len(prefix) :]: v for k, v in small_params.items() if k.startswith(prefix)}
        _copy_layer(model.model.layers[wide_index], layer_params, config, shape)
    model.generation_config = copy.deepcopy(small.generation_config)
    return model.eval()


def _scaled_params(small, shape: WideShape, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The small model's weights, scaled in float64 for the wide model (norms by sqrt(n / H), queries by
    sqrt(D / d)), then cast to `dtype` on `device`."""
    config = small.config
    norm_scale = math.sqrt(config.hidden_size / shape.hidden_size)
    query_scale = math.sqrt(shape.head_dim / config.head_dim)  # undoes the wider head's 1/sqrt(head_dim)
    params = {}
    for name, value in small.state_dict().items():
        value = value.detach().to(device, torch.float64)
        if name.endswith("norm.weight"):
            value = value * norm_scale
        elif name.endswith("q_proj.weight"):
            value = value * query_scale
        params[name] = value.to(dtype)
    return params


def _copy_layer(layer, small: dict[str, torch.Tensor], config, shape: WideShape) -> None:
    """Write one small layer's (scaled) weights into the wide `layer` (already random, with zero writes)."""
    n, d, D = config.hidden_size, config.head_dim, shape.head_dim
    r = D // d
    half = d // 2
    # small head dim i -> wide dim r*i (first half) or D/2 + r*(i - d/2) (second half): same rotary frequency
    rotary_dims = [r * i for i in range(half)] + [D // 2 + r * i for i in range(half)]
    small_group = config.num_attention_heads // config.num_key_value_heads
    wide_group = shape.num_attention_heads // shape.num_key_value_heads
    layer.input_layernorm.weight[:n] = small["input_layernorm.weight"]
    layer.post_attention_layernorm.weight[:n] = small["post_attention_layernorm.weight"]

    attn = layer.self_attn
    q = attn.q_proj.weight.view(shape.num_attention_heads, D, -1)  # [heads, D, H]
    k = attn.k_proj.weight.view(shape.num_key_value_heads, D, -1)
    v = attn.v_proj.weight.view(shape.num_key_value_heads, D, -1)
    o = attn.o_proj.weight.view(-1, shape.num_attention_heads, D)  # [H, heads, D]
    small_q = small["self_attn.q_proj.weight"].view(config.num_attention_heads, d, n)
    small_k = small["self_attn.k_proj.weight"].view(config.num_key_value_heads, d, n)
    small_v = small["self_attn.v_proj.weight"].view(config.num_key_value_heads, d, n)
    small_o = small["self_attn.o_proj.weight"].view(n, config.num_attention_heads, d)
    for kv_head in range(config.num_key_value_heads):
        k[kv_head, rotary_dims, :n] = small_k[kv_head]  # other dims stay random: the query is 0 there
        v[kv_head, :d, :n] = small_v[kv_head]  # other dims stay random: o_proj reads none of them
        for member in range(small_group):
            small_head, wide_head = kv_head * small_group + member, kv_head * wide_group + member
            q[wide_head, :, :n] = 0
            q[wide_head, rotary_dims, :n] = small_q[small_head]
            o[:n, wide_head, :d] = small_o[:, small_head]

    mlp, m = layer.mlp, config.intermediate_size
    mlp.gate_proj.weight[:m, :n] = small["mlp.gate_proj.weight"]  # extra units stay random: down_proj reads none
    mlp.up_proj.weight[:m, :n] = small["mlp.up_proj.weight"]
    mlp.down_proj.weight[:n, :m] = small["mlp.down_proj.weight"]
