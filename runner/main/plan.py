"""``mode=plan``: the fastest layout of a job on a topology, every row a compile that fitted.

The search (runner.main.plan_space) enumerates the layouts the model and the topology allow
and orders them by an analytic model; this module compiles the most promising ones, each as the
very command that would train it with ``mode=compile`` in front (runner.parallel.compile), in
parallel processes, within a budget in compiles and minutes; and ranks those that fit by the
compiled program's roofline (runner.parallel.roofline). A compile's report is kept under runner's
cache, keyed by its command and runner's, jax's and libtpu's versions, so a plan asked again
(or widened) compiles only what it has not.

Exit 0 with a plan, DOES_NOT_FIT_EXIT_CODE when no compiled layout fits (with mode=compile's
advice), 2 for a request it cannot honour. The last line of stdout is the plan as JSON.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from runner.errors import ConfigError, UserError
from runner.exits import DOES_NOT_FIT_EXIT_CODE
from runner.main.plan_space import SEARCHED, Layout, facts_of, layouts, promising
from runner.parallel.roofline import Rates, StepEstimate, seconds_text
from runner.parallel.topology import Topology, parse_topology

RUNNER_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Row:
    """One layout the plan compiled (or could not)."""

    layout: Layout
    status: str = "not compiled"  # fits | does not fit | refused | failed | not compiled
    report: dict[str, Any] | None = None  # mode=compile's JSON line
    message: str = ""  # why it was refused or failed
    seconds: float = 0.0
    cached: bool = False

    @property
    def estimate(self) -> StepEstimate | None:
        data = (self.report or {}).get("estimate")
        return StepEstimate(**data) if data else None

    @property
    def memory(self) -> int | None:
        memory = (self.report or {}).get("memory")
        return None if memory is None else int(memory["total"])


@dataclass
class Plan:
    """Everything mode=plan says; `to_json` is the line scripts read."""

    job: str
    topology: str
    base: list[str]  # the user's settings, kept in every command
    held: dict[str, str]
    candidates: int  # layouts enumerated
    pruned: int  # past the memory model's bound
    rows: list[Row] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # enumerate, compile, rank

    def fitting(self) -> list[Row]:
        rows = [r for r in self.rows if r.status == "fits" and r.estimate is not None]
        return sorted(rows, key=lambda r: r.estimate.step_s)  # type: ignore[union-attr]

    def command(self, row: Row, mode: str = "") -> str:
        return " ".join(["python -m runner", *([f"mode={mode}"] if mode else []), *self.base,
                         *row.layout.overrides()])

    def to_json(self) -> str:
        def row_json(row: Row) -> dict[str, Any]:
            est = row.estimate
            return {"layout": row.layout.label(), "overrides": row.layout.overrides(), "status": row.status,
                    "memory_bytes": row.memory, "analytic_memory_bytes": int(row.layout.memory_bytes),
                    "estimate": None if est is None else asdict(est), "command": self.command(row),
                    "message": row.message, "compile_seconds": row.seconds, "cached": row.cached}

        best = self.fitting()
        return json.dumps({"report": "plan", "job": self.job, "topology": self.topology, "held": self.held,
                           "candidates": self.candidates, "pruned": self.pruned, "seconds": self.seconds,
                           "best": row_json(best[0]) if best else None,
                           "rows": [row_json(r) for r in [*best, *(r for r in self.rows if r not in best)]]})


def _size(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _why(first: Row, second: Row) -> str:
    """Why the best row beats the next: the term of the estimate that differs most between them."""
    a, b = first.estimate, second.estimate
    assert a is not None and b is not None
    own, other = a.terms(), b.terms()
    gap = b.step_s / a.step_s if a.step_s else 1.0
    term = max(own, key=lambda name: other[name] - own[name])
    said = (f"row 1 ({first.layout.label()}) is estimated {gap:.2f}x faster than row 2 ({second.layout.label()}): "
            f"the term that differs most is {term}, {seconds_text(other[term])} against {seconds_text(own[term])}")
    if term == "compute" and first.layout.remat != second.layout.remat:
        said += f" (remat {second.layout.remat} against {first.layout.remat}: what the backward pass recomputes)"
    if b.bubble > a.bubble:
        said += f"; row 2's pipeline also idles {b.bubble:.1%} of each stage's iterations"
    return said + f" (row 1 is {a.bound}-bound, row 2 {b.bound}-bound)."


def text(plan: Plan, shown: int) -> str:
    """The human-readable plan: a table, best first, each row's command, and why the best wins."""
    best = plan.fitting()
    others = [r for r in plan.rows if r not in best]
    lines = [f"mode=plan: {plan.job} on {plan.topology}: {plan.candidates} layouts enumerated, {plan.pruned} pruned "
             f"by the memory model, {sum(r.status != 'not compiled' for r in plan.rows)} compiled"
             + (f"; held: {', '.join(f'{k}={v}' for k, v in plan.held.items())}" if plan.held else ""), ""]
    header = f"  {'#':>2}  {'layout':<64} {'memory':>10} {'fits':>5} {'step':>9} {'MFU':>6} {'tok/s/chip':>10} " \
             f"{'between slices':>14}  bound"
    lines.append(header)
    for i, row in enumerate([*best, *others][:shown], 1):
        est = row.estimate
        fits = {"fits": "yes", "does not fit": "NO"}.get(row.status, row.status)
        if est is None:
            lines.append(f"  {i:>2}  {row.layout.label():<64} {_size(row.memory):>10} {fits:>5}")
            continue
        lines.append(f"  {i:>2}  {row.layout.label():<64} {_size(row.memory):>10} {fits:>5} "
                     f"{seconds_text(est.step_s):>9} {est.mfu:>6.1%} {est.tokens_per_s_per_chip:>10,.0f} "
                     f"{_size(est.dcn_bytes):>14}  {est.bound}")
    lines.append("")
    for i, row in enumerate(best[:shown], 1):
        lines.append(f"  {i}: {plan.command(row)}")
    for row in others:
        if row.status in ("refused", "failed") and row.message:
            lines.append(f"  {row.status}: {row.layout.label()}: {row.message[:300]}")
    if len(best) >= 2:
        lines += ["", "  " + _why(best[0], best[1])]
    s = plan.seconds
    lines += ["", f"  time: enumerating and pruning {s.get('enumerate', 0):.1f} s, compiling "
              f"{s.get('compile', 0):.1f} s (wall, {sum(r.seconds for r in plan.rows):.1f} s of compiles, "
              f"{sum(r.cached for r in plan.rows)} from the cache), ranking {s.get('rank', 0):.2f} s",
              "  (estimated step: max(compute + HBM, ICI, DCN) / (1 - bubble) at the chip's published rates; "
              "docs/planning.md says how far to trust it)"]
    return "\n".join(lines)


def _held(overrides: Sequence[str]) -> dict[str, str]:
    out = {}
    for override in overrides:
        key, _, value = override.partition("=")
        if key in SEARCHED:
            out[key] = value
    return out


def _base(overrides: Sequence[str]) -> list[str]:
    """The user's settings every command keeps: all but mode, plan.* and what the search sets."""
    searched = set(SEARCHED)
    return [o for o in overrides if o.partition("=")[0] not in searched and not o.startswith(("mode=", "plan."))]


def _check_topology(topology: Topology) -> Rates:
    if topology.chip is None:
        raise ConfigError("topology", topology.name, "mode=plan ranks layouts by a chip's published rates "
                          "(FLOPs, HBM, links), and this topology names no chip.",
                          "name the slice to plan for, e.g. topology=v5p-64 (libtpu compiles for it here), or a "
                          "GPU type such as h100-8 on a machine with those GPUs.")
    if topology.platform == "gpu":  # compiled on the GPUs themselves: refused here, once, where they are absent
        from runner.parallel.compile import compile_devices

        compile_devices(topology)
    rates = Rates.of(topology.chip)
    if rates is None:
        raise ConfigError("topology", topology.name, f"runner has no published bandwidths for {topology.chip.name} "
                          "chips, so it cannot estimate a step there.", "plan for v4, v5p, v5e, v6e, tpu7x or a GPU "
                          "type; mode=compile still says whether a layout fits.")
    return rates


_VERSIONS: str | None = None


def _code_version() -> str:
    """runner's sources and configs, and the compilers' versions: a cached report is reused only
    for the very same program."""
    global _VERSIONS
    if _VERSIONS is None:
        digest = hashlib.sha256()
        sources = [*RUNNER_ROOT.joinpath("runner").rglob("*.py"), *RUNNER_ROOT.joinpath("conf").rglob("*.yaml")]
        for path in sorted(sources):
            digest.update(str(path.relative_to(RUNNER_ROOT)).encode())
            digest.update(path.read_bytes())
        from importlib import metadata

        for package in ("jax", "jaxlib", "libtpu"):
            try:
                digest.update(f"{package}={metadata.version(package)}".encode())
            except metadata.PackageNotFoundError:
                pass
        _VERSIONS = digest.hexdigest()
    return _VERSIONS


def _cache_file(args: Sequence[str]) -> Path:
    from runner.checkpoint.storage import cache_root

    # the working directory too: a relative path among the settings (a data source) names another file elsewhere
    key = hashlib.sha256("\0".join([_code_version(), os.getcwd(), *args]).encode()).hexdigest()[:32]
    return cache_root() / "plan" / f"{key}.json"


def compile_layout(args: Sequence[str], use_cache: bool) -> tuple[int, dict[str, Any] | None, str, bool]:
    """`python -m runner mode=compile ARGS` in its own process: (exit code, its JSON line, its last
    stderr line, whether it came from the cache). Refusals (exit 2) are kept too: the same command
    is refused the same way."""
    cache = _cache_file(args)
    if use_cache and cache.is_file():
        kept = json.loads(cache.read_text())
        return int(kept["code"]), kept["report"], kept["message"], True
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "runner", "mode=compile", *args], capture_output=True, text=True,
                          env=env, cwd=os.getcwd())
    report = None
    lines = proc.stdout.strip().splitlines()
    if lines and lines[-1].startswith('{"report": "compile"'):
        report = json.loads(lines[-1])
    errors = [line for line in proc.stderr.strip().splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    raised = [line for line in errors if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    message = next((e[len("error: "):] for e in errors if e.startswith("error: ")),
                   raised[-1] if raised else errors[-1] if errors else "")
    if proc.returncode in (0, 2, DOES_NOT_FIT_EXIT_CODE) and (report is not None or proc.returncode == 2):
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"code": proc.returncode, "report": report, "message": message}))
        tmp.replace(cache)
    return proc.returncode, report, message, False


def _valid(layout: Layout, base: Sequence[str]) -> str:
    """Why runner refuses this layout's command ('' if it does not): the same checks a run makes."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hydra.core.hydra_config import HydraConfig

    from runner.main.config import build_spec

    overrides = [*base, *layout.overrides()]
    try:
        build_spec(compose(HydraConfig.get().job.config_name, overrides=overrides), overrides)
    except UserError as err:
        return " ".join(str(err).split())
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        return " ".join(str(err).split())
    return ""


def _compile_in_order(plan: Plan, order: Sequence[Layout], settings: Any, say: Callable[[str], None]) -> int:
    """Compile `order`'s layouts, `settings.workers` at a time, until `settings.compiles` have compiled
    or `settings.minutes` have passed, each into `plan.rows` with a progress line; the number compiled.
    A layout runner refuses is listed without spending a compile."""
    workers = settings.workers or max(1, min(8, os.cpu_count() or 1))
    say(f"mode=plan: {plan.candidates} layouts of {plan.job} on {plan.topology}, {len(order)} to compile in order;"
        f" compiling up to {settings.compiles} of them, {workers} at a time, for at most {settings.minutes:g} minutes"
        " ...")
    compiling = time.perf_counter()
    deadline = compiling + 60 * settings.minutes
    queue = iter(order)
    running: dict[concurrent.futures.Future, Row] = {}
    done = 0
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        def submit_next() -> bool:
            for layout in queue:
                row = Row(layout)
                reason = _valid(layout, plan.base)
                if reason:
                    row.status, row.message = "refused", reason
                    plan.rows.append(row)
                    continue
                row.seconds = time.perf_counter()
                running[pool.submit(compile_layout, [*plan.base, *layout.overrides()], settings.cache)] = row
                return True
            return False

        launched = 0
        while launched < min(workers, settings.compiles) and submit_next():
            launched += 1
        while running:
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                row = running.pop(future)
                code, report, message, cached = future.result()
                row.seconds, row.report, row.cached = time.perf_counter() - row.seconds, report, cached
                row.status = {0: "fits", DOES_NOT_FIT_EXIT_CODE: "does not fit", 2: "refused"}.get(code, "failed")
                row.message = "" if code in (0, DOES_NOT_FIT_EXIT_CODE) else message or f"exit {code}"
                plan.rows.append(row)
                done += 1
                fits = sum(r.status == "fits" for r in plan.rows)
                say(f"mode=plan: {done}/{settings.compiles} compiled ({fits} fit) in "
                    f"{time.perf_counter() - compiling:.0f} s: {row.layout.label()}: {row.status}"
                    + (f", {_size(row.memory)}" if row.memory is not None else "") + (" (cached)" if cached else ""))
                if launched < settings.compiles and time.perf_counter() < deadline and submit_next():
                    launched += 1
    return done


def run_plan(spec: Any, overrides: Sequence[str], say: Callable[[str], None] = print) -> int:
    """mode=plan: search, compile, rank, print; the exit code says whether anything fits."""
    topology = parse_topology(spec.topology)
    _check_topology(topology)
    settings = spec.plan
    started = time.perf_counter()
    held, base = _held(overrides), _base(overrides)
    facts = facts_of(spec)
    from runner.models.common.decoder import remat_of

    candidates = layouts(topology, facts, held, remat_of(spec.job.model))
    limit = topology.chip.hbm_bytes_per_device if topology.chip else None
    if not candidates:
        raise UserError(f"mode=plan found no layout of job={spec.job.name} on topology={topology.name} that the "
                        f"held settings {held} allow (a mesh of the topology's devices, micro-batches that split the "
                        f"batch). Fix: hold fewer settings, or hold values that fit the topology.")
    # past the memory model's bound, the smallest still go to the compiler: its verdict, not the model's, is exit 3
    within = promising(candidates, limit)
    order = within or sorted(candidates, key=lambda c: c.memory_bytes)
    plan = Plan(spec.job.name, topology.name, base, held, len(candidates), len(candidates) - len(within))
    plan.seconds["enumerate"] = time.perf_counter() - started
    compiling = time.perf_counter()
    done = _compile_in_order(plan, order, settings, say)
    plan.seconds["compile"] = time.perf_counter() - compiling
    ranking = time.perf_counter()
    best = plan.fitting()
    plan.seconds["rank"] = time.perf_counter() - ranking
    say(text(plan, settings.rows))
    if not best and not any(r.status == "does not fit" for r in plan.rows):
        why = next((r for r in plan.rows if r.message), None)
        raise UserError(f"mode=plan could not compile any of the {len(plan.rows)} layouts of job={spec.job.name} on "
                        f"topology={topology.name} it tried: " + (f"{why.layout.label()} was {why.status}: "
                                                                  f"{why.message}" if why else "none was tried")
                        + " Fix: correct what that says (each layout's command is the job's, with its mesh), or "
                        "hold the settings it needs on the command line.")
    if not best:
        tried = sorted((r for r in plan.rows if r.status == "does not fit" and r.report), key=lambda r: r.memory or 0)
        advice = str(tried[0].report.get("advice", "pick a larger slice")) if tried and tried[0].report else \
            "pick a larger slice"
        say(f"fits: NO, none of the {done} compiled layouts fits on {topology.name} (exit "
            f"{DOES_NOT_FIT_EXIT_CODE}). For the smallest: {advice[0].upper()}{advice[1:]}; or raise plan.compiles "
            "to compile more layouts.")
    else:
        est = best[0].estimate
        assert est is not None
        hours = spec.train.steps * est.step_s / 3600
        chips = topology.num_chips
        say(f"best: {plan.command(best[0])}\n  at its estimate, train.steps={spec.train.steps:,} take "
            f"{hours / 24:.1f} days on {topology.name} ({hours * chips:,.0f} chip-hours), before evaluation, "
            "checkpoints and restarts")
    say(plan.to_json())
    return 0 if best else DOES_NOT_FIT_EXIT_CODE

