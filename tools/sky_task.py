"""Write a SkyPilot managed-job task that runs a runner command on every host of a TPU pod or GPU cluster.

Why a generator: the task is the same few lines every time, but they must agree with each other and
with runner (the topology with the accelerators, the coordinator with SkyPilot's node variables, the
run directory on a bucket every re-provisioned cluster reaches, and which exits are retried), and a
mistake there costs a cluster. SkyPilot does the relaunching; runner's restore does the resuming.

    python tools/sky_task.py --accelerators tpu-v5p-128 --run-dir gs://my-bucket/runs/llama \\
        --env WANDB_API_KEY --out llama.yaml -- job=llama3_8b
    .venv-sky/bin/sky jobs launch llama.yaml --env WANDB_API_KEY      # bash tools/venv.sh sky

What it writes: `setup` installs runner on every host (`bash tools/venv.sh tpu|cuda`); `run` is the
runner command (on a TPU pod SkyPilot runs it on every TPU VM host and JAX finds its peers; on GPU
nodes the coordinator is the first of SKYPILOT_NODE_IPS, the process id SKYPILOT_NODE_RANK);
`job_recovery` retries preemptions (always, SkyPilot's own) and decides the rest by the exit code
(runner/exits.py) as far as SkyPilot can: 75 (runner stopped early after saving: SIGTERM, the
watchdog, a bucket down) is in `recover_on_exit_codes`, recovered every time, without limit; every
other nonzero code counts against one budget, `max_restarts_on_errors: 3` over the job's life, so a
crash (1, 134 when another host died, 137 killed, ...) is retried at most 3 times and a crash that
repeats on every launch ends the job. SkyPilot cannot tell the other codes apart there: a halt (65),
a usage error (2) or a run that does not fit (3) is relaunched too, up to 3 times, and ends the same
way each time; a stop you asked for (76) is relaunched as well and trains on (stop a managed job with
`sky jobs cancel`). Ray's launcher and launch_tpu --restart never restart them. `--check` loads the
written task with SkyPilot's own parser (from .venv-sky).
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
# runner's exit codes, from their one table (read by its path: this tool needs none of runner's dependencies)
EXITS = runpy.run_path(str(ROOT / "runner" / "exits.py"))
USAGE_EXIT_CODE = EXITS["USAGE_EXIT_CODE"]
# recovered without limit: runner's stop to be resumed (a crash is retried from the bounded budget below)
RECOVERED = (EXITS["PREEMPTED_EXIT_CODE"],)
# SkyPilot's budget for every other nonzero code, over the job's life: it cannot tell a crash from a halt there
MAX_RESTARTS_ON_ERRORS = 3
COORDINATOR_PORT = 8476
_TPU = re.compile(r"^tpu-(v2|v3|v4|v5p|v5litepod|v5e|v6e|v7x)-(\d+)$")
_GPU = re.compile(r"^([A-Za-z0-9-]+):(\d+)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# SkyPilot's TPU generation names as runner's topology names spell them
_RUNNER_GEN = {"v5litepod": "v5litepod", "v5e": "v5e", "v7x": "tpu7x"}


def fail(message: str) -> None:
    print("error: " + " ".join(message.split()), file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)


def yaml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def topology_of(accelerators: str, nodes: int) -> tuple[str, str]:
    """(runner's topology name, the platform: tpu or cuda) for SkyPilot's accelerator spec."""
    tpu = _TPU.match(accelerators)
    if tpu:
        gen, count = tpu.groups()
        return f"{_RUNNER_GEN.get(gen, gen)}-{count}", "tpu"
    gpu = _GPU.match(accelerators)
    if gpu:
        return f"gpu-{int(gpu.group(2)) * nodes}", "cuda"
    fail(f"--accelerators {accelerators!r} is neither a TPU slice (tpu-v5p-128, tpu-v6e-64, ...) nor GPUs per node "
         "(H100:8). Fix: name one as SkyPilot spells it (`sky show-gpus`).")
    raise AssertionError


def shell_quote(word: str) -> str:
    return "'" + word.replace("'", "'\"'\"'") + "'"


def task_yaml(args: argparse.Namespace) -> str:
    topology, platform = topology_of(args.accelerators, args.nodes)
    overrides = list(args.overrides)
    given = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    if "run.dir" in given:
        fail("run.dir is set among the overrides. Fix: give it as --run-dir, which is checked to be a bucket.")
    if any(k.startswith("distributed.") for k in given):
        fail("distributed.* is set among the overrides, but the task sets the coordinator from SkyPilot's node "
             "variables. Fix: drop the distributed.* overrides.")
    if "topology" in given and given["topology"] != topology:
        fail(f"topology={given['topology']} does not match --accelerators {args.accelerators} "
             f"({'x'.join([str(args.nodes), args.accelerators]) if platform == 'cuda' else args.accelerators} is "
             f"topology={topology}). Fix: drop topology= (the task sets it) or make the two agree.")
    if platform == "tpu" and args.nodes != 1:
        fail(f"--nodes {args.nodes} with a TPU slice: SkyPilot runs the task on every host of the slice already. "
             "Fix: drop --nodes (one slice per task).")
    kept = [o for o in overrides if not o.startswith("topology=")]
    words = [*kept, f"topology={topology}", f"run.dir={args.run_dir}"]
    command = ".venv/bin/python -m runner " + " ".join(shell_quote(w) for w in words)
    if platform == "cuda" and args.nodes > 1:
        command += (' distributed.coordinator_address="$(echo "$SKYPILOT_NODE_IPS" | head -n1):'
                    f'{COORDINATOR_PORT}" distributed.num_processes="$SKYPILOT_NUM_NODES" '
                    'distributed.process_id="$SKYPILOT_NODE_RANK"')
    envs = "\n".join(f"  {name}: null  # given at launch: sky jobs launch ... --env {name}" for name in args.env)
    accelerator_args = ("\n  accelerator_args:\n    runtime_version: " + args.runtime_version
                        if platform == "tpu" and args.runtime_version else "")
    return f"""# Written by tools/sky_task.py; launch with `sky jobs launch THIS.yaml` (docs/launching.md, SkyPilot).
name: {args.name}
workdir: {yaml_str(str(args.workdir))}
num_nodes: {args.nodes}
resources:
  accelerators: {args.accelerators}{accelerator_args}
  use_spot: {str(args.spot).lower()}
  job_recovery:
    # preemptions are always recovered (SkyPilot's own); 75 (stopped early after saving: resume) every time;
    # any other nonzero code (a crash, but also 2, 3, 65, 76: SkyPilot cannot tell them apart) at most 3 times
    max_restarts_on_errors: {MAX_RESTARTS_ON_ERRORS}
    recover_on_exit_codes: [{", ".join(str(c) for c in RECOVERED)}]
envs:
  PYTHONUNBUFFERED: "1"
{envs}
setup: |
  bash tools/venv.sh {'tpu' if platform == 'tpu' else 'cuda'}
run: |
  {command}
""".replace("envs:\n  PYTHONUNBUFFERED: \"1\"\n\n", "envs:\n  PYTHONUNBUFFERED: \"1\"\n")


def check_with_skypilot(path: Path, sky_python: str) -> str:
    """SkyPilot's own parser (offline): the schema, and for TPUs the resources too. Returns its
    account of the task."""
    script = (
        "import sys, yaml, sky\n"
        "config = yaml.safe_load(open(sys.argv[1]))\n"
        "given = [(k, 'given-at-launch') for k, v in (config.get('envs') or {}).items() if v is None]\n"
        "task = sky.Task.from_yaml_config(config, env_overrides=given)\n"
        "(resources,) = task.resources\n"
        "if str(resources.accelerators).startswith(\"{'tpu\"):\n"
        "    task.validate(skip_file_mounts=True, skip_workdir=True)\n"
        "print(f'{task.name}: {task.num_nodes} node(s), {resources.accelerators}, '\n"
        "      f'recovery {resources.job_recovery}')\n")
    home = os.environ.get("SKY_CHECK_HOME") or os.environ.get("HOME", "/tmp")
    result = subprocess.run([sky_python, "-c", script, str(path)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HOME": home})
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        fail(f"SkyPilot refuses {path}: {lines[-1] if lines else 'no reason given'}")
    return result.stdout.strip()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerators", required=True, help="tpu-v5p-128 (a TPU slice) or H100:8 (GPUs per node)")
    p.add_argument("--run-dir", required=True, help="gs://BUCKET/PATH: every host and every re-provisioned cluster")
    p.add_argument("--nodes", type=int, default=1, help="GPU nodes (a TPU slice is one node of several hosts)")
    p.add_argument("--name", default="runner", help="the managed job's name")
    p.add_argument("--env", action="append", default=[], help="a variable NAME the job needs, given at launch")
    p.add_argument("--spot", action="store_true", help="spot/preemptible capacity (preemptions are recovered)")
    p.add_argument("--runtime-version", default="", help="the TPU VM runtime (SkyPilot's default: per generation)")
    p.add_argument("--workdir", type=Path, default=ROOT, help="the runner checkout synced to every host")
    p.add_argument("--out", type=Path, default=None, help="write the task here (default: print it)")
    p.add_argument("--check", action="store_true", help="load the task with SkyPilot's parser (.venv-sky)")
    p.add_argument("--sky-python", default=str(ROOT / ".venv-sky" / "bin" / "python"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parse_args(argv[:cut])
    args.overrides = argv[cut + 1:]
    if any(o.startswith("-") for o in args.overrides):
        fail(f"{next(o for o in args.overrides if o.startswith('-'))!r} is not a runner override. Fix: put this "
             "tool's options before `--` and only key=value overrides after it.")
    if not args.run_dir.startswith("gs://"):
        fail(f"--run-dir {args.run_dir}: a managed job may come back on a new cluster, so its run directory must "
             "outlive every host. Fix: give a bucket, --run-dir gs://BUCKET/PATH.")
    if args.nodes < 1:
        fail(f"--nodes {args.nodes}: a job needs at least one node. Fix: --nodes 1 or more.")
    for name in args.env:
        if not _ENV_NAME.match(name):
            fail(f"--env {name!r} is not a variable name. Fix: give only the name (e.g. --env WANDB_API_KEY).")
    text = task_yaml(args)
    if args.out is None and not args.check:
        print(text, end="")
        return
    out = args.out or Path("sky-task.yaml")
    out.write_text(text)
    print(f"wrote {out}", flush=True)
    if args.check:
        if not Path(args.sky_python).exists():
            fail(f"--check needs SkyPilot's client at {args.sky_python}. Fix: `bash tools/venv.sh sky`, or name "
                 "another with --sky-python.")
        print(check_with_skypilot(out, args.sky_python), flush=True)


if __name__ == "__main__":
    main()
