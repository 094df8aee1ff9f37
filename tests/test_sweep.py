"""Hydra multirun sweeps through `python -m runner -m`: directories, summary, failures, resume."""

from __future__ import annotations

import json
import signal

from tests.conftest import TINY, run_runner

SWEEP = ["-m", *TINY, "train.steps=6", "checkpoint.every_steps=2", "eval.every=0", "run.sweep=s1"]


def summary(tmp_path) -> list[dict]:
    return json.loads((tmp_path / "runs" / "sweeps" / "s1" / "summary.json").read_text())["members"]


def test_members_run_in_their_own_dirs_and_one_failure_does_not_stop_the_rest(tmp_path) -> None:
    args = [*SWEEP, "optimizer.lr=1e-2,3e-3", "job.model.n_heads=2,3"]
    first = run_runner(args, tmp_path)
    assert first.returncode == 1, first.stderr[-3000:]  # the sweep reports its failures
    members = summary(tmp_path)
    assert [m["status"] for m in members] == ["finished", "finished", "failed", "failed"]
    assert "job.model.n_heads" in members[2]["message"]
    dirs = [m["run_dir"] for m in members[:2]]
    assert len(set(dirs)) == 2 and all(d.startswith("runs/sweeps/s1/gpt_tiny/") for d in dirs)
    assert all(m["metrics"]["step"] == 6 and m["metrics"]["loss"] > 0 for m in members[:2])

    again = run_runner(args, tmp_path)  # the same sweep again: finished members are skipped
    assert again.returncode == 1
    assert [m["status"] for m in summary(tmp_path)][:2] == ["skipped (already finished)"] * 2
    assert [m["run_dir"] for m in summary(tmp_path)][:2] == dirs


def test_a_crashed_sweep_resumes_unfinished_members(tmp_path) -> None:
    args = [*SWEEP, "optimizer.lr=1e-2,3e-3", "logging.wandb=offline"]
    crashed = run_runner(args, tmp_path, RUNNER_FAULT="kill_at_step:4", WANDB_API_KEY="secret-key-0123456789")
    assert crashed.returncode == -signal.SIGKILL  # died inside the first member
    resumed = run_runner(args, tmp_path, WANDB_API_KEY="secret-key-0123456789")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2 " in resumed.stdout
    members = summary(tmp_path)
    assert [m["status"] for m in members] == ["finished", "finished"]
    for m in members:  # one wandb run per member, grouped by the sweep; no secret written anywhere
        run_dir = tmp_path / m["run_dir"]
        runs = list((run_dir / "wandb").glob("offline-run-*"))
        assert len({r.name.rsplit("-", 1)[-1] for r in runs}) == 1  # resumed: the same wandb run id
        data = b"".join(p.read_bytes() for p in runs[0].rglob("*") if p.is_file())
        assert b"s1" in data
    everything = b"".join(p.read_bytes() for p in (tmp_path / "runs").rglob("*") if p.is_file())
    assert b"secret-key-0123456789" not in everything
