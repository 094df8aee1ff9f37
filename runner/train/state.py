"""The train state: what it holds, its shapes and shardings computed without a device, and the one
path that creates it directly on its devices.

Parameters are sharded by their logical axis names; the optimizer state by what each of its
leaves is (runner.optim.sharding); the step, the PRNG key and the guard's statistics are
replicated.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from runner.models.common.layers import MODEL_STATE
from runner.optim.offload import on_host
from runner.optim.sharding import opt_state_sharding
from runner.train.guards import initial_guard_state


class TrainState(train_state.TrainState):
    """Flax's TrainState plus the base PRNG key (the key for step s is fold_in(rng, s)), the
    numerical guard's rolling statistics and the model's untrained state (MODEL_STATE: an MoE
    router's selection bias; {} for most models), so all are checkpointed and resume exactly."""

    rng: jax.Array
    guard: Any = None
    model_state: Any = None

    def variables(self, params: Any = None) -> dict[str, Any]:
        """What the model is applied to: the parameters (these, or the state's) and its state."""
        out = {"params": self.params if params is None else params}
        if self.model_state:
            out[MODEL_STATE] = self.model_state
        return out


def create_state(model: Any, tx: optax.GradientTransformation, key: jax.Array, init_args: Sequence[Any],
                 guard_window: int = 128) -> TrainState:
    """A fresh state. The parameters are unboxed before the optimizer sees them, so its state
    carries no stale partition metadata (`abstract_state` derives its shardings)."""
    init_key, _ = jax.random.split(key)
    variables = nn.meta.unbox(model.init(init_key, *init_args))
    return state_around(model, tx, key, variables["params"], variables.get(MODEL_STATE, {}), guard_window)


def state_around(model: Any, tx: optax.GradientTransformation, key: jax.Array, params: Any,
                 model_state: Any = None, guard_window: int = 128) -> TrainState:
    """The fresh state `create_state` builds around these parameters (and model state), with an
    empty spike window of `guard_window` steps (guard.spike_window). With the parameters' shapes
    known already, `jax.eval_shape` of this gives the state's shapes without tracing the model again
    (about a second of every launch for gpt_10m)."""
    _, rng = jax.random.split(key)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=rng,
                              guard=initial_guard_state(guard_window), model_state=model_state or {})
    # An int32 array, as a restored step is (not the weakly typed 0 `create` gives): a fresh launch and
    # a resumed or extended one then compile the same train step and share its compile-cache entry.
    return state.replace(step=jnp.asarray(state.step, jnp.int32))


def abstract_variables(model: Any, key: jax.Array, init_args: Sequence[Any]) -> Any:
    """The model's variables as shapes, still boxed with their logical axis names."""
    return jax.eval_shape(model.init, jax.random.split(key)[0], *init_args)


def abstract_state(create: Callable[..., TrainState], args: Sequence[Any], param_specs: Any,
                   mesh: jax.sharding.Mesh, rules: Sequence[tuple[str, Any]],
                   offload: bool = False) -> tuple[TrainState, Any]:
    """(abstract state, its shardings), computed without touching a device. `create(*args)` makes
    the state; `param_specs` are the parameters' logical partition specs; with `offload`, the
    optimizer state's shardings are in the host's memory (optimizer.offload=host)."""
    abstract = jax.eval_shape(create, *args)
    params = nn.logical_to_mesh_sharding(param_specs, mesh, rules)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_state = opt_state_sharding(abstract.opt_state, abstract.params, params, mesh)
    sharding = jax.tree.map(lambda _: replicated, abstract).replace(
        params=params, opt_state=on_host(opt_state) if offload else opt_state)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sharding)
    return abstract, sharding


def init_sharded(create: Callable[..., Any], sharding: Any, *args: Any) -> Any:
    """`create(*args)` jitted with `sharding` as its output shardings: every array is born on its
    devices, none is ever whole on one. The one path both the train state and `sharded_init` use."""
    return jax.jit(create, out_shardings=sharding)(*args)


def state_tree(state: TrainState) -> dict[str, Any]:
    """What a checkpoint holds of a state (the functions and the optimizer are rebuilt)."""
    tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng,
            "guard": state.guard}
    if getattr(state, "model_state", None):  # absent for a model without one: its checkpoints stay as they were
        tree["model_state"] = state.model_state
    return tree


def model_shapes(params: Any) -> dict[str, list[int]]:
    """Parameter path -> shape, saved with every checkpoint to refuse resuming another model."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in flat}


def param_count(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
