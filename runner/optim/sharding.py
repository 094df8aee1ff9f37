"""Shardings for an optimizer's state, derived from the state itself.

An optax state is not always a parameter-shaped copy of the parameters: Adafactor's factored
second moments drop an axis of their parameter (and hold a (1,) placeholder where they don't
apply), masked and partitioned optimizers (muon) leave `MaskedNode`s where a parameter is not
theirs, and counters and coefficients are scalars or small vectors that belong to no parameter.
Every optax state that tracks a parameter keeps it under the parameter's own key path (after
its own prefix: ``[0].mu['blocks']['attn']['query']['kernel']``), so a state leaf whose path
ends with a parameter's path is that parameter's, and takes the parameter's sharding restricted
to the axes it keeps; every other leaf is replicated. The result always has the state's own
tree structure and a valid sharding for each leaf's rank, whatever optimizer built it.
(`optax.tree_map_params` finds the same copies, but breaks on masked states.)
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def restricted_spec(leaf_shape: tuple[int, ...], param_shape: tuple[int, ...], spec: P) -> P:
    """The parameter's spec kept for the axes the leaf keeps, matched in order by size.

    A leaf of the parameter's own shape gets its spec unchanged; a factored moment (the
    parameter with an axis removed) keeps the specs of the remaining axes; a leaf whose axes
    can't be matched (a placeholder, a reduced statistic) is replicated. Any match is valid:
    matched axes have the parameter's sizes, which its spec already divides.
    """
    if leaf_shape == param_shape:
        return spec
    entries = tuple(spec) + (None,) * (len(param_shape) - len(spec))
    kept: list[Any] = []
    j = 0
    for size in leaf_shape:
        while j < len(param_shape) and param_shape[j] != size:
            j += 1
        if j == len(param_shape):
            return P()
        kept.append(entries[j])
        j += 1
    return P(*kept)


def opt_state_sharding(opt_state: Any, params: Any, param_sharding: Any, mesh: Mesh) -> Any:
    """A sharding for every leaf of the (abstract) `opt_state` kept for `params`."""
    replicated = NamedSharding(mesh, P())
    by_path = {
        tuple(map(str, path)): (tuple(param.shape), sharding.spec)
        for (path, param), sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                           jax.tree_util.tree_leaves(param_sharding))
    }

    def for_leaf(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        shape = tuple(getattr(leaf, "shape", ()))
        keys = tuple(map(str, path))
        for start in range(len(keys)):
            if keys[start:] in by_path and shape:
                param_shape, spec = by_path[keys[start:]]
                return NamedSharding(mesh, restricted_spec(shape, param_shape, spec))
        return replicated

    return jax.tree_util.tree_map_with_path(for_leaf, opt_state)
