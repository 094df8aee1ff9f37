"""Llama-family decoder (flax.linen): Llama 2/3, Mistral-style and Qwen2/Qwen3-style from one config.

Rotary position embeddings (theta, and Llama 3's frequency scaling), RMSNorm, a SwiGLU MLP,
grouped-query attention (``n_kv_heads`` from 1 to ``n_heads``), optional QK-norm (Qwen3),
optional q/k/v biases (Qwen2), tied or untied embeddings, and ``head_dim`` independent of
``d_model``. Layers scan (``scan_layers``) and rematerialise (``remat``) as GPT's do; parameters
are stored in ``param_dtype`` and the compute dtype is ``compute_dtype``. The tensor layout follows Hugging Face's
(rotate-half rotary embeddings, RMSNorm computed in float32), so weights move between the two.

Logical axes as GPT's, plus ``kv_heads`` for the key/value heads: on the tensor axis when it
divides n_kv_heads, replicated when it does not (see `axis_rules`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from runner.errors import ConfigError, UserError
from runner.hf import HFTensor, one, same
from runner.models.attention import attend
from runner.models.family import MODEL_FAMILIES, fields_of
from runner.models.gpt import (_COMPUTE_DTYPES, LOGICAL_AXIS_RULES as GPT_RULES, check_length, empty_cache,
                              output_logits, stack_blocks)

KVCache = tuple[jax.Array, jax.Array]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    context_length: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | llama3
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    norm_eps: float = 1e-5
    qk_norm: bool = False
    qkv_bias: bool = False
    tie_embeddings: bool = False
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "auto"  # runner.models.attention
    remat: str = "none"
    scan_layers: bool = True

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")

    @property
    def dtype(self) -> Any:
        return _COMPUTE_DTYPES[self.compute_dtype]

    @property
    def params_dtype(self) -> Any:
        return _COMPUTE_DTYPES[self.param_dtype]


def axis_rules(cfg: LlamaConfig, tensor: int) -> tuple[tuple[str, Any], ...]:
    """GPT's rules plus the key/value heads: split over the tensor axis when it divides them; with
    fewer key/value heads than tensor shards (n_kv_heads=1, say), they are replicated on every
    tensor shard (each holds all of K and V, as MaxText and Levanter do), costing memory, not
    correctness."""
    kv = "tensor" if tensor > 1 and cfg.n_kv_heads % tensor == 0 else None
    return (*GPT_RULES[:4], ("kv_heads", kv), *GPT_RULES[4:])


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, (head_dim / 2,), with Llama 3's scaling: long
    wavelengths slowed by `rope_factor`, short ones kept, the band between interpolated."""
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    if cfg.rope_scaling == "llama3":
        low_wavelen = cfg.rope_original_context / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_context / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (cfg.rope_original_context / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate (B, T, N, H) by positions (B, T), rotate-half layout (Hugging Face's)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # (B, T, H/2)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32."""

    eps: float
    dtype: Any
    axis_name: str = "embed"
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), (self.axis_name,)),
                            (x.shape[-1],), self.param_dtype)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
        return (weight * h).astype(self.dtype)


def _init(std: float, names: tuple[str | None, ...]) -> Callable[..., Any]:
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), names)


def _zeros(names: tuple[str | None, ...]) -> Callable[..., Any]:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


class Attention(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg = self.cfg

        def proj(name: str, heads: int, axis: str) -> jax.Array:
            y = nn.Einsum((cfg.d_model, heads, cfg.head_dim), "btd,dnh->btnh", use_bias=cfg.qkv_bias,
                          dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                          kernel_init=_init(0.02, ("embed", axis, "kv")),
                          bias_init=_zeros((axis, "kv")), name=name)(x)
            return nn.with_logical_constraint(y, ("batch", "length", axis, "kv"))

        q = proj("query", cfg.n_heads, "heads")
        k = proj("key", cfg.n_kv_heads, "kv_heads")
        v = proj("value", cfg.n_kv_heads, "kv_heads")
        if cfg.qk_norm:
            q = RMSNorm(cfg.norm_eps, cfg.dtype, "kv", cfg.params_dtype, name="query_norm")(q)
            k = RMSNorm(cfg.norm_eps, cfg.dtype, "kv", cfg.params_dtype, name="key_norm")(k)
        inv_freq = rope_frequencies(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if cache is None:
            y = attend(cfg.attention, q, k, v, segment_ids, kv_axes=("batch", "length", "kv_heads", "kv"))
        else:
            assert index is not None, "decoding with a cache needs each row's start position"
            write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis=0))
            cached_k = write(cache[0], k.astype(cache[0].dtype), index)
            cached_v = write(cache[1], v.astype(cache[1].dtype), index)
            key_pos = jnp.arange(cached_k.shape[1])
            mask = key_pos[None, None, :] <= positions[:, :, None]
            y = jax.nn.dot_product_attention(q, cached_k, cached_v, mask=mask[:, None])
            cache = (cached_k, cached_v)
        y = nn.Einsum((cfg.n_heads, cfg.head_dim, cfg.d_model), "btnh,nhd->btd", use_bias=False, dtype=cfg.dtype,
                      param_dtype=cfg.params_dtype,
                      kernel_init=_init(0.02 / math.sqrt(2 * cfg.n_layers), ("heads", "kv", "embed")), name="out")(y)
        return y, cache


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg

        def dense(name: str, features: int, names: tuple[str, str], std: float) -> nn.Dense:
            return nn.Dense(features, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                            kernel_init=_init(std, names), name=name)

        h = nn.silu(dense("gate", cfg.d_ff, ("embed", "mlp"), 0.02)(x)) * dense("up", cfg.d_ff, ("embed", "mlp"), 0.02)(x)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        return dense("down", cfg.d_model, ("mlp", "embed"), 0.02 / math.sqrt(2 * cfg.n_layers))(h)


class Block(nn.Module):
    """Pre-norm block, ``(carry, cache) -> (carry, new cache)`` to fit ``nn.scan``."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg = self.cfg
        norm = functools.partial(RMSNorm, cfg.norm_eps, cfg.dtype, param_dtype=cfg.params_dtype)
        y, cache = Attention(cfg, name="attn")(norm(name="attn_norm")(x), positions, segment_ids, cache, index)
        x = x + y
        x = x + MLP(cfg, name="mlp")(norm(name="mlp_norm")(x))
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), cache


class Llama(nn.Module):
    """``int32[B, T] -> float32[B, T, vocab]`` logits; with ``cache`` and ``index`` (as GPT's),
    ``(logits, updated cache)`` for decoding. Packed documents: ``segment_ids`` (B, T) keep
    attention inside each document, ``positions`` (B, T) restart the rotary positions."""

    cfg: LlamaConfig

    def init_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
        """An empty cache (see runner.models.gpt.empty_cache), n_kv_heads wide."""
        return empty_cache(self.cfg, self.cfg.n_kv_heads, batch, length)

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True,
                 cache: dict[str, jax.Array] | None = None, index: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        cfg = self.cfg
        batch, seq_len = tokens.shape
        check_length(cfg, seq_len)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                         embedding_init=_init(0.02, ("vocab", "embed")), name="embed")
        if positions is None or cache is not None:
            start = jnp.zeros((batch,), jnp.int32) if cache is None else jnp.asarray(index, jnp.int32)
            positions = start[:, None] + jnp.arange(seq_len)[None]
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        layer_caches = None if cache is None else (cache["key"], cache["value"])

        x, new_cache = stack_blocks(Block, (cfg,), cfg, x, (positions, segment_ids), layer_caches, index)
        x = RMSNorm(cfg.norm_eps, cfg.dtype, param_dtype=cfg.params_dtype, name="norm")(x)
        return output_logits(cfg, x, embed, new_cache, decoding=cache is not None)


def param_count(cfg: LlamaConfig, include_embeddings: bool = True) -> int:
    d, h, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    q, kv = cfg.n_heads * h, cfg.n_kv_heads * h
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv) * int(cfg.qkv_bias) + 2 * h * int(cfg.qk_norm)
    layer = attn + 3 * d * f + 2 * d
    total = cfg.n_layers * layer + d
    if not cfg.tie_embeddings:
        total += d * cfg.vocab_size
    if include_embeddings:
        total += cfg.vocab_size * d
    return total


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the matmul weights (attention projections, SwiGLU's three
    matrices, the LM head) plus attention's QK^T and AV over the full (not causally halved) score
    matrix, 12 * n_layers * n_heads * head_dim * seq_len, as GPT's count."""
    d, h = cfg.d_model, cfg.head_dim
    matmul = cfg.n_layers * (2 * d * cfg.n_heads * h + 2 * d * cfg.n_kv_heads * h + 3 * d * cfg.d_ff) + d * cfg.vocab_size
    return float(6 * matmul + 12 * cfg.n_layers * cfg.n_heads * h * seq_len)


class LlamaFamily:
    """Llama 2/3, Mistral-style and Qwen2/Qwen3-style decoders."""

    name = "llama"

    @staticmethod
    def config(model: Any) -> LlamaConfig:
        r = model.rope
        if r.scaling not in ("none", "llama3"):
            raise ConfigError("job.model.rope.scaling", r.scaling, "it is not a known rotary scaling.",
                              "use none or llama3.")
        kv = model.n_kv_heads or model.n_heads
        if kv < 0 or model.n_heads % kv:
            raise ConfigError("job.model.n_kv_heads", model.n_kv_heads, f"it must divide n_heads={model.n_heads} "
                              "(each key/value head serves a whole group of query heads).",
                              "use a divisor of n_heads, e.g. 1, or 0 for n_heads (no grouping).")
        return fields_of(LlamaConfig, model, n_kv_heads=model.n_kv_heads or model.n_heads,
                         d_ff=model.d_ff or 4 * model.d_model, rope_theta=r.theta, rope_scaling=r.scaling,
                         rope_factor=r.factor, rope_low_freq_factor=r.low_freq_factor,
                         rope_high_freq_factor=r.high_freq_factor, rope_original_context=r.original_context)

    @staticmethod
    def module(config: LlamaConfig) -> Llama:
        return Llama(config)

    @staticmethod
    def axis_rules(config: LlamaConfig, mesh_shape: Any) -> tuple[tuple[str, Any], ...]:
        return axis_rules(config, int(dict(mesh_shape).get("tensor", 1)))

    param_count = staticmethod(param_count)
    flops_per_token = staticmethod(flops_per_token)

    # ------------------------------------------------------------------ Hugging Face

    @staticmethod
    def hf_architecture(cfg: LlamaConfig) -> tuple[str, str]:
        """(architecture, model_type): Qwen3 has QK-norm, Qwen2 q/k/v biases, Llama neither."""
        if cfg.qk_norm and cfg.qkv_bias:
            raise UserError("No transformers architecture has both QK-norm and q/k/v biases (job.model.qk_norm and "
                            "job.model.qkv_bias). Fix: train with one of them to export to Hugging Face.")
        if cfg.qk_norm:
            return "Qwen3ForCausalLM", "qwen3"
        return ("Qwen2ForCausalLM", "qwen2") if cfg.qkv_bias else ("LlamaForCausalLM", "llama")

    @staticmethod
    def hf_config(cfg: LlamaConfig) -> dict[str, Any]:
        arch, model_type = LlamaFamily.hf_architecture(cfg)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling == "llama3":
            rope.update(rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                        high_freq_factor=cfg.rope_high_freq_factor,
                        original_max_position_embeddings=cfg.rope_original_context)
        config = {
            "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "rope_parameters": rope,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "dtype": "float32",
        }
        if model_type == "qwen2":
            config.update(use_sliding_window=False, max_window_layers=cfg.n_layers)
        return config

    @staticmethod
    def hf_dims(hf: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
        """job.model field -> (config.json key, value), for checking an imported model."""
        model_type = hf.get("model_type")
        if model_type not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ConfigError("run.init_from", model_type, "the llama family reads Llama, Mistral, Qwen2 and Qwen3 "
                              "models (config.json model_type llama, mistral, qwen2, qwen3).",
                              "import a model of one of those, or use job.model.family=gpt for GPT-2.")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"]
        dims = {
            "vocab_size": ("vocab_size", hf["vocab_size"]), "d_model": ("hidden_size", hf["hidden_size"]),
            "n_layers": ("num_hidden_layers", hf["num_hidden_layers"]), "n_heads": ("num_attention_heads", heads),
            "n_kv_heads": ("num_key_value_heads", hf.get("num_key_value_heads") or heads),
            "head_dim": ("head_dim", hf.get("head_dim") or hf["hidden_size"] // heads),
            "d_ff": ("intermediate_size", hf["intermediate_size"]),
            "tie_embeddings": ("tie_word_embeddings", bool(hf.get("tie_word_embeddings", False))),
            "qk_norm": ("model_type", model_type == "qwen3"), "qkv_bias": ("model_type", model_type == "qwen2"),
            "norm_eps": ("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)), "rope.theta": ("rope_theta", float(theta)),
            "rope.scaling": ("rope_type", "llama3" if rope.get("rope_type", rope.get("type")) == "llama3" else "none"),
        }
        return dims

    @staticmethod
    def hf_layout(cfg: LlamaConfig) -> list[HFTensor]:
        d, h, n, k = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads

        def heads_in(heads: int) -> tuple[Callable[..., np.ndarray], Callable[..., tuple[np.ndarray, ...]]]:
            return (lambda w: w.reshape(d, heads * h).T), one(lambda w: w.T.reshape(d, heads, h))

        out = [HFTensor("model.embed_tokens.weight", ("embed/embedding",), None, same, one(same)),
               HFTensor("model.norm.weight", ("norm/scale",), None, same, one(same))]
        if not cfg.tie_embeddings:
            out.append(HFTensor("lm_head.weight", ("lm_head/kernel",), None, lambda w: w.T, one(lambda w: w.T)))
        templates: list[tuple[str, str, Any, Any]] = [
            ("input_layernorm.weight", "attn_norm/scale", same, one(same)),
            ("post_attention_layernorm.weight", "mlp_norm/scale", same, one(same)),
            ("self_attn.q_proj.weight", "attn/query/kernel", *heads_in(n)),
            ("self_attn.k_proj.weight", "attn/key/kernel", *heads_in(k)),
            ("self_attn.v_proj.weight", "attn/value/kernel", *heads_in(k)),
            ("self_attn.o_proj.weight", "attn/out/kernel", lambda w: w.reshape(n * h, d).T,
             one(lambda w: w.T.reshape(n, h, d))),
            ("mlp.gate_proj.weight", "mlp/gate/kernel", lambda w: w.T, one(lambda w: w.T)),
            ("mlp.up_proj.weight", "mlp/up/kernel", lambda w: w.T, one(lambda w: w.T)),
            ("mlp.down_proj.weight", "mlp/down/kernel", lambda w: w.T, one(lambda w: w.T)),
        ]
        if cfg.qkv_bias:
            for proj, heads in (("q", n), ("k", k), ("v", k)):
                name = {"q": "query", "k": "key", "v": "value"}[proj]
                templates.append((f"self_attn.{proj}_proj.bias", f"attn/{name}/bias", lambda b: b.reshape(-1),
                                  one(lambda b, heads=heads: b.reshape(heads, h))))
        if cfg.qk_norm:
            templates += [("self_attn.q_norm.weight", "attn/query_norm/scale", same, one(same)),
                          ("self_attn.k_norm.weight", "attn/key_norm/scale", same, one(same))]
        for hf_name, source, to_hf, from_hf in templates:  # a source's layers together: each leaf read once
            out += [HFTensor(f"model.layers.{i}.{hf_name}", (source,), i, to_hf, from_hf) for i in range(cfg.n_layers)]
        return out


MODEL_FAMILIES.register("llama")(LlamaFamily)
