"""tools/cadence_check.py: its schedule, its measurement and verdicts in-process, and (deep) the
whole check in a tiny configuration: runs killed on a seeded schedule, relaunched, measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import cadence_check as tool  # noqa: E402

TINY_MODEL = ["job.model.d_model=32", "job.model.n_layers=2", "job.model.n_heads=2", "job.model.context_length=32",
              "train.seq_len=32"]


def test_the_schedule_is_seeded_poisson() -> None:
    first = [t for _, t in zip(range(2000), tool.kill_times(60.0, seed=3))]
    assert first == [t for _, t in zip(range(2000), tool.kill_times(60.0, seed=3))]
    assert first != [t for _, t in zip(range(2000), tool.kill_times(60.0, seed=4))]
    gaps = [b - a for a, b in zip([0.0, *first], first)]
    assert min(gaps) > 0 and sum(gaps) / len(gaps) == pytest.approx(60.0, rel=0.1)


def result(name: str, measured: float, closed: float, interval_s: float = 2.0) -> tool.Result:
    return tool.Result(name, 10, interval_s, 3, 2, 100.0, measured, measured, closed, closed, 0.03, 0.1, 5.0, 5.0,
                       0.05, 1.0, 80.0)


def test_verdicts_compare_auto_with_the_best_within_noise_and_each_forecast_within_10_percent() -> None:
    close = tool.verdicts([result("auto", 0.80, 0.82), result("fixed x2", 0.81, 0.80, 4.0)], mtbf_s=30.0)
    assert close["auto_best_or_within_noise"] and close["best"] == "fixed x2" and 0 < close["noise_margin"] < 0.2
    assert close["forecast_within_10pct"] and close["worst_forecast_off"] == pytest.approx(0.025)
    far = tool.verdicts([result("auto", 0.50, 0.60), result("fixed x2", 0.80, 0.80, 4.0)], mtbf_s=30.0)
    assert not far["auto_best_or_within_noise"] and not far["forecast_within_10pct"]
    alone = tool.verdicts([result("auto", 0.80, 0.80), result("fixed x2", 0.70, 0.70, 4.0)], mtbf_s=30.0)
    assert alone["auto_best_or_within_noise"] and alone["noise_margin"] == 0.0  # auto is the best: nothing to add


def test_the_difference_of_two_runs_under_the_same_kills_is_less_noisy_than_two_independent_ones() -> None:
    a, b = result("auto", 0.8, 0.8), result("fixed x2", 0.8, 0.8, 4.0)
    together = tool.difference_noise(a, b, mtbf_s=30.0, seeds=100)
    apart = (a.model(30.0, runs=100).stdev ** 2 + b.model(30.0, runs=100, seed=1).stdev ** 2) ** 0.5
    assert 0 < together < apart


def test_a_run_is_measured_against_the_supervisors_wall_and_forecast_from_its_own_costs(tmp_path: Path) -> None:
    # saved every 10 steps, but a restored checkpoint carries the saves before it, not itself, and the saves of
    # a killed launch after it are lost: the record counts 6 saves, not 11, so 100 steps over its saves would
    # say every 20; the interval is the one the run saved at (fixed: checkpoint.every_steps)
    record = {"step": 100, "goodput/percent": 90.0, "goodput/train_s": 12.0, "goodput/recomputed_s": 2.0,
              "goodput/saves": 6.0, "goodput/checkpoint_s": 0.6, "goodput/eval_s": 0.0, "goodput/other_s": 0.5,
              "goodput/data_wait_s": 0.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    session = tool.Session([tool.Launch(0.0, 4.0, 9.0, -9, True), tool.Launch(9.0, 14.0, 22.0, 0, False)], [9.0])
    r = tool.measure("fixed x1", 10, session, tmp_path, mtbf_s=60.0, steps=100)
    assert r.measured == pytest.approx(10.0 / 22.0) and r.runner_percent == 0.9
    assert (r.start_s, r.relaunch_s, r.save_s, r.step_s, r.interval_s) == pytest.approx((4.0, 5.0, 0.1, 0.1, 1.0))
    assert r.launches == 2 and r.kills == 1 and 0 < r.closed_form < 1 and 0 < r.replayed < 1


def test_auto_is_measured_at_its_last_printed_choice() -> None:
    lines = ["checkpoint cadence auto: durable every 100 steps (the fixed intervals) until a durable save and a "
             "step are measured; relaunch 0 s, job MTBF 60 s (...)",
             "checkpoint cadence auto: durable every 37 steps (2.4 s), local off; a durable save blocks 0.1 s ...",
             "Finished: 400 steps",
             "checkpoint cadence auto: durable every 41 steps (2.6 s), local off; a durable save blocks 0.11 s ..."]
    assert tool.chosen_every(lines) == 41
    assert tool.chosen_every(lines[:1]) is None  # the fixed interval it waited at is not a choice


@pytest.mark.parametrize("args, needle", [
    (["--multiples", "a,b"], "not a comma-separated list"),
    (["--multiples", "0,2"], "each must be > 0"),
    (["--mtbf-s", "0"], "--mtbf-s=0.0: it must be > 0"),
    (["--nope"], "unrecognized arguments"),
])
def test_bad_arguments_are_one_paragraph_and_exit_2(args: list[str], needle: str, capsys) -> None:
    assert tool.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and needle in captured.err and captured.err.count("\n") == 1 and "Fix:" in captured.err


@pytest.mark.deep
def test_the_check_runs_auto_and_fixed_cadences_under_kills_in_a_tiny_configuration(tmp_path: Path) -> None:
    args = ["--steps", "4000", "--mtbf-s", "12", "--seed", "5", "--multiples", "0.5,4", "--fallback-steps", "100",
            "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "check.jsonl")]
    for override in TINY_MODEL:
        args += ["--override", override]
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "cadence_check.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "check.jsonl").read_text())
    assert [r["name"] for r in record["runs"]] == ["auto", "fixed x0.5", "fixed x4"]
    auto = record["runs"][0]
    assert record["runs"][1]["every_steps"] == max(1, round(auto["every_steps"] * 0.5))
    assert sum(r["kills"] for r in record["runs"]) >= 1  # the schedule killed something, and the runs finished
    for r in record["runs"]:  # every run finished: each kill cost one launch, and the last one exited 0
        assert r["launches"] == r["kills"] + 1
        assert 0 < r["measured"] <= 1 and 0 < r["closed_form"] <= 1 and 0 < r["replayed"] <= 1
        # forecast at the interval the run saved at: its every_steps (auto's: its last choice) of its step time
        assert r["interval_s"] == pytest.approx(r["every_steps"] * r["step_s"])
    auto_log = (tmp_path / "work" / "auto.log").read_text().splitlines()
    assert tool.chosen_every(auto_log) is not None and auto["every_steps"] == tool.chosen_every(auto_log)
    # the verdicts are the runs' own figures (no bound on how far off: runs of 15 s under kills every 12 s on
    # average swing by tens of percent when a kill lands near a save or the run's end; the full check is where
    # the 10% verdicts mean something)
    assert record["worst_forecast_off"] == pytest.approx(max(abs(r["closed_form"] - r["measured"]) / r["measured"]
                                                             for r in record["runs"]))
    assert record["worst_replay_off"] == pytest.approx(max(abs(r["replayed"] - r["measured"]) / r["measured"]
                                                           for r in record["runs"]))
    assert record["forecast_within_10pct"] == (record["worst_forecast_off"] <= 0.10)
    assert record["best"] == max(record["runs"], key=lambda r: r["measured"])["name"]
    assert "auto is" in done.stdout and done.stdout.strip().splitlines()[-1] == json.dumps(record)
