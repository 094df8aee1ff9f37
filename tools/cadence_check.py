"""The cadence model held against a measurement on this machine (docs/cadence.md, "The measured
check"): a small job trained to the end under a seeded schedule of SIGKILLs, relaunched by a
supervisor loop, once with checkpoint.cadence=auto and once per fixed interval at multiples of the
interval auto chose; each run's goodput measured beside the forecast for it.

    python tools/cadence_check.py                        # gpt_tiny, 3000 steps, MTBF 60 s: about 20 minutes
    python tools/cadence_check.py --steps 400 --mtbf-s 20 --multiples 0.5,2 --override job.model.d_model=32

The schedule: kill times of a Poisson process with mean gap --mtbf-s, drawn from --seed, in each
run's own wall clock from its first launch; every run meets the same times (common random numbers,
so the runs differ by their cadence more than by their luck). At a kill time the supervisor
SIGKILLs the launch's process group, and relaunches the same command at once, until a launch exits 0.

Measured, per run: the goodput the model speaks of, the training kept (goodput/train_s less
recomputed_s of its last record) over the supervisor's wall time from the first launch to the end
of the last (runner's own goodput/percent is shown too: it cannot count the time of launches that
died before their first checkpoint). The forecast for each run takes that run's measured costs: a
save's blocking seconds (goodput/checkpoint_s over saves), a relaunch's (the supervisor's time from
a relaunch to its first step), the first launch's start, the step time and the interval the run
saved at (checkpoint.every_steps; for auto, the last interval it chose, from its printed lines), the
schedule's MTBF, and what the model does not choose over (evaluation, data waits and
other seconds of the record). Two forecasts: the closed form (expected goodput), and the model
replayed on the kill times this run met.

Verdicts: auto's goodput is the best measured or within noise of it (two standard deviations of the
difference between auto's run and the best one, simulated with both meeting the same kill times as
here); each closed-form forecast is within 10% of its measured goodput (and, apart, each replayed
one). The table, the verdicts and one JSON line go to stdout (--out appends the JSON). The noise
column is one run's standard deviation under the model: with a handful of kills per run it is a
few points, so the closed form can miss by luck where the replay does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from goodput_forecast import goodput_record  # noqa: E402

from runner.checkpoint import cadence as cd  # noqa: E402

QUIET = ["eval.evaluators=[]", "logging.wandb=disabled", "logging.progress=plain", "train.log_every=1"]
# auto's choice (not the line saying it waits at the fixed intervals: "durable every N steps (the fixed ...")
CHOSEN = re.compile(r"checkpoint cadence auto: durable every (\d+) steps \((?!the fixed intervals)")


class Refused(Exception):
    """A bad argument: one paragraph, exit 2."""


class Failed(Exception):
    """A run that could not be measured (runner failed, or never finished)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise Refused(f"{message}. Fix: see `python tools/cadence_check.py --help`.")


@dataclass
class Launch:
    spawned: float  # seconds from the run's start
    first_step: Optional[float]
    ended: float
    code: int
    killed: bool


@dataclass
class Session:
    """One run under the schedule: its launches, the kill times it met and its output."""

    launches: list[Launch] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.launches[-1].ended if self.launches else 0.0


def kill_times(mtbf_s: float, seed: int) -> Iterator[float]:
    """The seeded Poisson schedule: cumulative exponential gaps of mean `mtbf_s`."""
    rng, t = random.Random(seed), 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        yield t


def supervise(args: list[str], env: dict[str, str], mtbf_s: float, seed: int, log: Path,
              max_launches: int) -> Session:
    """Run `python -m runner args` to the end, SIGKILLing each launch's process group at the schedule's
    times and relaunching at once."""
    session, schedule = Session(), kill_times(mtbf_s, seed)
    next_kill = next(schedule)
    start = time.monotonic()
    with open(log, "a") as out:
        while True:
            spawned = time.monotonic() - start
            proc = subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            first: list[float] = []
            reader = threading.Thread(target=_read, args=(proc, out, session.lines, first, start), daemon=True)
            reader.start()
            killed = False
            try:
                while proc.poll() is None:
                    now = time.monotonic() - start
                    if now >= next_kill:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        session.kills.append(next_kill)
                        next_kill, killed = next(schedule), True
                        break
                    time.sleep(min(0.02, next_kill - now))
            except BaseException:  # (Ctrl-C): leave no launch behind
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                raise
            ended = time.monotonic() - start
            reader.join()
            session.launches.append(Launch(spawned, first[0] if first else None, ended, proc.returncode, killed))
            if proc.returncode == 0:
                return session
            if not killed:
                raise Failed(f"runner exited {proc.returncode} (not killed by the schedule): {' '.join(args)}; "
                             f"its output is in {log}")
            if len(session.launches) >= max_launches:
                raise Failed(f"not finished after {max_launches} launches ({' '.join(args)}): the schedule kills "
                             "faster than a launch reaches its first save; raise --mtbf-s.")


def _read(proc: subprocess.Popen, out: Any, lines: list[str], first: list[float], start: float) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if not first and line.startswith("step "):
            first.append(time.monotonic() - start)
        out.write(line)
        if "checkpoint cadence auto" in line or line.startswith("Finished"):
            lines.append(line.rstrip())


@dataclass
class Result:
    name: str
    every_steps: int
    interval_s: float
    launches: int
    kills: int
    wall_s: float
    measured: float  # kept training over the supervisor's wall
    runner_percent: float
    closed_form: float
    replayed: float
    noise: float  # one run's simulated standard deviation
    save_s: float
    relaunch_s: float
    start_s: float
    step_s: float
    other_s: float
    kept_s: float

    @property
    def off(self) -> float:
        return (self.closed_form - self.measured) / self.measured

    @property
    def replay_off(self) -> float:
        return (self.replayed - self.measured) / self.measured

    def model(self, mtbf_s: float, failure_times: Optional[Sequence[float]] = None, runs: int = 1,
              seed: int = 0) -> cd.Simulated:
        """This run in the model: its own costs, its interval, its training; the wall time the model
        does not choose over (other_s) added."""
        sim = cd.simulate(cd.Cadence(self.interval_s), cd.Costs(self.save_s, self.relaunch_s, mtbf_s), self.kept_s,
                          runs=runs, seed=seed, start_s=self.start_s, final_save=True, failure_times=failure_times)
        return dataclasses.replace(sim, goodput=self.kept_s / (self.kept_s / sim.goodput + self.other_s))


def chosen_every(lines: Sequence[str]) -> Optional[int]:
    """auto's last choice of durable interval, in steps, from the lines its launches printed (None: it never
    chose): the interval the run saved at in the end."""
    chosen = [int(m.group(1)) for line in lines for m in [CHOSEN.search(line)] if m]
    return chosen[-1] if chosen else None


def measure(name: str, every: int, session: Session, run_dir: Path, mtbf_s: float, steps: int) -> Result:
    """The run's measured goodput and the forecasts made from its own measured costs, at the interval
    it saved at: `every` steps (checkpoint.every_steps; for auto, its last choice). Not the steps over
    the saves counted: a restored checkpoint carries the saves before it, not itself, and a killed
    launch's saves after it are lost, so that count undercounts."""
    last, _ = goodput_record(run_dir)
    kept = last["goodput/train_s"] - last["goodput/recomputed_s"]
    saves = max(1.0, last.get("goodput/saves", 1.0))
    step_s = kept / steps
    interval_steps = every
    starts = [launch.first_step - launch.spawned for launch in session.launches if launch.first_step is not None]
    start_s = starts[0] if starts else 0.0
    relaunch_s = sum(starts[1:]) / len(starts[1:]) if len(starts) > 1 else start_s
    other = sum(last.get(f"goodput/{c}_s", 0.0) for c in ("eval", "data_wait", "other"))
    costs = cd.Costs(last["goodput/checkpoint_s"] / saves, relaunch_s, mtbf_s)
    cadence = cd.Cadence(interval_steps * step_s)
    closed = kept / (kept / cd.expected_run_goodput(cadence, costs, kept, start_s) + other)
    result = Result(name, every, cadence.durable_s, len(session.launches), len(session.kills), session.wall_s,
                    kept / session.wall_s, last["goodput/percent"] / 100.0, closed, math.nan, math.nan, costs.save_s,
                    relaunch_s, start_s, step_s, other, kept)
    result.replayed = result.model(mtbf_s, session.kills + list(_after(session.kills, mtbf_s))).goodput
    result.noise = result.model(mtbf_s, runs=200, seed=1).stdev
    return result


def _after(kills: Sequence[float], mtbf_s: float, more: int = 1000) -> Iterator[float]:
    """Failures the replay may meet after the run's last kill (it can run longer than the run did)."""
    t = kills[-1] if kills else 0.0
    rng = random.Random(len(kills))
    for _ in range(more):
        t += rng.expovariate(1.0 / mtbf_s)
        yield t


def table(results: Sequence[Result]) -> str:
    head = (f"{'run':12s} {'every':>6s} {'interval':>9s} {'launches':>8s} {'wall s':>7s} {'measured':>9s} "
            f"{'runner':>7s} {'forecast':>9s} {'replayed':>9s} {'off':>7s} {'noise':>6s}")
    rows = [head] + [f"{r.name:12s} {r.every_steps:6d} {r.interval_s:8.2f}s {r.launches:8d} {r.wall_s:7.1f} "
                     f"{100 * r.measured:8.1f}% {100 * r.runner_percent:6.1f}% {100 * r.closed_form:8.1f}% "
                     f"{100 * r.replayed:8.1f}% {100 * r.off:+6.1f}% {100 * r.noise:5.1f}%" for r in results]
    return "\n".join(rows)


def difference_noise(a: Result, b: Result, mtbf_s: float, seeds: int = 200) -> float:
    """The standard deviation of a's goodput less b's when both meet the same kill times, as the
    check's runs do (common random numbers), from the model with each run's own costs."""
    if a is b:
        return 0.0
    diffs = []
    for seed in range(seeds):
        horizon, times = 20.0 * max(a.wall_s, b.wall_s) + 10.0 * mtbf_s, []
        for t in kill_times(mtbf_s, 1_000_000 + seed):
            if t > horizon:
                break
            times.append(t)
        diffs.append(a.model(mtbf_s, times).goodput - b.model(mtbf_s, times).goodput)
    mean = sum(diffs) / seeds
    return math.sqrt(sum((d - mean) ** 2 for d in diffs) / (seeds - 1))


def verdicts(results: Sequence[Result], mtbf_s: float, tolerance: float = 0.10) -> dict[str, Any]:
    """auto (the first result) is the best measured, or behind it by less than two standard
    deviations of the difference; each forecast is within `tolerance` of its measurement."""
    auto, best = results[0], max(results, key=lambda r: r.measured)
    margin = 2.0 * difference_noise(auto, best, mtbf_s)
    return {"auto_best_or_within_noise": auto.measured >= best.measured - margin, "best": best.name,
            "auto_behind_best": best.measured - auto.measured, "noise_margin": margin,
            "forecast_within_10pct": all(abs(r.off) <= tolerance for r in results),
            "worst_forecast_off": max(abs(r.off) for r in results),
            "replay_within_10pct": all(abs(r.replay_off) <= tolerance for r in results),
            "worst_replay_off": max(abs(r.replay_off) for r in results)}


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="gpt_tiny")
    p.add_argument("--steps", type=int, default=3000, help="train.steps of every run")
    p.add_argument("--mtbf-s", type=float, default=60.0, help="the schedule's mean seconds between kills")
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed")
    p.add_argument("--multiples", default="0.25,0.5,2,4", help="the fixed intervals, as multiples of auto's")
    p.add_argument("--fallback-steps", type=int, default=100,
                   help="checkpoint.every_steps of the auto run: its interval until a save is measured")
    p.add_argument("--override", action="append", default=[], help="another runner override (repeatable)")
    p.add_argument("--max-launches", type=int, default=200, help="give up on a run after this many launches")
    p.add_argument("--work-dir", default="", help="where the runs go (default: a temporary directory, removed)")
    p.add_argument("--out", default="", help="append the JSON line to this file")
    opts = p.parse_args(argv)
    try:
        opts.multiples = [float(m) for m in opts.multiples.split(",") if m.strip()]
    except ValueError:
        raise Refused(f"--multiples={opts.multiples!r}: not a comma-separated list of numbers. Fix: e.g. "
                      "--multiples 0.25,0.5,2,4.") from None
    for name in ("steps", "mtbf_s", "fallback_steps", "max_launches"):
        if getattr(opts, name) <= 0:
            raise Refused(f"--{name.replace('_', '-')}={getattr(opts, name)}: it must be > 0. Fix: give a value > 0.")
    if not opts.multiples or any(m <= 0 for m in opts.multiples):
        raise Refused(f"--multiples={opts.multiples}: each must be > 0. Fix: e.g. --multiples 0.25,0.5,2,4.")
    return opts


def run_all(opts: argparse.Namespace, work: Path) -> list[Result]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    base = [f"job={opts.job}", f"train.steps={opts.steps}", *QUIET, f"checkpoint.mtbf_hours={opts.mtbf_s / 3600!r}",
            *opts.override]
    plan: list[tuple[str, list[str], int]] = [
        ("auto", ["checkpoint.cadence=auto", f"checkpoint.every_steps={opts.fallback_steps}"], 0)]
    results: list[Result] = []
    while plan:
        name, extra, every = plan.pop(0)
        run_dir = work / name.replace(" ", "_")
        print(f"{name}: training {opts.steps} steps under kills every {opts.mtbf_s:g} s on average ...", flush=True)
        session = supervise([*base, *extra, f"run.dir={run_dir}"], env, opts.mtbf_s, opts.seed,
                            work / f"{run_dir.name}.log", opts.max_launches)
        if name == "auto":
            chosen = chosen_every(session.lines)
            if chosen is None:
                raise Failed(f"the auto run never chose an interval (no line 'checkpoint cadence auto: durable every "
                             f"N steps (...)'); see {work / 'auto.log'}")
            every = chosen
            plan = [(f"fixed x{m:g}", [f"checkpoint.every_steps={max(1, round(every * m))}"],
                     max(1, round(every * m))) for m in opts.multiples]
        result = measure(name, every, session, run_dir, opts.mtbf_s, opts.steps)
        results.append(result)
        print(f"  {result.launches} launches, {result.kills} kills, {result.wall_s:.0f} s: goodput measured "
              f"{100 * result.measured:.1f}%, forecast {100 * result.closed_form:.1f}%", flush=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        opts = parse(argv)
    except Refused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    work = Path(opts.work_dir) if opts.work_dir else Path(tempfile.mkdtemp(prefix="cadence-check-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        results = run_all(opts, work)
    except Failed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if not opts.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    found = verdicts(results, opts.mtbf_s)
    print(table(results))
    print(f"auto is {'the best or within noise of it' if found['auto_best_or_within_noise'] else 'NOT within noise'}"
          f" (best: {found['best']}, {100 * found['auto_behind_best']:.1f} points ahead of auto; noise margin "
          f"{100 * found['noise_margin']:.1f}); every forecast within 10%: {found['forecast_within_10pct']} (worst "
          f"{100 * found['worst_forecast_off']:.1f}%); every replay within 10%: {found['replay_within_10pct']} (worst "
          f"{100 * found['worst_replay_off']:.1f}%)")
    record = {"check": "cadence", "job": opts.job, "steps": opts.steps, "mtbf_s": opts.mtbf_s, "seed": opts.seed,
              "overrides": opts.override, "minutes": (time.monotonic() - started) / 60, **found,
              "runs": [asdict(r) for r in results], "command": " ".join(sys.argv)}
    line = json.dumps(record)
    print(line)
    if opts.out:
        with open(opts.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
