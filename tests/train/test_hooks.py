"""Hooks, numerical guards, stopping conditions, debug helpers, run card and size scaling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runner.exits import HALTED_EXIT_CODE, PREEMPTED_EXIT_CODE, STOPPED_ON_REQUEST_EXIT_CODE
from runner.spec import ModelSpec, scaled_model
from tests import wandb_records
from tests.conftest import TINY, read_metrics, run_runner, start_runner_until
from tests.train.test_restore import params_of

BASE = [*TINY, "eval.every=2", "checkpoint.every_steps=2", "train.steps=3"]


def events(path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.deep
def test_hook_points_run_in_order(tmp_path) -> None:
    log = tmp_path / "hooks.log"
    result = run_runner([*BASE, "run.dir=run", "callbacks=[tests.callback_fixture:Recorder]",
                         "job.trainer=tests.callback_fixture:HookedTrainer"], tmp_path, HOOK_LOG=str(log))
    assert result.returncode == 0, result.stderr[-3000:]
    assert events(log) == [
        "on_init_start", "on_init_end", "on_train_start",
        "on_eval_start 0", "on_eval_end 0",
        "trainer.on_step_start 1", "on_step_start 1",
        "trainer.on_step_start 2", "on_step_start 2",
        "trainer.on_step_end 1", "on_step_end 1",  # metrics are read one step late
        "trainer.on_step_end 2", "on_step_end 2",
        "on_eval_start 2", "on_eval_end 2", "on_save_start 2", "on_save_end 2",
        "trainer.on_step_start 3", "on_step_start 3",
        "trainer.on_step_end 3", "on_step_end 3",
        "on_eval_start 3", "on_eval_end 3", "on_save_start 3", "on_save_end 3",
        "on_train_end",
    ]


@pytest.mark.deep
def test_a_raising_hook_stops_with_a_checkpoint_and_names_itself(tmp_path) -> None:
    result = run_runner([*BASE, "run.dir=run", "train.steps=10", "callbacks=[tests.callback_fixture:Recorder]"],
                        tmp_path, HOOK_LOG=str(tmp_path / "hooks.log"), HOOK_FAIL_AT="3")
    assert result.returncode == HALTED_EXIT_CODE
    assert "tests.callback_fixture.Recorder.on_step_end raised RuntimeError: boom" in result.stderr
    assert "Traceback" not in result.stderr
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] == 4  # the newest state (step 4 was running when step 3 was read)


@pytest.mark.deep
def test_unknown_callback_is_a_config_error(tmp_path) -> None:
    result = run_runner([*TINY, "callbacks=[nope.module:Thing]"], tmp_path)
    assert result.returncode == 2 and "callbacks" in result.stderr


EXPLODE = [*TINY, "optimizer=sgd", "optimizer.lr=1e8", "optimizer.clip_norm=null", "train.steps=12", "eval.every=0",
           "checkpoint.every_steps=0"]


@pytest.mark.deep
def test_guard_stop_saves_the_last_good_state(tmp_path) -> None:
    result = run_runner([*EXPLODE, "run.dir=run", "guard.nonfinite=stop"], tmp_path)
    assert result.returncode == HALTED_EXIT_CODE and "non-finite" in result.stderr, result.stderr[-2000:]
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    first_bad = min(r["step"] for r in records if r["nonfinite"])
    assert f"at step {first_bad} " in result.stderr
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1
    assert all(np.isfinite(p).all() for p in params_of(tmp_path / "run", saved[0]))


@pytest.mark.deep
def test_guard_skip_continues_up_to_the_consecutive_limit(tmp_path) -> None:
    result = run_runner([*EXPLODE, "run.dir=run", "guard.nonfinite=skip", "guard.max_consecutive_skips=3"], tmp_path)
    assert result.returncode == HALTED_EXIT_CODE and "4 consecutive steps skipped" in result.stderr, result.stderr[-2000:]
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    # the limit is noticed when step k's metrics are read, while step k+1 (also skipped) runs
    assert sum(r["skipped"] for r in records) == 5
    saved = max(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert all(np.isfinite(p).all() for p in params_of(tmp_path / "run", saved))


RESUMABLE = [*TINY, "train.steps=20", "eval.every=0", "checkpoint.every_steps=0", "optimizer.lr=1e-2",
             "logging.wandb=offline"]


@pytest.mark.deep
def test_the_stop_file_and_the_step_limit_stop_cleanly_and_the_run_resumes_exactly(tmp_path) -> None:
    """Launch 1 is stopped by a STOP file in its run directory (exit 76: a stop you asked for, which
    no supervisor restarts; the file removed); launch 2 resumes and stops after
    train.max_steps_this_launch=5 steps, counted from where it resumed (75: a supervisor relaunches
    it); launch 3 ends the run (0), bit for bit the uninterrupted run's parameters. wandb (its own
    run files, offline): the stopped launches preempted with their exit codes, the last finished with
    0, all three one wandb run. (The time limit is tested by an injected clock in
    tests/train/test_loop.py, not by waiting for it.)"""
    reference = run_runner([*RESUMABLE, "run.dir=reference"], tmp_path)
    assert reference.returncode == 0, reference.stderr[-2000:]
    args = [*RESUMABLE, "run.dir=run"]
    # launch 1 is held at the end of step 5 until the file is made (HoldForStopFile), so it is still
    # running then however fast the machine is, and stops at a known step
    proc = start_runner_until([*args, "callbacks=[tests.callback_fixture:HoldForStopFile]"], tmp_path,
                              tmp_path / "run", 4)
    (tmp_path / "run" / "STOP").touch()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == STOPPED_ON_REQUEST_EXIT_CODE, err[-2000:]
    assert "stopped by the stop file" in out and not (tmp_path / "run" / "STOP").exists()
    stopped = max(r["step"] for r in read_metrics(tmp_path / "run"))
    # a step's end (its metrics) comes once the next step is dispatched: held at step 5's
    # (HoldForStopFile.STEP), the file is seen with step 6 done
    assert stopped == 6, stopped

    limited = run_runner([*args, "train.max_steps_this_launch=5"], tmp_path)
    assert limited.returncode == PREEMPTED_EXIT_CODE, limited.stderr[-2000:]
    assert f"resumed from step {stopped} " in limited.stdout, limited.stdout[-2000:]
    assert ("stopped by the step limit for this launch (train.max_steps_this_launch=5) at step "
            f"{stopped + 5}") in limited.stdout, limited.stdout[-2000:]
    done = run_runner(args, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for a, b in zip(params_of(tmp_path / "run", 20), params_of(tmp_path / "reference", 20), strict=True):
        np.testing.assert_array_equal(a, b)
    launches = wandb_records.launches(tmp_path / "run")
    assert [(w["preempting"], w["exit_code"]) for w in launches] == [(True, 76), (True, 75), (False, 0)]
    assert len({w["id"] for w in launches}) == 1


@pytest.mark.deep
def test_overfit_one_batch_profiler_norms_and_run_card(tmp_path) -> None:
    result = run_runner([*TINY, "run.dir=run", "train.steps=80", "debug.overfit_batch=true", "optimizer.lr=1e-2",
                         "schedule.warmup_steps=5", "eval.every=0", "debug.profile_start=3", "debug.profile_steps=2",
                         "debug.norms_every=20"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_metrics(tmp_path / "run")
    losses = [r["loss"] for r in records if "loss" in r]
    # Memorised: a byte-level model this small gets nowhere near 1 nat per byte on text it has not
    # seen, only on the one batch it is shown again and again (which batch depends on the corpus,
    # i.e. on the Python version's standard library).
    assert losses[0] > 3.0 and losses[-1] < 1.0
    norms = [r for r in records if "grad_norm/block_0" in r]
    assert [r["step"] for r in norms] == [20, 40, 60, 80]
    assert {"param_norm/wte", "update_norm/block_1", "grad_norm/ln_f"} <= set(norms[0])
    assert list((tmp_path / "run" / "profile" / "process_0").rglob("*.xplane.pb"))
    card = (tmp_path / "run" / "RUN_CARD.md").read_text()
    assert "parameters:" in card and "FLOPs per token" in card and "mesh:" in card and "memory per device" in card
    assert "## Final metrics" in card and "## Resolved spec" in card and "overfit_batch: true" in card
    assert "parameters:" in result.stdout


def test_one_integer_scales_the_model() -> None:
    small, big = scaled_model(ModelSpec(scale=2)), scaled_model(ModelSpec(scale=4))
    assert (small.d_model, small.n_heads, small.d_ff) == (128, 2, 512)
    assert (big.d_model, big.n_heads, big.d_ff) == (256, 4, 1024)
    assert scaled_model(ModelSpec()) == ModelSpec()
    from runner.models.gpt.model import GPTConfig, param_count

    counts = [param_count(GPTConfig(vocab_size=320, context_length=128, d_model=m.d_model, n_layers=4,
                                    n_heads=m.n_heads, d_ff=m.d_ff)) for m in (small, big)]
    assert counts[1] > 3 * counts[0]


@pytest.mark.deep
def test_scale_sweep_is_one_multirun_line(tmp_path) -> None:
    result = run_runner(["-m", *TINY, "job.model.scale=1,2", "job.model.head_dim=16", "train.steps=2",
                         "eval.every=0", "run.sweep=sizes"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    members = json.loads((tmp_path / "runs" / "sweeps" / "sizes" / "summary.json").read_text())["members"]
    dims = [json.loads(json.dumps(m))["run_dir"] for m in members]
    assert len(set(dims)) == 2
    cards = [(tmp_path / d / "RUN_CARD.md").read_text() for d in dims]
    assert "d_model: 16" in cards[0] and "d_model: 32" in cards[1]
