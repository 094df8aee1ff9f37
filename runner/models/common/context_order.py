"""The zig-zag order of a row split over the mesh's "context" axis (runner.models.attention.context): shard
i holds chunks i and 2C-1-i of 2C equal chunks, so every shard has the same causal work. The
families put a row's integers (tokens, positions, segment ids, the loss's targets) into it, and
each token's loss back out of it: reordering hidden states instead would gather whole rows of
them on every device."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

AXIS = "context"


def context_ways() -> int:
    """The size of the current mesh's context axis (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else int(dict(mesh.shape).get(AXIS, 1))


def active(seq_len: int) -> bool:
    """Whether a row of `seq_len` tokens runs context-parallel here: a context axis of 2 or more,
    and 2 x that many equal chunks (shorter or odd rows, an evaluator's or a prompt's, run whole)."""
    ways = context_ways()
    return ways > 1 and seq_len % (2 * ways) == 0


@functools.lru_cache(maxsize=64)
def zigzag_order(seq_len: int, ways: int) -> np.ndarray:
    """The original index of each position in context order: shard i's half of the row is chunk
    i then chunk 2*ways-1-i of 2*ways equal chunks."""
    chunks = np.arange(seq_len).reshape(2 * ways, seq_len // (2 * ways))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * ways - 1 - i]]) for i in range(ways)])


def to_context_order(*arrays: Optional[jax.Array]) -> tuple[Optional[jax.Array], ...]:
    """(B, T, ...) arrays in zig-zag order along T (None stays None); unchanged when not active."""
    seq_len = next(a.shape[1] for a in arrays if a is not None)
    if not active(seq_len):
        return arrays
    order = zigzag_order(seq_len, context_ways())
    return tuple(None if a is None else jnp.take(a, order, axis=1) for a in arrays)


def from_context_order(x: jax.Array) -> jax.Array:
    """Undo `to_context_order` for (B, T, ...) `x`."""
    if not active(x.shape[1]):
        return x
    return jnp.take(x, np.argsort(zigzag_order(x.shape[1], context_ways())), axis=1)
