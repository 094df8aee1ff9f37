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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from runner.errors import ConfigError
from runner.models import gpt_hf
from runner.models.attention import attend
from runner.models.common import COMPUTE_DTYPES, activation
from runner.models.family import MODEL_FAMILIES, fields_of, refuse_foreign_keys

# Logical axis name -> mesh axes for a ("data", "fsdp", "tensor") mesh.  Order
# matters: flax assigns rules first-come and never reuses a mesh axis within one
# array, so "batch" claims "fsdp" before "embed" does on activations, while
# weights (which have no batch axis) are FSDP-sharded along "embed".
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("length", None),
    ("layers", None),
)

KVCache = tuple[jax.Array, jax.Array]  # one layer's cached (keys, values), (B, L, N, H) each

_COMPUTE_DTYPES = COMPUTE_DTYPES
_REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "full": None,  # save nothing: recompute the whole block on the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@dataclass(frozen=True)
class GPTConfig:
    """Model hyperparameters; ``d_ff == 0`` means the GPT-2 default ``4 * d_model``."""

    vocab_size: int
    context_length: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int = 0
    tie_embeddings: bool = True
    dropout: float = 0.0
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "auto"  # runner.models.attention
    remat: str = "none"
    use_bias: bool = True
    scan_layers: bool = True
    activation: str = "gelu_new"  # transformers' name (runner.models.common.ACTIVATIONS)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            # Frozen dataclass: resolve the default once so every consumer
            # (model, param_count, flops_per_token) sees the same value.
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        for name in ("compute_dtype", "param_dtype"):
            if getattr(self, name) not in _COMPUTE_DTYPES:
                raise ValueError(f"{name} must be one of {sorted(_COMPUTE_DTYPES)}")
        if self.remat not in ("none", *_REMAT_POLICIES):
            raise ValueError(f"remat must be 'none', 'full' or 'dots', got {self.remat!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def dtype(self) -> Any:
        return _COMPUTE_DTYPES[self.compute_dtype]

    @property
    def params_dtype(self) -> Any:
        return _COMPUTE_DTYPES[self.param_dtype]


def _init(std: float, names: tuple[str | None, ...]) -> Callable[..., Any]:
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), names)


def _zeros(names: tuple[str | None, ...]) -> Callable[..., Any]:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


# ----------------------------------------------------------------------------- decoder plumbing
# (shared with the llama family: the layer stack, the cache and the output head)


def empty_cache(cfg: Any, kv_heads: int, batch: int, length: int) -> dict[str, jax.Array]:
    """An empty cache for ``batch`` rows of up to ``length`` positions: keys and values stacked
    over layers, (n_layers, batch, length, kv_heads, head_dim) each."""
    if length > cfg.context_length:
        raise ValueError(f"cache length {length} exceeds context_length {cfg.context_length}")
    shape = (cfg.n_layers, batch, length, kv_heads, cfg.head_dim)
    return {"key": jnp.zeros(shape, cfg.dtype), "value": jnp.zeros(shape, cfg.dtype)}


def check_length(cfg: Any, seq_len: int) -> None:
    if seq_len > cfg.context_length:
        raise ValueError(f"sequence length {seq_len} exceeds context_length {cfg.context_length}")


def stack_blocks(block: Any, block_args: tuple[Any, ...], cfg: Any, x: jax.Array, shared: tuple[Any, ...],
                 caches: KVCache | None, index: jax.Array | None,
                 rngs: tuple[str, ...] = ("params",)) -> tuple[jax.Array, KVCache | None]:
    """n_layers blocks, ``block(*block_args)(x, *shared, cache, index) -> (x, cache)``: scanned (one
    compiled block, parameters and cache stacked on a leading "layers" axis, as ``blocks``) or
    unrolled (``block_i``), rematerialised as ``cfg.remat`` says. Call inside a compact method."""
    if cfg.remat != "none":
        # Under scan the loop boundary already stops XLA from CSE-ing the recomputation away, so
        # prevent_cse would only cost performance.
        block = nn.remat(block, prevent_cse=not cfg.scan_layers, policy=_REMAT_POLICIES[cfg.remat])
    if cfg.scan_layers:
        return nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={r: True for r in rngs},
            in_axes=(*[nn.broadcast] * len(shared), 0, nn.broadcast),
            length=cfg.n_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(*block_args, name="blocks")(x, *shared, caches, index)
    updated = []
    for i in range(cfg.n_layers):
        layer = None if caches is None else (caches[0][i], caches[1][i])
        x, layer = block(*block_args, name=f"block_{i}")(x, *shared, layer, index)
        updated.append(layer)
    if caches is None:
        return x, None
    return x, (jnp.stack([u[0] for u in updated]), jnp.stack([u[1] for u in updated]))


def output_logits(cfg: Any, x: jax.Array, embed: nn.Embed, new_cache: KVCache | None,
                  decoding: bool) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """float32 logits from the final hidden states (the embedding transposed when tied, else an
    ``lm_head``), with the updated cache when decoding. Call inside a compact method."""
    if cfg.tie_embeddings:
        logits = embed.attend(x)
    else:
        logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                          kernel_init=_init(0.02, ("embed", "vocab")), name="lm_head")(x)
    logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab")).astype(jnp.float32)
    if not decoding:
        return logits
    assert new_cache is not None
    return logits, {"key": new_cache[0], "value": new_cache[1]}


def _layer_norm(cfg: GPTConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=cfg.norm_eps,
        dtype=cfg.dtype,
        param_dtype=cfg.params_dtype,
        use_bias=cfg.use_bias,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        bias_init=_zeros(("embed",)),
        name=name,
    )


def _residual_std(cfg: GPTConfig) -> float:
    # GPT-2: projections that write into the residual stream are scaled down so
    # the stream's variance does not grow with depth.
    return 0.02 / math.sqrt(2 * cfg.n_layers)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention via ``jax.nn.dot_product_attention``.

    Projections are ``nn.Einsum`` rather than ``nn.DenseGeneral``: DenseGeneral
    initialises a flattened 2-D kernel and, under a mesh, flax constrains that
    flat array with the 3-D logical spec and fails (flax 0.12.8).  There is no
    attention-probability dropout: the fused op has none; residual dropout after
    the output projection is kept.
    """

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
        def proj(name: str) -> jax.Array:
            y = nn.Einsum(
                (cfg.d_model, cfg.n_heads, cfg.head_dim),
                "btd,dnh->btnh",
                use_bias=cfg.use_bias,
                dtype=cfg.dtype,
                param_dtype=cfg.params_dtype,
                kernel_init=_init(0.02, ("embed", "heads", "kv")),
                bias_init=_zeros(("heads", "kv")),
                name=name,
            )(x)
            return nn.with_logical_constraint(y, ("batch", "length", "heads", "kv"))

        q, k, v = proj("query"), proj("key"), proj("value")
        if cache is None:
            y = attend(cfg.attention, q, k, v, segment_ids)  # (B, T, N, H)
        else:
            assert index is not None, "decoding with a cache needs each row's start position"
            write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis=0))
            cached_k = write(cache[0], k.astype(cache[0].dtype), index)
            cached_v = write(cache[1], v.astype(cache[1].dtype), index)
            query_pos = index[:, None] + jnp.arange(x.shape[1])  # (B, T)
            key_pos = jnp.arange(cached_k.shape[1])  # (L,)
            mask = key_pos[None, None, :] <= query_pos[:, :, None]  # (B, T, L): causal over the cache
            y = jax.nn.dot_product_attention(q, cached_k, cached_v, mask=mask[:, None])
            cache = (cached_k, cached_v)
        y = nn.Einsum(
            (cfg.n_heads, cfg.head_dim, cfg.d_model),
            "btnh,nhd->btd",
            use_bias=cfg.use_bias,
            dtype=cfg.dtype,
            param_dtype=cfg.params_dtype,
            kernel_init=_init(_residual_std(cfg), ("heads", "kv", "embed")),
            bias_init=_zeros(("embed",)),
            name="out",
        )(y)
        return nn.Dropout(cfg.dropout, deterministic=self.deterministic)(y), cache


class MLP(nn.Module):
    """Position-wise feed-forward block (GELU, tanh approximation, unless cfg.activation says)."""

    cfg: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = nn.Dense(
            cfg.d_ff,
            use_bias=cfg.use_bias,
            dtype=cfg.dtype,
            param_dtype=cfg.params_dtype,
            kernel_init=_init(0.02, ("embed", "mlp")),
            bias_init=_zeros(("mlp",)),
            name="fc",
        )(x)
        h = nn.with_logical_constraint(activation(cfg.activation)(h), ("batch", "length", "mlp"))
        y = nn.Dense(
            cfg.d_model,
            use_bias=cfg.use_bias,
            dtype=cfg.dtype,
            param_dtype=cfg.params_dtype,
            kernel_init=_init(_residual_std(cfg), ("mlp", "embed")),
            bias_init=_zeros(("embed",)),
            name="proj",
        )(h)
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
        y, cache = CausalSelfAttention(cfg, self.deterministic, name="attn")(_layer_norm(cfg, "ln_1")(x), segment_ids,
                                                                            cache, index)
        x = x + y
        x = x + MLP(cfg, self.deterministic, name="mlp")(_layer_norm(cfg, "ln_2")(x))
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), cache


class GPT(nn.Module):
    """GPT-2 language model: ``int32[B, T] -> float32[B, T, vocab]`` logits.

    Packed documents: ``segment_ids`` (B, T) keep attention inside each document and
    ``positions`` (B, T) restart the learned positions at each one (runner.data.documents).

    Decoding with a KV cache uses the same call and the same weights: pass ``cache`` (from
    ``init_cache``) and ``index`` (each row's position of its first new token) and get
    ``(logits, updated cache)``. A prompt is fed once (index 0), then one token at a time.
    """

    cfg: GPTConfig

    def init_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
        """An empty cache (see `empty_cache`)."""
        return empty_cache(self.cfg, self.cfg.n_heads, batch, length)

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True,
                 cache: dict[str, jax.Array] | None = None, index: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        cfg = self.cfg
        _, seq_len = tokens.shape
        check_length(cfg, seq_len)

        wte = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cfg.dtype,
            param_dtype=cfg.params_dtype,
            embedding_init=_init(0.02, ("vocab", "embed")),
            name="wte",
        )
        wpe = nn.Embed(
            cfg.context_length,
            cfg.d_model,
            dtype=cfg.dtype,
            param_dtype=cfg.params_dtype,
            embedding_init=_init(0.02, (None, "embed")),
            name="wpe",
        )
        if cache is None:
            x = wte(tokens) + (wpe(jnp.arange(seq_len))[None] if positions is None else wpe(positions))
        else:
            index = jnp.asarray(index, jnp.int32)
            x = wte(tokens) + wpe(index[:, None] + jnp.arange(seq_len))
            layer_caches = (cache["key"], cache["value"])
        x = nn.Dropout(cfg.dropout, deterministic=deterministic)(x)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

        # One compiled block when scanned: each layer's slice of the cache is scanned in, the
        # updated slices stacked back.
        x, new_cache = stack_blocks(Block, (cfg, deterministic), cfg, x, (segment_ids,),
                                    None if cache is None else layer_caches, index, rngs=("params", "dropout"))
        x = _layer_norm(cfg, "ln_f")(x)
        return output_logits(cfg, x, wte, new_cache, decoding=cache is not None)


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


class GPTFamily:
    """GPT-2: learned positions, LayerNorm, GELU MLP, multi-head attention."""

    name = "gpt"

    @staticmethod
    def config(model: Any) -> GPTConfig:
        if model.d_model % model.n_heads:
            raise ConfigError("job.model.n_heads", model.n_heads, f"it does not divide d_model={model.d_model}.",
                              "choose n_heads so that d_model / n_heads is a whole number.")
        refuse_foreign_keys(model, "gpt", ("n_kv_heads", "qk_norm", "qkv_bias", "out_bias", "mlp_bias", "rope"),
                            "drop it, or use job.model.family=llama; the gpt family's biases are job.model.use_bias.")
        if model.hf.architecture not in ("", gpt_hf.ARCHITECTURE):
            raise ConfigError("job.model.hf.architecture", model.hf.architecture, "the gpt family exports as "
                              f"{gpt_hf.ARCHITECTURE} only.", f"use {gpt_hf.ARCHITECTURE}, or leave it empty.")
        return fields_of(GPTConfig, model, activation=model.activation or "gelu_new")

    @staticmethod
    def module(config: GPTConfig) -> GPT:
        return GPT(config)

    @staticmethod
    def axis_rules(config: GPTConfig, mesh_shape: Any) -> tuple[tuple[str, Any], ...]:
        return LOGICAL_AXIS_RULES

    param_count = staticmethod(param_count)
    flops_per_token = staticmethod(flops_per_token)

    # ------------------------------------------------------------------ Hugging Face (runner.models.gpt_hf)

    hf_model_types = ("gpt2",)  # config.json model_type values it imports
    hf_base_prefix = gpt_hf.BASE_PREFIX
    hf_settings = staticmethod(gpt_hf.settings)
    hf_config = staticmethod(gpt_hf.hf_config)
    hf_layout = staticmethod(gpt_hf.layout)
    hf_buffers = staticmethod(gpt_hf.buffers)

    @staticmethod
    def hf_architecture(cfg: GPTConfig) -> tuple[str, str]:
        return gpt_hf.ARCHITECTURE, "gpt2"


MODEL_FAMILIES.register("gpt")(GPTFamily)

__all__ = [
    "GPT",
    "GPTFamily",
    "GPTConfig",
    "LOGICAL_AXIS_RULES",
    "flops_per_token",
    "param_count",
]

