"""Pipeline parallelism: the layers split into stages over the mesh's "stage" axis, each
micro-batch's rows into microbatches that pass from stage to stage. The schedule is MaxText's
Linen pipeline's (read for it, written here for runner's stacked layers): SPMD, one program on
every device, the stages vmapped with ``spmd_axis_name="stage"``.

The stored layout of the parameters does not change: the scanned layers' leading "layers" axis
(runner.models.common.decoder.stack_blocks) is split over "stage", consecutive layers on each stage, so a
checkpoint restores onto a mesh with or without stages and exports as any other.

Schedules (`Schedule`), S stages, M microbatches:

  gpipe     stage s runs layers [s*L, (s+1)*L) (L = n_layers / S) on each microbatch in turn:
            M + S - 1 iterations of L layers.
  circular  the layers go round the stages R times: layer r*S*L + s*L + j runs on stage s in
            repeat r (L = n_layers / (S*R)): M*R + S - 1 iterations of L layers, so the idle share
            is smaller. The stored consecutive layout moves to this one once a step (one exchange
            over "stage"; its transpose for the gradients). Needs M >= S: a microbatch's next
            repeat starts once its last one has left the last stage.

Each iteration every stage runs its layers on the microbatch it holds, then the activations move
one stage on (a roll over the stage-sharded dimension: XLA's collective permute). The last
stage's outputs are kept for every stage (what follows the layers runs on every stage, and a
circular schedule's first stage takes them back). The bubble, (S - 1) / (M*R + S - 1), is the
share of a stage's iterations spent on nothing: it computes on zeros whose results are dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from runner.errors import ConfigError

AXIS = "stage"  # the mesh axis
STAGES = "stages"  # the logical axis of arrays with one entry per stage (LOGICAL_AXIS_RULES maps it to AXIS)


@dataclass(frozen=True)
class Schedule:
    """`stages` stages, each micro-batch in `microbatches`, the layers round the stages `repeats`
    times (1: gpipe, more: circular)."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def name(self) -> str:
        return "circular" if self.repeats > 1 else "gpipe"

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of each stage's iterations that computes nothing kept."""
        return (self.stages - 1) / self.iterations

    def describe(self, n_layers: int) -> str:
        per = n_layers // (self.stages * self.repeats)
        layers = f"{per} layer{'s' if per != 1 else ''}"
        rounds = f", round them {self.repeats} times" if self.repeats > 1 else ""
        return (f"{self.name}: {self.stages} stages of {layers}{rounds}, {self.microbatches} microbatches, "
                f"{self.iterations} iterations, bubble {self.bubble:.1%} ((S-1)/(M*R+S-1))")


def _mesh_has_stages() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and AXIS in mesh.axis_names


def by_stage(w: jax.Array, schedule: Schedule) -> jax.Array:
    """A stacked weight [n_layers, ...] as [S, R, L, ...]: stage s's layers for repeat r (for gpipe
    a reshape of each stage's own consecutive layers; for circular an exchange over the stages)."""
    s, r = schedule.stages, schedule.repeats
    w = w.reshape(r, s, w.shape[0] // (s * r), *w.shape[1:]).swapaxes(0, 1)
    if _mesh_has_stages():
        w = jax.lax.with_sharding_constraint(w, P(AXIS, None, None, *[P.UNCONSTRAINED] * (w.ndim - 3)))
    return w


def _at(a: jax.Array, i: jax.Array) -> jax.Array:
    """Whether each entry of `a`'s leading axis is entry `i`, broadcastable against `a`."""
    return (jnp.arange(a.shape[0]) == i).reshape(-1, *[1] * (a.ndim - 1))


def _pick(a: jax.Array, i: jax.Array) -> jax.Array:
    """`a[i]` as a masked sum over the leading (microbatch) axis: the same value, and XLA keeps each
    device's rows where they are (a dynamic slice of the buffer had it gather the whole microbatch
    buffer over the batch's devices first, at Llama 3 70B 32 GiB a device)."""
    return jnp.sum(jnp.where(_at(a, i), a, jnp.zeros((), a.dtype)), axis=0)


def _put(a: jax.Array, i: jax.Array, value: jax.Array, keep: jax.Array) -> jax.Array:
    """`a.at[i].set(value)` when `keep`, else `a`, as a masked select (see `_pick`)."""
    return jnp.where(_at(a, i) & keep, value[None], a)


def to_microbatches(a: jax.Array, m: int) -> jax.Array:
    """(B, ...) -> (M, B/M, ...): microbatch k holds rows k, k + M, ..., so each device's share of
    the batch dimension stays on it."""
    return a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)


def from_microbatches(a: jax.Array) -> jax.Array:
    return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _constrain(a: jax.Array, lead: str | None, names: Sequence[str]) -> jax.Array:
    return nn.with_logical_constraint(a, (lead, *names[:a.ndim - 1]))


def by_layer(a: jax.Array) -> jax.Array:
    """`by_stage`'s inverse: [S, R, L, ...] -> [n_layers, ...]."""
    return a.swapaxes(0, 1).reshape(-1, *a.shape[3:])


def run(layer: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]], params: Any, x: jax.Array, shared: Any,
        schedule: Schedule, names: Sequence[str] = ("batch", "length", "embed"), remat: bool = False,
        policy: Callable[..., bool] | None = None) -> tuple[jax.Array, Any]:
    """`x` (B, ...) through every layer of `params` (each leaf stacked [n_layers, ...]) in the
    `schedule`'s order: ``layer(one layer's params, h, shared) -> (h, sums)``, `shared` (each leaf
    (B, ...) or None) cut into microbatches as `x` is. Returns (the output, each layer's `sums`
    added up over the microbatches, stacked [n_layers, ...]). `names`: x's logical axes. With
    `remat` each iteration is rematerialised under `policy` (the model's): with none (full remat)
    the backward pass keeps only each iteration's stage inputs and recomputes its layers' inputs,
    one iteration at a time, instead of keeping every layer's input for every iteration (MaxText's
    remat of its pipeline iterations)."""
    s, m, r = schedule.stages, schedule.microbatches, schedule.repeats
    staged = jax.tree.map(lambda w: by_stage(w, schedule), params)
    micro = _constrain(to_microbatches(x, m), None, names)
    shared_mb = jax.tree.map(lambda a: _constrain(to_microbatches(a, m), None, names), shared)
    stage_ids = jnp.arange(s)

    def stage(w: Any, repeat: jax.Array, h: jax.Array, sh: Any) -> tuple[jax.Array, Any]:
        w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, keepdims=False), w)
        return jax.lax.scan(lambda carry, wl: layer(wl, carry, sh), h, w)

    stages = jax.vmap(stage, spmd_axis_name=AXIS if _mesh_has_stages() else None)
    state = _constrain(jnp.zeros((s, *micro.shape[1:]), x.dtype), STAGES, names)
    first_sh = jax.tree.map(lambda a: jnp.broadcast_to(a[:1], (s, *a.shape[1:])), shared_mb)
    sums_shape = jax.eval_shape(stages, staged, jnp.zeros(s, jnp.int32), state, first_sh)[1]
    sums = jax.tree.map(lambda a: jnp.zeros((s, r, *a.shape[1:]), a.dtype), sums_shape)

    Carry = tuple[jax.Array, jax.Array, Any]  # the stages' inputs, the outputs kept, the sums

    def iteration(carry: Carry, t: jax.Array) -> tuple[Carry, None]:
        state, outputs, sums = carry
        processed = t - stage_ids  # what each stage works on: microbatch processed % M, repeat processed // M
        first = jnp.where(t < m, _pick(micro, t % m), _pick(outputs, t % m))  # stage 0: new, or its next repeat
        state = _constrain(jnp.where((stage_ids == 0).reshape(-1, *[1] * x.ndim), first[None], state), STAGES, names)
        sh = jax.tree.map(lambda a: _constrain(a[processed % m], STAGES, names), shared_mb)
        repeat = jnp.clip(processed // m, 0, r - 1)
        out, got = stages(staged, repeat, state, sh)
        out = _constrain(out, STAGES, names)
        # each stage's sums count for its repeat's layers when it worked on a real microbatch
        kept = jax.nn.one_hot(repeat, r, dtype=jnp.float32) * ((processed >= 0) & (processed < m * r))[:, None]
        sums = jax.tree.map(lambda total, a: total + kept.reshape(s, r, *[1] * (a.ndim - 1)).astype(a.dtype)
                            * a[:, None], sums, got)
        last = processed[-1]
        outputs = _put(outputs, last % m, out[-1], (last >= 0) & (last < m * r))
        return (jnp.roll(out, 1, axis=0), _constrain(outputs, None, names), sums), None

    body = jax.checkpoint(iteration, policy=policy, prevent_cse=False) if remat else iteration
    (_, outputs, sums), _ = jax.lax.scan(body, (state, jnp.zeros_like(micro), sums), jnp.arange(schedule.iterations))
    return from_microbatches(outputs), jax.tree.map(by_layer, sums)


# ----------------------------------------------------------------------------- the spec's pipeline


def resolve(spec: Any, config: Any) -> Any:
    """`config` with the run's pipeline (mesh.stage, the pipeline section; microbatches 0: one per
    stage); unchanged for a family without one."""
    if not hasattr(config, "pipeline_stages"):
        return config
    stages, p = spec.mesh.stage, spec.pipeline
    return dataclasses.replace(config, pipeline_stages=stages, pipeline_microbatches=p.microbatches or stages,
                               pipeline_repeats=p.repeats if stages > 1 else 1)


def _refuse(key: str, value: Any, reason: str, fix: str) -> None:
    raise ConfigError(key, value, reason, fix)


def check(spec: Any, config: Any, context_kind: str = "") -> None:
    """The stages the spec asks for are ones this model runs exactly as on one stage (refused at
    start, with the fix, otherwise). `context_kind`: job.model.context_parallel with auto resolved."""
    stages, model = spec.mesh.stage, spec.job.model
    if stages <= 1:
        return
    key = "mesh.stage"
    if not hasattr(config, "pipeline_stages"):
        _refuse(key, stages, f"the {model.family} family does not run its layers in stages (its config has no "
                "pipeline_stages).", "use mesh.stage=1, or a family with stages (gpt, llama, deepseek).")
    groups = stages * spec.pipeline.repeats
    what = f"mesh.stage={stages} x pipeline.repeats={spec.pipeline.repeats} = {groups}" \
        if spec.pipeline.repeats > 1 else f"mesh.stage={stages}"
    if model.n_layers % groups:
        _refuse(key, stages, f"each stage holds an equal share of the {model.n_layers} layers (job.model.n_layers) "
                f"in every repeat, and {what} does not divide them.",
                f"use stages (times repeats) dividing {model.n_layers}, e.g. mesh.stage="
                f"{max(d for d in range(1, stages + 1) if model.n_layers % (d * spec.pipeline.repeats) == 0)}.")
    first_dense = model.moe.first_dense_layers if model.moe.n_experts else 0
    if first_dense % groups:
        _refuse("job.model.moe.first_dense_layers", first_dense, f"the {first_dense} dense layers and the "
                f"{model.n_layers - first_dense} with experts are two stacks, each run in the stages, and "
                f"{what} does not divide them.",
                f"use first_dense_layers that {groups} divides, or other stages.")
    unsupported = [
        (model.moe.n_experts > 0 and model.moe.dispatch == "capacity", "job.model.moe.dispatch", "capacity",
         "each expert's capacity is a share of the tokens one call routes, and a stage routes one microbatch at a "
         "time: it would drop other tokens than the one-stage run.", "use job.model.moe.dispatch=ragged (dropless), "
         "or mesh.stage=1."),
        (spec.mesh.context > 1 and context_kind == "usp", "job.model.context_parallel", "usp", "usp's ring between "
         "its all-to-all groups has no form inside the stages (JAX cannot batch it over them).",
         "use job.model.context_parallel=allgather, ring or ulysses with stages, or mesh.stage=1."),
        (model.quantization != "none", "job.model.quantization", model.quantization, "Qwix quantizes by the model's "
         "module paths, and the stages apply each layer on its own.", "use mesh.stage=1, or quantization=none."),
        (model.dropout > 0, "job.model.dropout", model.dropout, "the stages would draw each layer's dropout masks "
         "apart from the one-stage run's.", "set job.model.dropout=0, or mesh.stage=1."),
    ]
    for bad, name, value, reason, fix in unsupported:
        if bad:
            _refuse(name, value, f"with mesh.stage={stages}: {reason}", fix)
    check_microbatches(spec)


def check_microbatches(spec: Any, batch_ways: int = 1) -> None:
    """Every micro-batch (and eval batch) cuts into the pipeline's microbatches, each split evenly
    over the `batch_ways` devices the batch is split over; circular needs at least one per stage."""
    stages, p = spec.mesh.stage, spec.pipeline
    count = p.microbatches or stages
    key = "pipeline.microbatches"
    if p.schedule == "circular" and count < stages:
        _refuse(key, count, f"the circular schedule starts a microbatch's next round only after it has left the "
                f"last of the mesh.stage={stages} stages, so it needs at least one microbatch per stage.",
                f"use pipeline.microbatches={stages} or more.")
    micro = spec.train.batch_size // spec.train.accumulate_steps
    for name, rows in (("train.batch_size / train.accumulate_steps", micro), ("eval.batch_size", spec.eval.batch_size)):
        if rows % (count * batch_ways):
            ways = f" of {batch_ways} rows each (the mesh's data x fsdp x expert ways)" if batch_ways > 1 else ""
            _refuse(key, count, f"each batch of {name} = {rows} rows is cut into {count} microbatches{ways}.",
                    f"use a number of microbatches whose multiple of {batch_ways} divides {rows}, or change the "
                    "batch size." if batch_ways > 1 else f"use a divisor of {rows}.")


def describe(config: Any) -> str:
    """The launch's line on the pipeline; empty with one stage."""
    schedule = from_config(config)
    return "" if schedule is None else f"pipeline: {schedule.describe(config.n_layers)}"


def from_config(config: Any) -> Schedule | None:
    """The pipeline the config's layers run in, or None: one stage."""
    stages = getattr(config, "pipeline_stages", 1)
    return Schedule(stages, config.pipeline_microbatches, config.pipeline_repeats) if stages > 1 else None
