"""A job's goodput at scale, from what its saves and relaunches cost and how often its hosts fail
(docs/cadence.md): the expected goodput, the interruptions a day and the best checkpoint
intervals, for auto and for fixed cadences, the closed form beside a seeded simulation.

    python tools/goodput_forecast.py --run-dir runs/gpt_tiny/default --hosts 128
    python tools/goodput_forecast.py --save-s 40 --relaunch-s 600 --hosts 2048
    python tools/goodput_forecast.py --save-s 40 --local-save-s 4 --relaunch-s 600 --hosts 2048 --json

With --run-dir (a path or a gs:// URL, read through runner.checkpoint.storage) the costs are the
run's own, from the newest goodput record of its metrics.jsonl: a durable save's blocking seconds
(goodput/checkpoint_s over goodput/saves), a local save's (checkpoint_local_s over saves_local) and
the step time (the median logged step_time_s); a relaunch's is the mean of startup_s + restore_s +
compile_s over the launches in its launches.jsonl (every launch that reached its loop, those killed
before their first save too; without that file, the record's sums over goodput/launches, which
counts only the launches a checkpoint remembers, so it is biased low when launches die before their
first save), and the hosts those lines record. Its spec.yaml gives the fixed intervals it ran with,
checkpoint.mtbf_hours, checkpoint.auto_max_minutes and the local tier's host_loss_fraction. Any of
them given on the command line wins.

Costs of more than 50 job MTBFs (a relaunch, or a save with the shortest interval) are refused: the
goodput there is below e^-50, nothing to plan with, and the arithmetic would overflow; a row whose
interval reaches that far shows n/a.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.checkpoint import cadence as cd  # noqa: E402

MULTIPLES = (0.25, 0.5, 2.0, 4.0)
SEGMENTS = 5000  # a simulated run ends after `days` of training or this many intervals between saves (its time)


class Refused(Exception):
    """A bad argument: one paragraph, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise Refused(f"{message}. Fix: see `python tools/goodput_forecast.py --help`.")


@dataclass
class Inputs:
    """A job's costs and failure rate, and where each came from."""

    save_s: float
    relaunch_s: float
    hosts: int
    mtbf_hours: float
    local_save_s: Optional[float] = None
    local_recovers: float = 0.0
    step_s: Optional[float] = None
    fixed: Optional[cd.Cadence] = None  # the run's own fixed intervals, in seconds
    fixed_words: str = ""
    source: str = ""
    max_minutes: float = 60.0  # the longest interval auto chooses (checkpoint.auto_max_minutes)

    def costs(self) -> cd.Costs:
        return cd.Costs(self.save_s, self.relaunch_s, cd.job_mtbf_s(self.mtbf_hours, self.hosts), self.local_save_s,
                        self.local_recovers if self.local_save_s is not None else 0.0)


def goodput_record(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The newest record with goodput in a run's metrics.jsonl, and all its step records."""
    text = _read(run_dir, "metrics.jsonl")
    if text is None:
        raise Refused(f"--run-dir={run_dir}: there is no metrics.jsonl in it. Fix: give a run directory runner "
                      "trained in, or the costs themselves (--save-s, --relaunch-s).")
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    found = [r for r in records if "goodput/percent" in r]
    if not found:
        raise Refused(f"--run-dir={run_dir}: its metrics.jsonl has no goodput record yet (one is logged every "
                      "train.log_every steps). Fix: train it further, or give the costs (--save-s, --relaunch-s).")
    return found[-1], [r for r in records if "loss" in r and "step_time_s" in r]


def _read(run_dir: str | Path, name: str) -> Optional[str]:
    """A file of the run directory, local or remote (the location passed on as given: a gs:// URL
    must not go through pathlib, which would fold its `//`)."""
    from runner.checkpoint import storage

    path = storage.path(run_dir) / name
    return path.read_text() if path.exists() else None


def _launches(run_dir: str) -> list[dict[str, Any]]:
    """The run's launches.jsonl (runner.observability.launches): one line per launch that reached its loop."""
    from runner.observability import launches

    return launches.read(run_dir)


def from_run(run_dir: str, hosts: Optional[int]) -> Inputs:
    """A run directory's measured costs, its fixed intervals and its settings."""
    last, steps = goodput_record(run_dir)
    saves = last.get("goodput/saves")
    if not saves:
        raise Refused(f"--run-dir={run_dir}: its goodput record counts no durable save (goodput/saves: "
                      f"{saves!r}; runner logs it since checkpoint.cadence came in). Fix: give --save-s.")
    starts = _launches(run_dir)
    if starts:  # every launch that reached its loop, those that died before their first save too
        relaunch = statistics.fmean(sum(float(r.get(f"{c}_s", 0.0)) for c in ("startup", "restore", "compile"))
                                    for r in starts)
        launch_words = f"{len(starts)} launches (launches.jsonl)"
    else:  # the launches the checkpoints remember: biased low when launches die before their first save
        launches = max(1.0, last.get("goodput/launches", 1.0))
        relaunch = sum(last.get(f"goodput/{c}_s", 0.0) for c in ("startup", "restore", "compile")) / launches
        launch_words = f"{int(launches)} launches (goodput/launches; no launches.jsonl)"
    recorded = next((int(r[k]) for r in reversed(starts) for k in ("hosts", "processes") if r.get(k)), None)
    local_saves = last.get("goodput/saves_local", 0.0)
    local_s = last["goodput/checkpoint_local_s"] / local_saves if local_saves else None
    step_s = statistics.median(r["step_time_s"] for r in steps) if steps else None
    spec = _spec(run_dir)
    ck = spec.get("checkpoint", {}) or {}
    inputs = Inputs(last["goodput/checkpoint_s"] / saves, relaunch, hosts or recorded or 1,
                    float(ck.get("mtbf_hours", cd.DEFAULT_MTBF_HOURS)), local_s, step_s=step_s,
                    source=f"{run_dir}: {int(saves)} durable saves, {int(local_saves)} local, {launch_words}",
                    max_minutes=float(ck.get("auto_max_minutes", 60.0)))
    local = ck.get("local", {}) or {}
    if local_s is not None:
        inputs.local_recovers = 1.0 - float(local.get("host_loss_fraction", cd.DEFAULT_HOST_LOSS))
    if step_s and ck.get("every_steps"):
        local_every = local.get("every_steps") if local.get("dir") else 0
        inputs.fixed = cd.Cadence(ck["every_steps"] * step_s, local_every * step_s if local_every else None)
        local_words = f", local every {local_every}" if local_every else ""
        inputs.fixed_words = f"every {ck['every_steps']} steps{local_words}"
    return inputs


def _spec(run_dir: str) -> dict[str, Any]:
    text = _read(run_dir, "spec.yaml")
    if text is None:
        return {}
    import yaml

    return yaml.safe_load(text) or {}


@dataclass
class Row:
    name: str
    durable_s: float
    local_s: Optional[float]
    closed_form: float
    simulated: float
    stderr: float


def forecast(inputs: Inputs, days: float = 7.0, runs: int = 100, seed: int = 0,
             max_s: float = 3600.0) -> tuple[cd.Cadence, list[Row]]:
    """auto's choice and the rows: auto, fixed at multiples of it, and the run's own fixed
    intervals; each row's closed form and simulated goodput (runs of `days` of training each). A
    row beyond the model's range (cadence.Unworkable: an interval over 50 job MTBFs, or a simulated
    run that would meet more failures than cadence.MAX_SIMULATED_FAILURES) is NaN there."""
    costs = inputs.costs()
    auto = cd.best(costs, min_s=inputs.step_s or 1e-3, max_s=max_s)
    rows = [("auto", auto)] + [(f"fixed x{m:g}", auto.scaled(m)) for m in MULTIPLES]
    if inputs.fixed is not None:
        rows.append((f"fixed, as run ({inputs.fixed_words})", inputs.fixed))
    out = []
    for name, cadence in rows:
        period = cadence.k * cadence.period_s  # a whole number of durable periods: the steady state
        work = max(1, round(min(days * cd.DAY, SEGMENTS * cadence.period_s) / period)) * period
        closed = simulated = stderr = math.nan
        with contextlib.suppress(cd.Unworkable):
            closed = cd.expected_goodput(cadence, costs)
            sim = cd.simulate(cadence, costs, work, runs=runs, seed=seed)
            simulated, stderr = sim.goodput, sim.stderr
        out.append(Row(name, cadence.k * cadence.period_s, cadence.local_s if cadence.k > 1 else None,
                       closed, simulated, stderr))
    return auto, out


def table(inputs: Inputs, rows: Sequence[Row], days: float, runs: int) -> str:
    costs = inputs.costs()
    head = [f"job: {inputs.hosts:,} host{'s' if inputs.hosts != 1 else ''}, MTBF {inputs.mtbf_hours:,.4g} h per host: "
            f"job MTBF {cd._duration(costs.mtbf_s)}, {cd._count(costs.failures_per_day)} interruptions a day",
            f"costs: a durable save blocks {inputs.save_s:.3g} s, a relaunch {inputs.relaunch_s:.3g} s"
            + (f", a local save {inputs.local_save_s:.3g} s (the local tier recovers "
               f"{100 * inputs.local_recovers:.0f}% of failures)" if inputs.local_save_s is not None else "")
            + (f", a step {inputs.step_s:.3g} s" if inputs.step_s else "")
            + (f" ({inputs.source})" if inputs.source else ""),
            f"goodput: the closed form (exact for the model) beside {runs} seeded simulated runs of {days:g} days of "
            f"training or {SEGMENTS:,} intervals each (mean, standard error)", ""]
    lines = [f"{'cadence':34s} {'durable':>10s} {'local':>10s} {'closed form':>12s} {'simulated':>18s}"]
    for r in rows:
        local = cd._duration(r.local_s) if r.local_s else "off"
        closed = "n/a" if math.isnan(r.closed_form) else f"{100 * r.closed_form:.2f}%"
        simulated = "n/a" if math.isnan(r.simulated) else f"{100 * r.simulated:.2f}% ± {100 * r.stderr:.2f}"
        lines.append(f"{r.name:34s} {cd._duration(r.durable_s):>10s} {local:>10s} {closed:>12s} {simulated:>18s}")
    if any(math.isnan(r.closed_form) or math.isnan(r.simulated) for r in rows):
        lines.append(f"(n/a: beyond the model's range, an interval and its save over {cd.MAX_OVER_MTBF:g} job "
                     f"MTBFs, or a simulated run of more than {cd.MAX_SIMULATED_FAILURES:,} failures; its goodput is "
                     "near 0)")
    return "\n".join(head + lines)


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", help="a run directory (or gs:// URL): its measured costs")
    p.add_argument("--save-s", type=float, help="seconds a durable save blocks training")
    p.add_argument("--local-save-s", type=float, help="seconds a local save blocks training (a local tier)")
    p.add_argument("--relaunch-s", type=float, help="seconds a relaunch costs before training resumes")
    p.add_argument("--step-s", type=float, help="seconds a step takes (the shortest interval)")
    p.add_argument("--hosts", type=int, help="the job's hosts (default: with --run-dir the hosts its "
                   "launches.jsonl records, else 1)")
    p.add_argument("--mtbf-hours", type=float, help=f"per host (default {cd.DEFAULT_MTBF_HOURS:g}: Llama 3's)")
    p.add_argument("--host-loss", type=float, help="with a local tier: the fraction of failures that lose a host "
                   f"with it (default: the run's checkpoint.local.host_loss_fraction, else {cd.DEFAULT_HOST_LOSS}; 0 "
                   "when every host's shards have a copy on another)")
    p.add_argument("--max-minutes", type=float, help="the longest interval (default: the run's "
                   "checkpoint.auto_max_minutes, else 60)")
    p.add_argument("--days", type=float, default=7.0, help="training days per simulated run")
    p.add_argument("--runs", type=int, default=100, help="simulated runs per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    return p.parse_args(argv)


def inputs_of(opts: argparse.Namespace) -> Inputs:
    for name in ("save_s", "local_save_s", "relaunch_s", "step_s", "hosts", "mtbf_hours", "max_minutes", "days",
                 "runs"):
        value = getattr(opts, name)
        if value is not None and (value <= 0 if name not in ("save_s", "local_save_s", "relaunch_s") else value < 0):
            bound = "> 0" if name not in ("save_s", "local_save_s", "relaunch_s") else ">= 0"
            raise Refused(f"--{name.replace('_', '-')}={value}: it must be {bound}. Fix: give a value {bound}.")
    if opts.host_loss is not None and not 0 <= opts.host_loss <= 1:
        raise Refused(f"--host-loss={opts.host_loss}: it is a fraction of failures. Fix: give a value from 0 to 1.")
    if opts.run_dir:
        inputs = from_run(opts.run_dir, opts.hosts)
    elif opts.save_s is None or opts.relaunch_s is None:
        raise Refused("nothing to forecast from: give --run-dir DIR (a run's measured costs), or --save-s and "
                      "--relaunch-s (seconds). Fix: e.g. `--save-s 40 --relaunch-s 600 --hosts 2048`.")
    else:
        inputs = Inputs(opts.save_s, opts.relaunch_s, opts.hosts or 1, cd.DEFAULT_MTBF_HOURS)
    run_local = inputs.local_save_s is not None  # the run had a local tier: its host_loss_fraction is known
    for name in ("save_s", "relaunch_s", "local_save_s", "step_s", "mtbf_hours", "max_minutes"):
        if getattr(opts, name) is not None:
            setattr(inputs, name, getattr(opts, name))
    if opts.host_loss is not None and inputs.local_save_s is None:
        raise Refused(f"--host-loss={opts.host_loss}: it is the share of failures a local tier does not survive, "
                      f"and there is no local tier{' in the run' if opts.run_dir else ''}. Fix: add --local-save-s "
                      "(seconds a local save blocks), or drop --host-loss.")
    if opts.host_loss is not None:
        inputs.local_recovers = 1.0 - opts.host_loss
    elif inputs.local_save_s is not None and not run_local:  # a local tier the run did not have: the default
        inputs.local_recovers = 1.0 - cd.DEFAULT_HOST_LOSS
    _check_range(inputs)
    return inputs


def _check_range(inputs: Inputs) -> None:
    """Refuse costs of more than MAX_OVER_MTBF job MTBFs: the goodput is ~0 and the arithmetic overflows."""
    costs = inputs.costs()
    shortest = inputs.step_s or 0.0
    try:
        cd.check_range(costs, shortest + max(costs.save_s, costs.local_save_s or 0.0))
    except cd.Unworkable as err:
        option = {"relaunch": "--relaunch-s", "save": "--save-s", "local save": "--local-save-s"}.get(err.what, "")
        raise Refused(f"{option or 'the costs'}: {err} Fix: check {option or 'the costs'}, or give fewer --hosts or "
                      "a larger --mtbf-hours (it is per host).") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        opts = parse(argv)
        inputs = inputs_of(opts)
    except Refused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    auto, rows = forecast(inputs, opts.days, opts.runs, opts.seed, inputs.max_minutes * 60)
    print(table(inputs, rows, opts.days, opts.runs))
    if opts.json:
        costs = inputs.costs()
        print(json.dumps({"forecast": "goodput", **{k: v for k, v in asdict(inputs).items() if k != "fixed"},
                          "job_mtbf_s": costs.mtbf_s, "interruptions_per_day": costs.failures_per_day,
                          "auto_durable_s": auto.durable_s, "auto_local_s": auto.local_s if auto.k > 1 else None,
                          "young_s": cd.young(inputs.save_s, costs.mtbf_s),
                          "daly_s": cd.daly(inputs.save_s, costs.mtbf_s),
                          "rows": [_no_nan(asdict(r)) for r in rows]}, default=str))
    return 0


def _no_nan(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: a row beyond the model's range is null there."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


if __name__ == "__main__":
    sys.exit(main())
