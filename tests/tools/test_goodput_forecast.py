"""tools/goodput_forecast.py in-process: a forecast from given costs and from a run directory's
goodput record, and its refusals (one paragraph, exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint import cadence as cd
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import goodput_forecast as tool  # noqa: E402


def test_a_forecast_from_given_costs_at_llama_3s_scale(capsys) -> None:
    assert tool.main(["--save-s", "40", "--relaunch-s", "600", "--hosts", "2048", "--runs", "10", "--days", "2",
                      "--json"]) == 0
    out = capsys.readouterr().out
    assert "job: 2,048 hosts, MTBF 6,300 h per host: job MTBF 3.08 h, 7.8 interruptions a day" in out
    rows = {line.split()[0] + (line.split()[1] if line.startswith("fixed") else ""): line for line in out.splitlines()
            if line.startswith(("auto", "fixed"))}
    assert set(rows) == {"auto", "fixedx0.25", "fixedx0.5", "fixedx2", "fixedx4"}
    record = json.loads(out.strip().splitlines()[-1])
    auto = cd.best(cd.Costs(40.0, 600.0, cd.job_mtbf_s(6300, 2048)), max_s=3600.0)
    assert record["auto_durable_s"] == pytest.approx(auto.durable_s) and record["auto_local_s"] is None
    assert record["daly_s"] == pytest.approx(cd.daly(40.0, cd.job_mtbf_s(6300, 2048)))
    found = {r["name"]: r for r in record["rows"]}
    assert max(found.values(), key=lambda r: r["closed_form"])["name"] == "auto"
    for r in found.values():  # the simulation beside the closed form
        assert r["simulated"] == pytest.approx(r["closed_form"], abs=5 * r["stderr"] + 3e-3)


def test_a_forecast_from_a_run_directory_reads_its_measured_costs(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    steps = [{"step": s, "loss": 1.0, "step_time_s": 0.1} for s in range(1, 11)]
    last = {"step": 10, "goodput/percent": 80.0, "goodput/saves": 4.0, "goodput/saves_local": 0.0,
            "goodput/checkpoint_s": 2.0, "goodput/checkpoint_local_s": 0.0, "goodput/startup_s": 8.0,
            "goodput/restore_s": 1.0, "goodput/compile_s": 3.0, "goodput/launches": 2.0}
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [*steps, last]) + "\n")
    (run / "spec.yaml").write_text("checkpoint:\n  every_steps: 50\n  mtbf_hours: 0.5\n")
    inputs = tool.inputs_of(tool.parse(["--run-dir", str(run), "--hosts", "4"]))
    # without launches.jsonl: the carried sums over goodput/launches
    assert (inputs.save_s, inputs.relaunch_s, inputs.step_s, inputs.mtbf_hours, inputs.hosts) == (0.5, 6.0, 0.1,
                                                                                                  0.5, 4)
    assert inputs.fixed == cd.Cadence(5.0) and inputs.local_save_s is None and inputs.max_minutes == 60.0
    assert tool.main(["--run-dir", str(run), "--runs", "5", "--days", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "a durable save blocks 0.5 s, a relaunch 6 s, a step 0.1 s" in out and "4 durable saves" in out
    assert "fixed, as run (every 50 steps)" in out and "no launches.jsonl" in out


def run_dir_with_launches(run: Path) -> Path:
    """A run whose checkpoints remember 2 launches but whose launches.jsonl has 3 (one died before its
    first save), on 2 hosts of 4 processes, with checkpoint.auto_max_minutes=5."""
    run.mkdir()
    last = {"step": 10, "goodput/percent": 80.0, "goodput/saves": 4.0, "goodput/checkpoint_s": 2.0,
            "goodput/startup_s": 8.0, "goodput/restore_s": 1.0, "goodput/compile_s": 3.0, "goodput/launches": 2.0}
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "step_time_s": 0.1}) + "\n" +
                                       json.dumps(last) + "\n")
    (run / "spec.yaml").write_text("checkpoint:\n  every_steps: 50\n  mtbf_hours: 0.5\n  auto_max_minutes: 5\n")
    lines = [{"launch": n, "startup_s": s, "restore_s": r, "compile_s": c, "processes": 8, "hosts": 2}
             for n, (s, r, c) in enumerate([(5.0, 0.0, 2.0), (4.0, 1.0, 1.0), (6.0, 1.0, 1.0)], start=1)]
    (run / "launches.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def test_a_run_directorys_relaunch_cost_and_hosts_come_from_its_launches(tmp_path: Path) -> None:
    inputs = tool.inputs_of(tool.parse(["--run-dir", str(run_dir_with_launches(tmp_path / "run"))]))
    # the mean over every launch that reached its loop (7, 6, 8), not the carried 12 s over 2 remembered launches
    assert inputs.relaunch_s == pytest.approx(7.0) and "3 launches (launches.jsonl)" in inputs.source
    assert inputs.hosts == 2  # the hosts recorded, not the processes
    assert inputs.max_minutes == 5.0  # the run's checkpoint.auto_max_minutes
    auto, _ = tool.forecast(inputs, days=0.05, runs=2, max_s=inputs.max_minutes * 60)
    assert auto.durable_s <= 300.0 * (1 + 1e-6)
    given = tool.inputs_of(tool.parse(["--run-dir", str(tmp_path / "run"), "--hosts", "16", "--max-minutes", "9"]))
    assert given.hosts == 16 and given.max_minutes == 9.0  # the command line wins


def test_a_gs_run_directory_reaches_storage_unchanged(tmp_path: Path, monkeypatch) -> None:
    """`gs://b/x` must reach runner.checkpoint.storage as given (pathlib would make it `gs:/b/x`); the
    bucket is a local directory behind a fake storage.path."""
    from runner.checkpoint import storage

    local = run_dir_with_launches(tmp_path / "bucket")
    seen: list[str] = []

    def fake_path(location: Any) -> Path:
        seen.append(location)
        assert isinstance(location, str) and location == "gs://b/runs/x"
        return local

    monkeypatch.setattr(storage, "path", fake_path)
    inputs = tool.inputs_of(tool.parse(["--run-dir", "gs://b/runs/x"]))
    assert seen and set(seen) == {"gs://b/runs/x"}
    assert inputs.source.startswith("gs://b/runs/x: ") and inputs.relaunch_s == pytest.approx(7.0)
    assert inputs.mtbf_hours == 0.5 and inputs.fixed == cd.Cadence(5.0)


def test_a_local_tier_the_run_did_not_have_recovers_the_default_share(tmp_path: Path, capsys) -> None:
    run = run_dir_with_launches(tmp_path / "run")
    inputs = tool.inputs_of(tool.parse(["--run-dir", str(run), "--local-save-s", "0.01"]))
    assert inputs.local_save_s == 0.01 and inputs.local_recovers == pytest.approx(1 - cd.DEFAULT_HOST_LOSS)
    replicas = tool.inputs_of(tool.parse(["--run-dir", str(run), "--local-save-s", "0.01", "--host-loss", "0"]))
    assert replicas.local_recovers == 1.0 and cd.best(replicas.costs(), min_s=0.1, max_s=300.0).k > 1
    assert tool.main(["--run-dir", str(run), "--host-loss", "0.5"]) == 2  # no local tier to lose
    err = capsys.readouterr().err
    assert "--host-loss=0.5" in err and "no local tier in the run" in err and "Fix: add --local-save-s" in err


def test_costs_beyond_the_models_range_are_refused_and_rows_beyond_it_are_na(capsys) -> None:
    # a relaunch of 60 job MTBFs: goodput below e^-50, and exp() would overflow past ~709
    assert tool.main(["--save-s", "1", "--relaunch-s", "6000", "--mtbf-hours", "100", "--hosts", "3600"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --relaunch-s: a relaunch of 6e+03 s is 60 times the job's MTBF (100 s)")
    assert "Fix:" in err and err.count("\n") == 1
    # a save of 48 MTBFs: auto's interval (about one MTBF) is within range, four times it is not; a simulated run
    # would meet e^49 failures, so no row is simulated
    assert tool.main(["--save-s", "4800", "--relaunch-s", "10", "--mtbf-hours", "100", "--hosts", "3600", "--runs",
                      "2", "--days", "0.01", "--json"]) == 0
    out = capsys.readouterr().out
    rows = {r["name"]: r for r in json.loads(out.strip().splitlines()[-1])["rows"]}
    assert 0 < rows["auto"]["closed_form"] < 1e-15 and rows["auto"]["simulated"] is None
    assert rows["fixed x4"]["closed_form"] is None and "n/a" in out and "beyond the model's range" in out


@pytest.mark.parametrize("args, needle", [
    ([], "give --run-dir DIR"),
    (["--save-s", "3"], "give --run-dir DIR"),
    (["--save-s", "-1", "--relaunch-s", "3"], "--save-s=-1.0: it must be >= 0"),
    (["--save-s", "1", "--relaunch-s", "3", "--hosts", "0"], "--hosts=0: it must be > 0"),
    (["--save-s", "1", "--relaunch-s", "3", "--host-loss", "2"], "--host-loss=2.0"),
    (["--save-s", "1", "--relaunch-s", "3", "--host-loss", "0.5"], "there is no local tier. Fix"),
    (["--save-s", "1", "--relaunch-s", "3", "--max-minutes", "0"], "--max-minutes=0.0: it must be > 0"),
    (["--save-s", "x"], "invalid float value"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--run-dir", "/nonexistent/run"], "there is no metrics.jsonl"),
])
def test_bad_arguments_are_one_paragraph_and_exit_2(args: list[str], needle: str, capsys) -> None:
    assert tool.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and needle in captured.err and "Fix:" in captured.err
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1


def test_a_run_without_save_counts_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "goodput/percent": 50.0}) + "\n")
    assert tool.main(["--run-dir", str(tmp_path)]) == 2
    assert "counts no durable save" in capsys.readouterr().err
