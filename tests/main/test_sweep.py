"""Hydra multirun sweeps through `python -m runner -m`: directories, summary, failures, resume."""

from __future__ import annotations

import json
import signal

import pytest

from runner.exits import HALTED_EXIT_CODE
from tests.conftest import TINY, refused_in_process, run_runner

SWEEP = ["-m", *TINY, "train.steps=6", "checkpoint.every_steps=2", "eval.every=0", "run.sweep=s1"]


def summary(tmp_path) -> list[dict]:
    return json.loads((tmp_path / "runs" / "sweeps" / "s1" / "summary.json").read_text())["members"]


@pytest.mark.e2e
def test_members_run_in_their_own_dirs_and_one_failure_does_not_stop_the_rest(tmp_path) -> None:
    # The second source does not exist: a failure only running the member finds.
    args = [*SWEEP, "optimizer.lr=1e-2,3e-3", "data.sources=[{path:default}],[{path:nowhere}]"]
    first = run_runner(args, tmp_path)
    assert first.returncode == 2, first.stderr[-3000:]  # the sweep reports its failures: its members' code
    members = sorted(summary(tmp_path), key=lambda m: "nowhere" in " ".join(m["overrides"]))
    assert [m["status"] for m in members] == ["finished", "finished", "failed", "failed"]
    assert [m["exit_code"] for m in members] == [0, 0, 2, 2]  # missing data: a usage error
    assert "no token store" in members[2]["message"] and members[2]["objective"] is None
    dirs = [m["run_dir"] for m in members[:2]]
    assert len(set(dirs)) == 2 and all(d.startswith("runs/sweeps/s1/gpt_tiny/") for d in dirs)
    assert all(m["metrics"]["step"] == 6 and m["metrics"]["loss"] > 0 for m in members[:2])
    # each member's objective: the last value of the first held-out loss it logged
    assert all(m["objective_name"] == "eval/stdlib/loss" and m["objective"] == m["metrics"]["eval/stdlib/loss"]
               for m in members[:2])

    again = run_runner(args, tmp_path)  # the same sweep again: finished members are skipped
    assert again.returncode == 2
    again_members = sorted(summary(tmp_path), key=lambda m: "nowhere" in " ".join(m["overrides"]))
    assert [m["status"] for m in again_members][:2] == ["skipped (already finished)"] * 2
    assert [m["run_dir"] for m in again_members][:2] == dirs
    assert len(again_members) == 4  # the same members again: their records replaced, not added


@pytest.mark.deep
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


SWEEP_MISTAKES = [
    ("optimizer.lrr=1e-3,1e-2", "`optimizer.lrr`: runner has no setting of that name"),  # a typo
    ("+new_key=1", "runner has no setting of that name"),
    ("optimizer.name=adamw,nope", "there is no optimizer of that name"),
    ("job.model.n_heads=2,3", "does not divide d_model"),
    ("~seed", "deletes a setting"),
    ("run.objective=eval/mc/acc", "no configured evaluator logs it"),  # every member would return NaN
]


@pytest.mark.deep
def test_every_member_is_checked_before_any_trains(tmp_path) -> None:
    """A sweep gets the single run's exit-2 paragraph for a mistake in any member (here a wrong type
    in the second), before the first member starts: nothing is trained, no directory is made. (The
    other mistakes, through the same check in-process: the test below.)"""
    result = run_runner(["-m", *TINY, "train.steps=2", "optimizer.lr=1e-3,1e-2", "seed=1,abc"], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "seed=abc" in err[0] and "Fix:" in err[0]
    assert not (tmp_path / "runs").exists() and "step 1/" not in result.stdout


@pytest.mark.parametrize("mistake, message", SWEEP_MISTAKES)
def test_every_kind_of_member_mistake_is_one_exit_2_paragraph(tmp_path, monkeypatch, capsys, mistake: str,
                                                             message: str) -> None:
    """What `python -m runner -m ...` runs before any member starts (runner.main.cli.precheck), on
    each kind of mistake: exit 2, one paragraph naming it and the fix, nothing written."""
    monkeypatch.chdir(tmp_path)
    line = refused_in_process([*TINY, "train.steps=2", "optimizer.lr=1e-3,1e-2", mistake], capsys, multirun=True)
    assert message in line and "Fix:" in line, line
    assert not list(tmp_path.iterdir())


@pytest.mark.deep
def test_optuna_optimizes_the_run_objective(tmp_path) -> None:
    """hydra-optuna-sweeper gets each member's run.objective as a float and writes its best trial;
    a second invocation's trials join the summary next to the first's."""
    import yaml

    args = ["-m", *TINY, "train.steps=3", "eval.every=0", "run.sweep=opt", "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=1", "optimizer.lr=interval(1e-4,1e-2)",
            "run.objective=eval/stdlib/loss"]
    first = run_runner(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    root = tmp_path / "runs" / "sweeps" / "opt"
    best = yaml.safe_load((root / "optimization_results.yaml").read_text())
    members = json.loads((root / "summary.json").read_text())["members"]
    assert len(members) == 3 and all(m["status"] == "finished" for m in members)
    objectives = {m["objective"] for m in members}
    assert best["best_value"] == min(objectives) and len(objectives) == 3
    winner = next(m for m in members if m["objective"] == best["best_value"])
    assert f"optimizer.lr={best['best_params']['optimizer.lr']}" in winner["overrides"]
    again = run_runner([*args[:-4], "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=2", *args[-2:]], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(json.loads((root / "summary.json").read_text())["members"]) == 5  # every member ever run


@pytest.mark.deep
def test_a_diverging_or_raising_member_is_recorded_and_the_others_train(tmp_path) -> None:
    """The NaN guard's stop and a raising hook are a member's failure, not the sweep's: recorded with
    their reason and no objective, the other members train, the table prints, exit 65 (a halt); a rerun
    skips the finished member and fails the others again without blocking it."""
    args = ["-m", *TINY, "train.steps=6", "eval.every=0", "run.sweep=s1", "optimizer.clip_norm=null",
            "schedule.warmup_steps=0", "optimizer.lr=1e6,1e-3", "seed=0,1", "callbacks=[tests.callback_fixture:Recorder]"]
    env = {"HOOK_LOG": str(tmp_path / "hooks.log"), "HOOK_FAIL_AT": "3", "HOOK_FAIL_SEED": "1"}
    for attempt in range(2):
        result = run_runner(args, tmp_path, **env)
        assert result.returncode == HALTED_EXIT_CODE, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        members = {(m["overrides"][-3], m["overrides"][-2]): m for m in summary(tmp_path)}
        assert len(members) == 4
        ok = members[("optimizer.lr=0.001", "seed=0")]
        assert ok["status"] == ("finished" if attempt == 0 else "skipped (already finished)")
        assert isinstance(ok["objective"], float)
        hooked = members[("optimizer.lr=0.001", "seed=1")]
        if attempt == 0:
            assert hooked["status"] == "failed" and "boom" in hooked["message"] and hooked["objective"] is None
        else:  # resumed from its last good state, past the step its hook raised at
            assert hooked["status"] == "finished"
        for key in (("optimizer.lr=1000000.0", "seed=0"), ("optimizer.lr=1000000.0", "seed=1")):
            m = members[key]  # the NaN guard stops it again, every time
            assert m["status"] == "failed" and m["objective"] is None, m
            assert "non-finite" in m["message"] or "boom" in m["message"], m["message"]
        assert f"s1: 4 members, {3 - attempt} failed" in result.stdout
        assert "eval/stdlib/loss nan" in result.stdout


@pytest.mark.deep
def test_optuna_records_a_failed_trial_and_goes_on(tmp_path) -> None:
    """A diverging trial is a failed trial in Optuna's study (not a NaN told to it, which optuna
    refuses): the sweep finishes its trials and writes its best, exit 65 for the halt. (TPE,
    seeded to ask 1e6 then 1e-3; Optuna's grid sampler stops the study from inside `tell` when a
    failed trial is its last point, which hydra-optuna-sweeper does not expect.)"""
    import yaml

    args = ["-m", *TINY, "train.steps=4", "eval.every=0", "run.sweep=opt", "hydra/sweeper=optuna",
            "hydra.sweeper.sampler.seed=10", "hydra.sweeper.n_trials=2", "optimizer.clip_norm=null",
            "schedule.warmup_steps=0", "optimizer.lr=choice(1e6,1e-3)", "run.objective=eval/stdlib/loss"]
    result = run_runner(args, tmp_path)
    assert result.returncode == HALTED_EXIT_CODE, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Failed experiment" in result.stderr
    assert "\x1b[" not in result.stderr  # Optuna's colours only on a terminal
    root = tmp_path / "runs" / "sweeps" / "opt"
    best = yaml.safe_load((root / "optimization_results.yaml").read_text())
    assert best["best_params"]["optimizer.lr"] == 1e-3
    statuses = sorted(m["status"] for m in json.loads((root / "summary.json").read_text())["members"])
    assert statuses == ["failed", "finished"]


def test_a_sweep_exits_with_a_code_a_rerun_may_fix_first(tmp_path) -> None:
    """Its members are independent: a stop to resume or a crash (a rerun skips the finished members)
    before a member's end no rerun changes (a halt, a setting), before 0; a record written before
    members kept their code reads as it did (failed: 1, stopped: its code)."""
    from runner.checkpoint import storage
    from runner.main.sweep import SweepSummary

    root = SweepSummary(storage.path(tmp_path / "s"))
    assert root.exit_code == 0
    root.record(0, ["a=1"], "", "finished")
    root.record(1, ["a=2"], "", "failed", "halted", exit_code=65)
    root.record(2, ["a=3"], "", "failed", "bad", exit_code=2)
    assert root.exit_code == 65
    root.record(3, ["a=4"], "", "stopped (resumable)", exit_code=75)
    assert root.exit_code == 75
    old = SweepSummary(storage.path(tmp_path / "old"))
    old.record(0, ["a=1"], "", "failed")
    (tmp_path / "old" / "members" / next(p.name for p in (tmp_path / "old" / "members").iterdir())).write_text(
        json.dumps({"member": 0, "overrides": ["a=1"], "run_dir": "", "status": "failed", "metrics": {}}))
    assert old.exit_code == 1
    # a local sweep stopped by SIGTERM recorded its member as "stopped (exit 75)" before codes were kept
    stopped = SweepSummary(storage.path(tmp_path / "stopped"))
    stopped.record(0, ["a=1"], "", "finished")
    member = next((tmp_path / "stopped" / "members").iterdir())
    member.write_text(json.dumps({"member": 0, "overrides": ["a=1"], "run_dir": "", "status": "stopped (exit 75)",
                                  "metrics": {}}))
    assert stopped.exit_code == 75


def test_the_same_sweep_command_finds_the_same_sweep() -> None:
    """Value order does not make another sweep; Optuna gets a sampler seed derived from the sweep
    unless one is given."""
    from runner.main.sweep import sampler_seed, sweep_root

    assert sweep_root(["-m", "optimizer=lion,adamw", "optimizer.lr=1e-3,1e-2"]) == \
        sweep_root(["-m", "optimizer.lr=1e-2,1e-3", "optimizer=adamw,lion"])
    assert sweep_root(["-m", "optimizer=lion,adamw"]) != sweep_root(["-m", "optimizer=lion,sgd"])
    optuna = ["-m", "hydra/sweeper=optuna", "optimizer.lr=interval(1e-4,1e-2)"]
    assert sampler_seed(optuna) == sampler_seed(optuna) and sampler_seed(optuna)[0].startswith(
        "hydra.sweeper.sampler.seed=")
    assert sampler_seed([*optuna, "seed=1"]) != sampler_seed(optuna)  # another sweep, another seed
    assert sampler_seed([*optuna, "hydra.sweeper.sampler.seed=7"]) == []  # the user's is kept
    assert sampler_seed(["-m", "optimizer.lr=1e-3,1e-2"]) == []  # the basic sweeper has no sampler
    assert sampler_seed([*optuna, "hydra/sweeper/sampler=grid"]) == []  # nor has a grid a seed


@pytest.mark.deep
def test_rerunning_an_optuna_sweep_finds_its_finished_trials(tmp_path) -> None:
    """docs/sweeps.md's Optuna command, run twice with no seed: the second asks the same trials, finds
    each member finished, and its optimization_results.yaml covers the whole sweep."""
    import yaml

    args = ["-m", *TINY, "train.steps=2", "eval.every=0", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
            "hydra.sweeper.direction=minimize", "optimizer.lr=interval(1e-4,1e-2)"]
    first = run_runner(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    [root] = (tmp_path / "runs" / "sweeps").iterdir()
    best = yaml.safe_load((root / "optimization_results.yaml").read_text())
    again = run_runner(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    members = json.loads((root / "summary.json").read_text())["members"]
    assert len(members) == 2 and all(m["status"] == "skipped (already finished)" for m in members)
    assert yaml.safe_load((root / "optimization_results.yaml").read_text()) == best
    assert "step 1/" not in again.stdout  # nothing trained again
