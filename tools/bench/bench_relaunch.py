"""What a supervisor buys: a two-host run (two JAX processes on this machine) after a SIGKILL,
restarted by Ray (hydra/launcher=ray) against the same command relaunched by hand / by a shell loop.

    python tools/bench/bench_relaunch.py recover --out docs/records/bench_relaunch.jsonl
    python tools/bench/bench_relaunch.py schedule --kill-every 20 --out docs/records/bench_relaunch.jsonl

`recover` trains until step --kill-at, SIGKILLs process 1 and times what follows, from outside, on
the clock of this process: until the failure is noticed (Ray: the attempt's end; by hand: the last
process gone, the survivor after jax.distributed's heartbeat timeout), until the new processes start,
until runner says where it resumed (imports, jax.distributed, restore), and until the first new
step is logged (compiling, from the compile cache both share). Both side by side, in one run.

`schedule` trains --steps to the end while process 1 is SIGKILLed every --kill-every seconds of
training (from each launch's first logged step): once under Ray, once relaunched by a shell loop
the moment both processes are gone. It reports each one's wall time, launches, the useful training time (runner's
goodput/train_s less recomputed_s) as a share of that wall time, and runner's own goodput/percent,
which counts each launch from its own start: the wait between a launch's death and the next one's
start (the survivor's heartbeat timeout, Ray's teardown) is in the wall time only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours, imported or run

from bench import emit  # noqa: E402

QUIET = ["logging.wandb=disabled", "logging.progress=plain", "train.log_every=1", "eval.every=0"]


class Lines:
    """A process's output, each line with the time it arrived, read in a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.seen = proc, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.seen.append((time.monotonic(), line))

    def first(self, pattern: str, after: float = 0.0) -> Optional[tuple[float, re.Match]]:
        for when, line in list(self.seen):
            match = re.search(pattern, line)
            if when >= after and match:
                return when, match
        return None


def env_for(work: Path) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled",
            "RUNNER_CACHE": str(work / "cache"), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def runner_pids(run_dir: Path) -> list[int]:
    """The runner processes training `run_dir` (not the Ray driver), by their JAX process id."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"runner" in cmd and any(str(run_dir).encode() in c for c in cmd) and \
                any(e.startswith(b"JAX_PROCESS_ID=") for e in env):
            rank = next(int(e.split(b"=")[1]) for e in env if e.startswith(b"JAX_PROCESS_ID="))
            found.append((rank, int(entry.name)))
    return [pid for _, pid in sorted(found)]


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if '"loss"' in line]
    return max(steps, default=0)


def first_new_step(run_dir: Path, resumed: int, timeout: float = 600) -> float:
    """When step `resumed + 1` is logged by the new launch (the file is truncated to `resumed` first)."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists():
            steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if '"loss"' in line]
            if steps and steps[-1] == resumed + 1:
                return time.monotonic()
        time.sleep(0.02)
    raise SystemExit("no new step was logged")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def by_hand(args: list[str], env: dict[str, str], cwd: Path) -> list[subprocess.Popen]:
    """The two processes as a user starts them: the same command, the standard JAX variables."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env={**env, "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
                                  "JAX_PROCESS_ID": str(i)}) for i in range(2)]


def on_ray(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "runner", "hydra/launcher=ray", "hydra.launcher.hosts=2",
                             "hydra.launcher.max_restarts=-1", "hydra.launcher.object_store_mb=100", *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def recover(opts: argparse.Namespace, work: Path) -> None:
    env = env_for(work)
    base = [f"job={opts.job}", f"train.steps={opts.steps}", f"checkpoint.every_steps={opts.every}", *QUIET]
    results: dict[str, dict[str, float]] = {}
    for name in ("ray", "by_hand"):
        run_dir = work / name
        args = [*base, f"run.dir={run_dir}"]
        driver = on_ray(args, env, work) if name == "ray" else None
        procs = by_hand(args, env, work) if driver is None else []
        out = Lines(driver if driver is not None else procs[0])
        wait_until(lambda: last_step(run_dir) >= opts.kill_at, 900, f"{name}: step {opts.kill_at}")
        pids = wait_until(lambda: runner_pids(run_dir) if len(runner_pids(run_dir)) == 2 else None, 60, "processes")
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        if driver is not None:
            noticed = wait_until(lambda: out.first(r"ray: attempt 1 ended", killed), 600, "the failure")[0]
            started = wait_until(lambda: out.first(r"ray: attempt 2 started", killed), 600, "attempt 2")[0]
            when, match = wait_until(lambda: out.first(r"ray: attempt 2: resumed from step (\d+)", killed), 600,
                                     "the resume")
        else:
            for p in procs:
                p.wait(timeout=600)
            noticed = started = time.monotonic()
            procs = by_hand(args, env, work)  # the same command again, at once
            out = Lines(procs[0])
            when, match = wait_until(lambda: out.first(r"resumed from step (\d+)", started), 600, "the resume")
        resumed = int(match.group(1))
        first = first_new_step(run_dir, resumed)
        results[name] = {"noticed_s": noticed - killed, "restarted_s": started - noticed,
                         "resumed_s": when - started, "first_step_s": first - when, "total_s": first - killed,
                         "resumed_from": resumed}
        r = results[name]
        print(f"{name:8s}: SIGKILL -> first new step {r['total_s']:.1f} s = noticed {r['noticed_s']:.1f} s + new "
              f"processes {r['restarted_s']:.1f} s + start and restore {r['resumed_s']:.1f} s + compile and first step "
              f"{r['first_step_s']:.1f} s (resumed from step {resumed})", flush=True)
        for p in [driver] if driver is not None else procs:
            p.wait(timeout=900)
    emit({"bench": "relaunch_recover", "job": opts.job, "kill_at": opts.kill_at, "every": opts.every,
          **{f"{n}_{k}": v for n, r in results.items() for k, v in r.items()},
          "ratio_by_hand_over_ray": results["by_hand"]["total_s"] / results["ray"]["total_s"],
          "command": " ".join(sys.argv)}, opts.out)


def schedule(opts: argparse.Namespace, work: Path) -> None:
    env = env_for(work)
    base = [f"job={opts.job}", f"train.steps={opts.steps}", f"checkpoint.every_steps={opts.every}", *QUIET]
    results = {}
    for name in ("ray", "shell_loop"):
        run_dir = work / name
        args = [*base, f"run.dir={run_dir}"]
        start = time.monotonic()
        kills = 0
        if name == "ray":
            driver = on_ray(args, env, work)
            Lines(driver)
            while driver.poll() is None:
                if _kill_after_training(run_dir, opts.kill_every, lambda: driver.poll() is not None):
                    kills += 1
            code = driver.returncode
        else:
            while True:
                procs = by_hand(args, env, work)
                for p in procs:
                    Lines(p)
                done = lambda: all(p.poll() is not None for p in procs)  # noqa: E731
                if _kill_after_training(run_dir, opts.kill_every, done):
                    kills += 1
                for p in procs:
                    p.wait(timeout=900)
                if all(p.returncode == 0 for p in procs):
                    code = 0
                    break
        wall = time.monotonic() - start
        m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "goodput/percent" in line][-1]
        useful = m["goodput/train_s"] - m["goodput/recomputed_s"]
        results[name] = {"wall_s": wall, "kills": kills, "launches": m["goodput/launches"],
                         "useful_train_s": useful, "wall_goodput_percent": 100 * useful / wall,
                         "goodput_percent": m["goodput/percent"], "recomputed_steps": m["goodput/recomputed_steps"],
                         "startup_s": m["goodput/startup_s"], "restore_s": m["goodput/restore_s"],
                         "compile_s": m["goodput/compile_s"], "exit": code}
        r = results[name]
        print(f"{name:10s}: {wall:.0f} s wall, {kills} kills, useful training {useful:.0f} s = "
              f"{r['wall_goodput_percent']:.1f}% of the wall; runner's goodput {r['goodput_percent']:.1f}% over "
              f"{r['launches']:.0f} launches (startup {r['startup_s']:.0f} s, restore {r['restore_s']:.0f} s, compile "
              f"{r['compile_s']:.0f} s), exit {code}", flush=True)
    emit({"bench": "relaunch_schedule", "job": opts.job, "steps": opts.steps, "every": opts.every,
          "kill_every_s": opts.kill_every, **{f"{n}_{k}": v for n, r in results.items() for k, v in r.items()},
          "wall_ratio_shell_over_ray": results["shell_loop"]["wall_s"] / results["ray"]["wall_s"],
          "command": " ".join(sys.argv)}, opts.out)


def _kill_after_training(run_dir: Path, seconds: float, finished: Callable[[], bool]) -> bool:
    """Once this launch logs a step, wait `seconds`, then SIGKILL process 1; False if it finished first."""
    start_step = last_step(run_dir)
    while not finished() and last_step(run_dir) <= start_step:
        time.sleep(0.1)
    deadline = time.monotonic() + seconds
    while not finished() and time.monotonic() < deadline:
        time.sleep(0.1)
    if finished():
        return False
    pids = runner_pids(run_dir)
    if len(pids) < 2:
        return False
    os.kill(pids[1], signal.SIGKILL)
    while not finished() and len(runner_pids(run_dir)) == 2:  # until the group is torn down
        time.sleep(0.1)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("recover", "schedule"))
    p.add_argument("--job", default="gpt_tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=20, help="checkpoint.every_steps")
    p.add_argument("--kill-at", type=int, default=30, help="recover: the step after which process 1 is killed")
    p.add_argument("--kill-every", type=float, default=20.0, help="schedule: seconds of training per launch")
    p.add_argument("--out", default=None, help="append the JSON record to this file")
    opts = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-relaunch-"))
    try:
        (recover if opts.what == "recover" else schedule)(opts, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
