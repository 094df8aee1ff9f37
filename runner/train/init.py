"""Sharded initialization of any flax module: the body of the seed API's `BaseTrainer.sharded_init`,
kept apart from the trainer because it needs nothing of a run."""

from __future__ import annotations

import functools
from typing import Any, Sequence, Tuple

import flax.linen as nn
import jax

from runner.train.state import init_sharded


def sharded_init(model: Any, key: jax.Array, *args: Any, mesh: jax.sharding.Mesh,
                 rules: Sequence[tuple[str, Any]] = (), **kwargs: Any) -> Tuple[Any, Any]:
    """Initialize parameters sharded across `mesh` from the start: eval_shape gives the
    logical axes without materializing anything, then init is jitted with out_shardings
    so every array is born on its devices. Returns (variables, var_sharding)."""
    init = functools.partial(model.init, **kwargs)
    abstract = jax.eval_shape(init, key, *args)
    sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        variables = init_sharded(lambda k, *a: nn.meta.unbox(init(k, *a)), sharding, key, *args)
    return variables, sharding
