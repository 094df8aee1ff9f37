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

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from runner.errors import ConfigError
from runner.models.attention.kernels import attend
from runner.models.common.block import PreNormBlock
from runner.models.common.context_order import to_context_order
from runner.models.common.decoder import Decoder, KVCache, attend_cached, stack_blocks
from runner.models.common.layers import LOGICAL_AXIS_RULES, embedding, merge_heads, project_heads, state_over_context
from runner.models.common.moe import describe as describe_experts
from runner.models.common.moe import for_platform as moe_for_platform
from runner.models.common.norms import RMSNorm
from runner.models.common.quantization import quantized
from runner.models.common.rope import apply_rope, rope_attention_scale, rope_frequencies
from runner.models.common.runtime import Runtime
from runner.models.family import MODEL_FAMILIES, fields_of, refuse_foreign_keys
from runner.models.llama import hf as llama_hf


@dataclass(frozen=True)
class LlamaConfig(Runtime):
    vocab_size: int
    context_length: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | linear | llama3 | yarn
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0  # yarn; 0: 0.1 * ln(factor) + 1
    rope_truncate: bool = True
    norm_eps: float = 1e-5
    qk_norm: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"  # the gate's, SwiGLU by default (runner.models.common.layers.ACTIVATIONS)
    window: int = 0  # job.model.window.size: every layer's sliding window (Mistral v0.1, Mixtral); 0: none
    hf_architecture: str = ""  # the transformers class to export as; empty: chosen from the settings
    tie_embeddings: bool = False
    moe_experts: int = 0  # job.model.moe (runner.models.common.moe); 0: a dense MLP in every layer
    moe_top_k: int = 2
    moe_d_ff: int = 0
    moe_shared: int = 0
    moe_score: str = "softmax"
    moe_normalize: bool = True
    moe_dispatch: str = "ragged"
    moe_capacity_factor: float = 1.25
    moe_aux_loss: float = 0.01
    moe_z_loss: float = 0.001
    moe_first_dense: int = 0  # leading layers that keep a dense MLP
    moe_bias_rate: float = 0.0  # the router's selection bias moves by this per step (0: no bias)
    moe_kernel: str = "ragged_dot"  # the grouped matmul (runner.models.common.moe.KERNELS): gmm for dispatch gmm
    moe_native_exchange: bool = False  # expert parallelism by jax.lax.ragged_all_to_all (TPU, GPU; for_platform)

    @property
    def dense_layers(self) -> int:
        """How many leading layers have a dense MLP: all of them without experts."""
        return self.moe_first_dense if self.moe_experts else self.n_layers

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")


def axis_rules(cfg: LlamaConfig, tensor: int) -> tuple[tuple[str, Any], ...]:
    """The shared rules (runner.models.common.layers.LOGICAL_AXIS_RULES, GPT's) plus the key/value heads:
    split over the tensor axis when it divides them; with fewer key/value heads than tensor shards
    (n_kv_heads=1, say), they are replicated on every tensor shard (each holds all of K and V, as
    MaxText and Levanter do), costing memory, not correctness."""
    kv = "tensor" if tensor > 1 and cfg.n_kv_heads % tensor == 0 else None
    return (*LOGICAL_AXIS_RULES[:4], ("kv_heads", kv), *LOGICAL_AXIS_RULES[4:], ("expert", "expert"))


class Attention(nn.Module):
    """Grouped-query causal attention with rotary positions (and QK-norm when cfg.qk_norm)."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg = self.cfg
        q = project_heads(cfg, x, cfg.n_heads, "heads", cfg.qkv_bias, "query")
        k = project_heads(cfg, x, cfg.n_kv_heads, "kv_heads", cfg.qkv_bias, "key")
        v = project_heads(cfg, x, cfg.n_kv_heads, "kv_heads", cfg.qkv_bias, "value")
        if cfg.qk_norm:
            q = RMSNorm(cfg.norm_eps, cfg.dtype, "kv", cfg.params_dtype, name="query_norm")(q)
            k = RMSNorm(cfg.norm_eps, cfg.dtype, "kv", cfg.params_dtype, name="key_norm")(k)
        inv_freq, scale = rope_frequencies(cfg), rope_attention_scale(cfg)
        q, k = apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)
        if cache is None:
            y = attend(cfg.attention, q, k, v, segment_ids, kv_axes=("batch", "length", "kv_heads", "kv"),
                       context_parallel=cfg.context_parallel, ulysses_ways=cfg.ulysses_ways,
                       initializing=self.is_initializing(), window=cfg.window)
        else:  # positions are index + t when decoding (Llama.hidden)
            y, cache = attend_cached(q, k, v, cache, index, cfg.window)
        return merge_heads(cfg, y, cfg.out_bias), cache


class Block(PreNormBlock):
    """The shared pre-norm block (runner.models.common.block) with this family's attention."""

    attention_cls = Attention


class Llama(Decoder):
    """The Llama-family language model, rotary positions (the call, packing and decoding: see
    runner.models.common.decoder.Decoder)."""

    cfg: LlamaConfig

    @property
    def kv_heads(self) -> int:
        return self.cfg.n_kv_heads

    def hidden(self, tokens: jax.Array, deterministic: bool, caches: KVCache | None, index: jax.Array | None,
               segment_ids: jax.Array | None,
               positions: jax.Array | None) -> tuple[jax.Array, nn.Embed, KVCache | None]:
        cfg = self.cfg
        batch, seq_len = tokens.shape
        embed = embedding(cfg, cfg.vocab_size, ("vocab", "embed"), "embed")
        if positions is None or caches is not None:
            start = jnp.zeros((batch,), jnp.int32) if caches is None else jnp.asarray(index, jnp.int32)
            positions = start[:, None] + jnp.arange(seq_len)[None]
        if caches is None:  # rows split over a context axis: in its order from the tokens to the head
            tokens, positions, segment_ids = to_context_order(tokens, positions, segment_ids)
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        x, new_cache = self.layers(x, (positions, segment_ids), caches, index)
        return RMSNorm(cfg.norm_eps, cfg.dtype, param_dtype=cfg.params_dtype, name="norm")(x), embed, new_cache


    def layers(self, x: jax.Array, shared: tuple[Any, ...], caches: KVCache | None,
               index: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
        """The dense layers (all of them without experts; else the first `moe_first_dense`, scanned
        as ``dense_blocks``), then the sparse ones (``blocks``)."""
        cfg, split = self.cfg, self.cfg.dense_layers
        if split in (0, cfg.n_layers):
            return stack_blocks(Block, (cfg, split == 0), cfg, x, shared, caches, index)
        parts = [(range(split), False, "dense_blocks"), (range(split, cfg.n_layers), True, "blocks")]
        updated = []
        for layers, sparse, name in parts:
            part = slice(layers.start, layers.stop)
            cache = None if caches is None else (caches[0][part], caches[1][part])
            x, cache = stack_blocks(Block, (cfg, sparse), cfg, x, shared, cache, index, layers=layers, name=name)
            updated.append(cache)
        if caches is None:
            return x, None
        return x, (jnp.concatenate([u[0] for u in updated]), jnp.concatenate([u[1] for u in updated]))


def moe_settings(model: Any) -> dict[str, Any]:
    """LlamaConfig's moe_* fields from job.model.moe (all defaults while n_experts is 0)."""
    m = model.moe
    if not m.n_experts:
        return {}
    return dict(moe_experts=m.n_experts, moe_top_k=m.top_k, moe_d_ff=m.d_ff_expert or model.d_ff or 4 * model.d_model,
                moe_shared=m.n_shared_experts, moe_score=m.score, moe_normalize=m.normalize_top_k,
                moe_dispatch=m.dispatch, moe_capacity_factor=m.capacity_factor, moe_aux_loss=m.aux_loss,
                moe_z_loss=m.z_loss, moe_first_dense=m.first_dense_layers, moe_bias_rate=m.bias_update_rate)


def param_count(cfg: LlamaConfig, include_embeddings: bool = True) -> int:
    d, h, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    q, kv = cfg.n_heads * h, cfg.n_kv_heads * h
    attn = (d * q + 2 * d * kv + q * d + (q + 2 * kv) * int(cfg.qkv_bias) + 2 * h * int(cfg.qk_norm)
            + d * int(cfg.out_bias))
    mlp = 3 * d * f + (2 * f + d) * int(cfg.mlp_bias)
    moe = d * cfg.moe_experts + 3 * d * cfg.moe_d_ff * (cfg.moe_experts + cfg.moe_shared)  # router, experts, shared
    sparse = cfg.n_layers - cfg.dense_layers
    total = cfg.n_layers * (attn + 2 * d) + cfg.dense_layers * mlp + sparse * moe + d
    if not cfg.tie_embeddings:
        total += d * cfg.vocab_size
    if include_embeddings:
        total += cfg.vocab_size * d
    return total


def active_param_count(cfg: LlamaConfig) -> int:
    """The parameters one token uses: every one but the experts its router did not choose."""
    unused = cfg.moe_experts - cfg.moe_top_k if cfg.moe_experts else 0
    return param_count(cfg) - (cfg.n_layers - cfg.dense_layers) * unused * 3 * cfg.d_model * cfg.moe_d_ff


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the matmul weights (attention projections, SwiGLU's three
    matrices, the LM head) plus attention's QK^T and AV over the full (not causally halved) score
    matrix, 12 * n_layers * n_heads * head_dim * seq_len, as GPT's count; with a sliding window,
    over the window's keys (min(window, seq_len)) instead of the row's."""
    d, h = cfg.d_model, cfg.head_dim
    sparse = cfg.n_layers - cfg.dense_layers  # what a token uses there: the router, its top_k experts, the shared
    mlp = cfg.dense_layers * 3 * d * cfg.d_ff + sparse * (d * cfg.moe_experts + 3 * d * cfg.moe_d_ff * (
        cfg.moe_top_k + cfg.moe_shared))
    matmul = cfg.n_layers * (2 * d * cfg.n_heads * h + 2 * d * cfg.n_kv_heads * h) + mlp + d * cfg.vocab_size
    keys = min(cfg.window, seq_len) if cfg.window else seq_len  # the keys a query's scores cover
    return float(6 * matmul + 12 * cfg.n_layers * cfg.n_heads * h * keys)


# What each job.model.quantization_scope quantizes (runner.models.common.quantization): module path
# regexes and ops. The attention scores (an einsum in attn itself) and the router (a float32
# dot_general in moe) are never among them.
QUANTIZED = {
    "attention": ((r"(.*/)?attn/(query|key|value|out)", ("einsum",)),),
    "mlp": ((r"(.*/)?mlp/(gate|up|down)", ("dot_general",)),),
    "experts": ((r"(.*/)?moe", ("einsum", "ragged_dot")), (r"(.*/)?moe/shared_(gate|up|down)", ("dot_general",))),
    "head": ((r"embed|lm_head", ("einsum", "dot_general")),),  # the tied embedding's attend, or lm_head
}


class LlamaFamily:
    """Llama 2/3, Mistral-style and Qwen2/Qwen3-style decoders."""

    name = "llama"

    @staticmethod
    def config(model: Any) -> LlamaConfig:
        refuse_foreign_keys(model, "llama", ("use_bias", "dropout"), "drop it; the llama family has no dropout, and "
                            "its biases are job.model.qkv_bias, out_bias and mlp_bias.")
        refuse_foreign_keys(model, "llama", ("softcap", "mla", "mtp", "query_pre_attn_scalar"),
                            "drop it, or use the family that reads it (gemma: softcap, query_pre_attn_scalar; "
                            "deepseek: mla, mtp).")
        for key in ("global_every", "local_rope_theta"):
            if getattr(model.window, key):
                raise ConfigError(f"job.model.window.{key}", getattr(model.window, key), "the llama family slides "
                                  "the window in every layer (Mistral v0.1, Mixtral), with one rotary base; "
                                  "interleaved local and global layers are the gemma family's.",
                                  f"drop job.model.window.{key}, or use job.model.family=gemma.")
        for key in ("n_group", "topk_group", "routed_scaling"):
            if getattr(model.moe, key) != 1:
                raise ConfigError(f"job.model.moe.{key}", getattr(model.moe, key), "group-limited routing and the "
                                  "routed scaling factor are DeepSeek-V3's, and the llama family routes over every "
                                  "expert with unscaled weights.", f"drop job.model.moe.{key}, or use "
                                  "job.model.family=deepseek.")
        refuse_foreign_keys(model, "llama", ("rope.mscale_all_dim", "hf.rope_interleave"),
                            "drop it, or use job.model.family=deepseek (DeepSeek-V3's YaRN softmax scale and "
                            "interleaved rotary files are that family's).")
        r = model.rope
        if r.scaling not in ("none", "linear", "llama3", "yarn"):
            raise ConfigError("job.model.rope.scaling", r.scaling, "it is not a known rotary scaling.",
                              "use none, linear, llama3 or yarn.")
        if r.scaling != "none" and r.factor <= 0:
            raise ConfigError("job.model.rope.factor", r.factor, "it must be positive.", "use e.g. 8.0.")
        kv = model.n_kv_heads or model.n_heads
        if kv < 0 or model.n_heads % kv:
            raise ConfigError("job.model.n_kv_heads", model.n_kv_heads, f"it must divide n_heads={model.n_heads} "
                              "(each key/value head serves a whole group of query heads).",
                              "use a divisor of n_heads, e.g. 1, or 0 for n_heads (no grouping).")
        return fields_of(LlamaConfig, model, n_kv_heads=model.n_kv_heads or model.n_heads,
                         d_ff=model.d_ff or 4 * model.d_model, rope_theta=r.theta, rope_scaling=r.scaling,
                         rope_factor=r.factor, rope_low_freq_factor=r.low_freq_factor,
                         rope_high_freq_factor=r.high_freq_factor, rope_original_context=r.original_context,
                         rope_beta_fast=r.beta_fast, rope_beta_slow=r.beta_slow,
                         rope_attention_factor=r.attention_factor, rope_truncate=r.truncate,
                         activation=model.activation or "silu", hf_architecture=model.hf.architecture,
                         window=model.window.size,
                         **moe_settings(model))

    # what the platform decides of the experts, and how they run on a mesh (mode=compile's report)
    for_platform = staticmethod(moe_for_platform)
    describe = staticmethod(describe_experts)

    @staticmethod
    def module(config: LlamaConfig) -> Llama:
        return quantized(Llama(config), config, QUANTIZED)

    @staticmethod
    def axis_rules(config: LlamaConfig, mesh_shape: Any) -> tuple[tuple[str, Any], ...]:
        return state_over_context(axis_rules(config, int(dict(mesh_shape).get("tensor", 1))), mesh_shape)

    param_count = staticmethod(param_count)
    active_param_count = staticmethod(active_param_count)
    flops_per_token = staticmethod(flops_per_token)

    hf = llama_hf.LlamaHF  # Hugging Face both ways (runner.models.llama.hf)


MODEL_FAMILIES.register("llama")(LlamaFamily)
