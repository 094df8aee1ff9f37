"""GPT-2 style decoder-only transformer (flax.linen) with logical sharding axes.

Every parameter carries logical axis names (``nn.with_logical_partitioning``)
and the residual stream carries ``nn.with_logical_constraint`` annotations, so
the same module runs unsharded on one device or sharded under a mesh: bind the
names with ``nn.logical_axis_rules(LOGICAL_AXIS_RULES)`` and make the mesh
current with ``jax.set_mesh(mesh)``.  Constraints are no-ops when either is
missing (flax checks ``jax.sharding.get_abstract_mesh()``, which the
deprecated ``with mesh:`` does not set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from runner.errors import ConfigError
from runner.models.common.context_order import to_context_order
from runner.models.attention.kernels import attend
from runner.models.common import tiling
from runner.models.common.decoder import Decoder, KVCache, attend_cached, layer_input, stack_blocks
from runner.models.common.layers import (LOGICAL_AXIS_RULES, activation, dense, embedding, merge_heads, ones_init,
                                         project_heads, residual_std, state_over_context, zeros_init)
from runner.models.common.quantization import quantized
from runner.models.common.runtime import Runtime
from runner.models.family import MODEL_FAMILIES, fields_of, refuse_foreign_keys
from runner.models.gpt import hf as gpt_hf


@dataclass(frozen=True)
class GPTConfig(Runtime):
    """Model hyperparameters; ``d_ff == 0`` means the GPT-2 default ``4 * d_model``."""

    vocab_size: int
    context_length: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int = 0
    tie_embeddings: bool = True
    dropout: float = 0.0
    use_bias: bool = True
    activation: str = "gelu_new"  # transformers' name (runner.models.common.layers.ACTIVATIONS)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            # Frozen dataclass: resolve the default once so every consumer
            # (model, param_count, flops_per_token) sees the same value.
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        super().__post_init__()
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _layer_norm(cfg: GPTConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=cfg.norm_eps,
        dtype=cfg.dtype,
        param_dtype=cfg.params_dtype,
        use_bias=cfg.use_bias,
        scale_init=ones_init(("embed",)),
        bias_init=zeros_init(("embed",)),
        name=name,
    )


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention (``cfg.attention``; the projections: see `project_heads`).
    There is no attention-probability dropout: the fused op has none; residual dropout after the
    output projection is kept."""

    cfg: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, cache: KVCache | None = None,
                 index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        """Full causal attention (within each segment when ``segment_ids`` (B, T) are given, by
        ``cfg.attention``), or with ``cache`` (this layer's keys and values, (B, L, N, H)
        each) attention of the new tokens at per-row positions ``index + t`` over the cache,
        into which their keys and values are written. Returns (output, updated cache or None)."""
        cfg = self.cfg
        q, k, v = (project_heads(cfg, x, cfg.n_heads, "heads", cfg.use_bias, n) for n in ("query", "key", "value"))
        if cache is None:
            y = attend(cfg.attention, q, k, v, segment_ids, context_parallel=cfg.context_parallel,
                       ulysses_ways=cfg.ulysses_ways, initializing=self.is_initializing())  # (B,T,N,H)
        else:
            y, cache = attend_cached(q, k, v, cache, index)
        y = merge_heads(cfg, y, cfg.use_bias)
        return nn.Dropout(cfg.dropout, deterministic=self.deterministic)(y), cache


class MLP(nn.Module):
    """Position-wise feed-forward block (GELU, tanh approximation, unless cfg.activation says)."""

    cfg: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = dense(cfg, cfg.d_ff, ("embed", "mlp"), 0.02, cfg.use_bias, "fc")(x)
        h = nn.with_logical_constraint(activation(cfg.activation)(h), ("batch", "length", "mlp"))
        y = dense(cfg, cfg.d_model, ("mlp", "embed"), residual_std(cfg.n_layers), cfg.use_bias, "proj")(h)
        return nn.Dropout(cfg.dropout, deterministic=self.deterministic)(y)


class Block(nn.Module):
    """Pre-norm transformer block; ``(carry, cache) -> (carry, new cache)`` to fit ``nn.scan``
    (the cache is None when training, and this layer's (keys, values) when decoding)."""

    cfg: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, cache: KVCache | None = None,
                 index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg = self.cfg
        x = layer_input(x)
        y, cache = CausalSelfAttention(cfg, self.deterministic, name="attn")(_layer_norm(cfg, "ln_1")(x), segment_ids,
                                                                            cache, index)
        x = x + y
        tiles = cfg.mlp_tiles if cache is None else 1  # tiled when training (a cache: decoding)
        x = x + tiling.feed_forward(MLP(cfg, self.deterministic, name="mlp"), _layer_norm(cfg, "ln_2")(x), tiles)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), cache


class GPT(Decoder):
    """GPT-2 language model, learned positions (the call, packing and decoding: see `Decoder`)."""

    cfg: GPTConfig

    @property
    def kv_heads(self) -> int:
        return self.cfg.n_heads

    def hidden(self, tokens: jax.Array, deterministic: bool, caches: KVCache | None, index: jax.Array | None,
               segment_ids: jax.Array | None,
               positions: jax.Array | None) -> tuple[jax.Array, nn.Embed, KVCache | None]:
        cfg = self.cfg
        seq_len = tokens.shape[1]
        wte = embedding(cfg, cfg.vocab_size, ("vocab", "embed"), "wte")
        wpe = embedding(cfg, cfg.context_length, (None, "embed"), "wpe")
        if caches is None:  # rows split over a context axis: in its order from the tokens to the head
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(seq_len)[None], tokens.shape)
            tokens, positions, segment_ids = to_context_order(tokens, positions, segment_ids)
            x = wte(tokens) + wpe(positions)
        else:
            index = jnp.asarray(index, jnp.int32)
            x = wte(tokens) + wpe(index[:, None] + jnp.arange(seq_len))
        x = nn.Dropout(cfg.dropout, deterministic=deterministic)(x)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

        # One compiled block when scanned: each layer's slice of the cache is scanned in, the
        # updated slices stacked back.
        x, new_cache = stack_blocks(Block, (cfg, deterministic), cfg, x, (segment_ids,), caches, index,
                                    rngs=("params", "dropout"))
        return _layer_norm(cfg, "ln_f")(x), wte, new_cache


def param_count(cfg: GPTConfig, include_embeddings: bool = True) -> int:
    """Exact parameter count, without building the model.

    ``include_embeddings=False`` drops the token and position tables (Kaplan et
    al.'s "non-embedding" N); an untied LM head is a projection and is kept.
    """
    d, f, bias = cfg.d_model, cfg.d_ff, int(cfg.use_bias)
    layer_norm = d * (1 + bias)
    attn = 4 * d * d + bias * 4 * d
    mlp = 2 * d * f + bias * (f + d)
    total = cfg.n_layers * (2 * layer_norm + attn + mlp) + layer_norm
    if not cfg.tie_embeddings:
        total += d * cfg.vocab_size
    if include_embeddings:
        total += (cfg.vocab_size + cfg.context_length) * d
    return total


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM/Chinchilla style.

        6 * (n_layers * (4 * d_model**2 + 2 * d_model * d_ff) + d_model * vocab)
          + 12 * n_layers * d_model * seq_len

    The first term is 2 FLOPs per multiply-accumulate times 3 (backward costs
    twice the forward) over every matmul weight: QKV + output projection, the
    MLP, and the LM head (counted even when tied, since the matmul is still
    done).  The second term is attention's ``QK^T`` and ``AV`` products,
    ``seq_len * d_model`` MACs each per token per layer, counted over the full
    (not causally halved) score matrix.  Biases, norms, softmax and embedding
    lookups are ignored.
    """
    d = cfg.d_model
    matmul_params = cfg.n_layers * (4 * d * d + 2 * d * cfg.d_ff) + d * cfg.vocab_size
    return float(6 * matmul_params + 12 * cfg.n_layers * d * seq_len)


# What each job.model.quantization_scope quantizes (runner.models.common.quantization): module path
# regexes and ops. The attention scores (an einsum in attn itself) are never among them.
QUANTIZED = {
    "attention": ((r"(.*/)?attn/(query|key|value|out)", ("einsum",)),),
    "mlp": ((r"(.*/)?mlp/(fc|proj)", ("dot_general",)),),
    "head": ((r"wte|lm_head", ("einsum", "dot_general")),),  # the tied embedding's attend, or lm_head
}


class GPTFamily:
    """GPT-2: learned positions, LayerNorm, GELU MLP, multi-head attention."""

    name = "gpt"

    @staticmethod
    def config(model: Any) -> GPTConfig:
        if model.d_model % model.n_heads:
            raise ConfigError("job.model.n_heads", model.n_heads, f"it does not divide d_model={model.d_model}.",
                              "choose n_heads so that d_model / n_heads is a whole number.")
        if model.moe.n_experts:
            raise ConfigError("job.model.moe.n_experts", model.moe.n_experts, "the gpt family has no "
                              "mixture-of-experts layers, so it would train a dense model.",
                              "use job.model.family=llama for a mixture of experts, or drop it.")
        refuse_foreign_keys(model, "gpt", ("moe",), "drop it: the gpt family has no mixture-of-experts layers "
                            "(job.model.family=llama or deepseek has them).")
        refuse_foreign_keys(model, "gpt", ("n_kv_heads", "qk_norm", "qkv_bias", "out_bias", "mlp_bias", "rope"),
                            "drop it, or use job.model.family=llama; the gpt family's biases are job.model.use_bias.")
        refuse_foreign_keys(model, "gpt", ("window", "softcap", "query_pre_attn_scalar", "mla", "mtp"),
                            "drop it, or use the family that reads it (llama, gemma: window; gemma: softcap, "
                            "query_pre_attn_scalar; deepseek: mla, mtp).")
        refuse_foreign_keys(model, "gpt", ("hf.rope_interleave",), "drop it: the gpt family has no rotary "
                            "embeddings (interleaved rotary files are the deepseek family's).")
        if model.hf.architecture not in ("", gpt_hf.ARCHITECTURE):
            raise ConfigError("job.model.hf.architecture", model.hf.architecture, "the gpt family exports as "
                              f"{gpt_hf.ARCHITECTURE} only.", f"use {gpt_hf.ARCHITECTURE}, or leave it empty.")
        return fields_of(GPTConfig, model, activation=model.activation or "gelu_new")

    @staticmethod
    def module(config: GPTConfig) -> GPT:
        return quantized(GPT(config), config, QUANTIZED)

    @staticmethod
    def axis_rules(config: GPTConfig, mesh_shape: Any) -> tuple[tuple[str, Any], ...]:
        return state_over_context(LOGICAL_AXIS_RULES, mesh_shape)

    param_count = staticmethod(param_count)
    flops_per_token = staticmethod(flops_per_token)

    hf = gpt_hf.GPTHF  # Hugging Face both ways (runner.models.gpt.hf)


MODEL_FAMILIES.register("gpt")(GPTFamily)

__all__ = [
    "GPT",
    "GPTFamily",
    "GPTConfig",
    "LOGICAL_AXIS_RULES",
    "flops_per_token",
    "param_count",
]

