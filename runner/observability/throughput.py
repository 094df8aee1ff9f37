"""Model FLOPs utilisation: tokens/s per device, TFLOP/s per device and MFU on every logged step.

    tokens_per_s_per_device  tokens/s over the whole mesh / number of devices
    tflops_per_device        tokens_per_s_per_device x the model's training FLOPs per token / 1e12
    mfu                      tflops_per_device / the device's peak (bfloat16's, whatever the run's format)
    mfu_int8, mfu_fp8        a quantized run (job.model.quantization): against the chip's peak in that format

FLOPs per token are the model family's (`flops_per_token`: 6 x the matmul weights plus attention
over the full, not causally halved, score matrix, as PaLM's appendix counts; biases, norms and
softmax ignored). The peak is the chip's published dense bfloat16 FLOP/s (runner.parallel.topology.CHIPS),
from the topology name or, for topology=auto, from the device kind JAX reports; on a CPU, which
has no published peak, it is a float32 matmul measured on the whole host and divided among its
devices (`measure_cpu_peak`), once per machine: the figure is kept in the cache directory, keyed
by the CPU, its core count and the JAX version (delete `cpu_peak.json` there to measure again).
Everything is computed on the host from the step time the progress line already measures: no
added device sync.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from runner.checkpoint.files import atomic_write_json
from runner.checkpoint.storage import cache_root
from runner.parallel.topology import CHIPS, Chip, Topology

PEAK_FILE = "cpu_peak.json"

# Substrings of jax's device_kind -> chip (first match wins; "v5 lite" before "v5").
_DEVICE_KINDS = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6 lite", "v6e"), ("v6e", "v6e"), ("v5p", "v5p"),
                 ("v5", "v5p"), ("v4", "v4"), ("v3", "v3"), ("v2", "v2"), ("7x", "tpu7x"), ("ironwood", "tpu7x"),
                 ("h100", "h100"), ("h200", "h200"), ("a100", "a100"))


def chip_of(device: Any) -> Optional[Chip]:
    """The chip a JAX device is, from its device_kind ("TPU v4", "NVIDIA H100 80GB HBM3"), if known."""
    kind = str(getattr(device, "device_kind", "")).lower()
    for part, name in _DEVICE_KINDS:
        if part in kind:
            return CHIPS[name]
    return None


def measure_cpu_peak(device: Any, size: int = 1024, repeats: int = 4) -> float:
    """FLOP/s of a float32 (size x size) matmul on `device`, best of `repeats` (about 0.1 s)."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def cpu_peak(device: Any) -> float:
    """`measure_cpu_peak`, measured once per machine and kept in the cache directory."""
    import jax

    key = f"{platform.machine()}/{platform.processor()}/{os.cpu_count()} cpus/jax {jax.__version__}"
    path = cache_root() / PEAK_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict) or not isinstance(known.get(key), (int, float)):
        known = known if isinstance(known, dict) else {}
        known[key] = measure_cpu_peak(device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, known, indent=1)
        except OSError:  # a read-only cache: measure again next time
            pass
    return float(known[key])


@dataclass(frozen=True)
class Throughput:
    """What turns a measured tokens/s into per-device rates and MFU."""

    flops_per_token: Optional[float]
    devices: int
    peak_flops_per_device: Optional[float]
    peak_source: str  # e.g. "v4 bf16 peak", "measured f32 matmul"
    # a quantized run (job.model.quantization): its format, and the chip's peak in it per device,
    # for `mfu_<format>` beside `mfu` (which stays against the bf16 peak, so it is not flattered)
    quantization: str = "none"
    format_peak_per_device: Optional[float] = None

    @classmethod
    def for_run(cls, flops_per_token: Optional[float], topology: Topology, devices: Sequence[Any],
                quantization: str = "none") -> Throughput:
        chip = topology.chip or chip_of(devices[0])
        if chip is not None:
            rate = getattr(chip, f"peak_{quantization}_ops", None)
            return cls(flops_per_token, len(devices), chip.peak_bf16_flops_per_device, f"{chip.name} bf16 peak",
                       quantization, rate / chip.devices_per_chip if rate else None)
        if str(devices[0].platform) == "cpu":
            local = [d for d in devices if d.process_index == devices[0].process_index]
            peak = cpu_peak(devices[0]) / len(local)
            return cls(flops_per_token, len(devices), peak, "measured f32 matmul, host shared by its devices")
        return cls(flops_per_token, len(devices), None, "unknown device")

    def rates(self, tokens_per_s: float) -> dict[str, float]:
        per_device = tokens_per_s / self.devices
        out = {"tokens_per_s_per_device": per_device}
        if self.flops_per_token:
            flops = per_device * self.flops_per_token
            out["tflops_per_device"] = flops / 1e12
            if self.peak_flops_per_device:
                out["mfu"] = flops / self.peak_flops_per_device
            if self.format_peak_per_device:
                out[f"mfu_{self.quantization}"] = flops / self.format_peak_per_device
        return out

    def describe(self) -> str:
        if not self.peak_flops_per_device:
            return f"MFU: not reported (no peak known for this device: {self.peak_source})"
        text = f"MFU peak per device: {self.peak_flops_per_device / 1e12:.3g} TFLOP/s ({self.peak_source})"
        if self.quantization == "none":
            return text
        if not self.format_peak_per_device:
            return text + f"; matmuls in {self.quantization}, whose peak here is not known: mfu is against bf16's"
        return (text + f"; matmuls in {self.quantization}: mfu_{self.quantization} against its peak, "
                f"{self.format_peak_per_device / 1e12:.3g} TFLOP/s per device")
