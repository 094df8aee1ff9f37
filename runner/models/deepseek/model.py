"""DeepSeek-V3 (flax.linen): multi-head latent attention, a mixture of experts with shared experts and
group-limited sigmoid routing after leading dense layers, and multi-token prediction (MTP).

Multi-head latent attention (MLA): queries through a low-rank latent (``q_lora_rank``; 0: projected
directly, as DeepSeek-V2-Lite), keys and values through one shared latent (``kv_lora_rank``), each
head's query and key split into a part without positions (``qk_nope_head_dim``) and a rotary part
(``qk_rope_head_dim``) whose key is shared by every head; values ``v_head_dim`` wide. The kernels
(runner.models.attention.kernels) take one head width: queries, keys and values are zero-padded to
the wider of the two widths (zeros add nothing to a score or an output) and the output sliced back,
the queries pre-scaled so the kernel's 1/sqrt(width) is MLA's 1/sqrt(nope + rope) times YaRN's
``mscale_all_dim`` gain. Decoding caches the normed latent and the rotated shared key (what DeepSeek
caches), expanding them per step.

The experts are runner.models.common.moe's MoEMLP (sigmoid scores, ``n_group``/``topk_group``
group-limited routing, ``routed_scaling``, shared experts, a fixed selection bias ``score_bias``
for an imported ``e_score_correction_bias`` plus the auxiliary-loss-free bias that moves each step
when ``moe.bias_update_rate`` is set); layers [0, ``moe.first_dense_layers``) keep a dense MLP.

MTP (DeepSeek-V3 paper, section 2.2): module k (k = 1..depth) takes the previous depth's hidden
state (the trunk's final, normed one for k = 1, as vLLM and Megatron-LM feed DeepSeek's MTP weights)
and the embedding of the token k places ahead, each RMS-normed, concatenated (embedding first) and
projected back to d_model (``eh_proj``), runs one transformer block and the shared output head
(through its own RMSNorm) to predict the token k + 1 places ahead. The mean of the depths' losses
times ``mtp_loss_weight`` is sown into LOSSES, so the train step adds it; logits, the main loss and
evaluation are the trunk's alone (the modules run only when training asks for LOSSES). A target
counts only inside the row's document: a packed row's MTP loss is its documents' losses alone.

Tensor layout as transformers' DeepseekV3ForCausalLM (rotate-half rotary embeddings; its
interleaved layout is permuted on import and back on export: runner.models.deepseek.hf).
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from runner.errors import ConfigError
from runner.models.attention.kernels import attend
from runner.models.common import moe as moe_lib
from runner.models.common import tiling
from runner.models.common.block import PreNormBlock
from runner.models.common.context_order import from_context_order, to_context_order
from runner.models.common.decoder import (REMAT_POLICIES, Decoder, KVCache, check_length, output_head, remat_of,
                                          stack_blocks)
from runner.models.common.layers import (LOGICAL_AXIS_RULES, LOSSES, REPORTS, dense, embedding,
                                         normal_init, residual_std, state_over_context)
from runner.models.common.norms import RMSNorm
from runner.models.common.rope import apply_rope, rope_attention_scale, rope_frequencies
from runner.models.common.runtime import Runtime
from runner.models.deepseek import hf as deepseek_hf
from runner.models.family import MODEL_FAMILIES, fields_of, refuse_foreign_keys

# What a test may read back (flax's `intermediates` collection, which training never makes mutable):
# each MTP depth k's per-token losses and which of them count, in the row's own order ("mtp_losses_k").
INTERMEDIATES = "intermediates"


@dataclass(frozen=True)
class DeepSeekConfig(Runtime):
    vocab_size: int
    context_length: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int  # the dense layers' MLP width (DeepSeek-V3's intermediate_size)
    q_lora_rank: int = 1536  # 0: queries projected directly
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | linear | llama3 | yarn (runner.models.common.rope)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0  # yarn's cos/sin factor; 0: 0.1 * ln(factor) + 1
    rope_truncate: bool = True
    rope_mscale_all_dim: float = 0.0  # yarn: the softmax scale times (0.1 * this * ln(factor) + 1)^2
    hf_rope_interleave: bool = True  # the Hugging Face files' rotary rows: DeepSeek's interleaved pairs
    norm_eps: float = 1e-6
    activation: str = "silu"
    tie_embeddings: bool = False
    moe_experts: int = 0  # job.model.moe (runner.models.common.moe); 0: a dense MLP in every layer
    moe_top_k: int = 8
    moe_d_ff: int = 0
    moe_shared: int = 0
    moe_score: str = "sigmoid"
    moe_normalize: bool = True
    moe_dispatch: str = "ragged"
    moe_capacity_factor: float = 1.25
    moe_aux_loss: float = 0.0
    moe_z_loss: float = 0.0
    moe_first_dense: int = 0
    moe_bias_rate: float = 0.0
    moe_kernel: str = "ragged_dot"
    moe_native_exchange: bool = False
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling: float = 1.0
    moe_score_bias: bool = True  # a fixed selection bias per expert (transformers' e_score_correction_bias)
    mtp_depth: int = 0  # job.model.mtp
    mtp_loss_weight: float = 0.3

    @property
    def mlp_bias(self) -> bool:
        """DeepSeek-V3's MLPs have no biases (GatedMLP reads this)."""
        return False

    @property
    def dense_layers(self) -> int:
        """How many leading layers have a dense MLP: all of them without experts."""
        return min(self.moe_first_dense, self.n_layers) if self.moe_experts else self.n_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` (MTP module k is layer n_layers + k - 1, as DeepSeek numbers it) has experts."""
        return bool(self.moe_experts) and layer >= self.moe_first_dense

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary embeddings rotate "
                             "pairs)")


def rotary(cfg: DeepSeekConfig) -> Any:
    """The rotary settings as runner.models.common.rope reads them: the rotated width is MLA's rotary part."""
    names = ("rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_context", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_truncate")
    return types.SimpleNamespace(head_dim=cfg.qk_rope_head_dim, **{n: getattr(cfg, n) for n in names})


def softmax_gain(cfg: DeepSeekConfig) -> float:
    """What DeepSeek's YaRN multiplies the softmax scale by: (0.1 * mscale_all_dim * ln(factor) + 1)^2
    (transformers' yarn_apply_mscale); 1 without it."""
    if cfg.rope_scaling == "none" or not cfg.rope_mscale_all_dim or cfg.rope_factor <= 1:
        return 1.0
    return (0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0) ** 2


LATENT_NORM_EPS = 1e-6  # DeepseekV3Attention's q_a_layernorm and kv_a_layernorm (not rms_norm_eps)


def axis_rules(cfg: DeepSeekConfig, tensor: int) -> tuple[tuple[str, Any], ...]:
    """The shared rules plus the experts on mesh.expert (ahead of "embed", which is offered the
    expert axis too: `DeepSeekFamily.axis_rules`), the latents (replicated: they are narrow, and
    every head reads all of them) and MTP's joined input (replicated)."""
    return (*LOGICAL_AXIS_RULES[:1], ("expert", "expert"), *LOGICAL_AXIS_RULES[1:], ("q_lora", None),
            ("kv_lora", None), ("joined", None))


def with_embed_over_expert(rules: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """`rules` with the weights' "embed" axis offered fsdp (and context) x expert first, MaxText's
    rule, falling back to the next "embed" rule where expert is taken (an expert's own weights,
    whose "expert" rule comes first; an activation, whose batch holds it): with 256 experts over
    mesh.expert=64 the dense weights (DeepSeek-V3's 17B) would otherwise be split fsdp ways only.
    An activation's latent axis falls back to its replicated rule (its batch holds the axes)."""
    at = next(i for i, (name, _) in enumerate(rules) if name == "embed")
    axes = rules[at][1]
    axes = (*((axes,) if isinstance(axes, str) else tuple(axes or ())), "expert")
    # the latents' side of the up projections (query_up, kv_up: latent x heads x width) likewise: split
    # over heads by mesh.tensor alone they would be whole on every device (3.3B of DeepSeek-V3's)
    latents = [("q_lora", axes), ("kv_lora", axes)]
    return (*rules[:at], ("embed", axes), *rules[at:at + 1], *latents, *rules[at + 1:])


def _heads(cfg: DeepSeekConfig, x: jax.Array, shape: tuple[int, int, int], names: tuple[str, str, str],
           std: float, name: str) -> jax.Array:
    """(B, T, in) -> (B, T, heads, width) by an einsum (nn.Einsum: see layers.project_heads)."""
    y = nn.Einsum(shape, "bti,inh->btnh", use_bias=False, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                  kernel_init=normal_init(std, names), name=name)(x)
    return nn.with_logical_constraint(y, ("batch", "length", "heads", "kv"))


def _write(cache: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """`new` (B, T, ...) written into `cache` (B, L, ...) at each row's `index`."""
    write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis=0))
    return write(cache, new.astype(cache.dtype), index)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array, scale: float) -> jax.Array:
    """Decoding: queries (B, T, N, qk) at positions index + t over the cache's keys (B, L, N, qk) and
    values (B, L, N, v), causally, in float32 (values may be narrower than queries)."""
    query_pos = index[:, None] + jnp.arange(q.shape[1])
    mask = jnp.arange(k.shape[1])[None, None, :] <= query_pos[:, :, None]  # (B, T, L)
    scores = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v.astype(jnp.float32))
    return out.astype(q.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention, causal, rotary positions on the heads' rotary parts."""

    cfg: DeepSeekConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg = self.cfg
        n, nope, rope, width_v = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        # the latents' norms: transformers builds q_a_layernorm and kv_a_layernorm with its fixed 1e-6
        norm = functools.partial(RMSNorm, LATENT_NORM_EPS, cfg.dtype, param_dtype=cfg.params_dtype)
        if cfg.q_lora_rank:
            latent_q = dense(cfg, cfg.q_lora_rank, ("embed", "q_lora"), 0.02, False, "query_down")(x)
            latent_q = norm(axis_name="q_lora", name="query_norm")(latent_q)
            q = _heads(cfg, latent_q, (cfg.q_lora_rank, n, cfg.qk_head_dim), ("q_lora", "heads", "kv"), 0.02,
                       "query_up")
        else:
            q = _heads(cfg, x, (cfg.d_model, n, cfg.qk_head_dim), ("embed", "heads", "kv"), 0.02, "query")
        kv = dense(cfg, cfg.kv_lora_rank + rope, ("embed", "kv_lora"), 0.02, False, "kv_down")(x)
        latent = norm(axis_name="kv_lora", name="kv_norm")(kv[..., :cfg.kv_lora_rank])
        inv_freq, scale = rope_frequencies(rotary(cfg)), rope_attention_scale(rotary(cfg))
        k_rope = apply_rope(kv[..., None, cfg.kv_lora_rank:], positions, inv_freq, scale)  # (B, T, 1, rope)
        q = jnp.concatenate([q[..., :nope], apply_rope(q[..., nope:], positions, inv_freq, scale)], axis=-1)
        if cache is not None:  # the latent and the rotated shared key, written at each row's index
            assert index is not None, "decoding with a cache needs each row's start position"
            cache = (_write(cache[0], latent[:, :, None], index), _write(cache[1], k_rope, index))
            latent, k_rope = cache[0][:, :, 0], cache[1]
        up = _heads(cfg, latent, (cfg.kv_lora_rank, n, nope + width_v), ("kv_lora", "heads", "kv"), 0.02, "kv_up")
        k = jnp.concatenate([up[..., :nope], jnp.broadcast_to(k_rope, (*k_rope.shape[:2], n, rope)).astype(up.dtype)],
                            axis=-1)
        v = up[..., nope:]
        k = nn.with_logical_constraint(k, ("batch", "length", "heads", "kv"))
        gain = softmax_gain(cfg)
        if cache is None:
            width = max(cfg.qk_head_dim, width_v)  # one width for the kernels: zero-padded, the output sliced
            q = (q.astype(jnp.float32) * (gain * math.sqrt(width / cfg.qk_head_dim))).astype(q.dtype)
            y = attend(cfg.attention, _pad(q, width), _pad(k, width), _pad(v, width), segment_ids,
                       kv_axes=("batch", "length", "heads", "kv"), context_parallel=cfg.context_parallel,
                       ulysses_ways=cfg.ulysses_ways, initializing=self.is_initializing())[..., :width_v]
        else:
            y = cached_attention(q, k, v, index, gain / math.sqrt(cfg.qk_head_dim))
        out = nn.Einsum((n, width_v, cfg.d_model), "btnh,nhd->btd", use_bias=False, dtype=cfg.dtype,
                        param_dtype=cfg.params_dtype,
                        kernel_init=normal_init(residual_std(cfg.n_layers), ("heads", "kv", "embed")), name="out")
        return out(y), cache


def _pad(x: jax.Array, width: int) -> jax.Array:
    return x if x.shape[-1] == width else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),))


class Block(PreNormBlock):
    """The shared pre-norm block (runner.models.common.block) with this family's attention."""

    attention_cls = MLAttention


class MTPModule(nn.Module):
    """One multi-token-prediction depth: (previous depth's hidden state, embedding of the token
    `depth` places ahead) -> (this depth's hidden state, the same normed for the shared head)."""

    cfg: DeepSeekConfig
    depth: int  # k, from 1

    @nn.compact
    def __call__(self, h: jax.Array, ahead: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        norm = functools.partial(RMSNorm, cfg.norm_eps, cfg.dtype, param_dtype=cfg.params_dtype)
        joined = jnp.concatenate([norm(name="token_norm")(ahead), norm(name="hidden_norm")(h)], axis=-1)
        x = dense(cfg, cfg.d_model, ("joined", "embed"), 0.02, False, "project")(joined)
        block = Block
        if remat_of(cfg) != "none":
            block = nn.remat(Block, policy=REMAT_POLICIES[remat_of(cfg)])
        x, _ = block(cfg, cfg.sparse(cfg.n_layers + self.depth - 1), name="block")(x, positions, segment_ids)
        return x, norm(name="head_norm")(x)


def mtp_inputs(tokens: jax.Array, targets: jax.Array, segment_ids: jax.Array | None,
               depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For MTP depth k, in the row's own order: the input token k places ahead of each position,
    the target k + 1 places ahead, and whether that target counts: inside the row and, with
    segments, of the position's own document (its token at i + k + 1 in the same segment, so the
    row's last target, whose document the model cannot see, never counts with segments)."""
    batch, length = tokens.shape
    ahead = jnp.pad(tokens[:, depth:], ((0, 0), (0, depth)))
    labels = jnp.pad(targets[:, depth:], ((0, 0), (0, depth)))
    if segment_ids is None:
        valid = jnp.broadcast_to(jnp.arange(length) + depth < length, (batch, length))
    else:
        later = jnp.pad(segment_ids[:, depth + 1:], ((0, 0), (0, depth + 1)), constant_values=-1)
        valid = later == segment_ids
    return ahead, labels, valid


class DeepSeek(Decoder):
    """The DeepSeek-V3 language model (the call, packing and decoding: runner.models.common.decoder
    .Decoder, whose call this one extends with the MTP modules' loss)."""

    cfg: DeepSeekConfig

    @property
    def kv_heads(self) -> int:
        return 1

    def init_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
        """An empty cache: per layer the normed key/value latent (B, L, 1, kv_lora_rank) as "key"
        and the rotated shared key (B, L, 1, qk_rope_head_dim) as "value"."""
        cfg = self.cfg
        if length > cfg.context_length:
            raise ValueError(f"cache length {length} exceeds context_length {cfg.context_length}")
        return {"key": jnp.zeros((cfg.n_layers, batch, length, 1, cfg.kv_lora_rank), cfg.dtype),
                "value": jnp.zeros((cfg.n_layers, batch, length, 1, cfg.qk_rope_head_dim), cfg.dtype)}

    def trunk(self, tokens: jax.Array, caches: KVCache | None, index: jax.Array | None,
              segment_ids: jax.Array | None, positions: jax.Array | None) -> tuple[Any, ...]:
        """(final normed hidden states, the embedding, the updated caches, positions and segment
        ids), rows in context order without caches (as `hidden`)."""
        cfg = self.cfg
        batch, seq_len = tokens.shape
        embed = embedding(cfg, cfg.vocab_size, ("vocab", "embed"), "embed")
        if positions is None or caches is not None:
            start = jnp.zeros((batch,), jnp.int32) if caches is None else jnp.asarray(index, jnp.int32)
            positions = start[:, None] + jnp.arange(seq_len)[None]
        if caches is None:
            tokens, positions, segment_ids = to_context_order(tokens, positions, segment_ids)
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        x, new_cache = self.layers(x, (positions, segment_ids), caches, index)
        x = RMSNorm(cfg.norm_eps, cfg.dtype, param_dtype=cfg.params_dtype, name="norm")(x)
        return x, embed, new_cache, positions, segment_ids

    def hidden(self, tokens: jax.Array, deterministic: bool, caches: KVCache | None, index: jax.Array | None,
               segment_ids: jax.Array | None,
               positions: jax.Array | None) -> tuple[jax.Array, nn.Embed, KVCache | None]:
        return self.trunk(tokens, caches, index, segment_ids, positions)[:3]

    def layers(self, x: jax.Array, shared: tuple[Any, ...], caches: KVCache | None,
               index: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
        """The dense layers (all of them without experts; else the first `moe_first_dense`, scanned
        as ``dense_blocks``), then the sparse ones (``blocks``), as the llama family's."""
        cfg, split = self.cfg, self.cfg.dense_layers
        if split in (0, cfg.n_layers):
            return stack_blocks(Block, (cfg, split == 0), cfg, x, shared, caches, index)
        updated = []
        for layers, sparse, name in ((range(split), False, "dense_blocks"), (range(split, cfg.n_layers), True,
                                                                             "blocks")):
            part = slice(layers.start, layers.stop)
            cache = None if caches is None else (caches[0][part], caches[1][part])
            x, cache = stack_blocks(Block, (cfg, sparse), cfg, x, shared, cache, index, layers=layers, name=name)
            updated.append(cache)
        if caches is None:
            return x, None
        return x, (jnp.concatenate([u[0] for u in updated]), jnp.concatenate([u[1] for u in updated]))

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True,
                 cache: dict[str, jax.Array] | None = None, index: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                 targets: jax.Array | None = None) -> Any:
        """As Decoder's call; with MTP, while training (LOSSES mutable, targets given) or
        initialising, the MTP modules run too and sow their loss (the returned values are the
        trunk's alone)."""
        cfg = self.cfg
        check_length(cfg, tokens.shape[1])
        caches = None if cache is None else (cache["key"], cache["value"])
        x, embed, new_cache, pos, seg = self.trunk(tokens, caches, index, segment_ids, positions)
        head, project = output_head(cfg, embed)
        if cache is not None:
            assert new_cache is not None
            return project(head, x), {"key": new_cache[0], "value": new_cache[1]}
        training = targets is not None and self.is_mutable_collection(LOSSES)
        if cfg.mtp_depth and (training or self.is_initializing()):
            self.multi_token(x, embed, head, project, tokens, tokens if targets is None else targets, pos, seg,
                             segment_ids)
        if targets is None:
            return project(head, from_context_order(x))
        losses, correct = tiling.head_losses(project, head, x, *to_context_order(targets), cfg.loss_tiles)
        return from_context_order(losses), from_context_order(correct)

    def multi_token(self, h: jax.Array, embed: nn.Embed, head: nn.Module, project: Any, tokens: jax.Array,
                    targets: jax.Array, positions: jax.Array, segments: jax.Array | None,
                    row_segments: jax.Array | None) -> None:
        """The MTP modules on the trunk's hidden states `h` (context order, as `positions` and
        `segments`; `tokens`, `targets` and `row_segments` in the row's order): their weighted mean
        loss sown into LOSSES ("mtp"), the unweighted one into REPORTS ("mtp_loss")."""
        cfg = self.cfg
        depth_losses = []
        for k in range(1, cfg.mtp_depth + 1):
            ahead, labels, valid = to_context_order(*mtp_inputs(tokens, targets, row_segments, k))
            h, normed = MTPModule(cfg, k, name=f"mtp_{k - 1}")(h, embed(ahead), positions, segments)
            losses, _ = tiling.head_losses(project, head, normed, labels, cfg.loss_tiles)
            mask = valid.astype(jnp.float32)
            depth_losses.append(jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0))
            self.sow(INTERMEDIATES, f"mtp_losses_{k}", (from_context_order(losses), from_context_order(valid)))
        mean = sum(depth_losses) / cfg.mtp_depth
        self.sow(LOSSES, "mtp", cfg.mtp_loss_weight * mean)
        self.sow(REPORTS, "mtp_loss", mean)


# ----------------------------------------------------------------------------- counting


def _attention_params(cfg: DeepSeekConfig) -> int:
    d, n, r, kv = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    query = d * r + r + r * n * cfg.qk_head_dim if r else d * n * cfg.qk_head_dim
    keys_values = d * (kv + cfg.qk_rope_head_dim) + kv + kv * n * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return query + keys_values + n * cfg.v_head_dim * d


def _layer_params(cfg: DeepSeekConfig, layer: int) -> int:
    """One block: attention, two norms, its dense MLP or its experts (router, fixed selection
    bias, routed and shared experts)."""
    d = cfg.d_model
    if cfg.sparse(layer):
        ffn = d * cfg.moe_experts + cfg.moe_experts * int(cfg.moe_score_bias) + 3 * d * cfg.moe_d_ff * (
            cfg.moe_experts + cfg.moe_shared)
    else:
        ffn = 3 * d * cfg.d_ff
    return _attention_params(cfg) + 2 * d + ffn


def _mtp_params(cfg: DeepSeekConfig) -> int:
    """The MTP modules: per depth two input norms, the projection, a block and the head's norm (the
    embedding and the output head are the trunk's)."""
    d = cfg.d_model
    return sum(3 * d + 2 * d * d + _layer_params(cfg, cfg.n_layers + k) for k in range(cfg.mtp_depth))


def param_count(cfg: DeepSeekConfig, include_embeddings: bool = True) -> int:
    """Every parameter, the MTP modules' included (what training holds)."""
    d = cfg.d_model
    total = sum(_layer_params(cfg, i) for i in range(cfg.n_layers)) + d + _mtp_params(cfg)
    if not cfg.tie_embeddings:
        total += d * cfg.vocab_size
    if include_embeddings:
        total += cfg.vocab_size * d
    return total


def active_param_count(cfg: DeepSeekConfig) -> int:
    """The parameters one token uses to predict its next token: the main model's, but the experts its
    router did not choose (DeepSeek's "activated" count: 37B of V3's 671B). The MTP modules train the
    trunk and are not part of it."""
    unused = cfg.moe_experts - cfg.moe_top_k if cfg.moe_experts else 0
    sparse = cfg.n_layers - cfg.dense_layers
    return param_count(cfg) - _mtp_params(cfg) - sparse * unused * 3 * cfg.d_model * cfg.moe_d_ff


def flops_per_token(cfg: DeepSeekConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the matmul weights a token runs through (MLA's projections:
    the query latent and its up-projection, the key/value latent, its up-projection to every head's
    keys and values, the output; the dense MLPs or the router, top_k routed and the shared experts;
    the LM head; and each MTP module's projection, block and head) plus attention's QK^T (width
    qk_nope + qk_rope) and AV (width v_head_dim) over the full (not causally halved) score matrix:
    6 * n_heads * seq_len * (qk + v) per block, as GPT's count."""
    d, n = cfg.d_model, cfg.n_heads
    r, kv = cfg.q_lora_rank, cfg.kv_lora_rank
    query = d * r + r * n * cfg.qk_head_dim if r else d * n * cfg.qk_head_dim
    attention = query + d * (kv + cfg.qk_rope_head_dim) + kv * n * (cfg.qk_nope_head_dim + cfg.v_head_dim) + \
        n * cfg.v_head_dim * d

    def block(layer: int) -> int:
        if cfg.sparse(layer):
            return attention + d * cfg.moe_experts + 3 * d * cfg.moe_d_ff * (cfg.moe_top_k + cfg.moe_shared)
        return attention + 3 * d * cfg.d_ff

    blocks = cfg.n_layers + cfg.mtp_depth
    matmul = sum(block(i) for i in range(blocks)) + (1 + cfg.mtp_depth) * d * cfg.vocab_size + \
        cfg.mtp_depth * 2 * d * d
    return float(6 * matmul + 6 * blocks * n * seq_len * (cfg.qk_head_dim + cfg.v_head_dim))


# ----------------------------------------------------------------------------- the family


def moe_settings(model: Any) -> dict[str, Any]:
    """DeepSeekConfig's moe_* fields from job.model.moe (all defaults while n_experts is 0)."""
    m = model.moe
    if not m.n_experts:
        return {}
    return dict(moe_experts=m.n_experts, moe_top_k=m.top_k, moe_d_ff=m.d_ff_expert or model.d_ff or 4 * model.d_model,
                moe_shared=m.n_shared_experts, moe_score=m.score, moe_normalize=m.normalize_top_k,
                moe_dispatch=m.dispatch, moe_capacity_factor=m.capacity_factor, moe_aux_loss=m.aux_loss,
                moe_z_loss=m.z_loss, moe_first_dense=m.first_dense_layers, moe_bias_rate=m.bias_update_rate,
                moe_n_group=m.n_group, moe_topk_group=m.topk_group, moe_routed_scaling=m.routed_scaling)


# job.model keys other families read; the deepseek family's heads and widths are job.model.mla's
_FOREIGN = ("use_bias", "dropout", "n_kv_heads", "qk_norm", "qkv_bias", "out_bias", "mlp_bias", "head_dim", "scale",
            "query_pre_attn_scalar", "window", "softcap")


class DeepSeekFamily:
    """DeepSeek-V3: multi-head latent attention, shared and routed experts, multi-token prediction."""

    name = "deepseek"

    @staticmethod
    def config(model: Any) -> DeepSeekConfig:
        refuse_foreign_keys(model, "deepseek", _FOREIGN, "drop it; the deepseek family's attention is set by "
                            "job.model.mla (its head widths), and it has no biases, dropout or sliding window.")
        r = model.rope
        if r.scaling not in ("none", "linear", "llama3", "yarn"):
            raise ConfigError("job.model.rope.scaling", r.scaling, "it is not a known rotary scaling.",
                              "use none, linear, llama3 or yarn.")
        if r.scaling != "none" and r.factor <= 0:
            raise ConfigError("job.model.rope.factor", r.factor, "it must be positive.", "use e.g. 40.0.")
        if r.mscale_all_dim and r.scaling != "yarn":
            raise ConfigError("job.model.rope.mscale_all_dim", r.mscale_all_dim, "it scales the softmax with YaRN's "
                              f"factor, and job.model.rope.scaling is {r.scaling}.",
                              "use job.model.rope.scaling=yarn, or drop it.")
        if model.moe.n_experts and model.moe.score != "sigmoid":
            raise ConfigError("job.model.moe.score", model.moe.score, "DeepSeek-V3 scores experts by a sigmoid "
                              "(transformers' DeepseekV3 router has no other).",
                              "use job.model.moe.score=sigmoid, or the llama family for softmax routing.")
        if model.quantization != "none":
            raise ConfigError("job.model.quantization", model.quantization, "the deepseek family's matmuls are not "
                              "mapped to quantization scopes yet, so the run would train unquantized.",
                              "use job.model.quantization=none, or the llama family.")
        if model.hf.architecture not in ("", deepseek_hf.ARCHITECTURE):
            raise ConfigError("job.model.hf.architecture", model.hf.architecture, "the deepseek family exports as "
                              f"{deepseek_hf.ARCHITECTURE}.", "use it, or leave it empty.")
        from runner.spec import MoESpec, MTPSpec

        if not model.moe.n_experts and model.moe != MoESpec():
            key, value = next((k, v) for k, v in vars(model.moe).items() if v != getattr(MoESpec(), k))
            raise ConfigError(f"job.model.moe.{key}", value, "job.model.moe.n_experts is 0 (every layer a dense "
                              "MLP), so it would change nothing.", "set job.model.moe.n_experts (DeepSeek-V3: 256), "
                              "or drop it.")
        if not model.mtp.depth and model.mtp != MTPSpec():
            raise ConfigError("job.model.mtp.loss_weight", model.mtp.loss_weight, "job.model.mtp.depth is 0 (no "
                              "multi-token prediction module), so it would change nothing.",
                              "set job.model.mtp.depth (DeepSeek-V3: 1), or drop it.")
        m = model.mla
        return fields_of(DeepSeekConfig, model, d_ff=model.d_ff or 4 * model.d_model, q_lora_rank=m.q_lora_rank,
                         kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                         qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_theta=r.theta,
                         rope_scaling=r.scaling, rope_factor=r.factor, rope_low_freq_factor=r.low_freq_factor,
                         rope_high_freq_factor=r.high_freq_factor, rope_original_context=r.original_context,
                         rope_beta_fast=r.beta_fast, rope_beta_slow=r.beta_slow,
                         rope_attention_factor=r.attention_factor, rope_truncate=r.truncate,
                         rope_mscale_all_dim=r.mscale_all_dim, hf_rope_interleave=model.hf.rope_interleave,
                         activation=model.activation or "silu", mtp_depth=model.mtp.depth,
                         mtp_loss_weight=model.mtp.loss_weight, **moe_settings(model))

    for_platform = staticmethod(moe_lib.for_platform)
    describe = staticmethod(moe_lib.describe)

    @staticmethod
    def module(config: DeepSeekConfig) -> DeepSeek:
        return DeepSeek(config)

    @staticmethod
    def axis_rules(config: DeepSeekConfig, mesh_shape: Any) -> tuple[tuple[str, Any], ...]:
        rules = state_over_context(axis_rules(config, int(dict(mesh_shape).get("tensor", 1))), mesh_shape)
        return with_embed_over_expert(rules)

    param_count = staticmethod(param_count)
    active_param_count = staticmethod(active_param_count)
    flops_per_token = staticmethod(flops_per_token)

    hf = deepseek_hf.DeepSeekHF  # Hugging Face both ways (runner.models.deepseek.hf)


MODEL_FAMILIES.register("deepseek")(DeepSeekFamily)
