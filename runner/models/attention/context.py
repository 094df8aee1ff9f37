"""Context parallelism: every row's sequence split over the mesh's "context" axis, and attention
across the split (`job.model.context_parallel`).

    allgather  each shard gathers every shard's keys and values and attends for its own queries
               (Llama 3's choice): one all-gather of K/V per layer, then the blocks one at a time.
    ring       the key/value blocks travel around the ring of shards (`ppermute`), each shard
               folding one block at a time into an online softmax: no shard ever holds the whole
               row's keys, and the next block's transfer is issued before this block's compute.
    ulysses    DeepSpeed-Ulysses: an all-to-all over the context axis turns each shard's slice of
               the row (all its heads) into the whole row for 1/C of the heads; attention runs on
               whole rows with the platform's own kernel (splash, cuDNN or XLA, document masks
               included), and an all-to-all turns the heads back into sequence shards: four
               all-to-alls a layer (q, k, v, the output). The heads a shard holds (after
               mesh.tensor) must divide by C. Key/value heads
               that do not (grouped-query models with fewer of them than C) are repeated to one per
               query head first, and the launch says so.
    usp        Unified sequence parallelism: ulysses within groups of `job.model.ulysses_ways`
               consecutive shards, a ring of XLA blocks between the groups (each group's rows for a
               share of the heads travel it): the all-to-alls stay within a group (a host, a
               slice's fast links) while the ring spans the rest.
    auto       allgather.

Layout. A causal row has more work at its end than at its start, so the row is not cut into C
contiguous pieces: it is cut into 2C chunks, and shard i holds chunks i and 2C-1-i (the zig-zag
order), which gives every shard the same causal work. The family's decoder puts the row's tokens,
positions and segment ids into this order before the embedding, and the loss its targets; each
token's loss (or, for logits, the hidden states before the head) comes back in the row's order
(runner.models.common.context_order). Reordering integers keeps every device from gathering whole rows
of hidden states (4,194,304 tokens of Llama 3 8B: 64 GiB of float32 on each device). Attention
masks by each token's place in the original row and its document (segment id): a document that
spans two shards attends within itself only, whatever the order.

Kernels. With `job.model.attention=splash` (or auto on a TPU) and allgather, each shard runs the
splash kernel once for its own queries against the gathered row, with a mask computed inside the
kernel from each query's place in the row (MaxText's load-balanced splash; `_splash_allgather`);
with ring, each block it passes is one splash call, merged by the calls' log-sum-exps, with a
gradient of its own (runner.models.attention.splash_ring). Otherwise the blocks are XLA einsums with a
float32 online softmax (cuDNN takes no such mask). What cannot run is refused by
runner.parallel.mesh.check_context.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from runner.models.attention import splash, splash_ring
from runner.models.common.layers import Q_AXES, fit_spec
from runner.models.common.context_order import (AXIS, active, context_ways, from_context_order, to_context_order,
    zigzag_order)

__all__ = ["AXIS", "active", "context_ways", "from_context_order", "to_context_order", "zigzag_order",
           "context_attention", "choose", "splash_fits", "whole_row_tables_fit", "local_heads"]
SPLASH = ("splash", "splash_interpret")  # the implementations run per shard by the splash kernel
# (q (B, T, n, H), k and v (B, T, k, H), segment_ids (B, T) or None) -> (B, T, n, H): one device, whole rows
WholeRows = Callable[[jax.Array, jax.Array, jax.Array, Optional[jax.Array]], jax.Array]


def splash_fits(kind: str, seq_len: int, ways: int) -> bool:
    """Whether the splash kernel's tiles fit each shard's rows: its whole share of a row
    (allgather), or each half of it (ring's blocks)."""
    return seq_len % (ways * splash.TILE * (2 if kind == "ring" else 1)) == 0


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """(B, Tq, K, G, H) x (B, Tk, K, H) -> float32 (B, K, G, Tq, Tk), scaled."""
    return jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])


def _mask(q_index: jax.Array, k_index: jax.Array, q_seg: Optional[jax.Array],
          k_seg: Optional[jax.Array], window: int = 0) -> jax.Array:
    """(B or 1, 1, 1, Tq, Tk): a key at or before the query in the original row (within its last
    `window` keys: 0, all), of its document."""
    causal = k_index[None, :] <= q_index[:, None]
    if window:
        causal = causal & (q_index[:, None] - k_index[None, :] < window)
    causal = causal[None, None, None]
    if q_seg is None:
        return causal
    return causal & (q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :])


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    b, t, n, h = q.shape
    return q.reshape(b, t, kv_heads, n // kv_heads, h)


def _fold_blocks(q: jax.Array, k: jax.Array, v: jax.Array, seg: Optional[jax.Array], seq_len: int, ways: int,
                 ring: bool, hop: int = 1, window: int = 0) -> jax.Array:
    """One shard's queries against the row's key/value blocks, one block at a time into a running
    softmax (max, denominator, weighted values) in float32: the blocks gathered from every shard
    first (allgather), or passed around the ring of shards, the next transfer issued before this
    block's compute (ring). The running max is kept out of the gradient (any shift gives the same
    result), and the backward pass recomputes each block's scores instead of keeping them. Under
    usp (`hop` > 1) a block is the rows of `hop` consecutive shards (a ulysses group, for this
    shard's share of the heads) and the ring runs between groups, `hop` shards at a time. A
    sliding `window` masks each block by the places of its keys; a block wholly out of reach is
    still computed (its scores all masked)."""
    blocks = ways // hop
    order = jnp.asarray(zigzag_order(seq_len, ways)).reshape(blocks, -1)
    me = jax.lax.axis_index(AXIS) // hop
    qg = _grouped(q, k.shape[2])
    b, t, kh, g, h = qg.shape
    seg_own = seg if seg is not None else jnp.zeros((b, t), jnp.int32)
    perm = [(j, (j + hop) % ways) for j in range(ways)]
    gathered = None if ring else tuple(jax.lax.all_gather(a, AXIS) for a in (k, v, seg_own))  # (C, B, T/C, ...)

    def fold(step: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        out, top, total, *held = carry
        source = (me - step) % blocks
        if ring:
            k_blk, v_blk, s_blk = held
            held = [jax.lax.ppermute(a, AXIS, perm) for a in held]  # issued before the compute
        else:
            k_blk, v_blk, s_blk = (a[source] for a in gathered)
        mask = _mask(order[me], order[source], seg, s_blk if seg is not None else None, window)
        s = jnp.where(mask, _scores(qg, k_blk), -jnp.inf)
        new_top = jax.lax.stop_gradient(jnp.maximum(top, jnp.max(s, axis=-1)))
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        p = jnp.where(mask, jnp.exp(s - shift[..., None]), 0.0)
        scale = jnp.where(jnp.isfinite(top), jnp.exp(top - shift), 0.0)
        total = total * scale + jnp.sum(p, axis=-1)
        out = out * scale[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p, v_blk.astype(jnp.float32))
        return (out, new_top, total, *held)

    start = (jnp.zeros((b, kh, g, t, h), jnp.float32), jnp.full((b, kh, g, t), -jnp.inf, jnp.float32),
             jnp.zeros((b, kh, g, t), jnp.float32), *((k, v, seg_own) if ring else ()))
    out, _, total, *_ = jax.lax.fori_loop(0, blocks, jax.checkpoint(fold), start)
    out = out / total[..., None]  # every query sees itself: total > 0
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype)


def _splash_allgather(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array],
                      q_spec: jax.sharding.PartitionSpec, kv_spec: jax.sharding.PartitionSpec, ways: int,
                      interpret: bool, window: int = 0) -> jax.Array:
    """allgather with the splash kernel: each shard gathers the row's keys and values (and
    segment ids), puts them back in the original order, and runs one kernel call for its own
    queries, whose mask knows each query's place in the row (MaxText's load-balanced splash).
    The kernel's mask tables are split over the context axis with the queries; its gradient is
    the kernel's own."""
    mesh = jax.sharding.get_abstract_mesh()
    seq_len = q.shape[1]
    kernel = splash.zigzag_causal_kernel(q.shape[2] // k.shape[2], zigzag_order(seq_len, ways), ways, interpret,
                                         window)
    kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, AXIS)))
    back = np.argsort(zigzag_order(seq_len, ways))

    def local(kern: object, q: jax.Array, k: jax.Array, v: jax.Array, seg: Optional[jax.Array]) -> jax.Array:
        k, v = (jnp.take(jax.lax.all_gather(a, AXIS, axis=1, tiled=True), back, axis=1) for a in (k, v))
        seg_kv = None if seg is None else jnp.take(jax.lax.all_gather(seg, AXIS, axis=1, tiled=True), back, axis=1)
        return splash.rows(kern, q, k, v, seg, seg_kv)

    P = jax.sharding.PartitionSpec
    if segment_ids is None:
        return jax.shard_map(lambda kern, a, b, c: local(kern, a, b, c, None),
                             in_specs=(kernel_spec, q_spec, kv_spec, kv_spec), out_specs=q_spec,
                             check_vma=False)(kernel, q, k, v)
    return jax.shard_map(local, in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, P(q_spec[0], q_spec[1])),
                         out_specs=q_spec, check_vma=False)(kernel, q, k, v, segment_ids)


def local_heads(heads: int, spec_entry: object, mesh: jax.sharding.AbstractMesh) -> int:
    """How many of `heads` one device holds, its head dimension split as `spec_entry` says."""
    names = () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)
    return heads // math.prod(int(dict(mesh.shape)[n]) for n in names)


def _ulysses(q: jax.Array, k: jax.Array, v: jax.Array, seg: Optional[jax.Array], seq_len: int, ways: int,
             whole_rows: WholeRows) -> jax.Array:
    """One shard's slice of the rows (context order, all its heads) -> by all-to-all the whole
    rows for its 1/ways of the heads, in the original order -> `whole_rows` attention -> back to
    context order -> by all-to-all its own slice with all its heads."""
    order = zigzag_order(seq_len, ways)
    back = np.argsort(order)

    def to_heads(x: jax.Array) -> jax.Array:
        return jnp.take(jax.lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True), back, axis=1)

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    if seg is not None:
        seg = jnp.take(jax.lax.all_gather(seg, AXIS, axis=1, tiled=True), back, axis=1)
    out = jnp.take(whole_rows(q, k, v, seg), order, axis=1)
    return jax.lax.all_to_all(out, AXIS, split_axis=1, concat_axis=2, tiled=True)


def _usp(q: jax.Array, k: jax.Array, v: jax.Array, seg: Optional[jax.Array], seq_len: int, ways: int,
         hop: int, window: int = 0) -> jax.Array:
    """USP: within each group of `hop` consecutive shards an all-to-all gives every shard the
    group's rows for 1/hop of its heads (ulysses); between the groups those rows' key/value blocks
    travel a ring (`_fold_blocks`); an all-to-all in the group returns the output to its shards."""
    groups = [list(range(start, start + hop)) for start in range(0, ways, hop)]

    def exchange(x: jax.Array, split: int, concat: int) -> jax.Array:
        return jax.lax.all_to_all(x, AXIS, split_axis=split, concat_axis=concat, tiled=True, axis_index_groups=groups)

    q, k, v = (exchange(a, 2, 1) for a in (q, k, v))
    if seg is not None:  # the group's rows: its slice of the whole row's (context-order) segment ids
        share = hop * (seq_len // ways)
        seg = jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(seg, AXIS, axis=1, tiled=True),
                                           (jax.lax.axis_index(AXIS) // hop) * share, share, axis=1)
    return exchange(_fold_blocks(q, k, v, seg, seq_len, ways, ring=True, hop=hop, window=window), 1, 2)


def context_attention(kind: str, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array],
                      kv_axes: tuple[str, ...], impl: str = "xla", whole_rows: Optional[WholeRows] = None,
                      ulysses_ways: int = 0, window: int = 0) -> jax.Array:
    """Causal attention of rows in context order (q (B, T, N, H), k/v (B, T, K, H)), split over
    the context axis in shard_map: `allgather` or `ring` (`auto`: allgather), by the splash kernel
    (impl splash, where its tiles fit) or XLA blocks; `ulysses`, whole rows for a share of the
    heads attended by `whole_rows` (the implementation's own function on one device); or `usp`,
    ulysses within groups of `ulysses_ways` shards and a ring of XLA blocks between the groups.
    Batch and heads stay split as their logical axes say. A sliding `window` (keys a query sees,
    itself included; 0: all) masks every kind; ring with a window runs XLA blocks (the splash ring's
    three static block masks assume whole causal blocks), and ulysses passes it to `whole_rows`."""
    mesh = jax.sharding.get_abstract_mesh()
    ways, seq_len = int(dict(mesh.shape)[AXIS]), q.shape[1]
    q_spec, kv_spec = fit_spec(Q_AXES, q.shape, mesh), fit_spec(kv_axes, k.shape, mesh)
    split = {"ulysses": ways, "usp": ulysses_ways}.get(kind, 1)  # the shards a device's heads are split over
    if kind == "usp" and not (1 < split < ways and ways % split == 0):
        raise ValueError(f"usp: ulysses_ways={ulysses_ways} must divide mesh.context={ways} and lie between them "
                         "(runner.models.model_config resolves 0; runner.parallel.mesh.check_context refuses this)")
    if (local_heads(q.shape[2], q_spec[2], mesh) * k.shape[2] != local_heads(k.shape[2], kv_spec[2], mesh) * q.shape[2]
            or local_heads(k.shape[2], kv_spec[2], mesh) % split):
        # kv heads replicated while query heads are split (over a tensor axis of more than one: a
        # size-1 axis splits nothing, and a grouped-query row's kv heads travel as they are), or too
        # few to split over the shards (ulysses, usp): one kv head per query head
        repeat = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        kv_spec = q_spec
    interpret = impl == "splash_interpret"
    kernel = impl in SPLASH and splash_fits(kind, seq_len, ways) and not (window and kind == "ring")
    if split > 1 and (local_heads(q.shape[2], q_spec[2], mesh) % split or ways % split
                      or (kind == "ulysses" and whole_rows is None)):
        raise ValueError(f"{kind}: {q.shape[2]} heads split as {q_spec[2]} do not divide over {split} of "
                         f"{ways} context shards (runner.parallel.mesh.check_context refuses this)")
    if kind == "ulysses":
        local = functools.partial(_ulysses, seq_len=seq_len, ways=ways, whole_rows=whole_rows)
    elif kind == "usp":
        local = functools.partial(_usp, seq_len=seq_len, ways=ways, hop=split, window=window)
    elif kernel and kind != "ring":
        return _splash_allgather(q, k, v, segment_ids, q_spec, kv_spec, ways, interpret=interpret, window=window)
    elif kernel:
        local = functools.partial(splash_ring.attend, ways=ways, interpret=interpret)
    else:
        local = functools.partial(_fold_blocks, seq_len=seq_len, ways=ways, ring=kind == "ring", window=window)
    P = jax.sharding.PartitionSpec
    if segment_ids is None:
        return jax.shard_map(lambda a, b, c: local(a, b, c, None), in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q, k, v)
    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], q_spec[1])), out_specs=q_spec,
                         check_vma=False)(q, k, v, segment_ids)


# Splash's block tables for whole rows (ulysses) are prefetched into the chip's scalar memory:
# measured at 1,048,576 tokens (2,048 x 2,048 blocks of 512) as 8 MiB against 1 MiB (docs/long-context.md),
# 2 bytes a block, so whole rows fit up to 370,688 tokens (724 blocks of 512 a side).
SMEM_BYTES, TABLE_BYTES_PER_BLOCK, TABLE_BLOCK = 1 << 20, 2, 512


def whole_row_tables_fit(seq_len: int) -> bool:
    """Whether splash's tables for whole `seq_len`-token rows fit a TPU's scalar memory."""
    blocks = -(-seq_len // TABLE_BLOCK)
    return blocks * blocks * TABLE_BYTES_PER_BLOCK <= SMEM_BYTES


def choose(platform: str, seq_len: int, ways: int, heads: int, usp_ways: int) -> tuple[str, str]:
    """context_parallel=auto: (the kind, why) for rows of `seq_len` tokens split `ways` ways, on
    `platform`, with `heads` query heads on a device and `usp_ways` the largest usp group that
    splits them (0: none).

    GPU: ulysses, the one kind that attends by cuDNN's fused kernel (on whole rows); else usp;
    else ring. TPU: ulysses while the whole row's splash tables fit scalar memory (MaxText
    measured it 52% MFU against ring's 28.5% at 32K); else ring (the splash kernel per block, and
    no device holds the whole row's keys: 41.6 GiB against allgather's 62.3 at 1M tokens); else
    (tiles that do not fit ring's halves) allgather. CPU: allgather (XLA blocks run every kind
    alike there, measured equal)."""
    splits = heads % ways == 0
    if platform == "gpu":
        if splits:
            return "ulysses", f"on a GPU only ulysses attends by cuDNN's fused kernel (whole rows, {heads} heads " \
                              f"a device over mesh.context={ways})"
        if usp_ways:
            return "usp", f"the {heads} heads a device holds do not split {ways} ways; usp exchanges them in " \
                          f"groups of {usp_ways} and rings the rest"
        return "ring", f"no all-to-all group splits the {heads} heads a device holds; ring holds no whole row's keys"
    if platform == "tpu":
        if splits and whole_row_tables_fit(seq_len):
            return "ulysses", f"{heads} heads a device split over mesh.context={ways}, and splash's tables for " \
                              f"whole {seq_len:,}-token rows fit scalar memory"
        why = (f"splash's tables for whole {seq_len:,}-token rows exceed scalar memory" if splits
               else f"the {heads} heads a device holds do not split {ways} ways")
        if splash_fits("ring", seq_len, ways):
            return "ring", f"{why}; ring runs the splash kernel per block and holds no whole row's keys"
        return "allgather", f"{why}, and ring's half blocks do not fill splash's 128-token tiles"
    return "allgather", "on this platform XLA blocks run every kind alike"
