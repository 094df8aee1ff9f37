"""Refusals of a run that `python -m runner` makes past its command-line check, in this process:
the checks at the start of a run (runner.main.cli.execute: a run directory under a file, a gs://
run with no credentials, a compile cache on a file) and at its restore (another model's or other
data's checkpoints, a warm start from nothing). Each is the command's exit-2 paragraph
(runner.main.cli.fail, as the command calls it) with nothing written; that paragraph's process-level
behaviour (exit 2, one line, no traceback, no run directory) is proven end to end by
tests/test_spec.py, tests/main/test_ray.py and tests/checkpoint/test_locations.py's read-only tier,
so these need no process of their own."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from runner.errors import UserError
from tests.conftest import TINY

# the trained_run fixture's settings (tests/conftest.py), resumed for 2 more steps
TRAINED = [*TINY, "train.steps=6", "eval.every=2", "checkpoint.every_steps=2", "logging.progress=none"]


def spec_of(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from runner.main.cli import CONF_DIR, CONFIG_NAME, prepare
    from runner.main.config import build_spec

    prepare()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return build_spec(compose(CONFIG_NAME, overrides=overrides), overrides)


def refused(run: Callable[[Any], None], overrides: list[str], capsys: pytest.CaptureFixture) -> str:
    """`run` of the spec `overrides` build, its UserError printed and exited as the command does
    (runner.main.cli.task): asserts exit 2 and one `error:` line on stderr, and returns it."""
    from runner.main.cli import fail

    spec = spec_of(overrides)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        try:
            run(spec)
        except UserError as err:
            fail(str(err), err.exit_code)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def at_start(spec: Any) -> None:
    """What the command runs for one run (runner.main.cli.execute): its checks refuse before it
    enables the compile cache or touches a device, so nothing else of this process changes."""
    from runner.main.cli import execute

    execute(spec)


def on_restore(spec: Any) -> None:
    """What execute runs once its checks have passed: spec.yaml written, the job run (the
    trained_run fixture's way, without the compile cache that execute enables for the process)."""
    from runner.main.cli import write_resolved_spec
    from runner.train.job import JOBS

    write_resolved_spec(spec)
    JOBS.get(spec.job.trainer)(spec).run()


def steps(run_dir: Path) -> list[int]:
    return sorted(int(c.name) for c in (run_dir / "checkpoints").iterdir() if c.name.isdigit())


def test_resuming_another_model_or_other_data_is_refused_and_touches_no_checkpoint(tmp_path, trained_run,
                                                                                  capsys) -> None:
    run_dir = Path(shutil.copytree(trained_run[1], tmp_path / "run"))
    before = steps(run_dir)
    line = refused(on_restore, [*TRAINED, f"run.dir={run_dir}", "job.model.d_model=64"], capsys)
    assert "different model" in line, line
    line = refused(on_restore, [*TRAINED, f"run.dir={run_dir}", "data.strategy=synthetic"], capsys)
    assert "other data" in line and "allow_data_change" in line, line
    assert steps(run_dir) == before and not (run_dir / "damaged_checkpoints").exists()


def test_a_warm_start_from_nothing_is_refused(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    line = refused(on_restore, [*TRAINED, "run.dir=warm2", f"run.init_from={tmp_path / 'nowhere'}"], capsys)
    assert "no complete checkpoint" in line, line


def test_a_run_dir_under_a_file_is_a_clear_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("not a directory")
    line = refused(at_start, [*TINY, "run.dir=file/run"], capsys)
    assert "file/run" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_compile_cache_on_a_file_is_refused_before_any_device_work(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache").write_text("not a directory")
    line = refused(at_start, [*TINY, "train.steps=2", "run.dir=run2", f"run.compile_cache={tmp_path / 'cache'}"],
                   capsys)
    assert "run.compile_cache=" in line and "is a file" in line, line
    assert not (tmp_path / "run2").exists()


def test_a_gs_run_with_no_credentials_is_one_paragraph(tmp_path, monkeypatch, capsys) -> None:
    from runner.checkpoint import storage

    for key, value in {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing.json"), "NO_GCE_CHECK": "True",
                       "HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(tmp_path / "gcloud")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(storage.EMULATOR, raising=False)
    line = refused(at_start, [*TINY, "run.dir=gs://some-bucket/run"], capsys)
    assert "no Google Cloud credentials" in line and "gcloud auth application-default login" in line, line
