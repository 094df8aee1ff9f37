"""Accelerator topologies by name (``v4-32``, ``2xv5p-128``, ``v6e-8``, ``cpu-4``, ``auto``).

Parsing is pure: nothing here asks JAX for devices, so a job spec naming hardware this
machine does not have can still be validated, sized and compiled ahead of time
(``mode=compile``). The hardware facts below are the published per-chip numbers; they feed
memory estimates and MFU, so they are deliberately nominal (usable HBM is a little less).

Name rules, as Cloud TPU spells accelerator types:

* ``v2``/``v3``/``v4``/``v5p``/``tpu7x`` count TensorCores: ``v4-32`` is 16 chips. v4 and
  v5p are megacore (JAX sees one device per chip); v2, v3 and tpu7x (Ironwood, two chiplets
  per chip) expose each core as a JAX device.
* ``v5e`` (alias ``v5litepod``) and ``v6e`` count chips: ``v6e-8`` is 8 chips.
* ``Nx<name>`` is N identical slices joined by the data-centre network (multi-slice).
* ``cpu-N``: N (simulated) CPU devices in one process. ``gpu-N`` / ``h100-N`` / ``h200-N`` /
  ``a100-N``: N GPUs, 8 per host beyond 8.
* ``auto``: whatever this process sees; every count is 0, ``chip`` and ``physical_shape``
  are None, and ``check_devices`` accepts anything.

Hosts per slice: v2/v3/v4/v5p/tpu7x hosts hold 4 chips. v5e and v6e slices of up to 8 chips are
single-host (the ``-1t``/``-4t``/``-8t`` machine types of the Cloud TPU v5e/v6e docs);
larger slices are built from 4-chip hosts (``ct5lp-hightpu-4t`` / ``ct6e-standard-4t``),
so ``v5e-16`` is 4 hosts and ``v5e-256`` is 64.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from runner.errors import ConfigError, UserError

GiB = 2**30

Platform = Literal["tpu", "gpu", "cpu", "auto"]


@dataclass(frozen=True)
class Chip:
    """Per-chip hardware facts, so sizing and MFU need no device queries."""

    name: str
    hbm_bytes: int  # per chip
    peak_bf16_flops: float  # per chip, dense FLOP/s
    cores_per_chip: int  # TensorCores (1 for GPUs)
    chips_per_host: int  # in multi-host slices
    devices_per_chip: int  # JAX devices per chip: 2 on v2/v3, 1 on megacore v4/v5p
    name_counts: Literal["cores", "chips"]  # what the N in "<name>-N" counts
    single_host_max_chips: int  # slices up to this many chips fit on one host
    # dense int8 and fp8 matmul rates per chip (job.model.quantization): 0 where the chip has no
    # such matrix units, None where no rate is published
    peak_int8_ops: float | None = None
    peak_fp8_ops: float | None = None
    # Published rates per chip, for the roofline of mode=compile and mode=plan (runner.parallel.roofline):
    # HBM bytes/s; the chip's bidirectional inter-chip bandwidth over all its `ici_ports` (a GPU's NVLink
    # through its switch: one port); and its data-centre network (between slices; a GPU's between hosts).
    # None where no figure is published.
    hbm_bytes_per_s: float | None = None
    ici_bytes_per_s: float | None = None
    ici_ports: int = 1
    dcn_bytes_per_s: float | None = None

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.hbm_bytes // self.devices_per_chip

    @property
    def peak_bf16_flops_per_device(self) -> float:
        return self.peak_bf16_flops / self.devices_per_chip


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v2", 16 * GiB, 45e12, 2, 4, 2, "cores", 4, 0, 0),
        Chip("v3", 32 * GiB, 123e12, 2, 4, 2, "cores", 4, 0, 0),
        # Cloud TPU's system-architecture pages (v4: the JAX scaling book's per-link figures, 6 ports x 90 GB/s)
        Chip("v4", 32 * GiB, 275e12, 2, 4, 1, "cores", 4, 275e12, 0, hbm_bytes_per_s=1.2e12, ici_bytes_per_s=5.4e11,
             ici_ports=6, dcn_bytes_per_s=3.125e9),
        Chip("v5p", 95 * GiB, 459e12, 2, 4, 1, "cores", 4, 918e12, 0, hbm_bytes_per_s=2.765e12,
             ici_bytes_per_s=1.2e12, ici_ports=6, dcn_bytes_per_s=6.25e9),  # DCN 50 Gbps a chip
        Chip("v5e", 16 * GiB, 197e12, 1, 4, 1, "chips", 8, 394e12, 0, hbm_bytes_per_s=8.19e11, ici_bytes_per_s=2e11,
             ici_ports=4, dcn_bytes_per_s=3.125e9),  # ICI 1,600 Gbps; DCN 6.4 Tbps a 256-chip pod
        Chip("v6e", 32 * GiB, 918e12, 1, 4, 1, "chips", 8, 1836e12, 0, hbm_bytes_per_s=1.64e12,
             ici_bytes_per_s=4.48e11, ici_ports=4, dcn_bytes_per_s=1.25e10),  # ICI 3,584 Gbps; DCN 25.6 Tbps a pod
        Chip("tpu7x", 192 * GiB, 2307e12, 2, 4, 2, "cores", 4, None, 4614e12,  # Ironwood
             hbm_bytes_per_s=7.37e12, ici_bytes_per_s=1.2e12, ici_ports=6, dcn_bytes_per_s=1.25e10),
        # NVIDIA's datasheets: NVLink through the NVSwitch (one port), 400 Gb/s InfiniBand a GPU (A100: 200)
        Chip("h100", 80 * GiB, 989e12, 1, 8, 1, "chips", 8, 1979e12, 1979e12, hbm_bytes_per_s=3.35e12,
             ici_bytes_per_s=9e11, dcn_bytes_per_s=5e10),
        Chip("h200", 141 * GiB, 989e12, 1, 8, 1, "chips", 8, 1979e12, 1979e12, hbm_bytes_per_s=4.8e12,
             ici_bytes_per_s=9e11, dcn_bytes_per_s=5e10),
        Chip("a100", 80 * GiB, 312e12, 1, 8, 1, "chips", 8, 624e12, 0, hbm_bytes_per_s=2.039e12,
             ici_bytes_per_s=6e11, dcn_bytes_per_s=2.5e10),
    )
}
_TPU_ALIASES = {"v5litepod": "v5e"}  # canonical names: the Cloud TPU accelerator type
_CANONICAL_PREFIX = {"v5e": "v5litepod"}
_GPU_NAMES = ("gpu", "h100", "h200", "a100")


def _shapes(spec: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in s.split("x")) for s in spec.split())


# Standard slice shapes per generation (Cloud TPU docs; same table as MaxText/xpk).
_SLICE_SHAPES: dict[str, tuple[tuple[int, ...], ...]] = {
    "v2": _shapes("2x2 4x4 8x8 8x16 16x16"),
    "v3": _shapes("2x2 4x4 4x8 8x8 8x16 16x16 16x32 32x32"),
    "v4": _shapes("2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x4x12 4x8x8 8x8x8 8x8x12 8x8x16 8x16x16"),
    "v5p": _shapes(
        "2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x4x12 4x8x8 4x4x20 4x8x12 4x4x28 8x8x8 4x12x12"
        " 4x8x20 4x4x44 8x8x12 4x4x52 4x8x28 4x12x20 8x8x16 4x4x68 8x12x12 4x4x76 8x8x20"
        " 4x12x28 4x8x44 4x4x92 8x12x16 4x20x20 4x8x52 12x12x12 8x8x28 4x4x116 8x12x20"
        " 4x4x124 8x16x16 4x12x44 4x8x68 4x20x28 12x12x16 4x4x148 4x8x76 4x12x52 8x16x20"
        " 4x4x164 8x12x28 4x4x172 8x8x44 12x12x20 4x8x92 4x4x188 12x16x16 4x28x28 8x20x20"
        " 4x12x68 8x8x52 4x4x212 12x12x24 4x20x44 8x16x28 4x12x76 4x8x116 4x4x236 12x16x20"
        " 4x4x244 4x8x124 12x12x28 16x16x16 4x20x52 8x12x44 8x8x68 4x12x92 8x20x28 12x16x24"
        " 4x8x148 12x20x20 8x8x76 4x28x44 8x12x52 16x16x20 12x12x36 4x8x164 12x16x28 4x20x68"
        " 4x8x172 4x12x116 8x16x44 12x20x24 4x28x52 8x8x92 4x12x124 4x8x188 4x20x76 16x16x24"
        " 12x24x24 16x20x28"
    ),
    "v5e": _shapes("1x1 2x2 2x4 4x4 4x8 8x8 8x16 16x16"),
    "v6e": _shapes("1x1 2x2 2x4 4x4 4x8 8x8 8x16 16x16"),
    # Ironwood pods are built of 4x4x4 cubes, as v5p's are; the common shapes.
    "tpu7x": _shapes("2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x8x8 8x8x8 8x8x16 8x16x16 16x16x16 16x16x24"
                     " 16x24x24"),
}


def _by_name_count(chip: Chip) -> dict[int, tuple[int, ...]]:
    """Maps the N of ``<gen>-N`` to the slice's physical chip shape."""
    per = chip.cores_per_chip if chip.name_counts == "cores" else 1
    table: dict[int, tuple[int, ...]] = {}
    for shape in _SLICE_SHAPES[chip.name]:
        n = math.prod(shape) * per
        assert n not in table, f"duplicate {chip.name} slice size {n}"
        table[n] = shape
    return dict(sorted(table.items()))


_NAMED_SLICES = {gen: _by_name_count(CHIPS[gen]) for gen in _SLICE_SHAPES}


@dataclass(frozen=True)
class Topology:
    """What a job runs on; counts are totals over all slices unless named per-slice."""

    name: str  # canonical, e.g. "v4-32", "2xv5p-128", "v5litepod-16", "cpu-4", "auto"
    platform: Platform
    chip: Chip | None  # None for cpu-N, gpu-N and auto
    num_slices: int
    chips_per_slice: int  # 0 for auto
    num_devices: int  # JAX devices, all slices; 0 for auto
    num_hosts: int  # all slices; 0 for auto
    devices_per_host: int  # 0 for auto
    physical_shape: tuple[int, ...] | None  # chip grid of one TPU slice

    @property
    def num_chips(self) -> int:
        return self.num_slices * self.chips_per_slice

    @property
    def devices_per_slice(self) -> int:
        return self.num_devices // self.num_slices

    @property
    def hosts_per_slice(self) -> int:
        return self.num_hosts // self.num_slices

    @property
    def is_auto(self) -> bool:
        return self.platform == "auto"

    @property
    def peak_bf16_flops(self) -> float | None:
        """Whole-topology peak, the MFU denominator; None when the chip is unknown."""
        return None if self.chip is None else self.chip.peak_bf16_flops * self.num_chips


_NAME_RE = re.compile(r"^(?:(?P<slices>\d+)x)?(?P<kind>[a-z][a-z0-9]*)-(?P<count>\d+)$")


def _examples() -> str:
    sizes = ", ".join(
        f"{gen}-{{{', '.join(str(n) for n in list(table)[:6])}{', ...' if len(table) > 6 else ''}}}"
        for gen, table in _NAMED_SLICES.items()
    )
    return (
        f"use a Cloud TPU name ({sizes}; v5litepod-N is the same as v5e-N), optionally with a"
        " slice-count prefix such as 2xv4-32; or cpu-N (N simulated CPU devices), gpu-N,"
        " h100-N, h200-N, a100-N (N GPUs, a multiple of 8 above 8); or auto (use whatever"
        " devices are present)."
    )


def _bad(name: str, problem: str) -> ConfigError:
    return ConfigError("topology", name, problem, _examples())


def parse_topology(name: str) -> Topology:
    """Parses a topology name into counts and shapes, without touching any device."""
    raw = name
    name = str(name).strip().lower()
    if name == "auto":
        return Topology("auto", "auto", None, 1, 0, 0, 0, 0, None)
    m = _NAME_RE.match(name)
    if m is None:
        raise _bad(raw, "it is not of the form <kind>-<count>, [N x]<tpu>-<count> or auto.")
    kind, count = m["kind"], int(m["count"])
    slices = int(m["slices"]) if m["slices"] is not None else 1
    if slices < 1:
        raise _bad(raw, "the slice count before 'x' must be at least 1.")
    if count < 1:
        raise _bad(raw, "the device count must be at least 1.")

    if kind == "cpu" or kind in _GPU_NAMES:
        if m["slices"] is not None:
            raise _bad(raw, "the Nx multi-slice prefix only applies to TPU names.")
        if kind == "cpu":
            return Topology(name, "cpu", None, 1, count, count, 1, count, None)
        if count > 8 and count % 8:
            raise _bad(raw, f"{count} GPUs do not fill 8-GPU hosts.")
        hosts = 1 if count <= 8 else count // 8
        chip = CHIPS.get(kind)
        return Topology(name, "gpu", chip, 1, count, count, hosts, count // hosts, None)

    gen = _TPU_ALIASES.get(kind, kind)
    if gen not in _NAMED_SLICES:
        raise _bad(raw, f"{kind!r} is not a known accelerator.")
    chip, table = CHIPS[gen], _NAMED_SLICES[gen]
    if count not in table:
        counted = "TensorCores (2 per chip)" if chip.name_counts == "cores" else "chips"
        raise _bad(
            raw,
            f"{gen} slices come in {', '.join(map(str, table))} {counted}; {count} is not one of them.",
        )
    shape = table[count]
    chips = math.prod(shape)
    hosts = 1 if chips <= chip.single_host_max_chips else chips // chip.chips_per_host
    devices = chips * chip.devices_per_chip
    canonical = f"{_CANONICAL_PREFIX.get(gen, gen)}-{count}"
    if slices > 1:
        canonical = f"{slices}x{canonical}"
    return Topology(
        canonical, "tpu", chip, slices, chips, devices * slices, hosts * slices, devices // hosts, shape
    )


def _platform_of(device: Any) -> str:
    platform = str(getattr(device, "platform", "unknown")).lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def check_devices(topology: Topology, devices: Sequence[Any]) -> None:
    """Fails early, with a fix, when the named topology is not the hardware that is present.

    ``devices`` is ``jax.devices()``, passed in so this module never initialises a backend.
    """
    if topology.is_auto:
        return
    platforms = sorted({_platform_of(d) for d in devices}) or ["no"]
    hosts = len({getattr(d, "process_index", 0) for d in devices})
    seen_platform = "/".join(platforms)
    if (
        seen_platform == topology.platform
        and len(devices) == topology.num_devices
        and hosts == topology.num_hosts
    ):
        return
    fix = (
        f"To compile for {topology.name} without the hardware, run with mode=compile; to run on"
        " the devices that are here, pass topology=auto (or topology=cpu-N for N simulated CPU"
        " devices)."
    )
    if topology.platform == "cpu" and seen_platform == "cpu":
        fix += (
            f" For cpu-{topology.num_devices}, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={topology.num_devices} (or"
            f" jax.config.update('jax_num_cpu_devices', {topology.num_devices})) before JAX starts."
        )
    raise UserError(
        f"topology={topology.name} expects {_plural(topology.num_devices, topology.platform + ' device')}"
        f" on {_plural(topology.num_hosts, 'host')}, but this process sees"
        f" {_plural(len(devices), seen_platform + ' device')} on {_plural(hosts, 'host')}. {fix}"
    )


def _chips_per_host_bounds(topology: Topology) -> tuple[int, int, int]:
    chips_per_host = topology.chips_per_slice // topology.hosts_per_slice
    return {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}[chips_per_host]


def _wrap(gen: str, shape: tuple[int, ...]) -> tuple[bool, bool, bool] | None:
    """Torus wrap-around links: full 4x4x4 cubes on v4/v5p, full 16-chip rows on v5e/v6e."""
    if gen in ("v4", "v5p", "tpu7x"):
        full = all(d % 4 == 0 for d in shape)
        return (full, full, full)
    if gen in ("v5e", "v6e"):
        return (shape[0] == 16, shape[1] == 16, False)
    return None


_AOT_PREFIX = {"v2": "v2", "v3": "v3", "v4": "v4", "v5p": "v5", "v5e": "v5e", "v6e": "v6e", "tpu7x": "tpu7x"}


def aot_topology_args(topology: Topology) -> dict[str, Any]:
    """Keyword arguments for ``jax.experimental.topologies.get_topology_desc``.

    ``get_topology_desc(**aot_topology_args(t)).devices`` gives compile-only devices for
    ``mode=compile`` (this needs libtpu installed, not TPU hardware). The spelling follows
    MaxText's accelerator table: ``v4:2x2x4``, v5p spelled ``v5:...``, ``v5e:4x4``, ``v6e:2x4``,
    ``tpu7x:2x2x2``. Checked against libtpu 0.0.50.1 for v2, v3, v4, v5p, v5e, v6e and tpu7x,
    single- and multi-slice
    (``tests/parallel/test_compile.py`` keeps it checked): every argument matters there. Without
    ``chip_config_name="megacore"`` a v4/v5p slice has one device per TensorCore (twice too
    many), and without ``chips_per_host_bounds=(2, 4, 1)`` an 8-chip v5e/v6e host becomes two
    hosts.
    """
    if topology.platform != "tpu" or topology.chip is None or topology.physical_shape is None:
        raise ConfigError(
            "topology",
            topology.name,
            "ahead-of-time compilation without the hardware is only available for TPU topologies.",
            "name a TPU slice such as topology=v4-32 or topology=2xv5p-128, or run on the real devices.",
        )
    gen, shape = topology.chip.name, topology.physical_shape
    args: dict[str, Any] = {
        "platform": "tpu",
        "topology_name": f"{_AOT_PREFIX[gen]}:{'x'.join(map(str, shape))}",
        "chip_config_name": "megacore" if gen in ("v4", "v5p") else "default",
        "chips_per_host_bounds": _chips_per_host_bounds(topology),
        "num_slices": topology.num_slices,
    }
    wrap = _wrap(gen, shape)
    if wrap is not None:
        args["wrap"] = wrap
    return args


def check_spec(spec: Any) -> None:
    """The topology section: a name runner knows."""
    parse_topology(spec.topology)
