"""The same benchmark under several environments, interleaved: before/after an upgrade, XLA flags.

    python tools/bench/bench_envs.py --env before=/opt/venv-jax010/bin/python --env after=.venv/bin/python \\
        --repeats 3 --job gpt_tiny:60 --job gpt_10m:30 --out docs/records/bench_envs.jsonl

    python tools/bench/bench_envs.py --env plain=.venv/bin/python \\
        --env onednn=.venv/bin/python:XLA_FLAGS=--xla_cpu_use_onednn=true --job gpt_tiny:60

An environment is ``NAME=PYTHON[:VAR=VALUE[:VAR=VALUE...]]``: an interpreter (a virtual
environment with runner's dependencies) and extra environment variables. Every repeat runs
tools/bench/bench.py once per job and environment, each in a fresh process (so each measures its own
compilation), and the order of the environments flips from one repeat to the next, so the
machine's drift and other tenants' load fall on all of them alike. Each run's JSON line (from
tools/bench/bench.py) is appended to ``--out`` with the environment's name and the repeat; the table at
the end gives per job and environment the medians over repeats of runner's tokens/s, the bare
jitted loop's tokens/s and the time from the start of a run to its first step, and each against
the first environment as the median of the per-repeat ratios (runs of one repeat are next to
each other in time, so the ratio of a pair is far less noisy than the ratio of two medians).
``--summarize FILE`` prints the table of a earlier run's JSON lines again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def parse_env(text: str) -> tuple[str, str, dict[str, str]]:
    """``NAME=PYTHON[:VAR=VALUE...]`` -> (name, python, extra variables)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--env {text!r}: write NAME=PYTHON[:VAR=VALUE...]")
    python, *pairs = rest.split(":")
    extra = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--env {text!r}: {pair!r} is not VAR=VALUE")
        extra[key] = value
    return name, python, extra


def parse_job(text: str) -> tuple[str, int]:
    job, _, steps = text.partition(":")
    return job, int(steps or 60)


def run_one(env: tuple[str, str, dict[str, str]], job: str, steps: int, overrides: list[str]) -> dict[str, Any]:
    name, python, extra = env
    cmd = [python, str(ROOT / "tools" / "bench" / "bench.py"), "--rounds", "1", "--steps", str(steps),
           "--label", f"{name}/{job}", f"job={job}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", **extra},
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"bench_envs: {name}/{job} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    record = json.loads(lines[-1])
    record["env"] = name
    record["env_vars"] = extra
    return record


def summary(records: list[dict[str, Any]], envs: list[str]) -> str:
    """Medians per job and environment; against the first environment, the median of the ratios
    of runs in the same repeat."""
    keys = (("tokens_per_s", "runner tok/s"), ("baseline_tokens_per_s", "bare loop tok/s"),
            ("time_to_first_step_s", "first step s"), ("baseline_first_step_s", "bare compile s"))
    lines = []
    for job in dict.fromkeys(r["job"] for r in records):
        lines.append(f"{job}:")
        runs = {(r["env"], r.get("repeat", 0)): r for r in records if r["job"] == job}
        for env in envs:
            mine = [r for (e, _), r in runs.items() if e == env]
            cells = []
            for key, label in keys:
                value = statistics.median(r[key] for r in mine)
                pairs = [r[key] / runs[(envs[0], rep)][key] for (e, rep), r in runs.items()
                         if e == env and (envs[0], rep) in runs]
                against = f" ({statistics.median(pairs):.3f}x)" if env != envs[0] and pairs else ""
                cells.append(f"{label} {value:,.4g}{against}")
            lines.append(f"  {env:<20} n={len(mine)}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summarize", default=None, help="print the table of this JSON-lines file and exit")
    parser.add_argument("--env", action="append", type=parse_env, default=[],
                        help="NAME=PYTHON[:VAR=VALUE...]; the first is the reference")
    parser.add_argument("--job", action="append", type=parse_job, default=None,
                        help="JOB[:STEPS] (default gpt_tiny:60)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="append every run's JSON line here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args(argv)
    if args.summarize:
        records = [json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line.strip()]
        print(summary(records, list(dict.fromkeys(r["env"] for r in records))))
        return 0
    if not args.env:
        parser.error("name at least one --env NAME=PYTHON")
    jobs = args.job or [("gpt_tiny", 60)]
    records: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        order = args.env if repeat % 2 == 0 else list(reversed(args.env))
        for job, steps in jobs:
            for env in order:
                record = run_one(env, job, steps, args.overrides)
                record["repeat"] = repeat
                records.append(record)
                print(f"[{repeat + 1}/{args.repeats}] {env[0]}/{job}: {record['tokens_per_s']:,.0f} tok/s, "
                      f"bare {record['baseline_tokens_per_s']:,.0f}, first step {record['time_to_first_step_s']:.1f} s",
                      flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(record) + "\n")
    print(summary(records, [e[0] for e in args.env]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
