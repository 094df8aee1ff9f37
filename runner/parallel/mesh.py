"""The device mesh: six named axes, sized from config, laid out for the interconnect.

``stage`` splits the layers into pipeline stages (runner.models.common.pipeline; only activations
travel between stages, so it is the axis split across slices when it has more than one way),
``data`` is plain data parallelism (split across slices otherwise, since only gradient
all-reduces should cross the slow data-centre network), ``fsdp`` shards parameters and
optimizer state as well as the batch, ``expert`` shards a mixture of experts' expert weights
(tokens travel to their experts and back, runner.models.common.moe) and splits the batch elsewhere,
``context`` splits every row's sequence (runner.models.attention.context), and ``tensor`` shards within
layers.

Meshes use ``AxisType.Auto`` on every axis. ``jax.make_mesh`` (since JAX 0.10) defaults to
``Explicit`` axes, which changes tracing semantics (shardings become part of array types and
ops can demand explicit resharding), while ``jax.sharding.Mesh`` defaults to ``Auto``. We
want classic GSPMD behaviour driven by ``in_shardings``/``out_shardings`` and
``NamedSharding``, whichever constructor is used, so the type is always passed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from runner.errors import ConfigError, UserError
from runner.parallel.topology import Topology, check_devices, parse_topology

MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the batch dimension is split over all three


def resolve_mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int, expert: int = 1,
                       context: int = 1, stage: int = 1) -> dict[str, int]:
    """Fills in at most one ``-1`` axis and checks the sizes multiply to the device count."""
    shape = {"stage": stage, "data": data, "fsdp": fsdp, "expert": expert, "context": context, "tensor": tensor}
    fix_all = (
        f"give sizes whose product is {num_devices} (the device count), or set one axis to -1 to"
        f" take the remaining devices, e.g. mesh.data=-1 mesh.fsdp=1 mesh.expert=1 mesh.context=1 mesh.tensor=1."
    )
    for axis, size in shape.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise ConfigError("mesh", shape, f"mesh.{axis}={size!r} is not an integer.", fix_all)
        if size == 0 or size < -1:
            raise ConfigError("mesh", shape, f"mesh.{axis}={size} must be >= 1 or -1.", fix_all)
    free = [axis for axis, size in shape.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(
            "mesh", shape, f"{' and '.join(f'mesh.{a}' for a in free)} are both -1; at most one axis may be.",
            f"set all but one of them to a size; {fix_all}",
        )
    fixed = math.prod(size for size in shape.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(
                "mesh", shape,
                f"the fixed axes multiply to {fixed}, which does not divide the {num_devices} devices,"
                f" so mesh.{free[0]}=-1 has no whole size.",
                fix_all,
            )
        shape[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            "mesh", shape, f"the axes multiply to {fixed} but there are {num_devices} devices.", fix_all
        )
    return {axis: int(size) for axis, size in shape.items()}


def _slices(devices: Sequence[Any], num_slices: int) -> list[list[Any]]:
    """Groups devices by slice: ``slice_index`` on TPU, else process, else contiguous chunks.

    The fallbacks let multi-slice meshes be built (and tested) on CPU and GPU devices, which
    carry no ``slice_index``.
    """
    for attr in ("slice_index", "process_index"):
        if all(hasattr(d, attr) for d in devices):
            groups: dict[int, list[Any]] = defaultdict(list)
            for d in devices:
                groups[getattr(d, attr)].append(d)
            if len(groups) == num_slices or attr == "slice_index":
                return [groups[k] for k in sorted(groups)]
    per = len(devices) // num_slices
    return [list(devices[i * per:(i + 1) * per]) for i in range(num_slices)]


def make_mesh(shape: dict[str, int], devices: Sequence[Any] | None = None, num_slices: int = 1) -> Mesh:
    """Builds a topology-aware ``Mesh`` over ``MESH_AXES`` (``stage``, ``expert`` and ``context``
    are 1 when `shape` leaves them out); with slices, ``stage`` spans them when it has more than
    one way (`slice_axis`), else ``data``."""
    shape = {"stage": 1, "expert": 1, "context": 1, **shape}
    if set(shape) != set(MESH_AXES):
        raise ConfigError("mesh", shape, f"the mesh needs exactly the axes {MESH_AXES}.",
                          "give mesh.stage, mesh.data, mesh.fsdp, mesh.expert, mesh.context and mesh.tensor "
                          "(use resolve_mesh_shape).")
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(int(shape[a]) for a in MESH_AXES)
    if math.prod(sizes) != len(devices):
        raise ConfigError("mesh", shape, f"the axes multiply to {math.prod(sizes)} but there are"
                          f" {len(devices)} devices.", "resize the axes (one may be -1 to fill).")
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if num_slices == 1:
        try:
            return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
        except NotImplementedError:  # an axis that is no product of the chips' grid sides: split a side
            grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
            return Mesh(grid, MESH_AXES, axis_types=axis_types)
    check_slices(shape, num_slices)
    across = slice_axis(shape)
    ici = tuple(shape[a] // num_slices if a == across else shape[a] for a in MESH_AXES)
    dcn = tuple(num_slices if a == across else 1 for a in MESH_AXES)
    if all(hasattr(d, "slice_index") for d in devices):
        groups = _slices(devices, num_slices)
        if len(groups) != num_slices:
            raise UserError(
                f"The mesh asks for {num_slices} slices but the devices span {len(groups)}. Fix: name"
                f" the topology you are running on (e.g. topology={len(groups)}x<slice>) or topology=auto."
            )
        try:
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        except NotImplementedError:  # as above, within each slice
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    else:
        # No slice_index (CPU/GPU): build each group's mesh and stack them along the axis that
        # spans slices, which is what create_hybrid_device_mesh does for such a DCN shape.
        groups = _slices(devices, num_slices)
        grid = np.concatenate([mesh_utils.create_device_mesh(ici, g) for g in groups], axis=MESH_AXES.index(across))
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def slice_axis(shape: dict[str, int]) -> str:
    """The axis split across slices: ``stage`` when the layers are split into stages (only
    activations cross between them), else ``data`` (only gradient all-reduces cross)."""
    return "stage" if int(shape.get("stage", 1)) > 1 else "data"


def check_slices(shape: dict[str, int], num_slices: int) -> None:
    """The axis that spans the slices (`slice_axis`) splits evenly over them."""
    across = slice_axis(shape)
    if num_slices < 1 or shape[across] % num_slices:
        raise ConfigError(
            f"mesh.{across}", shape[across],
            f"with {num_slices} slices the {across} axis is split across them, so mesh.{across} must be a"
            " multiple of the slice count.",
            f"set mesh.{across} to a multiple of {num_slices} (the other axes stay inside a slice)"
            + ("." if across == "stage" else ", or split the layers over slices with mesh.stage."),
        )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data and fsdp; everything else replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def microbatch_sharding(mesh: Mesh) -> NamedSharding:
    """For (steps, batch, seq) arrays fed to a gradient-accumulation scan: split the batch."""
    return NamedSharding(mesh, P(None, BATCH_AXES, None))


def mesh_shape(spec: Any, num_devices: int) -> dict[str, int]:
    """The mesh section's sizes for `num_devices` devices (-1 filled in)."""
    m = spec.mesh
    return resolve_mesh_shape(m.data, m.fsdp, m.tensor, num_devices, expert=m.expert, context=m.context,
                              stage=m.stage)


def run_mesh(spec: Any, devices: Sequence[Any] | None = None) -> tuple[Topology, list[Any], Mesh]:
    """The topology spec.topology names, the devices (by default jax.devices()) checked against it
    so a wrong one fails before anything is built, and the run's mesh over them."""
    topology = parse_topology(spec.topology)
    devices = list(jax.devices() if devices is None else devices)
    check_devices(topology, devices)
    mesh = make_mesh(mesh_shape(spec, len(devices)), devices, num_slices=max(topology.num_slices or 1, 1))
    return topology, devices, mesh


def check_context(spec: Any, context: int, tensor: int = 0) -> None:
    """A context axis of `context` shards: rows cut into 2 x that many equal chunks (the zig-zag
    layout, runner.models.attention.context), attended by the splash kernel (each shard's tokens, or with
    ring each half of them, in whole tiles) or by XLA blocks, where cuDNN has no form; ulysses
    attends whole rows with any kernel, its heads split over the axis (`check_ulysses`)."""
    if context <= 1:
        return
    if spec.train.seq_len % (2 * context):
        raise ConfigError("train.seq_len", spec.train.seq_len, f"with mesh.context={context} every row is cut into "
                          f"{2 * context} equal chunks (two per shard, for equal causal work).",
                          f"use a multiple of {2 * context}, or another mesh.context.")
    attention, kind, seq_len = spec.job.model.attention, spec.job.model.context_parallel, spec.train.seq_len
    if kind == "ulysses":
        check_ulysses(spec, context, tensor)
        return
    if kind == "usp":
        usp_ways(spec, context, tensor)
        if attention not in ("auto", "xla"):
            raise ConfigError("job.model.attention", attention, f"under usp (mesh.context={context}) the ring "
                              "between the ulysses groups attends by XLA blocks here.",
                              "use job.model.attention=auto or xla, or context_parallel=ulysses for the "
                              "platform's kernel on whole rows.")
        return
    if attention == "splash":
        ring = kind == "ring"
        tiles = context * 128 * (2 if ring else 1)
        if seq_len % tiles:
            share = (f"ring's blocks are halves of each shard's {seq_len} / {context} tokens" if ring
                     else f"each shard holds {seq_len} / {context} tokens of a row")
            raise ConfigError("train.seq_len", seq_len, f"with mesh.context={context} and "
                              f"job.model.context_parallel={kind}, {share}, and the splash kernel tiles them in "
                              "blocks of 128.", f"use a multiple of {tiles}, or job.model.attention=xla (or auto).")
    if attention not in ("auto", "xla", "splash"):
        raise ConfigError("job.model.attention", attention, f"under context parallelism (mesh.context={context}) "
                          "attention runs as the splash kernel (TPU, allgather) or as XLA blocks across the shards; "
                          f"{attention} has no context-parallel form here.",
                          "use job.model.attention=auto, splash or xla.")


def tensor_ways(spec: Any, tensor: int = 0) -> int:
    """The tensor axis's size: `tensor` where the mesh is resolved, else mesh.tensor as set (1 when
    it is left to fill the devices: the check runs again on the resolved mesh)."""
    return tensor or (spec.mesh.tensor if spec.mesh.tensor > 0 else 1)


def ulysses_heads(spec: Any, tensor: int = 0) -> tuple[int, int]:
    """(query heads, key/value heads) each device holds before ulysses' all-to-all splits them
    over the context axis: the tensor axis splits them first where it divides them."""
    model = spec.job.model
    kv_heads = getattr(model, "n_kv_heads", 0) or model.n_heads
    tensor = tensor_ways(spec, tensor)
    return tuple(h // tensor if h % tensor == 0 else h for h in (model.n_heads, kv_heads))  # type: ignore[return-value]


def check_ulysses(spec: Any, context: int, tensor: int = 0) -> None:
    """Ulysses gives each context shard whole rows for 1/`context` of the heads: the query heads a
    device holds must divide by it (key/value heads that do not are repeated, and the launch's
    attention line says so: runner.parallel.compile.ulysses_summary)."""
    heads, _ = ulysses_heads(spec, tensor)
    if heads % context:
        tensor = tensor_ways(spec, tensor)
        held = (f"each device holds {heads} of the {spec.job.model.n_heads} query heads (job.model.n_heads, "
                f"after mesh.tensor={tensor})" if heads != spec.job.model.n_heads
                else f"there are {heads} query heads (job.model.n_heads)")
        raise ConfigError("job.model.context_parallel", "ulysses", f"ulysses splits every device's heads over "
                          f"mesh.context={context} (whole rows for 1/{context} of them each), and {held}.",
                          f"use a mesh.context that divides {heads}, or job.model.context_parallel=allgather or "
                          "ring (they split the sequence, not the heads).")


def usp_group_sizes(heads: int, context: int) -> list[int]:
    """The all-to-all group sizes usp can take: divisors of `context` strictly between 1 and it that
    divide the `heads` a device holds, smallest first."""
    return [u for u in range(2, context) if context % u == 0 and heads % u == 0]


def usp_ways(spec: Any, context: int, tensor: int = 0) -> int:
    """The shards of each of usp's all-to-all groups: job.model.ulysses_ways, or (0) the largest
    divisor of `context` below it that divides the query heads a device holds. A ConfigError
    when the set value does not divide the context axis or the heads, or none fits."""
    heads, _ = ulysses_heads(spec, tensor)
    fits = usp_group_sizes(heads, context)
    asked = spec.job.model.ulysses_ways
    if asked == 0 and fits:
        return fits[-1]
    if asked in fits:
        return asked
    why = (f"it must divide mesh.context={context}, lie strictly between 1 and it, and divide the {heads} query "
           f"heads a device holds (job.model.n_heads after mesh.tensor={tensor_ways(spec, tensor)})")
    fix = (f"use job.model.ulysses_ways={' or '.join(map(str, fits))}" if fits else
           "use context_parallel=ring or ulysses on this mesh: no group size fits") + " (or 0: the largest that fits)."
    raise ConfigError("job.model.ulysses_ways", asked, f"usp splits mesh.context={context} into all-to-all groups "
                      f"of this many shards and a ring between them; {why}.", fix)


def check_no_context(spec: Any) -> None:
    """mesh.context=1 splits no row: a context-parallel kind or a usp group size named for it would
    change nothing, so it is refused rather than ignored."""
    model = spec.job.model
    if spec.mesh.context != 1 or (model.context_parallel == "auto" and not model.ulysses_ways):
        return
    key, value = (("job.model.ulysses_ways", model.ulysses_ways) if model.ulysses_ways
                  else ("job.model.context_parallel", model.context_parallel))
    raise ConfigError(key, value, "it says how rows split over the mesh's context axis attend, and mesh.context=1 "
                      "splits no row: the run would train as if it were unset.",
                      f"set mesh.context to 2 or more (e.g. mesh.context=4) to split rows, or drop {key}.")


def check_spec(spec: Any) -> None:
    """The mesh against the topology: every micro-batch (and eval batch) splits evenly over the
    data x fsdp x expert ways of the mesh the topology gives, the expert axis divides the
    experts, and the context axis fits the rows (`check_context`)."""
    topology = parse_topology(spec.topology)
    check_no_context(spec)
    check_context(spec, spec.mesh.context)
    experts = spec.job.model.moe.n_experts
    if experts and spec.mesh.expert > 1 and experts % spec.mesh.expert:
        raise ConfigError("mesh.expert", spec.mesh.expert, f"each of its shards holds an equal share of the "
                          f"{experts} experts (job.model.moe.n_experts), so it must divide them.",
                          f"use a divisor of {experts}, e.g. mesh.expert="
                          f"{max(d for d in range(1, spec.mesh.expert + 1) if experts % d == 0)}.")
    if not topology.num_devices:
        return
    t = spec.train
    shape = mesh_shape(spec, topology.num_devices)
    if experts and shape["expert"] > 1 and experts % shape["expert"]:
        raise ConfigError("mesh.expert", shape["expert"], f"on topology {spec.topology} the expert axis takes "
                          f"{shape['expert']} devices, which does not divide the {experts} experts.",
                          "size the other mesh axes so the expert axis divides job.model.moe.n_experts.")
    check_context(spec, shape["context"], shape["tensor"])
    check_slices(shape, topology.num_slices or 1)
    batch_ways = shape["data"] * shape["fsdp"] * shape["expert"]
    micro = t.batch_size // t.accumulate_steps
    if micro % batch_ways:
        raise ConfigError("train.batch_size", t.batch_size,
                          f"each micro-batch ({micro} sequences) must split evenly over the mesh's "
                          f"data x fsdp x expert = {batch_ways} ways on topology {spec.topology}.",
                          f"use a batch size whose micro-batch is a multiple of {batch_ways}.")
    if spec.eval.batch_size % batch_ways:
        raise ConfigError("eval.batch_size", spec.eval.batch_size,
                          f"it must split evenly over the mesh's data x fsdp x expert = {batch_ways} ways.",
                          f"use a multiple of {batch_ways}.")
