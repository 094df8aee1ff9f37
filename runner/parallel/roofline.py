"""The estimated time of a compiled train step: a roofline at the chip's published rates.

The step's work is counted from the compiled program and priced at the chip's published rates:
the FLOPs at the chip's peak, the bytes its program moves through HBM, the bytes its collectives
receive over the inter-chip links, and the bytes that cross between slices over the data-centre
network. The collectives run asynchronously beside the computation (XLA overlaps them), so they
cost time only where they outlast it; the matrix units and the memory-bound fusions (norms,
activations, the optimizer's update, which stream through HBM) take turns on a core, so those two
add up. A pipeline's bubble stretches the whole by 1 / (1 - bubble):

    step = max(compute + HBM, ICI, DCN) / (1 - bubble)

* compute: the step's FLOPs a device (6N + attention, times 4/3 when job.model.remat=full recomputes
  the forward pass) at the chip's peak bf16 rate.
* HBM: XLA's count of the compiled program's bytes accessed at the chip's HBM bandwidth. XLA's cost
  analysis counts a loop body once (the layer scan, the micro-batches), so the count is scaled by
  how many times over the loops repeat the program's traffic (`loop_factor`: every instruction's
  operands and result, each loop body times its trips, over the same sum with the bodies once).
* ICI: each collective's bytes received a device (an all-gather receives (n-1)/n of its result, an
  all-reduce twice that, a reduce-scatter n-1 times its result), over the links its device group
  spans: a group spread over k dimensions of the torus uses k rings, each at one port's
  bidirectional rate (the chip's ICI bandwidth over its ports).
* DCN: the bytes a device sends between slices (runner.parallel.hlo.collective_bytes with the
  slices) at the chip's share of the data-centre network.

Each term assumes its resource runs at its published peak (optimistic); adding HBM to compute is
pessimistic where fusions overlap the matmuls; docs/planning.md compares the whole with published
measurements. mode=compile prints it, mode=plan ranks by it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from runner.parallel.hlo import COLLECTIVES, bytes_of, collective_bytes, device_groups, loop_totals
from runner.parallel.topology import Chip

# The forward pass again in the backward pass: 2 of a token's 6N FLOPs again (full); dots keeps
# the matmuls' outputs and recomputes only elementwise work; offload moves activations, no FLOPs.
REMAT_RECOMPUTE = {"full": 4 / 3, "dots": 1.0, "none": 1.0, "offload": 1.0}


def received_bytes(kind: str, result_bytes: int, group_size: int) -> float:
    """What one device receives for a collective over `group_size` devices whose result is
    `result_bytes` on it (ring algorithms)."""
    n = max(1, group_size)
    share = (n - 1) / n
    if kind == "all-reduce":
        return 2 * share * result_bytes
    if kind == "reduce-scatter":
        return (n - 1) * result_bytes
    if kind == "collective-permute":
        return float(result_bytes)
    return share * result_bytes  # all-gather, all-to-all, ragged-all-to-all


def dims_spanned(group: Sequence[int], coords: Sequence[Sequence[int] | None]) -> int:
    """How many dimensions of the chips' grid a device group spreads over (at least 1): the rings
    a collective over it can use at once. Devices without coordinates (CPU, GPU) count as one."""
    placed = [coords[d] for d in group if d < len(coords) and coords[d] is not None]
    if len(placed) < 2:
        return 1
    return max(1, sum(len({tuple(c)[axis] for c in placed}) > 1 for axis in range(len(placed[0]))))


@dataclass(frozen=True)
class Rates:
    """One device's share of its chip's published rates."""

    chip: str
    peak_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # one ICI port, both directions: what one ring delivers to a device
    dcn_bytes_per_s: float | None

    @classmethod
    def of(cls, chip: Chip) -> "Rates | None":
        """The chip's rates, or None where its bandwidths are not published (runner.parallel.topology)."""
        if chip.hbm_bytes_per_s is None or chip.ici_bytes_per_s is None:
            return None
        per = chip.devices_per_chip
        return cls(chip.name, chip.peak_bf16_flops / per, chip.hbm_bytes_per_s / per,
                   chip.ici_bytes_per_s / chip.ici_ports / per,
                   None if chip.dcn_bytes_per_s is None else chip.dcn_bytes_per_s / per)


def ici_seconds(hlo: str, rates: Rates, coords: Sequence[Sequence[int] | None],
                slice_of: Sequence[int] | None = None) -> tuple[float, float]:
    """(seconds, bytes received) a device spends in the compiled step's collectives within a
    slice (those spanning slices are the DCN term's), each loop body times its trips."""
    def group_of(line: str) -> list[int]:
        groups = device_groups(line, len(coords))
        return groups[0] if groups else [0]

    def spans_slices(group: list[int]) -> bool:
        return slice_of is not None and len({slice_of[d] for d in group if d < len(slice_of)}) > 1

    def seconds(kind: str, line: str, size: int) -> float:
        group = group_of(line)
        if spans_slices(group):
            return 0.0
        return received_bytes(kind, size, len(group)) / (dims_spanned(group, coords) * rates.link_bytes_per_s)

    def received(kind: str, line: str, size: int) -> float:
        group = group_of(line)
        return 0.0 if spans_slices(group) else received_bytes(kind, size, len(group))

    return (sum(collective_bytes(hlo, weigh=seconds).values()),
            sum(collective_bytes(hlo, weigh=received).values()))


@dataclass(frozen=True)
class StepEstimate:
    """A step's roofline terms (seconds), the bound, and what follows from it."""

    compute_s: float
    hbm_s: float
    ici_s: float
    dcn_s: float
    bubble: float  # the pipeline's idle share of each stage's iterations (0 without stages)
    step_s: float
    bound: str  # the largest term: compute | HBM | ICI | DCN
    mfu: float  # model FLOPs (6N + attention) over the step time at the devices' peak
    tokens_per_s_per_chip: float
    hardware_flops: float  # a device's, recomputation included
    hbm_bytes: float  # a device's, loop bodies times their trips
    ici_bytes: float  # received a device within slices
    dcn_bytes: float  # sent a device between slices
    rates: str  # whose published rates

    def terms(self) -> dict[str, float]:
        return {"compute": self.compute_s, "HBM": self.hbm_s, "ICI": self.ici_s, "DCN": self.dcn_s}

    def line(self) -> str:
        terms = ", ".join(f"{name} {seconds_text(value)}" for name, value in self.terms().items()
                          if value or name == "compute")
        bubble = f" / (1 - bubble {self.bubble:.1%})" if self.bubble else ""
        return (f"estimated step at {self.rates}'s published rates: {seconds_text(self.step_s)} from {terms}"
                f"{bubble} (max(compute + HBM, ICI, DCN)), {self.bound}-bound: MFU {self.mfu:.1%}, "
                f"{self.tokens_per_s_per_chip:,.0f} tokens/s a chip (docs/planning.md)")


def seconds_text(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{1e3 * value:.3g} ms"


def estimate_step(*, rates: Rates, model_flops: float, remat: str, devices: int, chips: int, tokens: int,
                  bytes_accessed: float | None, loops: float, ici: tuple[float, float], dcn_bytes: float,
                  bubble: float) -> StepEstimate:
    """The roofline of one compiled step: `model_flops` for the whole step (all devices), XLA's
    `bytes_accessed` for one device (a loop body once) times `loops` (`loop_factor`), `ici` from
    `ici_seconds`, `dcn_bytes` a device sends between slices."""
    hardware = model_flops * REMAT_RECOMPUTE.get(remat, 1.0) / devices
    hbm_bytes = (bytes_accessed or 0.0) * loops
    terms = {"compute": hardware / rates.peak_flops, "HBM": hbm_bytes / rates.hbm_bytes_per_s, "ICI": ici[0],
             "DCN": dcn_bytes / rates.dcn_bytes_per_s if dcn_bytes and rates.dcn_bytes_per_s else 0.0}
    bound = max(terms, key=lambda k: terms[k])
    busy = max(terms["compute"] + terms["HBM"], terms["ICI"], terms["DCN"])
    step = busy / (1 - bubble) if bubble < 1 else math.inf
    mfu = model_flops / (step * rates.peak_flops * devices) if step > 0 else 0.0
    return StepEstimate(terms["compute"], terms["HBM"], terms["ICI"], terms["DCN"], bubble, step, bound, mfu,
                        tokens / step / chips if step > 0 else 0.0, hardware, hbm_bytes, ici[1], dcn_bytes,
                        rates.chip)


# instructions that move no bytes of their own: names, tuples, loop and call wrappers, collectives (ICI's)
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
               "async-start", "async-update", "async-done", "after-all", "partition-id", "replica-id",
               "opt-barrier", "send", "send-done", "recv", "recv-done"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\(")


def loop_factor(hlo: str) -> float:
    """How many times over a step's instructions move their bytes, against once per loop body (what
    XLA's cost analysis counts): each instruction outside fused computations reads its operands and
    writes its result; summed with each loop body times its trips, over the same sum with every trip
    count 1. At least 1."""
    sizes = {m.group(1): bytes_of(m.group(2)) for m in map(_INSTRUCTION.match, hlo.splitlines()) if m}

    def measure(line: str, result: str, op: str) -> dict[str, float]:
        if op in _NO_TRAFFIC or op.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
            return {}
        operands = line[line.index(f" {op}(") + len(op) + 2:].split(")", 1)[0]
        return {"bytes": bytes_of(result) + sum(sizes.get(name, 0) for name in re.findall(r"%([^,\s)]+)",
                                                                                           operands))}

    once = loop_totals(hlo, measure, once=True).get("bytes", 0.0)
    return max(1.0, loop_totals(hlo, measure).get("bytes", 0.0) / once) if once else 1.0


def compiled_cost(compiled: Any, key: str) -> float | None:
    """A figure of XLA's cost analysis of a compiled program ("flops", "bytes accessed": one device's,
    a loop body once), or None where the backend gives none."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    value = (cost or {}).get(key)
    return float(value) if value is not None and value >= 0 else None
