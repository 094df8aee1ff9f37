"""Build the runner image from the top-level Dockerfile, with docker or, without a daemon, buildah.

Why two builders: laptops and CI runners have a docker daemon; build hosts inside containers and
locked-down machines often have none, and buildah builds the same Dockerfile without one.

    python tools/build_image.py                                     # tpu flavour, python:3.12-slim
    python tools/build_image.py --flavour cpu --tag runner:cpu
    python tools/build_image.py --ca-bundle corp.pem               # TLS-intercepting proxy
    python tools/build_image.py --base-rootfs rootfs.tar --flavour cpu   # no registry reachable

--base-rootfs makes the base image from a root filesystem tarball (e.g. from debootstrap with
python3 and python3-venv) first, for machines that cannot pull python:3.12-slim.
--dry-run prints the commands instead of running them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
USAGE_EXIT_CODE = 2
FLAVOURS = ("tpu", "cpu", "cuda")
DEFAULT_BASE_IMAGE = "python:3.12-slim"


def fail(message: str, code: int = USAGE_EXIT_CODE) -> None:
    print("error: " + " ".join(message.split()), file=sys.stderr, flush=True)
    sys.exit(code)


def docker_answers() -> bool:
    """Whether a docker daemon answers (the CLI alone is not enough)."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        return False


def pick_builder(requested: str) -> str:
    if requested == "docker" or (requested == "auto" and docker_answers()):
        return "docker"
    if requested == "buildah" or shutil.which("buildah"):
        return "buildah"
    fail("Neither a docker daemon nor buildah is available to build the image. Fix: start docker, "
         "or install buildah (Debian/Ubuntu: apt-get install buildah), or build elsewhere with "
         "`docker build -t runner .`.")
    raise AssertionError  # unreachable


def base_image_tag(rootfs: Path) -> str:
    """A tag that names the tarball's content, so an unchanged tarball is imported once."""
    digest = hashlib.sha256()
    with rootfs.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"localhost/runner-base:{digest.hexdigest()[:12]}"


def build_command(builder: str, *, tag: str, base_image: str, flavour: str, ca_bundle: Path | None,
                  context: Path, dockerfile: Path) -> list[str]:
    """The one build command, the same Dockerfile and build arguments for either builder."""
    if builder == "docker":
        cmd = ["docker", "build"]
    else:
        # --layers: keep the dependency layer between builds, as docker does by default.
        cmd = ["buildah", "bud", "--isolation", os.environ.get("BUILDAH_ISOLATION", "chroot"), "--layers"]
    cmd += ["--file", str(dockerfile), "--tag", tag,
            "--build-arg", f"BASE_IMAGE={base_image}", "--build-arg", f"JAX_FLAVOUR={flavour}"]
    if ca_bundle is not None:
        cmd += ["--secret", f"id=ca,src={ca_bundle}"]
    return [*cmd, str(context)]


def base_from_rootfs_commands(builder: str, rootfs: Path, tag: str, workdir: Path) -> list[list[str]]:
    """FROM scratch + ADD: the tarball as a one-layer image, with either builder."""
    verb = ["docker", "build"] if builder == "docker" else [
        "buildah", "bud", "--isolation", os.environ.get("BUILDAH_ISOLATION", "chroot")]
    return [["ln", "-f", str(rootfs), str(workdir / "rootfs.tar")],
            [*verb, "--tag", tag, str(workdir)]]


def image_exists(builder: str, tag: str) -> bool:
    inspect = ["docker", "image", "inspect", tag] if builder == "docker" else [
        "buildah", "inspect", "--type", "image", tag]
    return subprocess.run(inspect, capture_output=True).returncode == 0


def image_size(builder: str, tag: str) -> str:
    if builder == "docker":
        out = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", tag],
                             capture_output=True, text=True)
        return f"{int(out.stdout.strip()) / 1e6:.0f} MB" if out.returncode == 0 else "unknown size"
    out = subprocess.run(["buildah", "images", "--format", "{{.Size}}", tag], capture_output=True, text=True)
    return out.stdout.strip() or "unknown size"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-image", default=DEFAULT_BASE_IMAGE,
                   help="the Python base image (build arg BASE_IMAGE)")
    p.add_argument("--base-rootfs", type=Path, default=None,
                   help="a root filesystem tarball with python3 and python3-venv: made into the base image")
    p.add_argument("--flavour", choices=FLAVOURS, default="tpu", help="which JAX (build arg JAX_FLAVOUR)")
    p.add_argument("--tag", default="runner:latest")
    p.add_argument("--ca-bundle", type=Path, default=None,
                   help="PEM file of extra CA certificates pip should trust (mounted as build secret `ca`)")
    p.add_argument("--builder", choices=("auto", "docker", "buildah"), default="auto")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.ca_bundle is not None and not args.ca_bundle.is_file():
        fail(f"--ca-bundle {args.ca_bundle} is not a file. Fix: give the path of a PEM file of CA certificates.")
    if args.base_rootfs is not None and not args.base_rootfs.is_file():
        fail(f"--base-rootfs {args.base_rootfs} is not a file. Fix: give a root filesystem tarball "
             "(e.g. `debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "
             "trixie rootfs && tar -C rootfs -cf rootfs.tar .`).")
    if args.base_rootfs is not None and args.base_image != DEFAULT_BASE_IMAGE:
        fail("--base-image and --base-rootfs both name the base image. Fix: give one of them.")
    builder = pick_builder(args.builder)
    ca_bundle = args.ca_bundle.resolve() if args.ca_bundle is not None else None
    commands: list[list[str]] = []
    base_image = args.base_image
    with tempfile.TemporaryDirectory(prefix="runner-base-") as tmp:
        if args.base_rootfs is not None:
            rootfs = args.base_rootfs.resolve()
            base_image = base_image_tag(rootfs)
            # The tag names the tarball's content: an existing one is this base, and importing it
            # again would give it a new id and void the layer cache of every build on it.
            if args.dry_run or not image_exists(builder, base_image):
                (Path(tmp) / "Dockerfile").write_text("FROM scratch\nADD rootfs.tar /\nCMD [\"python3\"]\n")
                commands += base_from_rootfs_commands(builder, rootfs, base_image, Path(tmp))
        commands.append(build_command(builder, tag=args.tag, base_image=base_image, flavour=args.flavour,
                                      ca_bundle=ca_bundle, context=ROOT, dockerfile=ROOT / "Dockerfile"))
        if args.dry_run:
            for cmd in commands:
                print(shlex.join(cmd))
            return
        env = dict(os.environ, DOCKER_BUILDKIT="1")  # RUN --mount=type=secret needs BuildKit
        env.setdefault("BUILDAH_ISOLATION", "chroot")
        start = time.monotonic()
        for cmd in commands:
            if cmd[0] == "ln":  # a hard link keeps a large tarball out of a copy; fall back to one
                _, _, source, target = cmd
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)
                continue
            print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
            code = subprocess.run(cmd, env=env).returncode
            if code:
                fail(f"`{cmd[0]} {cmd[1]}` failed (exit {code}); its output above says why. Fix: if pip "
                     "could not verify a certificate, pass your proxy's CA with --ca-bundle.", code)
    print(f"built {args.tag} ({args.flavour}, base {base_image}) with {builder} in "
          f"{time.monotonic() - start:.0f}s: {image_size(builder, args.tag)}", flush=True)


if __name__ == "__main__":
    main()
