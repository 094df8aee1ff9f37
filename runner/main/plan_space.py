"""mode=plan's search space: the layouts a model and a topology allow, sized before any compile.

A layout is the mesh (stage, data, fsdp, expert, context, tensor), the micro-batches, the
rematerialisation, the pipeline schedule and the optimizer's offload; settings the user gave on
the command line are held, not searched. Each layout is sized by an analytic model of a device's
memory (state, activations, one layer's working set) and of its step time (FLOPs at peak, the
collectives each axis implies at the chip's link rates, the pipeline bubble). Both are rough on
purpose: they only prune the hopeless and order the rest; the compiler decides what fits and the
compiled program's roofline (runner.parallel.roofline) ranks it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from runner.parallel.roofline import REMAT_RECOMPUTE, Rates
from runner.parallel.topology import Topology

MESH_KEYS = ("mesh.stage", "mesh.data", "mesh.fsdp", "mesh.expert", "mesh.context", "mesh.tensor")
# every setting the search may choose; one the user names is held at the user's value
SEARCHED = (*MESH_KEYS, "train.accumulate_steps", "job.model.remat", "pipeline.schedule", "pipeline.microbatches",
            "pipeline.repeats", "optimizer.offload", "job.model.mlp_tiles")
MLP_TILES = 4  # the feed-forward over this many tiles of each row, where its whole would not fit
PRUNE_ABOVE = 1.3  # analytic memory past this many times the chip's HBM: not worth a compile
LONG_ROW = 16384  # rows at least this long are also split over a context axis
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ModelFacts:
    """What the analytic models need of the job (runner.models: the family's own counts)."""

    parameters: int
    flops_per_token: float
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    n_experts: int
    batch_size: int
    seq_len: int
    param_bytes: int
    state_bytes: int


@dataclass(frozen=True)
class Layout:
    """One candidate: the settings it passes on the command line, and its analytic sizes."""

    mesh: dict[str, int]
    accumulate_steps: int
    remat: str
    schedule: str = ""  # gpipe | circular, with stages
    microbatches: int = 0
    repeats: int = 1
    offload: str = "none"
    mlp_tiles: int = 1
    memory_bytes: float = field(default=0.0, compare=False)  # analytic, a device
    step_s: float = field(default=0.0, compare=False)  # analytic
    bound: str = field(default="", compare=False)
    notes: dict[str, float] = field(default_factory=dict, compare=False)

    def overrides(self) -> list[str]:
        """The command-line settings that select this layout."""
        out = [f"mesh.{axis}={size}" for axis, size in self.mesh.items()]
        out += [f"train.accumulate_steps={self.accumulate_steps}", f"job.model.remat={self.remat}"]
        if self.mesh["stage"] > 1:
            out += [f"pipeline.schedule={self.schedule}", f"pipeline.microbatches={self.microbatches}"]
            if self.schedule == "circular":
                out.append(f"pipeline.repeats={self.repeats}")
        if self.offload != "none":
            out.append(f"optimizer.offload={self.offload}")
        if self.mlp_tiles != 1:
            out.append(f"job.model.mlp_tiles={self.mlp_tiles}")
        return out

    def label(self) -> str:
        """The layout in a few words: the mesh axes above 1, the micro-batches, the rest."""
        mesh = " ".join(f"{axis}={size}" for axis, size in self.mesh.items() if size > 1) or "one device"
        parts = [mesh, f"accum {self.accumulate_steps}", f"remat {self.remat}"]
        if self.mesh["stage"] > 1:
            parts.append(f"{self.schedule} m={self.microbatches}" + (f" r={self.repeats}" if self.repeats > 1 else ""))
        if self.mlp_tiles != 1:
            parts.append(f"mlp tiles {self.mlp_tiles}")
        if self.offload != "none":
            parts.append("optimizer on host")
        return ", ".join(parts)


def _powers_of_two_dividing(n: int, most: int) -> list[int]:
    return [p for p in (2 ** k for k in range(0, 14)) if p <= most and n % p == 0]


def _meshes(topology: Topology, facts: ModelFacts, held: dict[str, Any]) -> Iterator[dict[str, int]]:
    """Every mesh of the topology's devices: stages only across slices (their links carry only
    activations), a tensor axis that divides the heads, a context axis for long rows, an expert
    axis that divides the experts, and the rest split between data and fsdp."""
    devices, slices = topology.num_devices, max(1, topology.num_slices)
    per_slice = devices // slices
    stages = [1] + ([slices] if slices > 1 and facts.n_layers % slices == 0 else [])
    if "mesh.stage" in held:  # stages the user asks for, within a slice too
        stages = [int(held["mesh.stage"])] if facts.n_layers % int(held["mesh.stage"]) == 0 else []
    tensors = [t for t in _powers_of_two_dividing(per_slice, 8) if facts.n_heads % t == 0]
    contexts = _powers_of_two_dividing(per_slice, 8) if facts.seq_len >= LONG_ROW else [1]
    experts = [e for e in _powers_of_two_dividing(per_slice, 64) if facts.n_experts % e == 0] if facts.n_experts \
        else [1]
    for stage, tensor, context, expert in itertools.product(stages, tensors, contexts, experts):
        fixed = {"stage": stage, "tensor": tensor, "context": context, "expert": expert}
        if any(int(held.get(f"mesh.{k}", v)) != v for k, v in fixed.items()):
            continue
        inner = tensor * context * expert  # within a slice; the stage axis spans slices, or splits one
        rest = devices // (stage * inner) if per_slice % inner == 0 and devices % (stage * inner) == 0 else 0
        if not rest:
            continue
        for fsdp in _powers_of_two_dividing(rest, rest):
            data = rest // fsdp
            if slices > 1 and stage == 1 and data % slices:
                continue  # the data axis is the one split across slices
            mesh = {"stage": stage, "data": data, "fsdp": fsdp, "expert": expert, "context": context,
                    "tensor": tensor}
            if all(int(held.get(f"mesh.{k}", v)) in (v, -1) for k, v in mesh.items()):
                yield mesh


def layouts(topology: Topology, facts: ModelFacts, held: dict[str, Any], job_remat: str) -> list[Layout]:
    """Every candidate the held settings allow, each with its analytic memory and step time."""
    remats = [held["job.model.remat"]] if "job.model.remat" in held else sorted({"full", "dots", job_remat} - {"auto"})
    # what costs time to save memory, cheapest first, each tried only where the ones before do not fit: the
    # feed-forward in tiles (recomputed in the backward), then the optimizer's state in host memory
    steps = ((1, "none"), (MLP_TILES, "none"), (1, "host"), (MLP_TILES, "host"))
    savings = [(tiles, offload) for tiles, offload in steps
               if str(tiles) == held.get("job.model.mlp_tiles", str(tiles))
               and offload == held.get("optimizer.offload", offload)]
    out: list[Layout] = []
    for mesh in _meshes(topology, facts, held):
        ways = mesh["data"] * mesh["fsdp"] * mesh["expert"]
        accumulations = ([int(held["train.accumulate_steps"])] if "train.accumulate_steps" in held else
                         [a for a in _powers_of_two_dividing(facts.batch_size, 64)
                          if (facts.batch_size // a) % ways == 0])
        for accumulate, remat in itertools.product(accumulations, remats):
            for schedule, micro, repeats in _schedules(mesh["stage"], facts, facts.batch_size // accumulate // ways,
                                                       held):
                for tiles, offload in savings or [(int(held.get("job.model.mlp_tiles", 1)),
                                                   held.get("optimizer.offload", "none"))]:
                    layout = size(Layout(mesh, accumulate, remat, schedule, micro, repeats, offload, tiles),
                                  topology, facts)
                    out.append(layout)
                    limit = topology.chip.hbm_bytes_per_device if topology.chip else None
                    if limit is None or layout.memory_bytes <= limit:
                        break  # it fits: the savings after it would only slow the step
    return out


def _schedules(stages: int, facts: ModelFacts, rows: int, held: dict[str, Any]) -> list[tuple[str, int, int]]:
    """The pipeline schedules for `stages` stages of a micro-batch of `rows` rows a data shard."""
    if stages == 1:
        return [("", 0, 1)]
    out = []
    for micro in (stages, 2 * stages, 4 * stages):
        if rows % micro == 0:
            out.append(("gpipe", micro, 1))
            for repeats in (2, 4):
                if facts.n_layers % (stages * repeats) == 0:
                    out.append(("circular", micro, repeats))
    wanted = {k: held[f"pipeline.{k}"] for k in ("schedule", "microbatches", "repeats") if f"pipeline.{k}" in held}
    return [s for s in out if all(str(dict(zip(("schedule", "microbatches", "repeats"), s))[k]) == str(v)
                                  for k, v in wanted.items())]


def size(layout: Layout, topology: Topology, facts: ModelFacts) -> Layout:
    """`layout` with its analytic memory a device and step time."""
    from dataclasses import replace

    mesh, f = layout.mesh, facts
    shard = mesh["fsdp"] * mesh["tensor"] * mesh["stage"] * (mesh["expert"] if f.n_experts else 1)
    state = f.parameters * (f.param_bytes * 2 + (0 if layout.offload == "host" else 2 * f.state_bytes)) / shard
    rows = f.batch_size / layout.accumulate_steps / (mesh["data"] * mesh["fsdp"] * mesh["expert"])
    tokens = rows * f.seq_len / mesh["context"]
    layers = f.n_layers / mesh["stage"]
    # bytes a token keeps a layer for the backward pass: the residual (full, offload), the matmuls' outputs
    # (dots), or every intermediate (none)
    width = f.d_ff / mesh["tensor"]
    kept = {"full": 2 * f.d_model, "offload": 2 * f.d_model,
            "dots": 2 * (4 * f.d_model + 3 * width)}.get(layout.remat, 2 * (10 * f.d_model + 4 * width))
    working = tokens * (3 * f.d_ff / mesh["tensor"] / layout.mlp_tiles + 6 * f.d_model) * 4
    gathered = 2 * f.parameters / f.n_layers / mesh["tensor"] * 2  # a layer's weights, gathered, bf16, twice
    memory = state + tokens * layers * kept + working + gathered + min(tokens * f.vocab_size * 4, 2**28)
    step, bound, notes = _step_time(layout, topology, f, tokens)
    return replace(layout, memory_bytes=memory, step_s=step, bound=bound, notes=notes)


def _step_time(layout: Layout, topology: Topology, f: ModelFacts, tokens: float) -> tuple[float, str, dict]:
    """The analytic roofline: FLOPs at peak; fsdp's gathers and reduce-scatters, tensor's
    all-reduces and data's gradient all-reduce at one ring's rate (two across their slices'
    network); the bubble."""
    rates = Rates.of(topology.chip) if topology.chip is not None else None
    if rates is None:
        return math.inf, "", {}
    mesh = layout.mesh
    devices = topology.num_devices
    recompute = REMAT_RECOMPUTE.get(layout.remat, 1.0)
    compute = f.flops_per_token * f.batch_size * f.seq_len * recompute / devices / rates.peak_flops
    passes = 3 if layout.remat == "full" else 2
    per_stage = f.parameters / (mesh["stage"] * mesh["tensor"])
    fsdp = mesh["fsdp"]
    gathers = (2 * per_stage * passes + 4 * per_stage) * (fsdp - 1) / fsdp * layout.accumulate_steps
    tensor = mesh["tensor"]
    layers = f.n_layers / mesh["stage"]
    tensor_bytes = 2 * (tensor - 1) / tensor * tokens * f.d_model * 2 * 2 * (passes + 1) * layers \
        * layout.accumulate_steps
    grads = 4 * f.parameters / (fsdp * tensor * mesh["stage"])
    slices = max(1, topology.num_slices)
    within = mesh["data"] // slices if slices > 1 and mesh["stage"] == 1 else mesh["data"]
    data_bytes = 2 * (within - 1) / max(1, within) * grads
    ici = (gathers / min(3, max(1, math.ceil(math.log(max(fsdp, 2), 4)))) + tensor_bytes + data_bytes) \
        / rates.link_bytes_per_s
    dcn = 0.0
    if slices > 1 and rates.dcn_bytes_per_s:
        if mesh["stage"] > 1:  # each microbatch's activations, forward and back, once an iteration
            dcn = 2 * 2 * tokens * f.d_model * 2 / rates.dcn_bytes_per_s * layout.accumulate_steps
        else:
            dcn = 2 * (slices - 1) / slices * grads / rates.dcn_bytes_per_s
    bubble = 0.0
    if mesh["stage"] > 1:
        bubble = (mesh["stage"] - 1) / (layout.microbatches * layout.repeats + mesh["stage"] - 1)
    terms = {"compute": compute, "ICI": ici, "DCN": dcn}
    bound = max(terms, key=lambda k: terms[k])
    return terms[bound] / (1 - bubble), bound, {**terms, "bubble": bubble}


def promising(candidates: Sequence[Layout], limit_bytes: int | None) -> list[Layout]:
    """The candidates worth compiling, most promising first: those the memory model says fit,
    fastest first, then those just past the chip (the model is rough), smallest first."""
    limit = limit_bytes or math.inf
    # equal rooflines (compute-bound) go to the one that communicates less: overlap is never perfect
    fit = sorted((c for c in candidates if c.memory_bytes <= limit),
                 key=lambda c: (c.step_s, sum(c.notes.get(k, 0.0) for k in ("ICI", "DCN")), c.memory_bytes))
    near = sorted((c for c in candidates if limit < c.memory_bytes <= PRUNE_ABOVE * limit),
                  key=lambda c: c.memory_bytes)
    return _mesh_first(fit) + _mesh_first(near)


def _mesh_first(ordered: list[Layout]) -> list[Layout]:
    """Each mesh's best layout first (in their order), then the rest: the compile budget sees every
    mesh before a second variant of any (the analytic model is rough, the mesh matters most)."""
    seen: set[tuple[int, ...]] = set()
    first, rest = [], []
    for layout in ordered:
        key = tuple(layout.mesh.values())
        (rest if key in seen else first).append(layout)
        seen.add(key)
    return first + rest


def facts_of(spec: Any) -> ModelFacts:
    """The job's sizes, from its family's own counts (no model is built)."""
    from runner.models import family_for

    family = family_for(spec)
    config = family.config(spec.job.model)
    m = spec.job.model
    return ModelFacts(
        parameters=int(family.param_count(config)), flops_per_token=float(family.flops_per_token(config,
                                                                                                 spec.train.seq_len)),
        d_model=m.d_model, d_ff=m.d_ff or 4 * m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
        n_kv_heads=getattr(m, "n_kv_heads", 0) or m.n_heads, vocab_size=m.vocab_size, n_experts=m.moe.n_experts,
        batch_size=spec.train.batch_size, seq_len=spec.train.seq_len,
        param_bytes=_DTYPE_BYTES.get(m.param_dtype, 4), state_bytes=_DTYPE_BYTES.get(spec.optimizer.state_dtype, 4))
