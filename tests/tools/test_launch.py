"""tools/launch_tpu.py: the exact gcloud commands a pod launch sends, and the refusals.

The dry run prints what would run on every worker; these tests pin it character for character,
check that the worker's shell would parse it, and that secret values never reach the output.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # every test here starts a process

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "launch_tpu.py"
IMAGE = "us-docker.pkg.dev/proj/repo/runner:tpu"
SECRET = "0123456789abcdef0123456789abcdef01234567"


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_PROJECT", "HF_TOKEN")}
    full_env.update(env)
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=full_env,
                          timeout=60)


def remote_of(line: str) -> str:
    """The shell line gcloud hands to every worker (the value of --command)."""
    (command,) = [a for a in shlex.split(line) if a.startswith("--command=")]
    return command.removeprefix("--command=")


def test_run_dry_run_is_exact_and_masks_secrets() -> None:
    out = launch("run", "pod-a", "--zone", "us-central2-b", "--project", "proj", "--image", IMAGE,
                 "--shared-mount", "/mnt/shared", "--run-dir", "/mnt/shared/runs/gpt_small",
                 "--env", "WANDB_API_KEY", "--env", "WANDB_PROJECT",
                 "--dry-run", "--", "job=gpt_small", "topology=v4-32", "optimizer.lr=3e-4",
                 WANDB_API_KEY=SECRET, WANDB_PROJECT="lm")
    assert out.returncode == 0, out.stderr
    remote = (f"mkdir -p /mnt/shared/runs/gpt_small && sudo docker pull --quiet {IMAGE} && "
              "{ sudo docker rm runner >/dev/null 2>&1 || true; } && "
              "sudo docker run --name runner --init --privileged --net=host --shm-size=32g "
              '--user "$(id -u):$(id -g)" --volume /mnt/shared:/mnt/shared '
              "--env WANDB_API_KEY=MASKED:40chars --env WANDB_PROJECT=lm "
              f"{IMAGE} job=gpt_small topology=v4-32 optimizer.lr=3e-4 run.compile_cache=/mnt/shared/runs/gpt_small/compile_cache run.dir=/mnt/shared/runs/gpt_small")
    expected = shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-a", "--zone=us-central2-b",
                           "--project=proj", "--worker=all", f"--command={remote}"])
    assert out.stdout == expected + "\n"
    assert SECRET not in out.stdout + out.stderr and SECRET[:8] not in out.stdout + out.stderr
    # The worker's bash accepts the line, and `docker run` gets the image then the overrides.
    check = subprocess.run(["bash", "-n", "-c", remote_of(out.stdout)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    docker_run = shlex.split(remote_of(out.stdout).split(" && ")[-1])
    assert docker_run[-5:] == ["job=gpt_small", "topology=v4-32", "optimizer.lr=3e-4",
                               "run.compile_cache=/mnt/shared/runs/gpt_small/compile_cache",
                               "run.dir=/mnt/shared/runs/gpt_small"]
    assert docker_run[-6] == IMAGE


def test_a_gs_run_dir_needs_no_mount() -> None:
    """A bucket is reached by every worker through its service account: no mount, no mkdir, and
    compiled programs cached beside the run, where the next launch's fresh containers find them."""
    out = launch("run", "pod-a", "--zone", "z", "--image", IMAGE, "--run-dir", "gs://bkt/runs/a", "--no-pull",
                 "--dry-run", "--", "job=gpt_small")
    assert out.returncode == 0, out.stderr
    assert remote_of(out.stdout) == (
        "{ sudo docker rm runner >/dev/null 2>&1 || true; } && "
        'sudo docker run --name runner --init --privileged --net=host --shm-size=32g --user "$(id -u):$(id -g)" '
        f"{IMAGE} job=gpt_small run.compile_cache=gs://bkt/runs/a/compile_cache run.dir=gs://bkt/runs/a")
    own = launch("run", "pod-a", "--zone", "z", "--image", IMAGE, "--run-dir", "gs://bkt/runs/a", "--dry-run",
                 "--", "run.compile_cache=gs://bkt/xla")
    assert "run.compile_cache=gs://bkt/xla run.dir=gs://bkt/runs/a" in remote_of(own.stdout)
    assert "compile_cache=gs://bkt/runs/a/compile_cache" not in own.stdout


def test_shared_mount_and_local_run_dirs() -> None:
    shared = launch("run", "pod-a", "--zone", "z", "--image", IMAGE, "--run-dir", "/mnt/nfs/runs/a",
                    "--shared-mount", "/mnt/nfs", "--no-sudo", "--no-pull", "--dry-run", "--", "job=gpt_small")
    assert shared.returncode == 0, shared.stderr
    assert remote_of(shared.stdout) == (
        "mkdir -p /mnt/nfs/runs/a && { docker rm runner >/dev/null 2>&1 || true; } && "
        'docker run --name runner --init --privileged --net=host --shm-size=32g --user "$(id -u):$(id -g)" '
        f"--volume /mnt/nfs:/mnt/nfs {IMAGE} job=gpt_small run.compile_cache=/mnt/nfs/runs/a/compile_cache run.dir=/mnt/nfs/runs/a")

    refused = launch("run", "pod-a", "--zone", "z", "--image", IMAGE, "--run-dir", "/data/runs/a",
                     "--dry-run", "--", "job=gpt_small")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("error: --run-dir /data/runs/a is a path on each worker's own disk")
    assert "--allow-local-run-dir" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1

    local = launch("run", "pod-a", "--zone", "z", "--image", IMAGE, "--run-dir", "/data/runs/a",
                   "--allow-local-run-dir", "--docker-user", "root", "--detach", "--dry-run", "--", "job=gpt_small")
    assert local.returncode == 0, local.stderr
    assert remote_of(local.stdout) == (
        f"mkdir -p /data/runs/a && sudo docker pull --quiet {IMAGE} && "
        "{ sudo docker rm runner >/dev/null 2>&1 || true; } && "
        "sudo docker run --name runner --init --privileged --net=host --shm-size=32g --user root --detach "
        f"--volume /data/runs/a:/data/runs/a {IMAGE} job=gpt_small run.compile_cache=/data/runs/a/compile_cache run.dir=/data/runs/a")


def test_stop_sends_sigint_first() -> None:
    """SIGINT: a stop you ask for, which runner saves and ends with 76, and no --restart loop relaunches."""
    out = launch("stop", "pod-a", "--zone", "z", "--grace-s", "600", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("gcloud compute tpus tpu-vm ssh pod-a --zone=z --worker=all '--command=sudo docker kill "
                          "--signal INT runner >/dev/null && { timeout 600 sudo docker wait runner >/dev/null || "
                          "sudo docker kill runner >/dev/null; }'\n")
    check = subprocess.run(["bash", "-n", "-c", remote_of(out.stdout)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    now = launch("stop", "pod-a", "--zone", "z", "--now", "--container", "exp1",
                 "--gcloud-arg=--tunnel-through-iap", "--dry-run")
    assert now.stdout == ("gcloud compute tpus tpu-vm ssh pod-a --zone=z --worker=all --tunnel-through-iap "
                          "'--command=sudo docker kill exp1'\n")


def test_user_errors_are_one_paragraph_exit_2() -> None:
    cases = {
        ("--run-dir", "runs/a"): "is relative",
        ("--run-dir", "s3://bucket/a"): "Google Cloud Storage (gs://) or",
        ("--run-dir", "/m/a", "--shared-mount", "/m", "--env", "WANDB_API_KEY"): "WANDB_API_KEY is not set",
        ("--run-dir", "/m/a", "--shared-mount", "/m", "--env", "WANDB_API_KEY=xyz"): "is not a variable name",
        ("--run-dir", "/m/a", "--shared-mount", "/m", "--", "run.dir=/m/b"): "run.dir is set among the overrides",
        ("--run-dir", "/m/a", "--shared-mount", "/m", "--", "--cfg"): "is not a runner override",
        ("--run-dir", "/mnt/sharedX/a", "--shared-mount", "/mnt/shared"): "on each worker's own disk",
    }
    for extra, message in cases.items():
        out = launch("run", "pod-a", "--zone", "z", "--image", IMAGE, "--dry-run", *extra)
        assert out.returncode == 2, (extra, out.stderr)
        assert out.stderr.startswith("error: ") and message in out.stderr, (extra, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""
    # Without --dry-run and without gcloud installed: a clear message rather than a traceback.
    no_gcloud = launch("stop", "pod-a", "--zone", "z", PATH="/nonexistent")
    assert no_gcloud.returncode == 2 and "gcloud is not on PATH" in no_gcloud.stderr


FAKE_DOCKER = """#!/bin/sh
# docker as the worker would run it: `run` exits with the next code of $CODES, one per call
[ "$1" = run ] || exit 0
n=$(cat "$STATE" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$STATE"
for arg in "$@"; do case "$arg" in RUNNER_ATTEMPT=*) echo "$arg" >> "$STATE.attempts";; esac; done
set -- $CODES; shift $((n - 1)); exit ${1:-0}
"""


@pytest.mark.parametrize("codes, restart, runs, final", [
    ("75 134 1 137 0", 4, 5, 0),  # a resumable stop, a host lost, a crash, a kill: relaunched each time, then finished
    ("75 75 75 75", 2, 3, 75),  # the bound: two relaunches, then the last code
    ("2 0", 5, 1, 2),  # a usage error: never relaunched
    ("65 0", 5, 1, 65),  # the guard or a hook: never relaunched
    ("75 76 0", 5, 2, 76),  # a stop you asked for (launch_tpu.py stop, the stop file): never relaunched
    ("125 0", 5, 1, 125),  # docker could not start the container
    ("75 0", 0, 1, 75),  # without --restart: once
])
def test_restart_relaunches_the_container_by_its_exit_code_within_the_bound(tmp_path, codes, restart, runs,
                                                                            final) -> None:
    """The worker's shell line itself, run here with a stand-in docker that exits as told: relaunched
    on the codes runner/exits.py calls restartable, ended on the others."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    extra = ["--restart", str(restart)] if restart else []
    out = launch("run", "pod-a", "--zone", "z", "--image", IMAGE, "--run-dir", "gs://b/r", "--no-pull", "--no-sudo",
                 "--dry-run", *extra, "--", "job=gpt_small")
    assert out.returncode == 0, out.stderr
    state = tmp_path / "state"
    worker = subprocess.run(["sh", "-c", remote_of(out.stdout)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(state),
                                 "CODES": codes})
    assert worker.returncode == final, worker.stderr
    assert int(state.read_text()) == runs
    assert worker.stderr.count("launch_tpu: the container exited") == runs - 1
    if restart:  # every attempt tells runner which it is (goodput/restarts)
        assert (tmp_path / "state.attempts").read_text().split() == [f"RUNNER_ATTEMPT={i}" for i in range(1, runs + 1)]


def test_restart_refusals() -> None:
    for extra, message in {("--restart", "-1"): "--restart -1 is negative",
                           ("--restart", "2", "--detach"): "a detached container is not watched"}.items():
        out = launch("run", "pod-a", "--zone", "z", "--image", IMAGE, "--run-dir", "gs://b/r", "--dry-run", *extra)
        assert out.returncode == 2 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr
