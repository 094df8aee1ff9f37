"""Every local place a run writes (run.dir, each checkpoint tier, the compile cache; the watchdog's
stacks go under run.dir) is checked at start: one paragraph, exit 2, before any device work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runner.checkpoint.storage import check_local_writable
from runner.errors import UserError
from tests.checkpoint.test_local_tier import _root
from tests.conftest import TINY, runner_env


def test_a_directory_that_can_be_written_passes_and_nothing_is_left(tmp_path) -> None:
    check_local_writable(str(tmp_path / "new" / "deeper"), "run.dir")  # created later by its writer
    check_local_writable(str(tmp_path), "run.dir")
    assert sorted(os.listdir(tmp_path)) == []
    check_local_writable("", "checkpoint.local.dir")  # unset: nothing to check
    check_local_writable("gs://bucket/x", "run.dir")  # a bucket: storage.check_reachable's


def test_a_file_or_a_path_under_a_file_is_refused_with_the_key_value_and_fix(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError) as err:
        check_local_writable(str(tmp_path / "f"), "run.compile_cache")
    assert f"run.compile_cache='{tmp_path / 'f'}'" in str(err.value) and "is a file" in str(err.value)
    with pytest.raises(UserError) as err:
        check_local_writable(str(tmp_path / "f" / "ckpt"), "checkpoint.local.dir")
    assert f"lies under {tmp_path / 'f'}, which is a file" in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.deep
def test_a_read_only_local_tier_is_refused_before_any_device_work(tmp_path) -> None:
    """A read-only mount (a private mount namespace, as the full-disk test makes one) for the local
    tier: exit 2, one paragraph, no run directory."""
    ro = tmp_path / "ro"
    ro.mkdir()
    namespace = ["unshare", "--mount", "--propagation", "private"] if _root() else \
        ["unshare", "--user", "--map-root-user", "--mount"]
    args = [*TINY, "train.steps=2", "run.dir=run", f"checkpoint.local.dir={ro}/tier", "checkpoint.local.every_steps=1"]
    script = f"mount -t tmpfs -o ro tmpfs {ro} && {sys.executable} -m runner {' '.join(repr(a) for a in args)}"
    result = subprocess.run([*namespace, "sh", "-c", script], cwd=tmp_path, env=runner_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("error: ") == 1 and "Traceback" not in result.stderr
    assert f"checkpoint.local.dir='{ro}/tier': runner cannot write in {ro} (Read-only file system)" in result.stderr
    assert not (tmp_path / "run").exists()
    # (a compile cache on a file, refused by the same checks: tests/train/test_refused_in_process.py)
