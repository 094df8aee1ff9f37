"""Gemma 3's text decoder (flax.linen), Gemma3ForCausalLM's function and tensor layout.

What sets it apart from the llama family: RMSNorm scaled by (1 + weight) (weights start at zero);
four norms a layer (before and after attention, before and after the feed-forward block); QK-norm;
a GeGLU feed-forward block (gelu_pytorch_tanh); the token embedding scaled by sqrt(d_model) in
the compute dtype; queries scaled by ``query_pre_attn_scalar ** -0.5``; tied embeddings; and
layers of two kinds: most attend through a sliding window with their own rotary base
(``local_rope_theta``), every ``global_every``-th attends to every earlier key with the global
base (and its linear scaling, Gemma 3 4B and up). Gemma 2's logit soft-capping (on the attention
scores, on the output logits) is honoured too.

Layers of the two kinds differ in static settings (the window a kernel is built for, the rotary
frequencies), so a scanned stack cannot be one scan over layers: it is one scan over *periods*
(``blocks``: global_every layers each, ``layer_0`` .. ``layer_{N-1}``, the last one global) then,
when global_every does not divide n_layers, a scan over the windowed layers left (``tail_blocks``).
Unrolled, layer i is ``block_i``. Both compute the same function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from runner.errors import ConfigError
from runner.models.attention import kernels
from runner.models.common.context_order import from_context_order, to_context_order
from runner.models.common import tiling
from runner.models.common.decoder import (REMAT_POLICIES, Decoder, KVCache, check_length, layer_input, output_head,
                                          remat_of, stack_blocks)
from runner.models.common.layers import (LOGICAL_AXIS_RULES, embedding, merge_heads, project_heads,
                                         state_over_context, zeros_init)
from runner.models.common.mlp import GatedMLP
from runner.models.common.quantization import quantized
from runner.models.common.rope import apply_rope, rope_frequencies
from runner.models.common.runtime import Runtime
from runner.models.family import MODEL_FAMILIES, fields_of, refuse_foreign_keys
from runner.models.gemma import hf as gemma_hf


@dataclass(frozen=True)
class GemmaConfig(Runtime):
    """The architecture (job.model through GemmaFamily.config); how it runs: Runtime's fields."""

    vocab_size: int
    context_length: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 1_000_000.0  # the global layers' rotary base
    rope_scaling: str = "none"  # none | linear: the global layers' (Gemma 3 4B and up: linear, factor 8)
    rope_factor: float = 8.0
    local_rope_theta: float = 10_000.0  # the windowed layers' rotary base (never scaled)
    window_size: int = 0  # keys a windowed layer's query sees, itself included; 0: no window, every layer global
    global_every: int = 0  # layers N-1, 2N-1, ... global, the rest windowed; 0: every layer windowed
    query_pre_attn_scalar: float = 0.0  # queries scaled by its -1/2 power; 0: head_dim
    attn_softcap: float = 0.0  # cap * tanh(scores / cap) on the attention scores; 0: off
    final_softcap: float = 0.0  # the same on the output logits; 0: off
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False  # (GatedMLP reads it; Gemma has no MLP biases)
    activation: str = "gelu_pytorch_tanh"  # the gate's: GeGLU
    tie_embeddings: bool = True
    hf_architecture: str = ""  # empty or Gemma3ForCausalLM

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")

    @property
    def period(self) -> int:
        """The layers of one repeat of the pattern: global_every with a window and a pattern, else 1
        (every layer of one kind)."""
        return self.global_every if self.window_size and self.global_every else 1

    def is_global(self, layer: int) -> bool:
        """Whether `layer` attends to every earlier key (no window)."""
        return not self.window_size or bool(self.global_every and (layer + 1) % self.global_every == 0)

    @property
    def q_scale(self) -> float:
        """What the attention scores are multiplied by: query_pre_attn_scalar ** -1/2."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5


def axis_rules(cfg: GemmaConfig, tensor: int) -> tuple[tuple[str, Any], ...]:
    """The shared rules plus the key/value heads, on the tensor axis when it divides them (else
    replicated on every tensor shard: memory, not correctness), as the llama family's."""
    kv = "tensor" if tensor > 1 and cfg.n_kv_heads % tensor == 0 else None
    return (*LOGICAL_AXIS_RULES[:4], ("kv_heads", kv), *LOGICAL_AXIS_RULES[4:])


def layer_frequencies(cfg: GemmaConfig, is_global: bool) -> np.ndarray:
    """The rotary inverse frequencies of a global layer (rope_theta, scaled) or a windowed one
    (local_rope_theta, unscaled), as transformers' Gemma3RotaryEmbedding computes each."""
    if is_global:
        return rope_frequencies(cfg)
    return rope_frequencies(SimpleNamespace(head_dim=cfg.head_dim, rope_theta=cfg.local_rope_theta,
                                            rope_scaling="none"))


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32; the weight starts at zero (Gemma's layout:
    its checkpoints store the weight, not 1 + weight)."""

    eps: float
    dtype: Any
    axis_name: str = "embed"
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("scale", zeros_init((self.axis_name,)), (x.shape[-1],), self.param_dtype)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
        return (h * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)


def capped(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap): soft-capping (Gemma 2); x itself when cap is 0."""
    return cap * jnp.tanh(x / cap) if cap else x


def scores_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                     softcap: float) -> jax.Array:
    """Attention with the score matrix in memory, as transformers' eager path: scores times `scale`,
    soft-capped, masked (`mask` (B or 1, T, S), True: attend), a float32 softmax. q (B, T, N, H),
    k and v (B, S, K, H), each key/value head serving N / K query heads."""
    batch, length, heads, dim = q.shape
    groups = heads // k.shape[2]
    qg = q.reshape(batch, length, k.shape[2], groups, dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = capped(scores, softcap)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", weights, v).reshape(batch, length, heads, dim)


def causal_mask(length: int, window: int, segment_ids: jax.Array | None) -> jax.Array:
    """(B or 1, T, T): earlier keys (itself included), within `window` of the query when it is not
    0, and of the query's own segment."""
    t = jnp.arange(length)
    mask = t[None, :] <= t[:, None]
    if window:
        mask &= t[:, None] - t[None, :] < window
    mask = mask[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def attend_cache(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, index: jax.Array, window: int,
                 scale: float, softcap: float) -> tuple[jax.Array, KVCache]:
    """Decoding (as runner.models.common.decoder.attend_cached, with a window and soft-capping):
    k, v (B, T, K, H) written into the layer's cache (B, L, K, H) at each row's `index`, then the
    queries, at positions index + t, attend to the cached keys at or before them (and, with a
    window, fewer than `window` positions back)."""
    write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis=0))
    cached_k = write(cache[0], k.astype(cache[0].dtype), index)
    cached_v = write(cache[1], v.astype(cache[1].dtype), index)
    query_pos = index[:, None] + jnp.arange(q.shape[1])  # (B, T)
    key_pos = jnp.arange(cached_k.shape[1])[None, None, :]  # (1, 1, L)
    mask = key_pos <= query_pos[:, :, None]
    if window:
        mask &= query_pos[:, :, None] - key_pos < window
    return scores_attention(q, cached_k, cached_v, mask, scale, softcap), (cached_k, cached_v)


class Attention(nn.Module):
    """Grouped-query causal attention: QK-norm, rotary positions (the layer's kind's frequencies),
    the layer's window, queries scaled by query_pre_attn_scalar ** -1/2."""

    cfg: GemmaConfig
    is_global: bool

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg = self.cfg
        q = project_heads(cfg, x, cfg.n_heads, "heads", cfg.qkv_bias, "query")
        k = project_heads(cfg, x, cfg.n_kv_heads, "kv_heads", cfg.qkv_bias, "key")
        v = project_heads(cfg, x, cfg.n_kv_heads, "kv_heads", cfg.qkv_bias, "value")
        q = GemmaRMSNorm(cfg.norm_eps, cfg.dtype, "kv", cfg.params_dtype, name="query_norm")(q)
        k = GemmaRMSNorm(cfg.norm_eps, cfg.dtype, "kv", cfg.params_dtype, name="key_norm")(k)
        inv_freq = layer_frequencies(cfg, self.is_global)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        window = 0 if self.is_global else cfg.window_size
        if cache is not None:  # positions are index + t when decoding (Gemma.hidden)
            assert index is not None, "decoding with a cache needs each row's start position"
            y, cache = attend_cache(q, k, v, cache, index, window, cfg.q_scale, cfg.attn_softcap)
        elif cfg.attn_softcap:  # the raw scores: runner's own XLA path (for_platform refuses the kernels)
            y = scores_attention(q, k, v, causal_mask(q.shape[1], window, segment_ids), cfg.q_scale,
                                 cfg.attn_softcap)
        else:  # the kernels scale by head_dim ** -1/2: the queries carry the rest
            relative = cfg.q_scale * math.sqrt(cfg.head_dim)
            if relative != 1.0:
                q = (q.astype(jnp.float32) * relative).astype(q.dtype)
            y = kernels.attend(cfg.attention, q, k, v, segment_ids, kv_axes=("batch", "length", "kv_heads", "kv"),
                               context_parallel=cfg.context_parallel, ulysses_ways=cfg.ulysses_ways,
                               initializing=self.is_initializing(), window=window)
        return merge_heads(cfg, y, cfg.out_bias), cache


class Block(nn.Module):
    """Gemma's block, ``(carry, cache) -> (carry, new cache)`` to fit ``nn.scan``: a norm before and
    after attention and before and after the feed-forward block, each output normed before the
    residual add. `is_global`: attention over every earlier key, else through the window."""

    cfg: GemmaConfig
    is_global: bool

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg = self.cfg
        x = layer_input(x)
        norm = functools.partial(GemmaRMSNorm, cfg.norm_eps, cfg.dtype, param_dtype=cfg.params_dtype)
        y, cache = Attention(cfg, self.is_global, name="attn")(norm(name="attn_norm")(x), positions, segment_ids,
                                                                cache, index)
        x = x + norm(name="post_attn_norm")(y)
        h = norm(name="mlp_norm")(x)  # the feed-forward tiled when training (not when decoding)
        y = tiling.feed_forward(GatedMLP(cfg, name="mlp"), h, cfg.mlp_tiles if cache is None else 1)
        x = x + norm(name="post_mlp_norm")(y)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), cache


def rematerialised(cfg: GemmaConfig) -> Any:
    """Block, rematerialised as cfg.remat says (what stack_blocks does to the block it stacks)."""
    if remat_of(cfg) == "none":
        return Block
    return nn.remat(Block, prevent_cse=not cfg.scan_layers, policy=REMAT_POLICIES[remat_of(cfg)])


class Period(nn.Module):
    """One repeat of the layer pattern, scanned as one step: layers ``layer_0`` .. ``layer_{N-1}``
    (N = cfg.period), each of its own kind and each rematerialised on its own (so a backward pass
    holds one layer's activations at a time, not the period's)."""

    cfg: GemmaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg, block = self.cfg, rematerialised(self.cfg)
        updated = []
        for j in range(cfg.period):
            layer = None if cache is None else (cache[0][j], cache[1][j])
            x, layer = block(cfg, cfg.is_global(j), name=f"layer_{j}")(x, positions, segment_ids, layer, index)
            updated.append(layer)
        if cache is None:
            return x, None
        return x, (jnp.stack([u[0] for u in updated]), jnp.stack([u[1] for u in updated]))


def scanned_parts(cfg: GemmaConfig) -> tuple[int, int]:
    """(periods, windowed layers after them) of a scanned stack."""
    return cfg.n_layers // cfg.period, cfg.n_layers % cfg.period


class Gemma(Decoder):
    """The Gemma 3 language model (the call, packing and decoding: runner.models.common.decoder
    .Decoder; the output head soft-capped when cfg.final_softcap is set)."""

    cfg: GemmaConfig

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
        # scaled by sqrt(d_model) rounded to the compute dtype, as transformers does (55.5, not 55.43, in bfloat16)
        x = embed(tokens) * jnp.asarray(math.sqrt(cfg.d_model), cfg.dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        x, new_cache = self.layers(x, (positions, segment_ids), caches, index)
        return GemmaRMSNorm(cfg.norm_eps, cfg.dtype, param_dtype=cfg.params_dtype, name="norm")(x), embed, new_cache

    def layers(self, x: jax.Array, shared: tuple[Any, ...], caches: KVCache | None,
               index: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
        """Unrolled: ``block_i``, each of its kind. Scanned: the periods (``blocks``), then the
        windowed layers left (``tail_blocks``); caches (n_layers, ...) cut to match."""
        cfg = self.cfg
        if not cfg.scan_layers:
            updated = []
            for i in range(cfg.n_layers):
                cache = None if caches is None else (caches[0][i:i + 1], caches[1][i:i + 1])
                x, cache = stack_blocks(Block, (cfg, cfg.is_global(i)), cfg, x, shared, cache, index,
                                        layers=range(i, i + 1))
                updated.append(cache)
            if caches is None:
                return x, None
            return x, (jnp.concatenate([u[0] for u in updated]), jnp.concatenate([u[1] for u in updated]))
        periods, tail = scanned_parts(cfg)
        whole = periods * cfg.period
        parts: list[KVCache] = []
        if periods:  # (none when global_every is above n_layers: every layer windowed, in the tail)
            cache = None if caches is None else tuple(
                c[:whole].reshape(periods, cfg.period, *c.shape[1:]) for c in caches)
            plain = dataclasses.replace(cfg, remat="none")  # each layer of a period is rematerialised on its own
            x, cache = stack_blocks(Period, (cfg,), plain, x, shared, cache, index, layers=range(periods))
            parts += [] if cache is None else [tuple(c.reshape(whole, *c.shape[2:]) for c in cache)]
        if tail:
            rest = None if caches is None else (caches[0][whole:], caches[1][whole:])
            x, rest = stack_blocks(Block, (cfg, False), cfg, x, shared, rest, index, layers=range(whole, cfg.n_layers),
                                   name="tail_blocks")
            parts += [] if rest is None else [rest]
        if caches is None:
            return x, None
        return x, (jnp.concatenate([p[0] for p in parts]), jnp.concatenate([p[1] for p in parts]))

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True,
                 cache: dict[str, jax.Array] | None = None, index: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                 targets: jax.Array | None = None) -> Any:
        """Decoder's call with the output head `capped_head` (soft-capped logits, in the tiled loss too)."""
        check_length(self.cfg, tokens.shape[1])
        caches = None if cache is None else (cache["key"], cache["value"])
        x, embed, new_cache = self.hidden(tokens, deterministic, caches, index, segment_ids, positions)
        head, project = capped_head(self.cfg, embed)
        if cache is not None:
            assert new_cache is not None
            return project(head, x), {"key": new_cache[0], "value": new_cache[1]}
        if targets is not None:  # the loss in context order, each token's put back
            losses, correct = tiling.head_losses(project, head, x, *to_context_order(targets),
                                                 getattr(self.cfg, "loss_tiles", 1))
            return from_context_order(losses), from_context_order(correct)
        return project(head, from_context_order(x))


def capped_head(cfg: GemmaConfig, embed: nn.Embed) -> tuple[nn.Module, Any]:
    """runner.models.common.decoder.output_head, its float32 logits soft-capped by cfg.final_softcap
    (Gemma 2's final_logit_softcapping); the tiled loss calls the same projection, so it is capped
    there too. Call inside a compact method."""
    head, project = output_head(cfg, embed)
    if not cfg.final_softcap:
        return head, project
    return head, lambda mdl, x: capped(project(mdl, x), cfg.final_softcap)


def param_count(cfg: GemmaConfig, include_embeddings: bool = True) -> int:
    """Exact: per layer the attention projections (and biases), QK-norm, four norms and GeGLU's
    three matrices; the final norm; the embedding (and an untied head)."""
    d, h, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    q, kv = cfg.n_heads * h, cfg.n_kv_heads * h
    attn = 2 * d * q + 2 * d * kv + (q + 2 * kv) * int(cfg.qkv_bias) + d * int(cfg.out_bias) + 2 * h
    total = cfg.n_layers * (attn + 3 * d * f + 4 * d) + d
    if not cfg.tie_embeddings:
        total += d * cfg.vocab_size
    if include_embeddings:
        total += cfg.vocab_size * d
    return total


def attended_keys(cfg: GemmaConfig, seq_len: int) -> int:
    """The keys a query's scores cover, summed over the layers: the whole row in a global layer,
    min(window, seq_len) in a windowed one (what a windowed kernel computes)."""
    return sum(seq_len if cfg.is_global(i) else min(cfg.window_size, seq_len) for i in range(cfg.n_layers))


def flops_per_token(cfg: GemmaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the matmul weights (attention projections, GeGLU's three
    matrices, the LM head) plus QK^T and AV, 12 * n_heads * head_dim per key a query's scores
    cover (not causally halved, as the other families count): `attended_keys`."""
    d, h = cfg.d_model, cfg.head_dim
    matmul = cfg.n_layers * (2 * d * cfg.n_heads * h + 2 * d * cfg.n_kv_heads * h + 3 * d * cfg.d_ff)
    matmul += d * cfg.vocab_size
    return float(6 * matmul + 12 * cfg.n_heads * h * attended_keys(cfg, seq_len))


# What each job.model.quantization_scope quantizes (runner.models.common.quantization): module path
# regexes and ops. The attention scores are never among them.
QUANTIZED = {
    "attention": ((r"(.*/)?attn/(query|key|value|out)", ("einsum",)),),
    "mlp": ((r"(.*/)?mlp/(gate|up|down)", ("dot_general",)),),
    "head": ((r"embed|lm_head", ("einsum", "dot_general")),),  # the tied embedding's attend, or lm_head
}


def _first_changed(model: Any, section: str) -> str:
    """The dotted key of the first field of job.model.`section` set away from its default."""
    from runner.spec import ModelSpec

    ours, default = getattr(model, section), getattr(ModelSpec(), section)
    changed = [f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(default, f.name)]
    return f"job.model.{section}.{changed[0]}" if changed else f"job.model.{section}"


class GemmaFamily:
    """Gemma 3's text decoder (Gemma3ForCausalLM), and Gemma 2's soft-capping."""

    name = "gemma"

    @staticmethod
    def config(model: Any) -> GemmaConfig:
        refuse_foreign_keys(model, "gemma", ("use_bias", "dropout", "mlp_bias"), "drop it; the gemma family has "
                            "no dropout and no MLP biases, and its attention biases are job.model.qkv_bias and "
                            "out_bias.")
        refuse_foreign_keys(model, "gemma", ("rope.mscale_all_dim", "hf.rope_interleave"),
                            "drop it, or use job.model.family=deepseek (DeepSeek-V3's YaRN softmax scale and "
                            "interleaved rotary files are that family's).")
        from runner.spec import ModelSpec

        for section, why in (("moe", "the gemma family has no mixture-of-experts layers"),
                             ("mla", "the gemma family's attention is grouped-query, not multi-head latent"),
                             ("mtp", "the gemma family has no multi-token prediction modules")):
            if getattr(model, section) != getattr(ModelSpec(), section):
                key = _first_changed(model, section)
                value = getattr(getattr(model, section), key.rsplit(".", 1)[-1], None)
                raise ConfigError(key, value, f"{why}, so it would change nothing.",
                                  f"drop it, or use the family that reads job.model.{section}.")
        if not model.qk_norm:
            raise ConfigError("job.model.qk_norm", model.qk_norm, "Gemma 3 normalises every head's queries and keys "
                              "(q_norm, k_norm), and the gemma family has no attention without them.",
                              "set job.model.qk_norm=true.")
        r, w = model.rope, model.window
        if r.scaling not in ("none", "linear"):
            raise ConfigError("job.model.rope.scaling", r.scaling, "the gemma family scales its global layers' "
                              "rotary frequencies linearly (Gemma 3 4B and up) or not at all.", "use none or linear.")
        if r.scaling == "linear" and r.factor <= 0:
            raise ConfigError("job.model.rope.factor", r.factor, "it must be positive.", "use e.g. 8.0.")
        kv = model.n_kv_heads or model.n_heads
        if kv < 0 or model.n_heads % kv:
            raise ConfigError("job.model.n_kv_heads", model.n_kv_heads, f"it must divide n_heads={model.n_heads} "
                              "(each key/value head serves a whole group of query heads).",
                              "use a divisor of n_heads, e.g. 1, or 0 for n_heads (no grouping).")
        if w.size and w.global_every == 1:
            raise ConfigError("job.model.window.global_every", 1, "every layer would attend to every earlier key, "
                              f"so job.model.window.size={w.size} would change nothing.",
                              "use N > 1 (layers N-1, 2N-1, ... global, Gemma 3: 6), 0 (every layer windowed), or "
                              "job.model.window.size=0.")
        if w.size and not (w.global_every and w.global_every <= model.n_layers):
            # every layer windowed: the global layers' rotary settings reach none
            moved = [(k, v) for k, v in (("rope.scaling", r.scaling), ("rope.theta", r.theta))
                     if v != getattr(type(r)(), k.split(".")[1]) and (k != "rope.theta" or w.local_rope_theta)]
            if moved:
                raise ConfigError(f"job.model.{moved[0][0]}", moved[0][1], "it sets the global layers' rotary "
                                  f"embedding, and with job.model.window.global_every={w.global_every} over "
                                  f"{model.n_layers} layers every layer is windowed (base "
                                  "job.model.window.local_rope_theta, never scaled): it would change nothing.",
                                  "drop it, or set job.model.window.global_every to make some layers global.")
        if model.hf.architecture not in ("", gemma_hf.ARCHITECTURE):
            raise ConfigError("job.model.hf.architecture", model.hf.architecture, "the gemma family exports as "
                              f"{gemma_hf.ARCHITECTURE} only.", f"use {gemma_hf.ARCHITECTURE}, or leave it empty.")
        if model.query_pre_attn_scalar < 0:
            raise ConfigError("job.model.query_pre_attn_scalar", model.query_pre_attn_scalar, "the queries are "
                              "scaled by its inverse square root.", "use a positive value, or 0 for head_dim.")
        return fields_of(GemmaConfig, model, n_kv_heads=kv, d_ff=model.d_ff or 4 * model.d_model,
                         rope_theta=r.theta, rope_scaling=r.scaling, rope_factor=r.factor,
                         local_rope_theta=w.local_rope_theta or r.theta, window_size=w.size,
                         global_every=w.global_every, attn_softcap=model.softcap.attention,
                         final_softcap=model.softcap.final, activation=model.activation or "gelu_pytorch_tanh",
                         hf_architecture=model.hf.architecture)

    @staticmethod
    def for_platform(config: GemmaConfig, platform: str) -> GemmaConfig:
        """What the platform and the run's layout (resolved in `config` by runner.models.model_config)
        cannot run: soft-capped attention scores anywhere but runner's own XLA path (a fused kernel
        never shows the raw scores), and pipeline stages (a stack of periods is not a stack of layers)."""
        if config.pipeline_stages > 1:
            raise ConfigError("mesh.stage", config.pipeline_stages, "the gemma family's layers are of two kinds "
                              "(windowed and global), stacked as periods of the pattern, which the pipeline does "
                              "not split into stages.", "use mesh.stage=1 (shard over fsdp or tensor instead).")
        if not config.attn_softcap:
            return config
        impl = config.attention
        if impl == "auto" and platform != "auto":
            impl = kernels.resolve(impl, platform, config.compute_dtype)
        if impl not in ("auto", "xla"):
            raise ConfigError("job.model.softcap.attention", config.attn_softcap, "soft-capping acts on the raw "
                              f"attention scores, which only runner's XLA attention computes, and "
                              f"job.model.attention is {impl} on this platform ({platform}).",
                              "set job.model.attention=xla, or drop job.model.softcap.attention.")
        if config.context_parallel != "auto":
            raise ConfigError("job.model.softcap.attention", config.attn_softcap, "soft-capped attention is "
                              "computed whole on each device, and rows split over a context axis "
                              f"(job.model.context_parallel={config.context_parallel}) need one of the context "
                              "strategies.", "use mesh.context=1, or drop job.model.softcap.attention.")
        return config

    @staticmethod
    def module(config: GemmaConfig) -> Gemma:
        return quantized(Gemma(config), config, QUANTIZED)

    @staticmethod
    def axis_rules(config: GemmaConfig, mesh_shape: Any) -> tuple[tuple[str, Any], ...]:
        return state_over_context(axis_rules(config, int(dict(mesh_shape).get("tensor", 1))), mesh_shape)

    param_count = staticmethod(param_count)
    flops_per_token = staticmethod(flops_per_token)

    hf = gemma_hf.GemmaHF  # Hugging Face both ways (runner.models.gemma.hf)


MODEL_FAMILIES.register("gemma")(GemmaFamily)
