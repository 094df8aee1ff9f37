"""The decoder plumbing around a family's blocks: the KV cache (its type, an empty one, the write and
the attention over it), the scanned, unrolled or pipelined layer stack with its remat policy, the
output head and its tiled loss, and `Decoder`, the model call every family's model subclasses (a
family supplies the hidden states)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from runner.models.common import pipeline, tiling
from runner.models.common.context_order import from_context_order, to_context_order
from runner.models.common.layers import LAYER_SUMS, LOSSES, MODEL_STATE, REPORTS, normal_init

KVCache = tuple[jax.Array, jax.Array]  # cached (keys, values): (B, L, K, H) for one layer, stacked over layers

# The name a block gives its input (`layer_input`), so a policy can move it to host memory.
LAYER_INPUT = "layer_input"
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "full": None,  # save nothing: recompute the whole block on the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # as full, with each block's input (what full keeps of a layer) in the host's pinned memory from
    # the forward pass to the backward (MaxText's offloaded decoder_layer_input); TPU and GPU only
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT], offload_src="device",
        offload_dst="pinned_host"),
}
# the platforms whose runtime places arrays in host memory (XLA's CPU backend ignores the placement)
OFFLOAD_PLATFORMS = ("tpu", "gpu")


def layer_input(x: jax.Array) -> jax.Array:
    """`x`, named as a block's input for the remat policy (REMAT_POLICIES["offload"] offloads it)."""
    return checkpoint_name(x, LAYER_INPUT)


def remat_of(cfg: Any) -> str:
    """cfg.remat with auto resolved: dots when the layers are scanned (a scan stacks every saved
    activation of every layer, and saving only the weight matmuls' outputs made the scanned step
    1.14x faster on the 10.9M GPT-2 of tools/bench/bench_maxtext.py), none when they are unrolled (where
    the two measured the same)."""
    if cfg.remat != "auto":
        return cfg.remat
    return "dots" if cfg.scan_layers else "none"


def check_length(cfg: Any, seq_len: int) -> None:
    if seq_len > cfg.context_length:
        raise ValueError(f"sequence length {seq_len} exceeds context_length {cfg.context_length}")


def empty_cache(cfg: Any, kv_heads: int, batch: int, length: int) -> dict[str, jax.Array]:
    """An empty cache for ``batch`` rows of up to ``length`` positions: keys and values stacked
    over layers, (n_layers, batch, length, kv_heads, head_dim) each."""
    if length > cfg.context_length:
        raise ValueError(f"cache length {length} exceeds context_length {cfg.context_length}")
    shape = (cfg.n_layers, batch, length, kv_heads, cfg.head_dim)
    return {"key": jnp.zeros(shape, cfg.dtype), "value": jnp.zeros(shape, cfg.dtype)}


def attend_cached(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
                  index: jax.Array | None, window: int = 0) -> tuple[jax.Array, KVCache]:
    """Decoding: the new tokens' keys and values k, v (B, T, K, H) written into this layer's
    ``cache`` (B, L, K, H) at each row's ``index`` (B,), then the queries q (B, T, N, H), at
    positions ``index + t``, attending causally over the cache (its last `window` keys: 0, all).
    Returns (output (B, T, N, H), updated cache)."""
    assert index is not None, "decoding with a cache needs each row's start position"
    write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis=0))
    cached_k = write(cache[0], k.astype(cache[0].dtype), index)
    cached_v = write(cache[1], v.astype(cache[1].dtype), index)
    query_pos = index[:, None] + jnp.arange(q.shape[1])  # (B, T)
    key_pos = jnp.arange(cached_k.shape[1])  # (L,)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # (B, T, L): causal over the cache
    if window:
        mask = mask & (query_pos[:, :, None] - key_pos[None, None, :] < window)
    return jax.nn.dot_product_attention(q, cached_k, cached_v, mask=mask[:, None]), (cached_k, cached_v)


def stack_blocks(block: Any, block_args: tuple[Any, ...], cfg: Any, x: jax.Array, shared: tuple[Any, ...],
                 caches: KVCache | None, index: jax.Array | None,
                 rngs: tuple[str, ...] = ("params",), layers: range | None = None,
                 name: str = "blocks") -> tuple[jax.Array, KVCache | None]:
    """The blocks `layers` (all n_layers by default), ``block(*block_args)(x, *shared, cache,
    index) -> (x, cache)``: scanned (one compiled block, parameters and cache stacked on a leading
    "layers" axis, as `name`) or unrolled (``block_i``, i the layer's number in the model),
    rematerialised as ``cfg.remat`` says. `caches` are the given layers'. Call inside a compact method."""
    layers = range(cfg.n_layers) if layers is None else layers
    if remat_of(cfg) != "none":
        # Under scan the loop boundary already stops XLA from CSE-ing the recomputation away, so
        # prevent_cse would only cost performance.
        block = nn.remat(block, prevent_cse=not cfg.scan_layers, policy=REMAT_POLICIES[remat_of(cfg)])
    if cfg.scan_layers:
        scanned = nn.scan(
            block,
            variable_axes={"params": 0, LOSSES: 0, REPORTS: 0, MODEL_STATE: 0},
            split_rngs={r: True for r in rngs},
            in_axes=(*[nn.broadcast] * len(shared), 0, nn.broadcast),
            length=len(layers),
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(*block_args, name=name)
        schedule = _pipelined(cfg, x, caches, scanned)
        if schedule is None:
            return scanned(x, *shared, caches, index)
        return pipelined_blocks(block, block_args, scanned.variables, [scanned.scope], x, shared, index,
                                schedule, remat_of(cfg)), None
    blocks = [block(*block_args, name=f"block_{i}") for i in layers]
    schedule = _pipelined(cfg, x, caches, blocks[0])
    if schedule is not None:  # the layers' variables stacked as the scan holds them
        stacked = jax.tree.map(lambda *w: jnp.stack(w), *(b.variables for b in blocks))
        return pipelined_blocks(block, block_args, stacked, [b.scope for b in blocks], x, shared, index,
                                schedule, remat_of(cfg)), None
    updated = []
    for n, module in enumerate(blocks):
        layer = None if caches is None else (caches[0][n], caches[1][n])
        x, layer = module(x, *shared, layer, index)
        updated.append(layer)
    if caches is None:
        return x, None
    return x, (jnp.stack([u[0] for u in updated]), jnp.stack([u[1] for u in updated]))


def _pipelined(cfg: Any, x: jax.Array, caches: KVCache | None, module: nn.Module) -> pipeline.Schedule | None:
    """The pipeline the layers run in for this call, or None: as one stage (no stages; initialising
    or decoding; or an odd batch, such as an evaluator's, that the microbatches do not divide)."""
    schedule = pipeline.from_config(cfg)
    if schedule is None or caches is not None or module.is_initializing() or x.shape[0] % schedule.microbatches:
        return None
    return schedule


def pipelined_blocks(block: Any, block_args: tuple[Any, ...], variables: Any, scopes: list[Any], x: jax.Array,
                     shared: tuple[Any, ...], index: jax.Array | None, schedule: pipeline.Schedule,
                     remat: str) -> jax.Array:
    """The blocks' stacked `variables` (parameters and MODEL_STATE) applied to `x` in the pipeline
    `schedule`, each layer by the same block module (and remat) the scan runs, each iteration
    rematerialised by the same policy (`remat`, resolved: REMAT_POLICIES or none). What the layers
    sum over a microbatch (LAYER_SUMS) is added up over the microbatches and settled by the block
    into the LOSSES, REPORTS and MODEL_STATE one call over the batch would have made, in `scopes`
    (the scanned stack's, or the unrolled blocks'). Initialisation and decoding run as one stage."""
    unknown = {name for name, tree in variables.items() if tree} - {"params", MODEL_STATE}
    if unknown:
        raise ValueError(f"pipelined layers carry parameters and {MODEL_STATE} only, not {sorted(unknown)}")
    carried = {name: variables[name] for name in ("params", MODEL_STATE) if name in variables}

    def layer(w: Any, h: jax.Array, sh: tuple[Any, ...]) -> tuple[jax.Array, Any]:
        (out, _), sown = block(*block_args, parent=None).apply(w, h, *sh, None, index, mutable=[LAYER_SUMS])
        return out, sown.get(LAYER_SUMS, {})

    x, sums = pipeline.run(layer, carried, x, shared, schedule, remat=remat != "none",
                           policy=REMAT_POLICIES.get(remat))
    if jax.tree.leaves(sums):
        settled = block.settle(block_args[0], sums, carried.get(MODEL_STATE, {}))
        for collection, tree in zip((LOSSES, REPORTS, MODEL_STATE), settled):
            for i, scope in enumerate(scopes):
                if tree and scope.is_mutable_collection(collection):
                    _put(scope, collection, tree if len(scopes) == 1 else jax.tree.map(lambda a: a[i], tree))
    return x


def _put(scope: Any, collection: str, tree: Mapping[str, Any]) -> None:
    """`tree`'s leaves into `collection` at their paths below `scope` (a module's submodules by name)."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _put(scope.push(key, reuse=True), collection, value)
        else:
            scope.put_variable(collection, key, value)


def output_head(cfg: Any, embed: nn.Embed) -> tuple[nn.Module, Callable[[nn.Module, jax.Array], jax.Array]]:
    """The output head and how it maps hidden states to float32 logits: the embedding transposed
    when tied, else an ``lm_head``. Call inside a compact method."""
    if cfg.tie_embeddings:
        head, project = embed, lambda mdl, x: mdl.attend(x)
    else:
        head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                        kernel_init=normal_init(0.02, ("embed", "vocab")), name="lm_head")
        project = lambda mdl, x: mdl(x)  # noqa: E731
    return head, lambda mdl, x: nn.with_logical_constraint(project(mdl, x), ("batch", "length", "vocab")).astype(
        jnp.float32)


def output_logits(cfg: Any, x: jax.Array, embed: nn.Embed, new_cache: KVCache | None,
                  decoding: bool) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """float32 logits from the final hidden states (`output_head`), with the updated cache when
    decoding. Call inside a compact method."""
    head, project = output_head(cfg, embed)
    logits = project(head, x)
    if not decoding:
        return logits
    assert new_cache is not None
    return logits, {"key": new_cache[0], "value": new_cache[1]}


def output_losses(cfg: Any, x: jax.Array, embed: nn.Embed, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy of the output head's logits against `targets` (B, T), and whether
    each target is their argmax, over cfg.loss_tiles tiles of the tokens (runner.models.common.tiling):
    with more than one, the whole logits never exist. Call inside a compact method."""
    head, project = output_head(cfg, embed)
    return tiling.head_losses(project, head, x, targets, getattr(cfg, "loss_tiles", 1))


class Decoder(nn.Module):
    """The call both families' language models share: ``int32[B, T] -> float32[B, T, vocab]`` logits.

    Packed documents: ``segment_ids`` (B, T) keep attention inside each document and ``positions``
    (B, T) restart the positions at each one (runner.data.documents).

    Decoding with a KV cache uses the same call and the same weights: pass ``cache`` (from
    `init_cache`) and ``index`` (each row's position of its first new token) and get ``(logits,
    updated cache)``. A prompt is fed once (index 0), then one token at a time.

    A family's model says how many key/value heads it caches (`kv_heads`) and computes the
    hidden states (`hidden`); the output head is `output_logits`."""

    cfg: Any

    @property
    def kv_heads(self) -> int:
        raise NotImplementedError

    def init_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
        """An empty cache (see `empty_cache`), `kv_heads` wide."""
        return empty_cache(self.cfg, self.kv_heads, batch, length)

    def hidden(self, tokens: jax.Array, deterministic: bool, caches: KVCache | None, index: jax.Array | None,
               segment_ids: jax.Array | None,
               positions: jax.Array | None) -> tuple[jax.Array, nn.Embed, KVCache | None]:
        """(the final, normed hidden states (B, T, d_model), the token embedding (the output head
        when tied), the updated caches or None). Runs inside `__call__`'s compact scope. Without
        caches, rows split over a context axis come back in its order (runner.models.attention.context
        .to_context_order of the tokens, positions and segments: integers, where putting the hidden
        states back in order would gather whole rows of them on every device)."""
        raise NotImplementedError

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True,
                 cache: dict[str, jax.Array] | None = None, index: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                 targets: jax.Array | None = None) -> Any:
        """The logits; with `targets` (B, T) instead each token's loss and whether its target is
        the argmax (`output_losses`: what training and evaluation ask for, tiled when
        cfg.loss_tiles says); with `cache`, (logits, updated cache)."""
        check_length(self.cfg, tokens.shape[1])
        caches = None if cache is None else (cache["key"], cache["value"])
        x, embed, new_cache = self.hidden(tokens, deterministic, caches, index, segment_ids, positions)
        if cache is not None:
            return output_logits(self.cfg, x, embed, new_cache, decoding=True)
        if targets is not None:  # the loss in context order, each token's put back: (B, T), not (B, T, d_model)
            losses, correct = output_losses(self.cfg, x, embed, *to_context_order(targets))
            return from_context_order(losses), from_context_order(correct)
        return output_logits(self.cfg, from_context_order(x), embed, new_cache, decoding=False)
