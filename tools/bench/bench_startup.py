"""Launch to first step, cold and warm: what the persistent compilation cache saves a relaunch.

    python tools/bench/bench_startup.py --job gpt_tiny --job gpt_10m --repeats 3 --out docs/records/bench_startup.jsonl

Each repeat runs every job twice in fresh processes and fresh run directories: `cold` with an
empty compilation cache (`run.compile_cache=<new dir>`), then `warm` with the cache the cold run
filled, as a relaunch after a preemption finds it. The figure is the wall time from starting
`python -m runner` to the progress line of step 1 (imports, data, initialisation, the start
evaluation, compiling or loading every program, and the first step itself). Both processes share
the same data cache (the embedded corpus is built once beforehand), so only compilation differs.
The table gives medians over repeats and the median of the per-repeat warm/cold ratios.

`--relaunch` times what a relaunch after a preemption does instead: resume a 2-step run (its
checkpoint copied afresh for each launch) to 4 steps, to the progress line of step 3: restore
instead of initialisation, no start evaluation, the train step compiled or loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def time_to_first_step(job: str, cache: Path, run_dir: Path, extra: list[str], steps: int = 2,
                       resumed_at: int = 0) -> float:
    """Seconds from launching runner to the progress line of its first step: `step 1/` for a fresh
    run, `step s+1/` for one that resumes at step s."""
    args = [sys.executable, "-m", "runner", f"job={job}", f"train.steps={steps}", "train.log_every=1",
            "eval.every=0", "logging.wandb=disabled", "logging.progress=plain", f"run.dir={run_dir}",
            f"run.compile_cache={cache}", *extra]
    first = f"step {resumed_at + 1}/"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if seen is None and line.startswith(first):
            seen = time.perf_counter() - start
    if proc.wait() != 0 or seen is None:
        raise SystemExit(f"runner failed for job={job} (exit {proc.returncode}): {' '.join(args)}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", action="append", default=None, help="a job (repeatable; default gpt_tiny, gpt_10m)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="append each measurement as a JSON line")
    parser.add_argument("--relaunch", action="store_true", help="time resumed launches (a relaunch after a "
                        "preemption) instead of fresh ones")
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    jobs = args.job or ["gpt_tiny", "gpt_10m"]
    results: dict[tuple[str, str], list[float]] = {}
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            for job in jobs:
                cache = work / f"cache-{job}-{repeat}"
                base = work / f"base-{job}-{repeat}"
                if args.relaunch:  # the run a preemption stopped at step 2 (its own cache, thrown away)
                    time_to_first_step(job, work / f"base-cache-{job}-{repeat}", base, args.extra)
                pair = {}
                for mode in ("cold", "warm"):
                    run_dir = work / f"run-{job}-{repeat}-{mode}"
                    if args.relaunch:
                        shutil.copytree(base, run_dir)
                    seconds = (time_to_first_step(job, cache, run_dir, args.extra, steps=4, resumed_at=2)
                               if args.relaunch else time_to_first_step(job, cache, run_dir, args.extra))
                    pair[mode] = seconds
                    results.setdefault((job, mode), []).append(seconds)
                    record = {"job": job, "mode": mode, "repeat": repeat, "seconds_to_first_step": seconds,
                              "cache_entries": len(list(cache.glob("*-cache"))),
                              "launch": "relaunch" if args.relaunch else "fresh"}
                    print(json.dumps(record), flush=True)
                    if args.out:
                        with open(args.out, "a") as out:
                            out.write(json.dumps(record) + "\n")
                ratios.setdefault(job, []).append(pair["warm"] / pair["cold"])
    print(f"\n{'job':<10} {'cold s':>8} {'warm s':>8} {'warm/cold':>10}")
    for job in jobs:
        cold, warm = statistics.median(results[(job, "cold")]), statistics.median(results[(job, "warm")])
        print(f"{job:<10} {cold:>8.1f} {warm:>8.1f} {statistics.median(ratios[job]):>10.2f}")


if __name__ == "__main__":
    main()
