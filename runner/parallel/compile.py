"""``mode=compile``: compile the real train step for a topology, without its hardware.

A pod slice is expensive to wait for and to hold, so whether a job fits should be known before
one is requested. For a TPU topology this builds the job's trainer on the *compile-only*
devices that libtpu describes for that slice (``jax.experimental.topologies``), so the mesh,
the state and batch shardings and the jitted step are exactly the ones training would use.
The step is lowered with abstract values (``ShapeDtypeStruct``) and compiled by the TPU
compiler on this machine: no array is ever placed on an accelerator. For ``cpu-N`` and
``auto`` the same happens on the local devices, which keeps the report testable on CPU CI.

The report gives per-device memory from ``compiled.memory_analysis()`` against the chip's HBM,
FLOPs per step from ``compiled.cost_analysis()`` beside the analytic count, and a verdict:
exit 0 when the step fits, ``DOES_NOT_FIT_EXIT_CODE`` when it does not (so it can gate a
launch), and 2 for a usage error such as libtpu not being installed. The last line of stdout
is the same report as one JSON object, for scripts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

from runner.errors import UserError, first_line
from runner.exits import DOES_NOT_FIT_EXIT_CODE
from runner.parallel import roofline
from runner.parallel.hlo import collective_bytes, fused_kernels, host_transfers, quantized_matmuls
from runner.parallel.topology import GiB, Topology, aot_topology_args, parse_topology
from runner.spec import ExecutionSpec

INSTALL_TPU_EXTRA = "bash tools/venv.sh tpu"  # or pip install -e '.[tpu]'


class LibtpuMissing(UserError):
    """A TPU topology needs the TPU compiler, which ships in the libtpu wheel."""


@dataclass(frozen=True)
class MemoryUse:
    """Per-device bytes of one compiled program (XLA's CompiledMemoryStats)."""

    argument: int  # inputs: the train state and the batch
    output: int  # the new state and the metrics
    alias: int  # outputs written in place of donated inputs (the state)
    temp: int  # activations, gradients, optimizer scratch
    generated_code: int
    host: int = 0  # in the host's memory (offloaded activations and optimizer state), not counted in total

    @property
    def total(self) -> int:
        """Peak footprint: donated state is counted once, as MaxText's memory report does."""
        return self.argument + self.output - self.alias + self.temp + self.generated_code


@dataclass
class CompileReport:
    """Everything ``mode=compile`` says; ``to_json`` is the line scripts read."""

    job: str
    topology: str
    devices: int
    device_kind: str
    mesh: dict[str, int]
    batch_size: int
    seq_len: int
    accumulate_steps: int
    parameters: int
    limit_bytes: int | None  # per device
    limit_source: str
    fits: bool
    compile_seconds: float
    sharded_argument_bytes: int = 0  # state + batch on one device, from the shardings alone
    memory: MemoryUse | None = None  # None when the compiler refused (out of memory)
    compiler_error: str | None = None
    required_bytes: int | None = None  # what the compiler said it needed, when it refused
    available_bytes: int | None = None  # what it said it had (usable HBM), when it refused
    flops_per_device: float | None = None  # compiled cost analysis, one device, one step
    flops_loops_counted_once: bool = False  # the program has loops; XLA counts each body once
    analytic_flops: float | None = None  # whole step, all devices (6N + attention)
    peak_flops_per_device: float | None = None
    attention: str = "xla"  # the attention implementation the target runs (job.model.attention)
    advice: str = "pick a larger slice"  # what would make it fit, settings already in force left out
    model_notes: str = ""  # what else the family says about how the model runs (its `describe`, e.g. the experts')
    param_dtype: str = "float32"
    optimizer_state_dtype: str = "float32"
    optimizer_offload: str = "none"  # optimizer.offload: host keeps the state in host memory between steps
    quantization: str = ""  # what runs quantized (job.model.quantization), once the step is traced
    quantized_matmuls: dict[str, int] | None = None  # int8 / fp8 matmul instructions in the compiled step
    format_peak_per_device: float | None = None  # the chip's peak in job.model.quantization's format
    kernels: dict[str, int] | None = None  # fused-kernel calls in the compiled step, by custom-call target
    host_transfers: dict[str, int] | None = None  # copies to and from host memory in the compiled step
    collective_bytes: dict[str, int] | None = None  # per device per step, by kind (`collective_bytes`)
    # what crosses between slices, by kind (multi-slice topologies only): `collective_bytes` with slice_of
    cross_slice_bytes: dict[str, int] | None = None
    # the roofline at the chip's published rates (runner.parallel.roofline.StepEstimate), where it has them
    estimate: dict[str, Any] | None = None

    def to_json(self) -> str:
        data = asdict(self)
        if self.memory is not None:
            data["memory"]["total"] = self.memory.total
        return json.dumps({"report": "compile", **data})

    def _model_lines(self) -> list[str]:
        """What was compiled: the step, the batch, the kernels, the precision."""
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        micro = f"{self.accumulate_steps} micro-batches" if self.accumulate_steps > 1 else "1 micro-batch"
        counts = self.quantized_matmuls
        return [
            f"Compiled the {self.job} train step for {self.topology}: {self.devices} x {self.device_kind},"
            f" mesh {mesh}, in {self.compile_seconds:.1f}s",
            f"  batch {self.batch_size} x {self.seq_len} tokens ({micro}), {self.parameters:,} parameters",
            f"  attention {self.attention}, parameters in {self.param_dtype}, optimizer state in"
            f" {self.optimizer_state_dtype}" + (", kept in host memory between steps (optimizer.offload=host)"
                                                if self.optimizer_offload == "host" else ""),
            *([f"  {self.model_notes}"] if self.model_notes else []),
            *([f"  {self.quantization}"] if self.quantization else []),
            *([f"  compiled step: {counts['int8']} int8 matmuls, {counts['fp8']} fp8 matmuls, of {counts['all']}"]
              if counts is not None else []),
            *(["  compiled step's fused kernels: " + ", ".join(f"{n} x {target}" for target, n in self.kernels.items())]
              if self.kernels else []),
            *(["  collectives per step and device (loop bodies times their trips): "
               + ", ".join(f"{kind} {_size(n)}" for kind, n in sorted(self.collective_bytes.items()))]
              if self.collective_bytes else []),
            *(["  between slices per step and device (collectives spanning slices, and the data-centre network's "
               "sends): "
               + (", ".join(f"{kind} {_size(n)}" for kind, n in sorted(self.cross_slice_bytes.items())) or "none")]
              if self.cross_slice_bytes is not None else []),
        ]

    def _speed_lines(self) -> list[str]:
        """The step's FLOPs, its time at peak, and the roofline's estimate."""
        lines: list[str] = []
        flops = []
        if self.flops_per_device is not None:
            flops.append(f"compiled {self.flops_per_device:.3e} per device"
                         f" ({self.flops_per_device * self.devices:.3e} in all)")
        if self.analytic_flops is not None:
            ratio = ""
            if self.flops_per_device:
                ratio = f", compiled/analytic {self.flops_per_device * self.devices / self.analytic_flops:.2f}"
            flops.append(f"analytic 6N + attention {self.analytic_flops:.3e} in all{ratio}")
        if flops:
            lines.append(f"  FLOPs per step: {'; '.join(flops)}")
        if self.flops_loops_counted_once:
            lines.append("    (XLA's cost analysis counts a loop body once, so scanned layers"
                         " (job.model.scan_layers) and accumulation steps are undercounted in the"
                         " compiled figure; the analytic one is the MFU numerator)")
        per_device = self.analytic_flops / self.devices if self.analytic_flops else self.flops_per_device
        if per_device and self.peak_flops_per_device:
            lines.append(f"  at peak bf16 FLOP/s ({self.peak_flops_per_device:.3g} per device) a step takes at least"
                         f" {1e3 * per_device / self.peak_flops_per_device:.3g} ms")
        if per_device and self.format_peak_per_device:
            lines.append(f"  at the chip's peak in the quantized format ({self.format_peak_per_device:.3g} per device),"
                         f" if every matmul ran in it: {1e3 * per_device / self.format_peak_per_device:.3g} ms")
        if self.estimate is not None:
            lines.append(f"  {roofline.StepEstimate(**self.estimate).line()}")
        return lines

    def text(self) -> str:
        """The human-readable report."""
        lines = [*self._model_lines(), "", "  memory per device"]
        limit = "unknown" if self.limit_bytes is None else _size(self.limit_bytes)
        if self.memory is not None:
            m = self.memory
            rows = [("arguments (state + batch)", m.argument), ("outputs (state + metrics)", m.output),
                    ("donated (counted once)", -m.alias), ("temporaries", m.temp),
                    ("generated code", m.generated_code)]
            lines += [f"  {name:<28}{_size(value):>12}" for name, value in rows]
            share = "" if not self.limit_bytes else f" ({100 * m.total / self.limit_bytes:.1f}%)"
            lines.append(f"  {'total':<28}{_size(m.total):>12}   of {limit} {self.limit_source}{share}")
            moved = self.host_transfers or {}
            if m.host or any(moved.values()):
                counted = (f"{moved.get('to_host', 0)} copies to host and {moved.get('from_host', 0)} back in the "
                           "compiled step (a loop body once)") if any(moved.values()) else \
                    "its copies are not counted on this platform (the counter reads TPU's)"
                lines.append(f"  {'host memory (apart)':<28}{_size(m.host):>12}   {counted}")
        else:
            lines.append(f"  {'arguments (state + batch)':<28}{_size(self.sharded_argument_bytes):>12}"
                         "   from the shardings")
            said = [f"needs {_size(self.required_bytes)}"] if self.required_bytes is not None else []
            if self.available_bytes is not None:
                said.append(f"{_size(self.available_bytes)} usable")
            said.append(f"{limit} {self.limit_source}")
            lines.append("  the attention kernel's block tables do not fit the chip's scalar memory (SMEM):"
                         if kernel_tables_overflow(self.compiler_error or "") else
                         f"  the compiler ran out of device memory ({', '.join(said)}):")
            lines.append(f"    {self.compiler_error}")
        lines += ["", *self._speed_lines()]
        if self.fits:
            lines.append(f"fits: yes, the train step fits on {self.topology} (exit 0)")
        else:
            lines.append(f"fits: NO, the train step does not fit on {self.topology} (exit {DOES_NOT_FIT_EXIT_CODE})."
                         f" {self.advice[0].upper()}{self.advice[1:]}.")
        return "\n".join(lines)


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n} B"


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[list[str]]:
    """Holds back C-level stderr (libtpu's warnings about not running on a TPU VM); the text
    is handed back so it can be shown if the call it wrapped fails."""
    captured: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))


def _libtpu_installed() -> bool:
    if os.path.isfile(os.environ.get("TPU_LIBRARY_PATH", "")):
        return True
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def _prefer_local_cpu(topology: Topology) -> None:
    """Keep JAX's own backend on the CPU (a TPU VM's chips may be training) and, for cpu-N,
    give it N devices; both only work before JAX starts a backend, and an explicit
    JAX_PLATFORMS is left alone."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    if topology.platform == "tpu" and not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    if topology.platform == "cpu":
        jax.config.update("jax_num_cpu_devices", topology.num_devices)


def compile_devices(topology: Topology) -> list[Any]:
    """The devices to compile for: libtpu's compile-only devices for a TPU slice, else the
    local ones (the trainer checks they are the topology that was named)."""
    import jax

    _prefer_local_cpu(topology)
    if topology.platform == "gpu":
        local = jax.devices()
        if not local or local[0].platform not in ("gpu", "cuda", "rocm"):
            raise UserError(
                f"mode=compile for topology={topology.name} needs those GPUs: without the hardware,"
                " ahead-of-time compilation is only available for TPU topologies. Fix: run it on a"
                " machine with the GPUs, or name a TPU slice (e.g. topology=v5p-8), cpu-N or auto."
            )
    if topology.platform != "tpu":
        return list(jax.devices())
    if not _libtpu_installed():
        raise LibtpuMissing(
            f"mode=compile for topology={topology.name} compiles with the TPU compiler, which ships in"
            f" the libtpu wheel, and libtpu is not installed for {sys.executable}. Fix: install runner's"
            f" tpu extra, `{INSTALL_TPU_EXTRA}` in the runner checkout, and run the same command"
            " again; no TPU is needed. (Or use topology=cpu-N or auto to compile for the local devices.)"
        )
    from jax.experimental import topologies

    args = aot_topology_args(topology)
    # Compile-only use needs no chips, so do not take libtpu's one-process-per-machine lock:
    # a training job, or any JAX process that probed for a TPU, may hold it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with _quiet_stderr() as noise:
        try:
            devices = list(topologies.get_topology_desc(**args).devices)
        except Exception as err:  # libtpu's errors are RuntimeError/JaxRuntimeError/ValueError
            failure = err
        else:
            failure = None
    if failure is not None:
        detail = first_line(failure)
        raise UserError(
            f"libtpu could not describe topology={topology.name} (get_topology_desc with {args}): {detail}."
            f" Fix: make sure libtpu is the version runner pins (`{INSTALL_TPU_EXTRA}`); libtpu's log"
            f" said: {' '.join(''.join(noise).split())[:600] or 'nothing'}"
        )
    if len(devices) != topology.num_devices:
        raise UserError(
            f"libtpu describes {topology.name} with {len(devices)} devices, but runner expects"
            f" {topology.num_devices}. Fix: install the libtpu version runner pins, `{INSTALL_TPU_EXTRA}`."
        )
    return devices


def _limit(topology: Topology, devices: Sequence[Any]) -> tuple[int | None, str]:
    """Per-device memory budget and where it comes from."""
    if topology.platform == "tpu" and topology.chip is not None:
        return topology.chip.hbm_bytes_per_device, f"{topology.chip.name} HBM (nominal)"
    try:
        stats = devices[0].memory_stats() or {}
    except Exception:  # CPU devices and some plugins do not implement it
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "device memory (bytes_limit)"
    if topology.chip is not None:
        return topology.chip.hbm_bytes_per_device, f"{topology.chip.name} HBM (nominal)"
    if devices and devices[0].platform == "cpu":
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None, "(host memory unknown)"
        local = sum(1 for d in devices if d.process_index == devices[0].process_index)
        return ram // local, f"host RAM / {local} device{'' if local == 1 else 's'}"
    return None, "(device memory unknown)"


# XLA:TPU's out-of-memory messages: "the total memory required for HLO temporaries (31.58G)
# exceeds available HBM (30.75G)", or "Used 40.5G of 31.25G hbm". Sizes are binary units.
_REQUIRED = re.compile(r"required[^(]*\(([\d.]+)([KMGT])\)|Used ([\d.]+)([KMGT]) of", re.IGNORECASE)
_AVAILABLE = re.compile(r"available[^(]*\(([\d.]+)([KMGT])\)|Used [\d.]+[KMGT] of ([\d.]+)([KMGT])",
                        re.IGNORECASE)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes_in(pattern: re.Pattern[str], message: str) -> int | None:
    m = pattern.search(message)
    if m is None:
        return None
    number, unit = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return int(float(number) * _UNITS[unit.upper()])


def _sharded_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    import jax
    import numpy as np

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def _advice(spec: Any, mesh: dict[str, int]) -> str:
    """The ways to fit a step that does not, leaving out each one already in force: fewer rows per
    device (while a device has more than one; at one, the row split over more devices by context
    parallelism), the state sharded over the devices the data axis holds, full
    rematerialisation, a larger slice."""
    t = spec.train
    rows = t.batch_size // t.accumulate_steps // (mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get("expert", 1))
    ways = []
    if rows > 1:
        ways.append(f"raise train.accumulate_steps or lower train.batch_size ({rows} rows per device now)")
    else:  # the sequence itself is what does not fit
        ways.append(f"split each row over more devices with mesh.context (context parallelism; mesh.context="
                    f"{mesh.get('context', 1)} now)")
    if mesh.get("data", 1) > 1:
        ways.append(f"shard the state over the data axis's devices with mesh.fsdp (mesh.data={mesh['data']} now)")
    if spec.job.model.remat not in ("full", "offload"):
        ways.append(f"use job.model.remat=full ({spec.job.model.remat} now)")
    if spec.optimizer.offload == "none":
        ways.append("keep the optimizer state in host memory between steps with optimizer.offload=host")
    ways.append("pick a larger slice")
    return ", ".join(ways[:-1]) + (", or " if len(ways) > 1 else "") + ways[-1]


def kernel_tables_overflow(message: str) -> bool:
    """Whether XLA's out-of-memory is a Pallas kernel's prefetched tables overflowing the chip's
    scalar memory (splash's block tables grow with the square of the row in blocks), not HBM. XLA
    says it two ways: an allocation in `space=smem`, or "Ran out of memory in memory space smem"."""
    return "space=smem" in message or "memory space smem" in message


def _tables_advice(spec: Any, mesh: dict[str, int]) -> str:
    """What fits a row whose splash tables do not: tables per device's share of the row."""
    kind, seq_len = spec.job.model.context_parallel, spec.train.seq_len
    whole = kind == "ulysses" or mesh.get("context", 1) == 1
    reason = (f"the splash kernel's block tables for whole {seq_len:,}-token rows exceed the chip's scalar memory"
              if whole else f"the splash kernel's block tables for this split of {seq_len:,}-token rows exceed "
              "the chip's scalar memory")
    if whole and mesh.get("context", 1) > 1:
        return (f"{reason}; use job.model.context_parallel=allgather or ring (each device's tables cover its share "
                "of the row), or a shorter train.seq_len")
    if kind == "allgather":
        return (f"{reason}; use job.model.context_parallel=ring (its tables cover one block of the row), split each "
                "row over more devices with mesh.context, or use job.model.attention=xla")
    return f"{reason}; split each row over more devices with mesh.context, or use job.model.attention=xla"


def attention_summary(job: Any) -> str:
    """The attention the step runs: the implementation, how rows split over a context axis are
    attended across it, and why, when context_parallel=auto chose the kind."""
    why = getattr(job, "context_reason", "")
    return _attention(job) + (f"; auto chose it: {why}" if why else "")


def _attention(job: Any) -> str:
    impl, ways = str(getattr(job, "attention", "xla")), int(dict(job.mesh.shape).get("context", 1))
    if ways == 1:
        return impl
    kind = getattr(job.model_config, "context_parallel", "auto")
    kind = "allgather" if kind == "auto" else kind
    if kind in ("ulysses", "usp"):
        return ulysses_summary(job.model_config, impl, dict(job.mesh.shape), kind)
    if impl.startswith("splash") and kind == "ring":
        return f"{impl} kernel per block, key/value blocks passed around mesh.context={ways} (ring)"
    if impl.startswith("splash"):
        return f"{impl} kernel on each shard's rows, keys and values gathered over mesh.context={ways} ({kind})"
    return f"{impl} blocks, rows split over mesh.context={ways} ({kind})"


def ulysses_summary(config: Any, impl: str, shape: dict[str, int], kind: str = "ulysses") -> str:
    """Ulysses (or usp) in words: the kernel on whole rows (or usp's groups and ring), the heads
    each context shard attends, and whether the key/value heads had to be repeated to split."""
    context, tensor = int(shape.get("context", 1)), int(shape.get("tensor", 1))
    ways = config.ulysses_ways if kind == "usp" else context
    heads = config.n_heads
    kv_heads = getattr(config, "n_kv_heads", 0) or heads
    held = [h // tensor if h % tensor == 0 else h for h in (heads, kv_heads)]
    repeated = (f"; key/value heads repeated to one per query head ({held[1]} on a device do not split "
                f"{ways} ways)") if held[1] % ways else ""
    per_device = held[0] // ways
    if kind == "usp":
        return (f"{impl} blocks, rows split over mesh.context={context} (usp): all-to-all within groups of {ways} "
                f"shards, {per_device} head{'s' if per_device != 1 else ''} per device, a ring of "
                f"{context // ways} groups{repeated}")
    return (f"{impl} on whole rows, {per_device} head{'s' if per_device != 1 else ''} per device, heads and "
            f"sequence exchanged by all-to-all over mesh.context={ways} (ulysses){repeated}")


def _model_notes(job: Any) -> str:
    """The family's one-line account of how the model runs on this mesh (empty if it has none), and
    the job's of the tiles of each row's tokens (runner.models.common.tiling) and of the pipeline
    (runner.models.common.pipeline)."""
    describe = getattr(getattr(job, "family", None), "describe", None)
    notes = [describe(job.model_config, dict(job.mesh.shape)) if describe else "",
             job.tiling() if hasattr(job, "tiling") else "",
             job.pipeline_schedule() if hasattr(job, "pipeline_schedule") else ""]
    return "\n  ".join(note for note in notes if note)


def _analytic_flops(job: Any) -> float | None:
    fpt = job.flops_per_token()
    if not fpt:
        return None
    t = job.spec.train
    return fpt * t.batch_size * t.seq_len


def compile_report(spec: ExecutionSpec, job_class: Callable[..., Any],
                   progress: Callable[[str], None] = lambda line: None) -> CompileReport:
    """Build the job (`job_class(spec, devices=...)`, the class job.trainer names) on the
    topology's devices, lower and compile its train step, and size it; `progress` is told each
    stage as it starts (a long row's trace and XLA's compile each take minutes)."""
    import jax

    topology = parse_topology(spec.topology)
    devices = compile_devices(topology)
    job = job_class(spec, devices=devices)
    abstract, job.program.state_sharding = job.program.abstract_state()
    batch = job.program.abstract_batch()
    step = job.program.train_step  # the very function training runs
    limit, limit_source = _limit(topology, devices)
    report = CompileReport(
        job=spec.job.name, topology=topology.name, devices=len(devices),
        device_kind=str(getattr(devices[0], "device_kind", devices[0].platform)),
        mesh={str(k): int(v) for k, v in job.mesh.shape.items()},
        batch_size=spec.train.batch_size, seq_len=spec.train.seq_len,
        accumulate_steps=spec.train.accumulate_steps,
        parameters=sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params)),
        limit_bytes=limit, limit_source=limit_source, fits=False, compile_seconds=0.0,
        sharded_argument_bytes=_sharded_bytes((abstract, batch)),
        analytic_flops=_analytic_flops(job),
        peak_flops_per_device=None if topology.chip is None else topology.chip.peak_bf16_flops_per_device,
        attention=attention_summary(job), param_dtype=spec.job.model.param_dtype,
        model_notes=_model_notes(job), advice=_advice(spec, dict(job.mesh.shape)),
        optimizer_state_dtype=spec.optimizer.state_dtype, optimizer_offload=spec.optimizer.offload,
    )
    start = time.perf_counter()
    progress(f"mode=compile: tracing the train step ({spec.train.batch_size} x {spec.train.seq_len} tokens, "
             f"{len(devices)} devices; attention {report.attention}) ...")
    with job.program.context():
        lowered = step.lower(abstract, batch)
    progress(f"mode=compile: traced in {time.perf_counter() - start:.1f} s; XLA is compiling it for "
             f"{topology.name} ...")
    report.quantization = str(getattr(job, "quantization", ""))  # traced now: the modules are known
    rate = getattr(topology.chip, f"peak_{spec.job.model.quantization}_ops", None) if report.quantization else None
    report.format_peak_per_device = rate / topology.chip.devices_per_chip if rate else None
    try:
        compiled = lowered.compile()
    except Exception as err:
        message = str(err)
        if "RESOURCE_EXHAUSTED" not in message and "out of memory" not in message.lower():
            raise
        report.compile_seconds = time.perf_counter() - start
        report.compiler_error = " ".join(message.split())[:500]
        if kernel_tables_overflow(message):
            report.advice = _tables_advice(spec, dict(job.mesh.shape))
        report.required_bytes = _bytes_in(_REQUIRED, message)
        report.available_bytes = _bytes_in(_AVAILABLE, message)
        return report
    report.compile_seconds = time.perf_counter() - start
    slices = [int(getattr(d, "slice_index", 0)) for d in job.mesh.devices.flat]
    _read_compiled(report, compiled, limit, slices if (topology.num_slices or 1) > 1 else None)
    report.estimate = _estimate(report, compiled, job, topology, slices)
    return report


def _estimate(report: CompileReport, compiled: Any, job: Any, topology: Topology,
              slices: Sequence[int]) -> dict[str, Any] | None:
    """The compiled step's roofline (runner.parallel.roofline), where the chip's rates are published.
    The model config says what it recomputes (job.model.remat, auto resolved as
    runner.models.common.decoder.remat_of does) and its pipeline's bubble (common.pipeline.Schedule)."""
    config = job.model_config
    remat = getattr(config, "remat", "none")
    if remat == "auto":
        remat = "dots" if getattr(config, "scan_layers", False) else "none"
    stages = int(getattr(config, "pipeline_stages", 1))
    bubble = 0.0 if stages <= 1 else \
        (stages - 1) / (config.pipeline_microbatches * config.pipeline_repeats + stages - 1)
    rates = None if topology.chip is None else roofline.Rates.of(topology.chip)
    if rates is None or not report.analytic_flops:
        return None
    devices, text = list(job.mesh.devices.flat), compiled.as_text()
    coords = [tuple(d.coords) if getattr(d, "coords", None) is not None else None for d in devices]
    multi = (topology.num_slices or 1) > 1
    estimate = roofline.estimate_step(
        rates=rates, model_flops=report.analytic_flops, remat=remat, devices=len(devices),
        chips=max(1, len(devices) // topology.chip.devices_per_chip), tokens=report.batch_size * report.seq_len,
        bytes_accessed=roofline.compiled_cost(compiled, "bytes accessed"), loops=roofline.loop_factor(text),
        ici=roofline.ici_seconds(text, rates, coords, slices if multi else None),
        dcn_bytes=float(sum((report.cross_slice_bytes or {}).values())) if multi else 0.0,
        bubble=bubble)
    return asdict(estimate)


def _read_compiled(report: CompileReport, compiled: Any, limit: int | None,
                   slice_of: Sequence[int] | None = None) -> CompileReport:
    """The compiled step's memory, FLOPs, kernels and collectives into `report` (with `slice_of`,
    each device's slice in the program's device order, those that span slices apart), and whether
    it fits `limit`."""
    stats = compiled.memory_analysis()
    if stats is not None:
        report.memory = MemoryUse(
            argument=int(stats.argument_size_in_bytes), output=int(stats.output_size_in_bytes),
            alias=int(stats.alias_size_in_bytes), temp=int(stats.temp_size_in_bytes),
            generated_code=int(stats.generated_code_size_in_bytes),
            host=int(getattr(stats, "host_argument_size_in_bytes", 0) + getattr(stats, "host_output_size_in_bytes", 0)
                     - getattr(stats, "host_alias_size_in_bytes", 0) + getattr(stats, "host_temp_size_in_bytes", 0)))
    report.flops_per_device = roofline.compiled_cost(compiled, "flops")
    text = compiled.as_text()
    if report.quantization:
        report.quantized_matmuls = quantized_matmuls(text)
    report.kernels = fused_kernels(text)
    report.host_transfers = host_transfers(text)
    report.collective_bytes = collective_bytes(text)
    if slice_of is not None:
        report.cross_slice_bytes = collective_bytes(text, slice_of)
    report.flops_loops_counted_once = report.flops_per_device is not None and " while(" in text
    report.fits = report.memory is None or limit is None or report.memory.total <= limit
    return report


def run_compile(spec: ExecutionSpec, job_class: Callable[..., Any]) -> int:
    """mode=compile: print the report and its JSON line; the exit code says whether it fits."""
    report = compile_report(spec, job_class, progress=lambda line: print(line, flush=True))
    print(report.text(), flush=True)
    print(report.to_json(), flush=True)
    return 0 if report.fits else DOES_NOT_FIT_EXIT_CODE
