"""The README's set-up script: a machine without Python 3.12+ gets one clear message, exit 2.

(That it finds one and sets everything up is what every CI run does first.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.conftest import ROOT


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
