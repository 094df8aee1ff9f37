"""Run the runner image on every worker of a Cloud TPU VM pod, or stop it there.

Why a tool: a pod run is one `docker run` per host, all with the same image, the same overrides
and the same run directory on shared storage, started together; a typo on one host is a hung
collective on the others. This builds that one command and sends it to all workers with
`gcloud compute tpus tpu-vm ssh NAME --worker=all`.

    python tools/launch_tpu.py run my-v4-32 --zone us-central2-b --image us-docker.pkg.dev/p/r/runner:tpu \\
        --run-dir gs://my-bucket/runs/gpt_small --env WANDB_API_KEY -- job=gpt_small topology=v4-32
    python tools/launch_tpu.py stop my-v4-32 --zone us-central2-b     # SIGINT: save, exit 76

`--restart N` relaunches the container on each worker, up to N times, by its exit code alone
(runner/exits.py, `restartable`): on 75 (runner stopped to be resumed: a SIGTERM, the watchdog, a
bucket down) and on a crash (1, or 128 + a signal: 134 when another host died, 137 when killed),
never on 0, 2 (a setting), 3 (does not fit), 65 (a halt: the guard, a hook), 76 (a stop you asked
for: `stop`) or docker's own failures (125-127). Every host's container ends when one fails, so all
of them start again together and meet at the coordinator; runner resumes from the newest
checkpoint. `--dry-run` prints the gcloud commands (secret values masked) and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# runner's exit codes, from their one table (read by its path: this tool needs none of runner's dependencies)
EXITS = runpy.run_path(str(Path(__file__).resolve().parent.parent / "runner" / "exits.py"))
USAGE_EXIT_CODE = EXITS["USAGE_EXIT_CODE"]
DOCKER_OWN = (125, 126, 127)  # docker run could not start the container (a daemon error, the command not runnable)
# Ends a --restart loop: what no supervisor restarts (runner/exits.py NEVER_RESTARTED), and docker's own failures
NOT_RESTARTED = tuple(sorted({*EXITS["NEVER_RESTARTED"], *DOCKER_OWN}))
# Environment variables whose values are never shown: their names contain one of these.
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The container runs as the worker's login user: it can reach the TPU as a plain `python` there
# can, and what it writes on bind-mounted storage belongs to that user. Expanded on the worker.
WORKER_USER = '"$(id -u):$(id -g)"'


def fail(message: str) -> None:
    print("error: " + " ".join(message.split()), file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)


def is_secret(name: str) -> bool:
    return any(marker in name.upper() for marker in SECRET_MARKERS)


@dataclass(frozen=True)
class EnvValue:
    """A variable passed into the container: the real value, and what a printout may show."""

    name: str
    value: str

    def shown(self) -> str:
        return f"MASKED:{len(self.value)}chars" if is_secret(self.name) else self.value


def collect_env(names: Sequence[str], environ: dict[str, str]) -> list[EnvValue]:
    """Values come from the caller's environment, so they never have to be typed on a command line."""
    values = []
    for name in names:
        if not _ENV_NAME.fullmatch(name):
            fail(f"--env {name!r} is not a variable name. Fix: give only the name (e.g. --env WANDB_API_KEY); "
                 "the value is taken from your environment.")
        if name not in environ:
            fail(f"--env {name} is not set in this shell's environment, so there is no value to pass. "
                 f"Fix: export {name}=... first, or drop --env {name}.")
        values.append(EnvValue(name, environ[name]))
    return values


def check_run_dir(run_dir: str, shared_mounts: Sequence[str], allow_local: bool) -> None:
    """Every host must write the same run directory: a bucket (gs://), which every worker reaches
    with its service account and nothing to mount, or a filesystem all workers mount."""
    if run_dir.startswith("gs://"):
        return
    if "://" in run_dir:
        fail(f"--run-dir {run_dir}: runner writes run directories to Google Cloud Storage (gs://) or to "
             "a mounted filesystem only. Fix: use gs://BUCKET/PATH, or a path under a --shared-mount.")
    if not run_dir.startswith("/"):
        fail(f"--run-dir {run_dir} is relative: inside the container it would land in the container's "
             "own runs/ and vanish with it. Fix: give gs://BUCKET/PATH or an absolute path under a --shared-mount.")
    if any(os_path_within(run_dir, mount) for mount in shared_mounts):
        return
    if not allow_local:
        fail(f"--run-dir {run_dir} is a path on each worker's own disk, so every host would keep its "
             "own checkpoints and a restart would not find them. Fix: give a bucket (gs://BUCKET/PATH), or "
             "a path under a filesystem every worker mounts (Filestore/NFS) named with --shared-mount "
             "MOUNT_POINT, or pass --allow-local-run-dir if that is really meant.")


def os_path_within(path: str, directory: str) -> bool:
    path, directory = os.path.normpath(path), os.path.normpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def gcloud_ssh(args: argparse.Namespace, remote: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, f"--zone={args.zone}"]
    if args.project:
        cmd.append(f"--project={args.project}")
    return [*cmd, "--worker=all", *args.gcloud_arg, f"--command={remote}"]


def docker(args: argparse.Namespace) -> str:
    return "docker" if args.no_sudo else "sudo docker"


def run_remote(args: argparse.Namespace, env: Sequence[EnvValue], shown: bool) -> str:
    """The shell line each worker runs: pull, clear a finished container of the name, run."""
    q = shlex.quote
    mounts = list(dict.fromkeys(args.shared_mount))
    remote = args.run_dir.startswith("gs://")
    if not remote and not any(os_path_within(args.run_dir, m) for m in mounts):
        mounts.append(args.run_dir)  # --allow-local-run-dir: each worker's own directory
    steps = []
    if args.registry_auth:
        gcloud = "gcloud" if args.no_sudo else "sudo gcloud"
        steps.append(f"{gcloud} auth configure-docker {q(args.registry_auth)} --quiet")
    if not remote:
        steps.append(f"mkdir -p {q(args.run_dir)}")  # owned by the login user, not by docker's root
    if not args.no_pull:
        steps.append(f"{docker(args)} pull --quiet {q(args.image)}")
    # `docker rm` without -f removes only a stopped container: a running one stays, and the
    # run below then refuses the name instead of starting a second copy.
    steps.append(f"{{ {docker(args)} rm {q(args.container)} >/dev/null 2>&1 || true; }}")
    run = [docker(args), "run", "--name", q(args.container), "--init", "--privileged", "--net=host",
           f"--shm-size={q(args.shm_size)}", "--user", WORKER_USER if args.docker_user is None else q(args.docker_user)]
    if args.detach:
        run.append("--detach")
    for mount in mounts:
        run += ["--volume", q(f"{mount}:{mount}")]
    for var in env:
        run += ["--env", q(f"{var.name}={var.shown() if shown else var.value}")]
    if args.restart:
        run += ["--env", '"RUNNER_ATTEMPT=$attempt"']  # goodput/restarts
    overrides = list(args.overrides)
    if not any(o.split("=", 1)[0] == "run.compile_cache" for o in overrides):
        # each container starts empty: keep compiled programs where the next launch finds them
        overrides.append(f"run.compile_cache={args.run_dir.rstrip('/')}/compile_cache")
    run += [q(args.image), *(q(o) for o in overrides), q(f"run.dir={args.run_dir}")]
    if not args.restart:
        steps.append(" ".join(run))
        return " && ".join(steps)
    # The same container again, at most --restart times, unless its code is one no rerun changes.
    final = "|".join(str(c) for c in NOT_RESTARTED)
    loop = (f"attempt=1; while :; do {{ {docker(args)} rm {q(args.container)} >/dev/null 2>&1 || true; }}; "
            f"{' '.join(run)}; code=$?; case $code in {final}) exit $code;; esac; "
            f"if [ $attempt -gt {args.restart} ]; then exit $code; fi; "
            f"echo \"launch_tpu: the container exited $code; relaunch $attempt of {args.restart}\" >&2; "
            "attempt=$((attempt + 1)); done")
    return " && ".join([*steps[:-1], loop])


def stop_remote(args: argparse.Namespace) -> str:
    """SIGINT first (a stop you ask for: runner saves on every host and exits 76, which no --restart
    loop relaunches), SIGKILL after the grace period. (`docker kill --signal` and `docker wait`: any
    docker version; `docker stop --signal` needs 23.0.)"""
    name = shlex.quote(args.container)
    if args.now:
        return f"{docker(args)} kill {name}"
    return (f"{docker(args)} kill --signal INT {name} >/dev/null && {{ timeout {args.grace_s} {docker(args)} wait "
            f"{name} >/dev/null || {docker(args)} kill {name} >/dev/null; }}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="action", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("name", help="the TPU VM (pod slice) name")
        sp.add_argument("--zone", required=True)
        sp.add_argument("--project", default=None)
        sp.add_argument("--container", default="runner", help="the container's name on every worker")
        sp.add_argument("--no-sudo", action="store_true", help="the login user may use docker without sudo")
        sp.add_argument("--gcloud-arg", action="append", default=[],
                        help="an extra argument for gcloud ... ssh, e.g. --gcloud-arg=--tunnel-through-iap")
        sp.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")

    run = sub.add_parser("run", help="docker run the image on every worker")
    common(run)
    run.add_argument("--image", required=True, help="an image every worker can pull")
    run.add_argument("--run-dir", required=True,
                     help="gs://BUCKET/PATH (nothing to mount), or an absolute path under a --shared-mount")
    run.add_argument("--shared-mount", action="append", default=[],
                     help="a directory every worker mounts (gcsfuse, NFS); bind-mounted into the container")
    run.add_argument("--allow-local-run-dir", action="store_true",
                     help="accept a run dir on each worker's own disk (each host keeps its own files)")
    run.add_argument("--env", action="append", default=[],
                     help="a variable NAME to pass through; the value comes from your environment")
    run.add_argument("--shm-size", default="32g")
    run.add_argument("--docker-user", default=None,
                     help="the container's user; default: the worker's login user (e.g. root if the "
                          "TPU device files are root-only)")
    run.add_argument("--registry-auth", default=None,
                     help="a registry host (e.g. us-docker.pkg.dev) to configure docker credentials for first")
    run.add_argument("--no-pull", action="store_true", help="use the image already on the workers")
    run.add_argument("--detach", action="store_true", help="return once started; `docker logs` shows the run")
    run.add_argument("--restart", type=int, default=0, metavar="N",
                     help="relaunch the container up to N times when its code says a rerun may fix it (75, "
                          "a crash); never after 0, 2, 3, 65 or 76")
    run.add_argument("overrides", nargs="*", help="runner overrides, after --: job=gpt_small topology=v4-32")

    stop = sub.add_parser("stop", help="stop the container on every worker (SIGINT: the run saves, exits 76)")
    common(stop)
    stop.add_argument("--grace-s", type=int, default=300,
                      help="seconds between SIGINT and SIGKILL: time for the agreed stop and the final save")
    stop.add_argument("--now", action="store_true",
                      help="SIGKILL at once (no save; a --restart loop relaunches it: 137 is a crash)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # argparse's subcommands do not take `--` well: the overrides after it are split off here.
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parse_args(argv[:cut])
    if args.action == "run":
        args.overrides = [*args.overrides, *argv[cut + 1:]]
    elif argv[cut + 1:]:
        fail("`stop` takes no overrides. Fix: drop what follows `--`.")
    if args.action == "run":
        if any(o.split("=", 1)[0].lstrip("+~") == "run.dir" for o in args.overrides):
            fail("run.dir is set among the overrides. Fix: give it as --run-dir, which is checked to be "
                 "shared storage (and mounted into the container when it is a path).")
        if any(o.startswith("-") for o in args.overrides):
            fail(f"{next(o for o in args.overrides if o.startswith('-'))!r} is not a runner override. "
                 "Fix: put this tool's options before `--` and only key=value overrides after it.")
        check_run_dir(args.run_dir, args.shared_mount, args.allow_local_run_dir)
        if args.restart < 0:
            fail(f"--restart {args.restart} is negative. Fix: give how many relaunches to allow (0: none).")
        if args.restart and args.detach:
            fail("--restart with --detach: a detached container is not watched, so nothing could relaunch it. "
                 "Fix: drop --detach (the command then runs until the run ends), or drop --restart.")
        env = collect_env(args.env, dict(os.environ))
        command, shown = gcloud_ssh(args, run_remote(args, env, False)), gcloud_ssh(args, run_remote(args, env, True))
    else:
        if args.grace_s < 0:
            fail(f"--grace-s {args.grace_s} is negative. Fix: give the seconds to wait before SIGKILL.")
        command = shown = gcloud_ssh(args, stop_remote(args))
    if args.dry_run:
        print(shlex.join(shown), flush=True)
        return
    if shutil.which("gcloud") is None:
        fail("gcloud is not on PATH. Fix: install the Google Cloud CLI (https://cloud.google.com/sdk) "
             "and run `gcloud auth login`, or use --dry-run to see the commands.")
    print("+ " + shlex.join(shown), file=sys.stderr, flush=True)
    sys.exit(subprocess.run(command).returncode)


if __name__ == "__main__":
    main()
