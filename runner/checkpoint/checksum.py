"""Checksums of a train state, computed on the devices where it lives, so that a restore can
tell the arrays it read from the arrays that were saved.

Orbax's zarr3 layout checksums only each shard file's index, not the data: a flipped bit in a
parameter chunk restores without complaint. So every save records, in its meta, one 32-bit
checksum per array, and a restore recomputes them on what it read (runner.checkpoint.checkpointer).

The checksum of an array is sum(word_i * (2*i + 1)) mod 2**32 over its elements' bit patterns
(`word_i`, the element widened to 32 bits) at flat position i. Integer sums wrap, so the value is
the same however the array is sharded or the sum is ordered; the odd weights change the checksum
for every single flipped bit (2**k times an odd number is never 0 mod 2**32) and for most
reorderings. One pass over the state, like one optimizer update.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _words(x: jax.Array) -> jax.Array:
    """The bit patterns of `x`, one uint32 per element (64-bit values: both halves folded)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size == 8:
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)  # shape (..., 2)
        return halves[..., 0] ^ (halves[..., 1] * jnp.uint32(0x9E3779B1))
    return jax.lax.bitcast_convert_type(x, _WIDTH[size]).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    words = _words(x).reshape(-1)
    weights = jnp.arange(words.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32)


@jax.jit
def _all(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_checksum(x) for x in leaves]


@jax.jit
def _from_host(x: jax.Array) -> jax.Array:
    return _checksum(jax.device_put(x, jax.memory.Space.Device))


def _in_host_memory(x: jax.Array) -> bool:
    return getattr(x.sharding, "memory_kind", None) == "pinned_host"


def checksums(tree: Any) -> dict[str, int]:
    """{path: checksum} for every array of `tree` (every process gets the same values). An array
    kept in host memory (optimizer.offload=host) is copied to the device one at a time, so a save
    never holds the whole offloaded state on the device."""
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = [jnp.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf for _, leaf in paths_and_leaves]
    on_device = _all([x for x in leaves if not _in_host_memory(x)])[::-1]
    values = jax.device_get([_from_host(x) if _in_host_memory(x) else on_device.pop() for x in leaves])
    return {jax.tree_util.keystr(path): int(np.asarray(v)) for (path, _), v in zip(paths_and_leaves, values)}


class ChecksumMismatch(ValueError):
    """Restored arrays differ from what was saved (a damaged file)."""


def verify(tree: Any, expected: Mapping[str, int] | None) -> None:
    """Raise ChecksumMismatch naming the arrays whose checksums differ from `expected` (a save's
    record); nothing to compare (a checkpoint from before checksums) passes."""
    if not expected:
        return
    found = checksums(tree)
    wrong = sorted(k for k in expected if k in found and found[k] != int(expected[k]))
    if wrong:
        raise ChecksumMismatch(f"checksum mismatch in {len(wrong)} array(s): {', '.join(wrong[:4])}"
                               f"{' ...' if len(wrong) > 4 else ''}")
