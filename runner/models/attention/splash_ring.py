"""Ring attention with the splash kernel per block (`job.model.context_parallel=ring` with
`job.model.attention=splash`): runner.models.attention.context's ring, each block one kernel call.

Forward. The key/value blocks travel around the ring of shards as in the XLA ring (the next
block's transfer issued before this block's compute); each block is one splash call that also
returns its log-sum-exp, and the blocks' outputs are merged by those (the softmax over all the
blocks a query sees).

Backward. The flash-attention backward of one block needs only the *merged* output and
log-sum-exp (each block's probabilities are exp(score - merged log-sum-exp)), so each block's
gradient is splash's own backward kernels run with those; the key/value gradients travel around
the ring with their blocks and go home after the last step (ring-flash-attention's scheme). The
kernel's public gradient cannot do this (it has none for its log-sum-exp), hence a custom VJP
around the whole ring; it calls splash's backward (`_splash_attention_bwd`, the one private name
used: tests/parallel/test_context_parallel.py compares every gradient with one device's, so a jax
that changes it fails there first).

Masks. In the zig-zag layout (shard i holds chunks i and 2C-1-i) every step's mask is static:
    its own block     causal over its two chunks, which keep their order;
    an earlier shard  every query sees the first half of the block's keys (chunk j < i), none of
                      the second (chunk 2C-1-j comes after both of the shard's chunks);
    a later shard     only the second half of the queries (chunk 2C-1-i) sees the block, all of it;
so three kernels serve every shard and step, each block half a kernel's work or less except the
own. Documents are the kernel's segment ids. Each shard's half row must fill the kernel's tiles
(runner.parallel.mesh.check_context).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from runner.models.attention import splash

AXIS = "context"


class Kernels(NamedTuple):
    own: Any  # (L, L) causal
    earlier: Any  # (L, L/2) full: every query, the first half of the keys
    later: Any  # (L/2, L) full: the second half of the queries, every key


def kernels(group: int, shard_len: int, interpret: bool) -> Kernels:
    """The three MQA kernels for `group` query heads per key/value head and `shard_len` tokens
    per shard, residuals (the log-sum-exp) saved. Built while tracing, as splash.causal_kernel."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    half = shard_len // 2
    sizes = splash.block_sizes(splash.splash_block(half))

    def kernel(mask: Callable[[], Any]) -> Any:
        made = sa.make_splash_mqa(sa.MultiHeadMask([mask() for _ in range(group)]), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)
        return type(made)(made.fwd_mask_info, made.dq_mask_info, made.dkv_mask_info,
                          **{**made.kwargs, "save_residuals": True})

    return Kernels(own=kernel(lambda: sa.CausalMask((shard_len, shard_len))),
                   earlier=kernel(lambda: sa.FullMask((shard_len, half))),
                   later=kernel(lambda: sa.FullMask((half, shard_len))))


def _per_head(fn: Callable[..., Any], q_seg: Optional[jax.Array], kv_seg: Optional[jax.Array],
              *arrays: jax.Array) -> Any:
    """fn(segment_ids, *arrays of one row and one key/value head) over the batch (axis 0 of
    arrays and segments) and the key/value heads (axis 1 of arrays)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    def one_row(segs: Optional[tuple[jax.Array, jax.Array]], *row: jax.Array) -> Any:
        ids = None if segs is None else sa.SegmentIds(q=segs[0], kv=segs[1])
        return jax.vmap(lambda *head: fn(ids, *head))(*row)

    if q_seg is None:
        return jax.vmap(lambda *row: one_row(None, *row))(*arrays)
    return jax.vmap(one_row)((q_seg, kv_seg), *arrays)


def _forward_block(kernel: Any, q: jax.Array, k: jax.Array, v: jax.Array, q_seg: Optional[jax.Array],
                   kv_seg: Optional[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """q (B, K, G, Tq, H), k/v (B, K, Tk, H) -> float32 output (B, K, G, Tq, H), log-sum-exp (B, K, G, Tq)."""
    out, (lse,) = _per_head(lambda ids, qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids), q_seg, kv_seg, q, k, v)
    return out.astype(jnp.float32), lse.astype(jnp.float32)


def _backward_block(kernel: Any, q: jax.Array, k: jax.Array, v: jax.Array, q_seg: Optional[jax.Array],
                    kv_seg: Optional[jax.Array], out: jax.Array, lse: jax.Array,
                    d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's float32 (dq, dk, dv) by splash's backward kernels, given the merged output and
    log-sum-exp of the queries."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak

    kw = kernel.kwargs

    def collapse(info: Any) -> Any:  # as sak._splash_attention does before its custom VJP
        blocks = None if info is None else info.partial_mask_blocks
        return info if blocks is None else info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))

    def one(ids: Any, qh: jax.Array, kh: jax.Array, vh: jax.Array, oh: jax.Array, lh: jax.Array,
            dh: jax.Array) -> tuple[jax.Array, ...]:
        res = (qh, kh, vh, ids, None, oh, lh, collapse(kernel.dq_mask_info), collapse(kernel.dkv_mask_info))
        grads = sak._splash_attention_bwd(False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None,
                                          kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"], res, dh)
        return grads[3:6]

    dq, dk, dv = _per_head(one, q_seg, kv_seg, q, k, v, out, lse, d_out)
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def _pad(x: jax.Array, axis: int, before: bool, value: float = 0.0) -> jax.Array:
    """`x` with as many `value`s again along `axis`, before or after it."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (x.shape[axis], 0) if before else (0, x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _halves(seg: Optional[jax.Array], second: bool) -> Optional[jax.Array]:
    """The first or second half of (B, L) segment ids (None stays None)."""
    if seg is None:
        return None
    half = seg.shape[1] // 2
    return seg[:, half:] if second else seg[:, :half]


def _shift(blocks: tuple[Optional[jax.Array], ...], ways: int) -> tuple[Optional[jax.Array], ...]:
    """Each shard's blocks to the next shard of the ring."""
    perm = [(j, (j + 1) % ways) for j in range(ways)]
    return tuple(None if a is None else jax.lax.ppermute(a, AXIS, perm) for a in blocks)


def _forward(ks: Kernels, ways: int, q: jax.Array, k: jax.Array, v: jax.Array,
             seg: Optional[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The merged output (q's dtype) and float32 log-sum-exp of this shard's queries."""
    me, half = jax.lax.axis_index(AXIS), q.shape[3] // 2
    held = _shift((k, v, seg), ways)  # the next block's transfer, issued before the own block's compute
    out, lse = _forward_block(ks.own, q, k, v, seg, seg)

    def step(t: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        out, lse, (k_blk, v_blk, s_blk) = carry
        following = _shift((k_blk, v_blk, s_blk), ways)

        def earlier() -> tuple[jax.Array, jax.Array]:
            return _forward_block(ks.earlier, q, k_blk[:, :, :half], v_blk[:, :, :half], seg, _halves(s_blk, False))

        def later() -> tuple[jax.Array, jax.Array]:
            o, lse = _forward_block(ks.later, q[:, :, :, half:], k_blk, v_blk, _halves(seg, True), s_blk)
            return _pad(o, 3, before=True), _pad(lse, 3, before=True, value=-jnp.inf)

        o_t, lse_t = jax.lax.cond((me - t) % ways < me, earlier, later)
        merged = jnp.logaddexp(lse, lse_t)
        out = out * jnp.exp(lse - merged)[..., None] + o_t * jnp.exp(lse_t - merged)[..., None]
        return out, merged, following

    out, lse, _ = jax.lax.fori_loop(1, ways, step, (out, lse, held))
    return out.astype(q.dtype), lse


def _backward(ks: Kernels, ways: int, res: tuple[Any, ...], d_out: jax.Array) -> tuple[Any, ...]:
    """(dq, dk, dv, None): the own block's gradients, then each other block's as it passes, its
    key/value gradients travelling with it; one more step takes them home."""
    q, k, v, seg, out, lse = res
    me, half = jax.lax.axis_index(AXIS), q.shape[3] // 2
    dq, dk, dv = _backward_block(ks.own, q, k, v, seg, seg, out, lse, d_out)

    def step(t: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        dq, (k_blk, v_blk, s_blk, dk_blk, dv_blk) = carry

        def earlier() -> tuple[jax.Array, ...]:
            dq_t, dk_t, dv_t = _backward_block(ks.earlier, q, k_blk[:, :, :half], v_blk[:, :, :half], seg,
                                               _halves(s_blk, False), out, lse, d_out)
            return dq_t, _pad(dk_t, 2, before=False), _pad(dv_t, 2, before=False)

        def later() -> tuple[jax.Array, ...]:
            dq_t, dk_t, dv_t = _backward_block(ks.later, q[:, :, :, half:], k_blk, v_blk, _halves(seg, True), s_blk,
                                               out[:, :, :, half:], lse[:, :, :, half:], d_out[:, :, :, half:])
            return _pad(dq_t, 3, before=True), dk_t, dv_t

        dq_t, dk_t, dv_t = jax.lax.cond((me - t) % ways < me, earlier, later)
        return dq + dq_t, _shift((k_blk, v_blk, s_blk, dk_blk + dk_t, dv_blk + dv_t), ways)

    dq, (*_, dk, dv) = jax.lax.fori_loop(1, ways, step, (dq, _shift((k, v, seg, dk, dv), ways)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def attend(q: jax.Array, k: jax.Array, v: jax.Array, seg: Optional[jax.Array], ways: int,
           interpret: bool) -> jax.Array:
    """One shard's causal attention in context order (inside shard_map over the context axis):
    q (B, L, N, H), k/v (B, L, K, H), segment ids (B, L) or None -> (B, L, N, H)."""
    batch, shard_len, heads, head_dim = q.shape
    kv_heads = k.shape[2]

    def forward(ks: Kernels, q: jax.Array, k: jax.Array, v: jax.Array,
                seg: Optional[jax.Array]) -> tuple[jax.Array, Any]:
        out, lse = _forward(ks, ways, q, k, v, seg)
        return out, (ks, q, k, v, seg, out, lse)

    def backward(res: tuple[Any, ...], d_out: jax.Array) -> tuple[Any, ...]:
        return (None, *_backward(res[0], ways, res[1:], d_out))

    # the kernels (their mask tables) are arguments, not closed over: they are values of the trace
    ring = jax.custom_vjp(lambda ks, q, k, v, seg: forward(ks, q, k, v, seg)[0])
    ring.defvjp(forward, backward)
    q = (q * (1.0 / math.sqrt(head_dim))).astype(q.dtype)  # the kernel does not scale
    qg = q.reshape(batch, shard_len, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)
    ks = kernels(heads // kv_heads, shard_len, interpret)
    out = ring(ks, qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), seg)  # (B, K, G, L, H)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, shard_len, heads, head_dim)
