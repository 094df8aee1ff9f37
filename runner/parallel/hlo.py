"""Reading a compiled program's HLO text: its collectives, host copies, fused kernels and quantized
matmuls, and sums over its instructions with each loop body times its trips (`loop_totals`).

XLA's own analyses count a loop body once (the layer scan, the micro-batches); these walk the call
graph and multiply. mode=compile reports what they find (runner.parallel.compile) and the roofline
prices it (runner.parallel.roofline).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Sequence

_DEFINED = re.compile(r"%(\S+) = \(?([a-z][a-z0-9]*)\[")  # an instruction's name and (first) element type
_MATMUL = re.compile(r" (dot|convolution|custom-call)\(%([^,)\s]+), %([^,)\s]+)")


_HOST = "S(5)"  # XLA's memory space of host memory, in a shape's layout
_ASYNC = re.compile(r" (copy-start|dynamic-update-slice-start|dynamic-slice-start)\(")
_SHAPE = re.compile(r"\w+\[[^\]]*\]\{[^}]*\}")


def host_transfers(hlo: str) -> dict[str, int]:
    """The compiled program's asynchronous copies to and from host memory (memory space 5), each
    instruction once (a loop body counts once). A copy's result is (destination, source, ...): to
    the host when the destination is there, back when the source is; an update-slice writes into
    its first operand (to the host when that lives there), a slice reads its first operand (back
    when that lives there)."""
    moved = {"to_host": 0, "from_host": 0}
    for line in hlo.splitlines():
        match = _ASYNC.search(line)
        if not match or "= " not in line[:match.start()]:
            continue
        shapes = _SHAPE.findall(line[line.index("= ") + 2:match.start()])
        if len(shapes) < 2:
            continue
        if match.group(1) == "copy-start":
            moved["to_host"] += _HOST in shapes[0] and _HOST not in shapes[1]
            moved["from_host"] += _HOST in shapes[1] and _HOST not in shapes[0]
        elif _HOST in shapes[0] and _HOST not in shapes[1]:
            moved["to_host" if match.group(1) == "dynamic-update-slice-start" else "from_host"] += 1
    return moved


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) ([a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_CALLEE = re.compile(r"(?:body|calls)=%([^\s,)]+)")
_CONDITION = re.compile(r"condition=%([^\s,)]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BOUND = re.compile(r"= s32\[\]\{?[^ ]* constant\((\d+)\)")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def bytes_of(result: str) -> int:
    """The bytes of every array in an instruction's result type (a tuple's summed)."""
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
        total += _DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
    return total


_GROUPS = re.compile(r"replica_groups=(\{[\d,{}]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_PAIRS = re.compile(r"source_target_pairs=\{([\d,{}]*)\}")
_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def device_groups(line: str, devices: int) -> list[list[int]]:
    """The groups of devices (their places in the program's device assignment) a collective
    instruction runs over: its source-target pairs, or its replica groups, listed or in XLA's iota
    form (``[G,N]<=[dims]T(perm)``); none given is one group of every device."""
    import numpy as np

    pairs = _PAIRS.search(line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    found = _GROUPS.search(line)
    text = found.group(1) if found else "{}"
    if text.startswith("{"):
        listed = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text)]
        return [g for g in listed if g] or [list(range(devices))]
    shape, dims, perm = _IOTA.match(text).groups()  # type: ignore[union-attr]
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids.reshape(int(shape.split(",")[0]), -1).tolist()


_NAME = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_FIRST_OPERAND = re.compile(r"-done\(%([^,)\s]+)")


def _crosses(line: str, slice_of: Sequence[int], started: dict[str, bool]) -> bool:
    """Whether the collective on `line` runs over devices of more than one slice: a `-done` as its
    start did (kept in `started`, by the start's name)."""
    done = _FIRST_OPERAND.search(line)
    if done:
        return started.get(done.group(1), False)
    crosses = any(len({slice_of[d] for d in group}) > 1 for group in device_groups(line, len(slice_of)))
    name = _NAME.match(line)
    if name:
        started[name.group(1)] = crosses
    return crosses


def loop_totals(hlo: str, measure: Callable[[str, str, str], dict[str, float]],
                once: bool = False) -> dict[str, float]:
    """`measure(line, result type, op)` summed over the compiled program's instructions, by key, each
    loop body times its trip count (the layer scan's 32 layers, say) and each called computation as
    often as it is called; fused computations (a fusion's `calls=`) are not entered. A loop's trip
    count is XLA's known_trip_count, else the one integer its condition compares the counter with
    (a scan's length), else 1 (every trip count is 1 with `once`: as XLA's cost analysis counts).
    Lines are measured in the program's order."""
    own: dict[str, dict[str, float]] = {}
    calls: dict[str, list[tuple[str, Any]]] = {}
    bounds: dict[str, set[int]] = {}
    entry, name = "", ""
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            name = header.group(1)
            entry = name if line.startswith("ENTRY") else entry
            own[name], calls[name], bounds[name] = {}, [], set()
            continue
        bound = _BOUND.search(line) if name else None
        if bound:
            bounds[name].add(int(bound.group(1)))
        match = _OP.match(line) if name else None
        if not match:
            continue
        result, op = match.groups()
        for key, amount in measure(line, result, op).items():
            own[name][key] = own[name].get(key, 0) + amount
        if op in ("while", "call", "async-start", "conditional"):
            trips, condition = _TRIPS.search(line), _CONDITION.search(line)
            times: Any = int(trips.group(1)) if trips else condition.group(1) if op == "while" and condition else 1
            calls[name] += [(callee, times) for callee in _CALLEE.findall(line)]

    def trips_of(times: Any) -> int:
        if once:
            return 1
        if isinstance(times, int):
            return times
        found = bounds.get(times, set())
        return next(iter(found)) if len(found) == 1 else 1

    def total(comp: str, seen: tuple[str, ...] = ()) -> dict[str, float]:
        out = dict(own.get(comp, {}))
        for callee, condition in calls.get(comp, []):
            times = trips_of(condition)
            if callee not in seen:
                for key, n in total(callee, (*seen, comp)).items():
                    out[key] = out.get(key, 0) + times * n
        return out

    return total(entry) if entry else {}


def collective_bytes(hlo: str, slice_of: Sequence[int] | None = None,
                     weigh: Callable[[str, str, int], float] | None = None) -> dict[str, int]:
    """Per device, the bytes of the results of the compiled step's collectives, by kind, each loop
    body times its trip count (`loop_totals`): what each device receives from the others in one
    step. An asynchronous collective counts at its `-done`; one wrapped in an async computation
    counts inside it. With `slice_of` (each device's slice, in the program's device order) only
    what crosses slices counts: the collectives whose device groups (`device_groups`) span slices,
    and the sends a multi-slice TPU program makes through its data-centre network runtime (XLA
    lowers the cross-slice part of a collective to those: `all-reduce by send`, `one-to-one by
    send`, ...). `weigh(kind, line, bytes)`, where given, says what a collective counts instead of
    its bytes (`line` is its start's, which names the device groups): the roofline's seconds
    (runner.parallel.roofline)."""
    started: dict[str, bool] = {}  # an asynchronous collective's start: whether its groups span slices
    start_lines: dict[str, str] = {}  # an asynchronous collective's start, by name: its device groups

    def measure(line: str, result: str, op: str) -> dict[str, float]:
        kind = re.sub(r"-(start|done)$", "", op)
        counted = kind in COLLECTIVES and (slice_of is None or _crosses(line, slice_of, started))
        if kind in COLLECTIVES and op.endswith("-start") and weigh is not None:
            named = _NAME.match(line)
            start_lines[named.group(1) if named else ""] = line
        if counted and not op.endswith("-start"):
            done = _FIRST_OPERAND.search(line) if op.endswith("-done") else None
            size = bytes_of(result)
            return {kind: size if weigh is None else weigh(kind, start_lines.get(done.group(1), line) if done
                                                           else line, size)}
        dcn = _MEGASCALE.search(line) if slice_of is not None and op == "send" else None
        if dcn:  # a transfer between slices by the TPU's data-centre network runtime: its data, the first array
            return {f"{dcn.group(1).lower().replace('_', '-')} by send": bytes_of(result.split("}", 1)[0])}
        return {}

    return loop_totals(hlo, measure)  # type: ignore[return-value]


_KERNEL_TARGETS = re.compile(r'custom_call_target="(tpu_custom_call|__cudnn\$fmha[^"]*)"')


def fused_kernels(hlo: str) -> dict[str, int]:
    """The compiled program's calls of fused kernels, by custom-call target: Pallas/Mosaic kernels
    on TPU (`tpu_custom_call`: splash attention, megablox) and cuDNN's fused attention on GPU. What
    proves the kernel named by job.model.attention reached the compiler (a loop body counts once)."""
    counts: dict[str, int] = {}
    for target in _KERNEL_TARGETS.findall(hlo):
        counts[target] = counts.get(target, 0) + 1
    return counts


def quantized_matmuls(hlo: str) -> dict[str, int]:
    """Count the compiled program's matmuls (dots, convolutions, cuBLAS calls), and those whose
    two operands are int8 or fp8: what proves the quantized ops reached the compiler (a TPU's
    int8 matmul may well return bf16; its operands say what it multiplied)."""
    types = dict(_DEFINED.findall(hlo))
    counts = {"int8": 0, "fp8": 0, "all": 0}
    for line in hlo.splitlines():
        match = _MATMUL.search(line)
        if not match or (match.group(1) == "custom-call" and "matmul" not in line):
            continue
        counts["all"] += 1
        operands = {types.get(match.group(2), ""), types.get(match.group(3), "")}
        if operands == {"s8"}:
            counts["int8"] += 1
        elif "matmul$f8" in line or all(t.startswith("f8") for t in operands):
            counts["fp8"] += 1
    return counts
