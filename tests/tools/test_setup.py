"""The README's set-up script: a machine without Python 3.12+ gets one clear message, exit 2.

(That it finds one and sets everything up is what every CI run does first.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.e2e
def test_without_a_new_enough_python_the_set_up_says_how_to_get_one(tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "venv.sh", tmp_path / "tools" / "venv.sh")
    bin_dir = tmp_path / "bin"  # only the tools the script uses, and a python3 that is too old
    bin_dir.mkdir()
    for tool in ("bash", "ls", "sort", "dirname", "rm"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "python3").write_text("#!/bin/sh\necho 'Python 3.10.0'\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "no-pyenv")}
    result = subprocess.run([str(bin_dir / "bash"), "tools/venv.sh"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs Python 3.12 or newer" in result.stderr and "RUNNER_PYTHON=" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / ".venv").exists()


def logging_tool(path: Path, log: Path) -> None:
    """A stand-in for pip or uv that only writes down the arguments it was called with."""
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    path.chmod(0o755)


def fake_venv(tmp_path: Path, system_site: bool = False, uv: bool = True) -> Path:
    """A copy of the set-up script beside pyproject.toml, and a .venv whose python is real (it answers
    the version check, reads pyproject.toml, reads pip's settings and imports this jax) and whose pip
    (pip.log) and uv (uv.log, unless `uv` is False) only write down what they were asked to do."""
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "venv.sh", tmp_path / "tools" / "venv.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (venv_bin / "python").chmod(0o755)
    logging_tool(venv_bin / "pip", tmp_path / "pip.log")
    if uv:
        logging_tool(venv_bin / "uv", tmp_path / "uv.log")
    (tmp_path / ".venv" / "pyvenv.cfg").write_text(f"include-system-site-packages = {str(system_site).lower()}\n")
    sky_bin = tmp_path / ".venv-sky" / "bin"  # SkyPilot's own venv (`test` adds it): its pip writes sky.log
    sky_bin.mkdir(parents=True)
    (sky_bin / "python").symlink_to(venv_bin / "python")
    logging_tool(sky_bin / "pip", tmp_path / "sky.log")
    return tmp_path / "pip.log"


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def sky_installs(tmp_path: Path) -> list[str]:
    return lines(tmp_path / "sky.log")


# pip's settings as a user's environment gives them (no pip.conf is read: PIP_CONFIG_FILE=/dev/null).
PIP_SETTINGS = {"PIP_INDEX_URL": "https://mirror.example/simple", "PIP_EXTRA_INDEX_URL": "file:///one file:///two",
                "PIP_FIND_LINKS": "/wheels", "PIP_CONSTRAINT": "/caps.txt"}
UV_FLAGS = ("--index-strategy unsafe-best-match --index-url https://mirror.example/simple --extra-index-url file:///one "
            "--extra-index-url file:///two --find-links /wheels --constraint /caps.txt")


def set_up(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return subprocess.run(["bash", "tools/venv.sh", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**clean, "PIP_CONFIG_FILE": os.devnull, **PIP_SETTINGS, **env})


@pytest.mark.e2e
def test_the_first_command_installs_training_alone_and_the_second_adds_the_tests_through_uv_with_pips_settings(
        tmp_path: Path) -> None:
    log = fake_venv(tmp_path)
    assert set_up(tmp_path).returncode == 0
    assert set_up(tmp_path, "test").returncode == 0
    assert set_up(tmp_path, "cuda").returncode == 0
    assert not log.exists()  # uv was there already: pip installs nothing
    venv = f"pip install --python .venv/bin/python --compile-bytecode {UV_FLAGS} -q"
    sky = f"pip install --python .venv-sky/bin/python --compile-bytecode {UV_FLAGS} -q skypilot==0.14.1"  # `test`
    assert lines(tmp_path / "uv.log") == [f"{venv} -e .", f"{venv} -e .[test,tpu]", sky, f"{venv} -e .[cuda]"]


@pytest.mark.e2e
def test_pip_installs_where_uv_cannot_be_had_or_is_not_wanted(tmp_path: Path) -> None:
    log = fake_venv(tmp_path, uv=False)  # pip "installs" uv, but no uv appears
    result = set_up(tmp_path, "test")
    assert result.returncode == 0 and "uv could not be installed" in result.stderr
    assert lines(log) == ["install -q uv==0.13.9", "install -q -e .[test,tpu]"]
    assert sky_installs(tmp_path) == ["install -q skypilot==0.14.1"]
    (tmp_path / ".venv" / "bin" / "uv").write_text("#!/bin/sh\nexit 1\n")  # uv there, but pip asked for by name
    (tmp_path / ".venv" / "bin" / "uv").chmod(0o755)
    assert set_up(tmp_path, "docs", RUNNER_INSTALLER="pip").returncode == 0
    assert lines(log)[-1] == "install -q -e .[docs]"

    failed = set_up(tmp_path, "docs")  # uv there, and failing: the way to pip is named
    assert failed.returncode != 0 and lines(log)[-1] == "install -q -e .[docs]"
    assert failed.stderr.strip().endswith("To install with pip instead: RUNNER_INSTALLER=pip bash tools/venv.sh docs")


@pytest.mark.e2e
def test_an_unknown_extra_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    log = fake_venv(tmp_path)
    result = set_up(tmp_path, "gpu")
    assert result.returncode == 2 and "does not know 'gpu'" in result.stderr and "cuda" in result.stderr
    assert not log.exists()


@pytest.mark.e2e
def test_with_the_system_jax_every_requirement_but_jax_is_installed_against_it_by_pip(tmp_path: Path) -> None:
    """A container's preinstalled jax (NVIDIA's ship one) stays: the venv sees it, runner's other
    requirements are installed with it pinned, runner itself without dependencies."""
    import tomllib

    import jax

    log = fake_venv(tmp_path, system_site=True)
    result = set_up(tmp_path, "--system-jax", "test")
    assert result.returncode == 0, result.stderr
    assert f"using the system's jax {jax.__version__}" in result.stderr
    first, second = lines(log)  # pip, not uv: the system's packages are in its view
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"] + project["optional-dependencies"]["tpu"]
    assert first.split()[:4] == ["install", "-q", "-c", first.split()[3]]
    assert first.split()[4:] == [r for r in wanted if not r.startswith(("jax==", "jaxlib=="))]
    assert second == "install -q --no-deps -e ."
    assert sky_installs(tmp_path) == ["install -q skypilot==0.14.1"] and not (tmp_path / "uv.log").exists()


def test_the_light_install_holds_no_test_dependency_and_cuda_matches_the_pinned_jax() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split("==")[0].split(">=")[0].split("[")[0].lower() for d in project["dependencies"]}
    assert not names & {"pytest", "torch", "transformers", "lm_eval", "lm-eval", "libtpu", "tensorboard"}
    jax = next(d for d in project["dependencies"] if d.startswith("jax=="))
    assert project["optional-dependencies"]["cuda"] == [jax.replace("jax==", "jax[cuda12]==")]
    assert project["optional-dependencies"]["cuda13"] == [jax.replace("jax==", "jax[cuda13]==")]
