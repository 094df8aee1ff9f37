"""The pure step functions, and the one place they are compiled with shardings.

`train_step` and `val_step` take a (S, B, T) batch of S micro-batches. Training and mode=compile
both compile `make_train_step`'s function, so what mode=compile measures is what trains.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from runner.data.documents import model_inputs
from runner.models.common.decoder import Decoder
from runner.models.common.layers import LOSSES, MODEL_STATE, REPORTS
from runner.observability import debug
from runner.optim import offload, schedules
from runner.parallel.mesh import microbatch_sharding
from runner.spec import ExecutionSpec
from runner.train.guards import guard_update

Batch = Mapping[str, jax.Array]  # {"x", "y", "mask"} (+ "segment_ids", "positions"), each (S, B, T)
# (state, params, micro-batch, key) -> (summed loss over real targets, number of real targets)
LossFn = Callable[[Any, Any, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, jax.Array]]


def targets_of(state: Any, micro: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The targets for a model that computes its own per-token losses (a `Decoder`: so that it can
    tile its output head, runner.models.common.tiling), else nothing: the model returns logits."""
    return {"targets": micro["y"]} if isinstance(getattr(state.apply_fn, "__self__", None), Decoder) else {}


def per_token(out: Any, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(each token's cross-entropy, whether its target is the argmax) from what the model returned:
    those two already (given targets), or logits."""
    if isinstance(out, tuple):
        return out
    return optax.softmax_cross_entropy_with_integer_labels(out, targets), jnp.argmax(out, -1) == targets


def token_loss(state: Any, params: Any, micro: Mapping[str, jax.Array],
               key: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(sum of per-token cross-entropy over real targets, plus what the model's layers add to the
    loss per token (their LOSSES: an MoE router's balancing terms); number of real targets; what
    the layers report (their REPORTS, reduced over layers), and under MODEL_STATE the model state
    as the layers updated it, when the model has one)."""
    mutable = [LOSSES, REPORTS, *([MODEL_STATE] if state.model_state else [])]
    out, sown = state.apply_fn(state.variables(params), micro["x"], deterministic=False, rngs={"dropout": key},
                               mutable=mutable, **model_inputs(micro), **targets_of(state, micro))
    losses, _ = per_token(out, micro["y"])
    mask = micro["mask"].astype(jnp.float32)
    count = jnp.sum(mask)
    extra = sum((jnp.sum(leaf) for leaf in jax.tree.leaves(sown.get(LOSSES, {}))), jnp.zeros((), jnp.float32))
    reported = reports(sown.get(REPORTS, {}))
    if state.model_state:
        reported[MODEL_STATE] = jax.lax.stop_gradient(sown[MODEL_STATE])
    return jnp.sum(losses * mask) + extra * count, count, reported


def _layer_order(path: Any) -> int:
    """Where a sown leaf's layers come in the model: an unrolled block_i at i; a scanned stack at
    0 (its layers are in order along the leaf)."""
    for p in path:
        key = str(getattr(p, "key", ""))
        if key.startswith("block_") and key[6:].isdigit():
            return int(key[6:])
    return 0


def reports(sown: Any) -> dict[str, jax.Array]:
    """The layers' sown reports by name: the largest over layers for a name ending in _max, the
    smallest for _min, else the mean; a _max or _min name also layer by layer, as `name/i` for
    the i-th layer that reports it."""
    by_name: dict[str, list[tuple[int, jax.Array]]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(sown)[0]:
        name = next(str(p.key) for p in reversed(path) if isinstance(p, jax.tree_util.DictKey))
        by_name.setdefault(name, []).append((_layer_order(path), jnp.ravel(leaf).astype(jnp.float32)))
    out = {}
    for name, values in by_name.items():
        merged = jnp.concatenate([v for _, v in sorted(values, key=lambda item: item[0])])
        if name.endswith(("_max", "_min")):
            out[name] = jnp.max(merged) if name.endswith("_max") else jnp.min(merged)
            out.update({f"{name}/{i}": merged[i] for i in range(merged.shape[0])} if merged.shape[0] > 1 else {})
        else:
            out[name] = jnp.mean(merged)
    return out


def train_step(state: Any, batch: Batch, key: jax.Array, accumulate_steps: int, layer_norms: bool = False,
               loss_fn: LossFn = token_loss) -> tuple[Any, jax.Array, Any]:
    """Gradients over S micro-batches, weighted by target-token count (a padded token counts for
    nothing), then one optimizer step; the model state the layers updated (MODEL_STATE) is the
    mean of their updates over the micro-batches. Returns (state, loss, meta); with `layer_norms`,
    meta also holds per-layer gradient norms."""
    def loss_and_reports(p: Any, micro: Mapping[str, jax.Array], k: jax.Array) -> tuple[jax.Array, Any]:
        loss, count, *rest = loss_fn(state, p, micro, k)  # a job's own loss may report nothing
        return loss, (count, rest[0] if rest else {})

    grad_fn = jax.value_and_grad(loss_and_reports, has_aux=True)
    first = jax.tree.map(lambda a: a[0], batch)
    report_shapes = jax.eval_shape(loss_and_reports, state.params, first, key)[1][1]

    def accumulate(carry, inputs):
        grads, loss_sum, count, reported = carry
        micro, k = inputs
        (micro_loss, (micro_count, micro_reports)), micro_grads = grad_fn(state.params, micro, k)
        grads = jax.tree.map(jnp.add, grads, micro_grads)
        reported = jax.tree.map(jnp.add, reported, micro_reports)
        return (grads, loss_sum + micro_loss, count + micro_count, reported), None

    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), state.params)
    keys = jax.random.split(key, accumulate_steps)
    zero = jnp.zeros((), jnp.float32)
    no_reports = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), report_shapes)
    (grads, loss_sum, count, reported), _ = jax.lax.scan(accumulate, (zeros, zero, zero, no_reports), (batch, keys))
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    new_state = state.apply_gradients(grads=grads)
    reported = jax.tree.map(lambda r: r / accumulate_steps, reported)  # the mean over micro-batches
    if MODEL_STATE in reported:
        new_state = new_state.replace(model_state=reported.pop(MODEL_STATE))
    meta = {"grad_norm": optax.tree.norm(grads), "tokens": count, **reported}
    if layer_norms:
        meta.update(debug.layer_norms(grads, "grad_norm"))
    return new_state, loss_sum / denom, meta


def val_step(state: Any, batch: Batch) -> tuple[jax.Array, jax.Array, Any]:
    """Summed validation loss over S micro-batches: (loss_sum, token_count, {"correct": the number
    of real targets that are the argmax prediction})."""

    def one(carry, micro):
        out = state.apply_fn(state.variables(), micro["x"], deterministic=True, **model_inputs(micro),
                             **targets_of(state, micro))
        losses, right_ones = per_token(out, micro["y"])
        mask = micro["mask"].astype(jnp.float32)
        correct = right_ones.astype(jnp.float32) * mask
        loss_sum, count, right = carry
        return (loss_sum + jnp.sum(losses * mask), count + jnp.sum(mask), right + jnp.sum(correct)), None

    zero = jnp.zeros((), jnp.float32)
    (loss_sum, count, correct), _ = jax.lax.scan(one, (zero, zero, zero), batch)
    return loss_sum, count, {"correct": correct}


def abstract_batch(spec: ExecutionSpec, mesh: jax.sharding.Mesh,
                   example: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """The global (S, B/S, ...) batch the train step takes, as shapes with shardings; the per-row
    shapes and dtypes come from one `example` row of the job's own data pipeline."""
    t = spec.train
    rows = t.batch_size // t.accumulate_steps
    sharding = microbatch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct((t.accumulate_steps, rows, *v.shape), v.dtype, sharding=sharding)
            for k, v in example.items()}


class Bound:
    """The train step (jitted, lowered or compiled) with its last argument bound: the schedule's
    length-dependent values (`runner.optim.schedules.Schedule`). Everyone calls and lowers it as
    (state, batch); the rest is the wrapped object's. The values go to the devices once, replicated
    and weakly typed like the Python numbers they stand for."""

    def __init__(self, inner: Any, values: Mapping[str, int | float], sharding: jax.sharding.Sharding) -> None:
        self.inner, self.values, self.sharding = inner, dict(values), sharding
        self._placed: Any = None

    def __call__(self, state: Any, batch: Batch) -> Any:
        if self._placed is None:
            self._placed = jax.device_put(self.values, self.sharding)
        return self.inner(state, batch, self._placed)

    def lower(self, state: Any, batch: Any) -> "Bound":
        return Bound(self.inner.lower(state, batch, self.values), self.values, self.sharding)

    def compile(self, *args: Any, **kwargs: Any) -> "Bound":
        return Bound(self.inner.compile(*args, **kwargs), self.values, self.sharding)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.inner, name)


def make_train_step(step_fn: Callable[..., tuple[Any, jax.Array, Any]], spec: ExecutionSpec,
                    schedule: optax.Schedule, state_sharding: Any, mesh: jax.sharding.Mesh,
                    optimizer_with: Callable[[optax.Schedule], optax.GradientTransformation] | None = None) -> Bound:
    """The jitted step the loop runs, (state, batch) -> (state, metrics): the step's key is
    fold_in(rng, step), the guard keeps or drops the update, and the metrics stay on the device
    (the loop reads them one step late). The state is donated.

    The schedule's lengths (train.steps, the warmup and what derives from them) are the step's
    arguments, not constants: it builds the optimizer around the schedule reading them
    (`optimizer_with`), so runs that differ only in length, and a finished run extended, share this
    program and its compile-cache entry. The state keeps its own optimizer (nothing is saved)."""
    accumulate, guard, norms = spec.train.accumulate_steps, spec.guard, spec.debug.norms_every > 0
    kept = state_sharding.opt_state  # in host memory with optimizer.offload=host: fetched, updated, stored
    values = schedules.values_of(schedule) if optimizer_with is not None else {}

    def step(state: Any, batch: Batch, lengths: schedules.Values) -> tuple[Any, dict[str, jax.Array]]:
        scheduled, own = schedules.at(schedule, lengths) if values else schedule, state.tx
        if values:
            state = state.replace(tx=optimizer_with(scheduled))
        state = state.replace(opt_state=offload.fetch(state.opt_state, kept))
        key = jax.random.fold_in(state.rng, state.step)
        new_state, loss, meta = step_fn(state, batch, key, accumulate, layer_norms=norms)
        new_state, flags = guard_update(guard, state, new_state, loss, meta["grad_norm"], state.step + 1)
        if norms:
            meta.update(debug.param_and_update_norms(state.params, new_state.params))
        lr = jnp.asarray(scheduled(state.step), jnp.float32)
        return new_state.replace(tx=own, opt_state=offload.store(new_state.opt_state, kept)), {
            "loss": loss, "lr": lr, **meta, **flags}

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    jitted = jax.jit(step, donate_argnums=0, in_shardings=(state_sharding, microbatch_sharding(mesh), replicated),
                     out_shardings=(state_sharding, replicated))
    return Bound(jitted, values, replicated)


def make_val_step(step_fn: Callable[..., Any], state_sharding: Any, mesh: jax.sharding.Mesh) -> Any:
    """The jitted validation step, (state, batch) -> replicated sums."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(step_fn, in_shardings=(state_sharding, microbatch_sharding(mesh)), out_shardings=replicated)
