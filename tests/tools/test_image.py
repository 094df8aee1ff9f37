"""The Dockerfile and tools/build_image.py.

Cheap checks always run: the exact build commands, and that the Dockerfile, the build tool and
pyproject.toml agree on the flavours. The real build is expensive (pip installs jax and the rest
inside the image, 5-10 minutes on two cores), so it runs only with RUNNER_IMAGE_TEST=1: it builds
the cpu flavour with docker or buildah, then trains the default job in the image without a network.

Its base image: $RUNNER_IMAGE_TEST_BASE (an image name), else $RUNNER_IMAGE_TEST_ROOTFS (a root
filesystem tarball with python3 and python3-venv), else one made with debootstrap (root, a Debian
mirror) and kept in $RUNNER_IMAGE_TEST_CACHE (~/.cache/runner-image-test). pip inside the build
trusts $PIP_CERT too, when it is set (TLS-intercepting proxies).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "build_image.py"
sys.path.insert(0, str(ROOT / "tools"))
import build_image  # noqa: E402

IMAGE_TEST = os.environ.get("RUNNER_IMAGE_TEST") == "1"
TAG = "localhost/runner-image-test:cpu"


def build_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.e2e
def test_build_commands_are_the_same_dockerfile_for_both_builders(tmp_path: Path) -> None:
    ca = tmp_path / "corp.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    common = ["--file", str(ROOT / "Dockerfile"), "--tag", "reg.example/runner:cpu",
              "--build-arg", "BASE_IMAGE=python:3.12-slim", "--build-arg", "JAX_FLAVOUR=cpu",
              "--secret", f"id=ca,src={ca}", str(ROOT)]
    args = ["--flavour", "cpu", "--tag", "reg.example/runner:cpu", "--base-image", "python:3.12-slim",
            "--ca-bundle", str(ca), "--dry-run"]
    docker = build_tool("--builder", "docker", *args)
    assert docker.returncode == 0, docker.stderr
    assert docker.stdout == shlex.join(["docker", "build", *common]) + "\n"
    buildah = build_tool("--builder", "buildah", *args)
    assert buildah.stdout == shlex.join(["buildah", "bud", "--isolation", "chroot", "--layers", *common]) + "\n"
    # The defaults: the tpu flavour on python:3.12-slim, no CA secret.
    default = build_tool("--builder", "docker", "--dry-run")
    assert default.stdout == shlex.join(
        ["docker", "build", "--file", str(ROOT / "Dockerfile"), "--tag", "runner:latest",
         "--build-arg", "BASE_IMAGE=python:3.12-slim", "--build-arg", "JAX_FLAVOUR=tpu", str(ROOT)]) + "\n"


@pytest.mark.e2e
def test_base_from_rootfs_then_build(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(b"not really a tarball, but hashed all the same")
    out = build_tool("--builder", "buildah", "--base-rootfs", str(rootfs), "--flavour", "cpu", "--dry-run")
    assert out.returncode == 0, out.stderr
    ln, base, build = [shlex.split(line) for line in out.stdout.splitlines()]
    tag = build_image.base_image_tag(rootfs)
    assert re.fullmatch(r"localhost/runner-base:[0-9a-f]{12}", tag)
    assert ln[:2] == ["ln", "-f"] and ln[2] == str(rootfs)
    assert base[:5] == ["buildah", "bud", "--isolation", "chroot", "--tag"] and base[5] == tag
    assert f"BASE_IMAGE={tag}" in build


@pytest.mark.e2e
def test_user_errors_exit_2(tmp_path: Path) -> None:
    missing = build_tool("--builder", "docker", "--ca-bundle", str(tmp_path / "none.pem"), "--dry-run")
    assert missing.returncode == 2 and missing.stderr.startswith("error: --ca-bundle")
    assert len(missing.stderr.strip().splitlines()) == 1
    both = build_tool("--builder", "docker", "--base-image", "x", "--base-rootfs", str(TOOL), "--dry-run")
    assert both.returncode == 2 and "both name the base image" in both.stderr
    flavour = build_tool("--flavour", "rocm", "--dry-run")
    assert flavour.returncode == 2 and "invalid choice: 'rocm'" in flavour.stderr


def test_dockerfile_pyproject_and_tool_agree() -> None:
    text = (ROOT / "Dockerfile").read_text()
    (version,) = re.findall(r"^ARG BASE_IMAGE=python:(3\.\d+)-slim$", text, re.M)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = re.fullmatch(r">=(3\.\d+)", project["requires-python"])[1]
    # The base image's Python is one the package installs on, and the tool builds on the same.
    assert tuple(map(int, version.split("."))) >= tuple(map(int, required.split("."))), (version, required)
    assert build_image.DEFAULT_BASE_IMAGE == f"python:{version}-slim"
    assert re.findall(r"^ARG JAX_FLAVOUR=(\w+)$", text, re.M) == ["tpu", "tpu"]
    (case,) = re.findall(r"^\s+(\w+(?:\|\w+)*)\) ;;", text, re.M)
    assert set(case.split("|")) == set(build_image.FLAVOURS)
    extras = project["optional-dependencies"]
    assert "tpu" in extras  # JAX_FLAVOUR=tpu installs this extra
    assert text.rstrip().endswith('ENTRYPOINT ["python", "-m", "runner"]')
    # What the image needs is not excluded from the build context.
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not ignored & {"conf", "jobs", "runner", "pyproject.toml", "README.md", "setup.py", "_runner_lm_eval.py",
                          "runner-lm-eval.pth"}


# ----------------------------------------------------------------------------- the real build


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _base_image_args(builder: str) -> list[str]:
    if os.environ.get("RUNNER_IMAGE_TEST_BASE"):
        return ["--base-image", os.environ["RUNNER_IMAGE_TEST_BASE"]]
    if os.environ.get("RUNNER_IMAGE_TEST_ROOTFS"):
        return ["--base-rootfs", os.environ["RUNNER_IMAGE_TEST_ROOTFS"]]
    cache = Path(os.environ.get("RUNNER_IMAGE_TEST_CACHE", Path.home() / ".cache" / "runner-image-test"))
    tarball = cache / "trixie-python3.tar"
    if not tarball.exists():
        if shutil.which("debootstrap") is None or os.geteuid() != 0:
            pytest.fail("No base image: set RUNNER_IMAGE_TEST_BASE=python:3.12-slim (a reachable registry) or "
                        "RUNNER_IMAGE_TEST_ROOTFS=rootfs.tar, or run as root with debootstrap installed.")
        rootfs = cache / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        made = _sh(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                    "trixie", str(rootfs), "http://deb.debian.org/debian"], timeout=1800)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        shutil.rmtree(rootfs / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        for deb in (rootfs / "var" / "cache" / "apt" / "archives").glob("*.deb"):
            deb.unlink()
        packed = _sh(["tar", "-C", str(rootfs), "--numeric-owner", "--exclude=./proc/*", "--exclude=./sys/*",
                      "--exclude=./dev/*", "-cf", str(tarball) + ".tmp", "."])
        assert packed.returncode == 0, packed.stderr
        os.replace(str(tarball) + ".tmp", tarball)
        shutil.rmtree(rootfs)
    return ["--base-rootfs", str(tarball)]


class Container:
    """One container of the image, run offline, with docker or buildah: the same checks for both."""

    def __init__(self, builder: str, image: str, config: dict, user: str | None = None,
                 volume: str | None = None) -> None:
        self.builder, self.image, self.config = builder, image, config
        self.user, self.volume, self.args = user, volume, None
        self.name = None
        if builder == "buildah":
            made = _sh(["buildah", "from", image])
            assert made.returncode == 0, made.stderr
            self.name = made.stdout.strip().splitlines()[-1]

    def run(self, *args: str, entrypoint: list[str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
        argv = [*(entrypoint if entrypoint is not None else self.config["Entrypoint"]), *args]
        opts = (["--user", self.user] if self.user else []) + (["--volume", self.volume] if self.volume else [])
        if self.builder == "buildah":
            # chroot isolation shares the caller's network namespace: give it an empty one.
            cmd = ["unshare", "--net", "buildah", "run", *opts, self.name, "--", *argv]
        else:
            cmd = ["docker", "run", "--rm", "--network", "none", *opts,
                   "--entrypoint", argv[0], self.image, *argv[1:]]
        return _sh(cmd, timeout=timeout, env=dict(os.environ, BUILDAH_ISOLATION="chroot"))

    def remove(self) -> None:
        if self.name:
            _sh(["buildah", "rm", self.name])


@pytest.mark.skipif(not IMAGE_TEST, reason="builds the image and pip-installs jax inside (5-10 min): "
                                           "set RUNNER_IMAGE_TEST=1")
@pytest.mark.deep
def test_image_builds_and_trains_offline(tmp_path: Path) -> None:
    builder = build_image.pick_builder("auto") if (shutil.which("docker") or shutil.which("buildah")) else None
    if builder is None:
        pytest.fail("RUNNER_IMAGE_TEST=1 but neither a docker daemon nor buildah is here.")
    if builder == "buildah" and _sh(["unshare", "--net", "true"]).returncode != 0:
        pytest.fail("Cannot run the image offline: `unshare --net` needs root (run the test as root).")
    args = ["--builder", builder, "--flavour", "cpu", "--tag", TAG, *_base_image_args(builder)]
    if os.environ.get("PIP_CERT"):
        args += ["--ca-bundle", os.environ["PIP_CERT"]]
    built = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]

    if builder == "buildah":
        inspected = json.loads(_sh(["buildah", "inspect", "--type", "image", TAG]).stdout)
        config = inspected["OCIv1"]["config"]
    else:
        config = json.loads(_sh(["docker", "image", "inspect", TAG]).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["python", "-m", "runner"]
    assert config["User"] == "10001:10001" and config["WorkingDir"] == "/opt/runner"
    assert "RUNNER_CONF_DIR=/opt/runner/conf" in config["Env"]

    box = Container(builder, TAG, config)
    try:
        # The final layer: no compilers, no pip cache, no CA secret, an unprivileged user.
        probe = box.run("-c", "id -u; for t in gcc cc g++ make; do command -v $t; done; "
                              "ls /root/.cache/pip /tmp/ca-bundle.pem /run/secrets/ca 2>/dev/null; true",
                        entrypoint=["sh"])
        assert probe.returncode == 0 and probe.stdout.split() == ["10001"], probe.stdout + probe.stderr

        first = box.run("train.steps=20")
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert "Finished gpt_tiny: 20 steps" in first.stdout
        if builder == "buildah":  # the same container again: the finished run is found
            again = box.run("train.steps=20")
            assert again.returncode == 0 and "already finished at step 20" in again.stdout, again.stdout
    finally:
        box.remove()

    # As tools/launch_tpu.py runs it: another uid, the run directory bind-mounted from the host.
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)
    other = Container(builder, TAG, config, user="4242:4242", volume=f"{runs}:/mnt/runs")
    try:
        out = other.run("train.steps=4", "run.dir=/mnt/runs/b", "eval.every=4")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        other.remove()
    steps = [json.loads(line).get("step") for line in (runs / "b" / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 4
    assert (runs / "b" / "checkpoints" / "4").is_dir() and (runs / "b").stat().st_uid == 4242
