"""The TPU splash-attention kernel's common parts: its tile, its block sizes, its masks, and how
one device's rows are fed to an MQA kernel (one key/value head, its group of query heads).

Used by runner.models.attention.kernels (whole rows on each device) and runner.models.attention.context (rows split
over the context axis: each shard's queries against the gathered keys and values, with a mask
that knows the zig-zag order). On a CPU the same kernel runs in Pallas interpret mode: exact but
slow, for tests.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import numpy as np

TILE = 128  # the kernel's smallest block: sequence lengths are multiples of it


def splash_block(seq_len: int) -> int:
    """The kernel's tile: 512 (MaxText's default) or the largest of 256, 128 dividing seq_len."""
    return next(block for block in (512, 256, 128) if seq_len % block == 0)


def block_sizes(block: int) -> Any:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    return sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                         block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)


def causal_kernel(heads: int, seq_len: int, interpret: bool, window: int = 0) -> Any:
    """A causal splash MQA kernel for `heads` query heads sharing one key/value head, each query
    seeing its last `window` keys (0: all earlier keys). Built while tracing (its mask tables
    become constants of the traced function; a cached kernel would leak one trace's arrays into
    the next). The mask is the placed causal mask with every query in its own place: splash's own
    CausalMask is evaluated entry by entry when its tables are built (quadratic: 7 s at 32,768
    tokens, hours at a million)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([_placed_causal_mask()(np.arange(seq_len), window) for _ in range(heads)])
    return sa.make_splash_mqa(mask, block_sizes=block_sizes(splash_block(seq_len)), head_shards=1, q_seq_shards=1,
                              interpret=interpret)


class _UniformBlock(np.ndarray):
    """A mask block of one value: a read-only broadcast of it to the block's shape, whose any() and
    all() answer at once (splash asks them of every block; on a 512 x 512 view numpy would still
    visit each entry)."""

    def any(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return bool(self.flat[0]) if not args and not kwargs and self.size else super().any(*args, **kwargs)

    def all(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return bool(self.flat[0]) if not args and not kwargs and self.size else super().all(*args, **kwargs)


@functools.lru_cache(maxsize=64)
def _uniform_block(value: bool, shape: tuple[int, int]) -> np.ndarray:
    """`value` broadcast to `shape`, read-only, one object per (value, shape)."""
    return np.broadcast_to(np.bool_(value), shape).view(_UniformBlock)


@functools.lru_cache(maxsize=None)
def _placed_causal_mask() -> type:
    """The class of `zigzag_causal_kernel`'s mask, made once: splash caches the processing of a
    mask (minutes at 128k tokens) by equality, which needs one class for every trace."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    class PlacedCausalMask(sa.splash_attention_mask._ComputableMask):
        """Causal by place: query row i is the token at q_positions[i] of the row, keys in order;
        with a `window`, only the last `window` keys up to the query's place."""

        def __init__(self, q_positions: np.ndarray, window: int = 0) -> None:
            seq_len = len(q_positions)
            reach = window or seq_len + 1  # no window: every earlier key is within reach
            super().__init__(shape=(seq_len, seq_len),
                             mask_function=lambda q_ids, kv_ids: (q_ids >= kv_ids) & (q_ids - kv_ids < reach))
            self.q_sequence = np.asarray(q_positions, dtype=np.int32)
            self.window, self._reach = window, reach
            self._bounds: dict[tuple[int, int], tuple[int, int]] = {}

        def __getitem__(self, idx: Any) -> np.ndarray:
            """One block of the mask. Splash builds its tables by asking for every (query block, key
            block) pair and reads only whether a block is empty, full or partial, and a partial
            block's entries: a block whose keys all come after (or all at or before) every query's
            place is answered without evaluating it (`_uniform_block`), so the tables of a
            million-token row cost the diagonal's blocks, not 10^12 entries."""
            q_slice, kv_slice = idx
            q0, q1, kv0, kv1 = q_slice.start, q_slice.stop, kv_slice.start, kv_slice.stop
            if None in (q0, q1, kv0, kv1) or q_slice.step not in (None, 1) or kv_slice.step not in (None, 1):
                return super().__getitem__(idx)
            bounds = self._bounds.get((q0, q1))
            if bounds is None:
                rows = self.q_sequence[q0:q1]
                bounds = self._bounds[(q0, q1)] = (int(rows.min()), int(rows.max())) if rows.size else (0, -1)
            if kv1 - 1 <= bounds[0] and bounds[1] - kv0 < self._reach:  # every key at or before, within reach
                return _uniform_block(True, (q1 - q0, kv1 - kv0))
            if kv0 > bounds[1] or bounds[0] - (kv1 - 1) >= self._reach:  # every key after, or out of reach
                return _uniform_block(False, (q1 - q0, kv1 - kv0))
            return super().__getitem__(idx)

        def __eq__(self, other: object) -> bool:
            return (isinstance(other, PlacedCausalMask) and self.window == other.window
                    and np.array_equal(self.q_sequence, other.q_sequence))

        def __hash__(self) -> int:
            return hash((self.q_sequence.tobytes(), self.window))

    return PlacedCausalMask


def zigzag_causal_kernel(heads: int, q_positions: np.ndarray, shards: int, interpret: bool, window: int = 0) -> Any:
    """A splash MQA kernel whose query rows are the row's tokens in the order `q_positions` gives
    (their places in the original row) and whose keys are the row in its original order: a query
    sees the keys at or before its place. Its mask tables are split over `shards` query shards
    (`manual_sharding_spec`), so each shard of a shard_map gets the rows it holds; the mask is
    computed inside the kernel from the positions, never stored. `window`: as causal_kernel's."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([_placed_causal_mask()(q_positions, window) for _ in range(heads)])
    return sa.make_splash_mqa(mask, block_sizes=block_sizes(splash_block(len(q_positions) // shards)), head_shards=1,
                              q_seq_shards=shards, interpret=interpret)


def rows(kernel: Any, q: jax.Array, k: jax.Array, v: jax.Array, q_segments: Optional[jax.Array],
         kv_segments: Optional[jax.Array]) -> jax.Array:
    """`kernel` over one device's rows: q (B, Tq, N, H), k/v (B, Tk, K, H), N a multiple of K,
    segment ids (B, Tq) and (B, Tk) or None. The kernel does not scale: q is scaled here."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    batch, q_len, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    q = (q * (1.0 / math.sqrt(head_dim))).astype(q.dtype)
    qg = q.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)  # (B, K, G, Tq, H)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, Tk, H)

    def one_row(qr: jax.Array, kr: jax.Array, vr: jax.Array, q_seg: Optional[jax.Array],
                kv_seg: Optional[jax.Array]) -> jax.Array:
        ids = None if q_seg is None else sa.SegmentIds(q=q_seg, kv=kv_seg)
        return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(qr, kr, vr)  # over K

    if q_segments is None:
        out = jax.vmap(lambda a, b, c: one_row(a, b, c, None, None))(qg, kt, vt)
    else:
        out = jax.vmap(one_row)(qg, kt, vt, q_segments, kv_segments)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, heads, head_dim)
