"""A lost host's shards of a local checkpoint, rebuilt from the copies other hosts hold.

A replaced host (a new machine, its local disk empty) holds none of a local checkpoint's shards.
When the mesh keeps a copy of each of its shards on a device of another process (the data axis
across hosts: every data-parallel replica holds the whole state, sharded the same way over fsdp,
expert and tensor), those copies are the step. The processes that hold the step read their
shards; the others fill theirs with zeros; then one collective per array gives every device the
bit pattern of a holder's copy (the maximum over the replica axes of the holders' bits against
zeros, exact for every dtype). Orbax's emergency manager does the same between slices by
broadcasting over the replica axis; this works over whichever axes the mesh replicates an array
on. The caller checks the result against the checksums recorded at save time, so a rebuilt
state is as trusted as a read one.
"""

from __future__ import annotations

from typing import Any, Collection

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[Any, Any, Any], ...]:
    return tuple((s.start, s.stop, s.step) for s in index)


def unreplicated(tree: Any, holders: Collection[int]) -> list[str]:
    """The paths of `tree`'s arrays (ShapeDtypeStructs or arrays, with shardings) that have a
    shard no device in `holders` (device ids) holds: the arrays the holders cannot rebuild.
    Empty when every shard has a copy on a holder."""
    missing = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            missing.append(jax.tree_util.keystr(path))
            continue
        indices = sharding.devices_indices_map(tuple(leaf.shape))
        held = {_index_key(index) for device, index in indices.items() if device.id in holders}
        if any(_index_key(index) not in held for index in indices.values()):
            missing.append(jax.tree_util.keystr(path))
    return missing


def zeros(tree: Any) -> Any:
    """Arrays of zeros shaped and sharded like `tree`'s ShapeDtypeStructs: a process's shards
    when it holds none of a step."""
    def zero(leaf: Any) -> jax.Array:
        dtype = leaf.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError("typed PRNG keys are not rebuilt from replicas")
        return jax.make_array_from_callback(tuple(leaf.shape), leaf.sharding,
                                            lambda index: np.zeros(_shard_shape(leaf.shape, index), dtype))
    return jax.tree.map(zero, tree)


def _shard_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def _flags(mesh: Any, holders: Collection[int]) -> jax.Array:
    """One flag per device of `mesh` (whether it holds the step), sharded one per device."""
    sharding = NamedSharding(mesh, P(*mesh.axis_names))
    block = (1,) * len(mesh.axis_names)
    return jax.make_array_from_single_device_arrays(
        tuple(mesh.devices.shape), sharding,
        [jax.device_put(np.full(block, device.id in holders, np.uint32), device)
         for device in mesh.devices.flat if device.process_index == jax.process_index()])


def _bits(x: jax.Array) -> jax.Array:
    """x's bit patterns as uint32 (64-bit elements as two words), and back with `_unbits`."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]).astype(jnp.uint32)


def _unbits(bits: jax.Array, dtype: Any) -> jax.Array:
    if dtype == jnp.bool_:
        return bits.astype(jnp.bool_)
    width = jnp.dtype(dtype).itemsize
    if width == 8:
        return jax.lax.bitcast_convert_type(bits, dtype)
    return jax.lax.bitcast_convert_type(bits.astype({1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]), dtype)


def _from_holders(x: jax.Array, flags: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Every shard of `x` replaced by a holder's copy of it (a collective over the replica axes)."""
    mesh, spec = sharding.mesh, sharding.spec
    used = {axis for part in spec if part is not None for axis in ((part,) if isinstance(part, str) else part)}
    replica_axes = tuple(axis for axis in mesh.axis_names if axis not in used)

    def body(block: jax.Array, flag: jax.Array) -> jax.Array:
        bits = jnp.where(flag.reshape(()) != 0, _bits(block), jnp.uint32(0))
        if replica_axes:
            bits = jax.lax.pmax(bits, replica_axes)
        return _unbits(bits, block.dtype)

    in_host = sharding.memory_kind == "pinned_host"  # optimizer.offload=host: rebuilt on the device, kept on the host
    x = jax.device_put(x, sharding.with_memory_kind("device")) if in_host else x
    out = jax.shard_map(body, mesh=mesh, in_specs=(spec, P(*mesh.axis_names)), out_specs=spec)(x, flags)
    return jax.device_put(out, sharding) if in_host else out


def rebuild(tree: Any, holders: Collection[int]) -> Any:
    """`tree` (arrays; the shards on devices not in `holders` are ignored) with every shard taken
    from a holder's copy. Collective: every process calls it. The caller has checked
    `unreplicated(tree, holders)` is empty."""
    leaves, treedef = jax.tree.flatten(tree)
    meshes = {id(leaf.sharding.mesh): leaf.sharding.mesh for leaf in leaves}
    flags = {key: _flags(mesh, holders) for key, mesh in meshes.items()}
    shardings = [leaf.sharding for leaf in leaves]
    step = jax.jit(lambda xs, fs: [_from_holders(x, f, s) for x, f, s in zip(xs, fs, shardings)],
                   out_shardings=shardings)
    return jax.tree.unflatten(treedef, step(leaves, [flags[id(leaf.sharding.mesh)] for leaf in leaves]))
