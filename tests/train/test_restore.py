"""Kill it anywhere, rerun the same command, get the same run: real processes, real signals."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.conftest import TINY, read_metrics, run_runner, runner_env, shared_run, start_runner_until


STEPS = 24
BASE = [*TINY, f"train.steps={STEPS}", "checkpoint.every_steps=8", "checkpoint.keep=5", "eval.every=0",
        "optimizer.lr=1e-2"]


def params_of(run_dir: Path, step: int) -> list[np.ndarray]:
    """Plain orbax, as docs/run-directory.md shows: works whatever topology saved the checkpoint."""
    import jax

    path = (run_dir / "checkpoints" / str(step) / "state").absolute()
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        state = checkpointer.restore(path, args=ocp.args.StandardRestore(
            fallback_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def goodput_of(run_dir: Path) -> dict:
    """The run's last goodput record (logged with the final step)."""
    return [r for r in read_metrics(run_dir) if "goodput/percent" in r][-1]


def ckpt_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def make_reference(tmp: Path) -> Path:
    result = run_runner([*BASE, "run.dir=ref"], tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "ref"


@pytest.fixture(scope="module")
def reference() -> Path:
    """The uninterrupted run (one process): made once a session, read by test_local_tier and test_gcs too."""
    return shared_run("restore-reference", make_reference)


def assert_same_run(run_dir: Path, reference: Path) -> None:
    for a, b in zip(params_of(run_dir, STEPS), params_of(reference, STEPS)):
        np.testing.assert_array_equal(a, b)  # bitwise
    assert losses(run_dir) == losses(reference)  # every step, exactly
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("fault, resumed_from", [
    ("kill_at_step:5", None),  # before the first checkpoint
    ("kill_at_step:13", 8),  # between checkpoints
    ("kill_after_save:16", (8, 16)),  # in the middle of an asynchronous save
])
@pytest.mark.e2e
def test_sigkill_anywhere_then_rerun_gives_the_same_run(tmp_path, reference, fault, resumed_from) -> None:
    args = [*BASE, "run.dir=run", "logging.tensorboard=true"]
    killed = run_runner(args, tmp_path, RUNNER_FAULT=fault)
    assert killed.returncode == -signal.SIGKILL
    again = run_runner(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    run_dir = tmp_path / "run"
    if resumed_from is None:
        assert "resumed from" not in again.stdout
    else:
        steps = resumed_from if isinstance(resumed_from, tuple) else (resumed_from,)
        assert any(f"resumed from step {s} " in again.stdout for s in steps), again.stdout
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]  # leftovers cleaned
    assert_same_run(run_dir, reference)
    # Goodput: two launches; the steps the killed one logged after its checkpoint are recomputed
    # (the kill at step 13 lands before that step's metrics are read: 9..12 are lost).
    final = goodput_of(run_dir)
    assert final["goodput/launches"] == 2 and "over 2 launches" in again.stdout
    if fault.startswith("kill_at_step"):
        assert final["goodput/recomputed_steps"] == 4 and "4 steps recomputed after a crash" in again.stdout
    assert final["goodput/recomputed_s"] > 0 and 0 < final["goodput/percent"] < 100
    parts = sum(final[f"goodput/{c}_s"] for c in ("startup", "restore", "compile", "train", "data_wait", "eval",
                                                   "checkpoint", "other"))
    assert abs(parts - final["goodput/wall_s"]) < 0.05 * final["goodput/wall_s"]  # the categories cover the wall time
    ref = goodput_of(reference)
    assert ref["goodput/launches"] == 1 and ref["goodput/recomputed_steps"] == 0
    assert_tensorboard_matches_metrics(run_dir)


def assert_tensorboard_matches_metrics(run_dir: Path) -> None:
    """TensorBoard's own reader sees every scalar of metrics.jsonl, each step once although two
    launches wrote event files (the resumed one purges what the killed one logged past its
    checkpoint)."""
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"),
                                                size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    records = read_metrics(run_dir)
    scalars = {k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    assert scalars <= set(events.Tags()["scalars"])
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == pytest.approx(list(losses(run_dir).values()), rel=1e-6)


@pytest.mark.deep
def test_sigterm_saves_exits_75_and_resumes_exactly(tmp_path, reference) -> None:
    # Held before step 8 until the signal is recorded (RUNNER_FAULT=hold_alone), so the 24 steps
    # cannot finish first however fast the machine is, and the stop is at a known step.
    args = [*BASE, "run.dir=run", "checkpoint.every_steps=0"]
    proc = start_runner_until(args, tmp_path, tmp_path / "run", 6, RUNNER_FAULT="hold_alone:8")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    stopped_at = ckpt_steps(tmp_path / "run")
    assert stopped_at == [8], stopped_at  # the step it was held before, then saved
    assert "stopped by signal SIGTERM at step 8" in out
    again = run_runner(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {stopped_at[0]} " in again.stdout
    assert_same_run(tmp_path / "run", reference)


@pytest.mark.deep
def test_damaged_newest_checkpoint_falls_back_and_is_set_aside(tmp_path, reference) -> None:
    shutil.copytree(reference, tmp_path / "run")
    run_dir = tmp_path / "run"
    victim = max((p for p in (run_dir / "checkpoints" / str(STEPS) / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])  # truncated
    stop = run_runner([*BASE, "run.dir=run", "checkpoint.on_damaged=stop"], tmp_path)
    # (tensorstore may print its own "Event loop is closed" noise; no traceback runs through runner)
    assert stop.returncode == 2 and "damaged" in stop.stderr and "/runner/" not in stop.stderr
    assert ckpt_steps(run_dir) == [8, 16, 24]  # nothing touched
    result = run_runner([*BASE, "run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoints/24 is damaged" in result.stdout and "resumed from step 16 " in result.stdout
    assert ckpt_steps(run_dir) == [8, 16, 24]  # 24 was recomputed and saved again
    assert len(list((run_dir / "damaged_checkpoints").iterdir())) == 1
    assert_same_run(run_dir, reference)  # the recomputed steps are the reference's, bit for bit


@pytest.mark.deep
def test_resuming_other_data_when_allowed(tmp_path, reference) -> None:
    """(Another model's or other data's checkpoints refused: tests/train/test_refused_in_process.py.)"""
    shutil.copytree(reference, tmp_path / "run")
    run_dir = tmp_path / "run"
    allowed = run_runner([*BASE, "run.dir=run", "train.steps=26", "data.strategy=synthetic",
                          "checkpoint.allow_data_change=true"], tmp_path)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "resumed from step 24 " in allowed.stdout and 26 in ckpt_steps(run_dir)


@pytest.mark.deep
def test_warm_start_from_parameters(tmp_path, reference) -> None:
    result = run_runner([*BASE, "run.dir=warm", "train.steps=2", f"run.init_from={reference}"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warm start: params" in result.stdout
    records = read_metrics(tmp_path / "warm")
    first_eval = next(r for r in records if "eval/stdlib/loss" in r and r["step"] == 0)
    fresh = next(r for r in read_metrics(reference) if "eval/stdlib/loss" in r and r["step"] == 0)
    assert first_eval["eval/stdlib/loss"] < fresh["eval/stdlib/loss"] - 1.0  # trained weights, step 0
    # (from nothing: refused, tests/train/test_refused_in_process.py)


# Rows of 128 tokens: the embedded corpus's documents are long (stdlib files), and the 192 rows of
# 32 tokens the other tests train on hold no document boundary, so masking would change nothing.
MASKED_ROWS = ["train.seq_len=128", "job.model.context_length=128"]


def holds_a_boundary(batch: dict[str, np.ndarray]) -> bool:
    """Whether a document-masked batch has a row with two documents in it."""
    rows = batch["segment_ids"].reshape(-1, batch["segment_ids"].shape[-1])
    return any(len(np.unique(row)) > 1 for row in rows)


def batch_and_loss(overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   step: int | None = None) -> tuple[int, dict[str, np.ndarray], float]:
    """(step, the batch of `step` of the run `overrides` describe, its loss at the run's initial
    parameters), in this process; `step` None: the first batch that holds a document boundary."""
    from hydra import compose, initialize_config_dir

    from runner.main.cli import CONF_DIR, CONFIG_NAME, prepare
    from runner.main.config import build_spec
    from runner.train.job import JOBS

    prepare()
    monkeypatch.setenv("RUNNER_CACHE", runner_env(tmp_path)["RUNNER_CACHE"])  # the corpus the runs prepared
    overrides = [*overrides, f"run.dir={tmp_path / 'in-process'}"]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        spec = build_spec(compose(CONFIG_NAME, overrides=overrides), overrides)
    job = JOBS.get(spec.job.trainer)(spec)
    loader = job.batch()
    try:
        if step is None:
            step = next((s for s in range(spec.train.steps) if holds_a_boundary(loader.batch_at(s))), None)
            assert step is not None, "no batch of the run holds a document boundary"
        batch = loader.batch_at(step)
    finally:
        loader.close()
    state = job.program.init_state()
    with job.program.context():
        loss_sum, count, _ = job.program.val_step(state, job.program.to_device(batch))
    return step, batch, float(loss_sum) / float(count)


@pytest.mark.deep
def test_document_masked_runs_resume_exactly(tmp_path, monkeypatch) -> None:
    """data.document_mask adds segment ids and positions to every row; the batch is still a pure
    function of the step, so a killed run resumes to the same parameters, bit for bit. The masking
    changes what is trained on: the loss of a batch that holds a document boundary (the same
    tokens, the same initial parameters) differs with the mask and without."""
    args = [*BASE, *MASKED_ROWS, "data.document_mask=true"]
    straight = run_runner([*args, "run.dir=straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = run_runner([*args, "run.dir=run"], tmp_path, RUNNER_FAULT="kill_at_step:13")
    assert killed.returncode == -signal.SIGKILL
    again = run_runner([*args, "run.dir=run"], tmp_path)
    assert again.returncode == 0 and "resumed from step 8 " in again.stdout, again.stderr[-3000:]
    assert_same_run(tmp_path / "run", tmp_path / "straight")
    step, masked, masked_loss = batch_and_loss(args, tmp_path, monkeypatch)
    _, unmasked, unmasked_loss = batch_and_loss([*BASE, *MASKED_ROWS], tmp_path, monkeypatch, step)
    np.testing.assert_array_equal(masked["x"], unmasked["x"])  # the same rows
    assert holds_a_boundary(masked) and "segment_ids" not in unmasked
    assert masked_loss != unmasked_loss  # the masking changed what it trains on


@pytest.mark.e2e
def test_resume_on_another_mesh_reshards(tmp_path, reference) -> None:
    args = [*BASE, "run.dir=run"]
    first = run_runner([*args, "topology=cpu-4", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], tmp_path,
                       devices=4, RUNNER_FAULT="kill_at_step:13")
    assert first.returncode == -signal.SIGKILL
    second = run_runner([*args, "topology=cpu-2", "mesh.data=2"], tmp_path, devices=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 8 " in second.stdout
    ref = losses(reference)
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)], [ref[s] for s in range(1, STEPS + 1)],
                               rtol=1e-5)  # same data order; only float summation order differs (3e-7 seen)
    for a, b in zip(params_of(tmp_path / "run", STEPS), params_of(reference, STEPS)):
        np.testing.assert_allclose(a, b, atol=1e-4)  # 2e-5 seen after 24 AdamW steps


@pytest.mark.deep
def test_a_full_disk_fails_the_save_clearly_and_keeps_earlier_checkpoints(tmp_path) -> None:
    """RLIMIT_FSIZE makes every write past 16 KiB fail with EFBIG (Python ignores SIGXFSZ): the
    checkpoint files of step 8 cannot be written, as on a full disk."""
    import resource

    args = [*BASE, "run.dir=run", "checkpoint.every_steps=4"]
    assert run_runner([*args, "train.steps=4"], tmp_path).returncode == 0

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))

    # its own compilation cache: a write cut at 16 KiB leaves a truncated entry, which JAX never
    # replaces, and the session's cache would warn about it in every later run of that program
    own_cache = f"run.compile_cache={tmp_path / 'xla'}"
    full = subprocess.run([sys.executable, "-m", "runner", *args, "train.steps=8", own_cache], cwd=tmp_path,
                          env=runner_env(tmp_path), capture_output=True, text=True, timeout=600, preexec_fn=limit)
    assert full.returncode == 2, full.stderr[-3000:]
    assert "failed" in full.stderr and "File too large" in full.stderr and "Earlier checkpoints are untouched" \
        in full.stderr
    # tensorstore's background threads print their own noise (in any order, and under load a
    # partial line of theirs may end just where runner's paragraph starts); runner's part is one
    # paragraph, and no traceback through runner's code.
    paragraph = re.search(r"error: A checkpoint save[^\n]*", full.stderr)
    assert paragraph and "Earlier checkpoints are untouched" in paragraph.group(0), full.stderr[-3000:]
    assert "/runner/" not in full.stderr
    assert ckpt_steps(tmp_path / "run") == [4]
    params_of(tmp_path / "run", 4)  # still restorable
    again = run_runner([*args, "train.steps=8"], tmp_path)  # space is back: the run continues
    assert again.returncode == 0 and "resumed from step 4 " in again.stdout, again.stderr[-2000:]
    assert ckpt_steps(tmp_path / "run") == [4, 8]


@pytest.mark.deep
def test_save_policy_keeps_the_newest_k_plus_every_pth(tmp_path) -> None:
    # (time-based saves are tested with an injected clock in tests/train/test_loop.py)
    result = run_runner([*BASE, "run.dir=steps", "checkpoint.every_steps=4", "checkpoint.keep=2",
                         "checkpoint.keep_every=8"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ckpt_steps(tmp_path / "steps") == [8, 16, 20, 24]  # newest 2, plus every 8th for good


@pytest.mark.deep
def test_wandb_history_after_sigkills_equals_metrics_jsonl(tmp_path) -> None:
    """SIGKILLs at random steps (a seeded draw), then a clean finish: every step metrics.jsonl holds
    is in wandb's offline history, and nothing else; a resumed launch gives wandb the steps up to
    its checkpoint that a killed launch's wandb never wrote."""
    import random

    from runner.observability.wandb_history import history_steps

    args = [*TINY, "train.steps=24", "checkpoint.every_steps=4", "checkpoint.async_save=false", "eval.every=8",
            "logging.wandb=offline", "run.dir=run"]
    kills = sorted(random.Random(27).sample(range(5, 23), 3))
    for step in kills:
        killed = run_runner(args, tmp_path, RUNNER_FAULT=f"kill_at_step:{step}")
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    done = run_runner(args, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    [run_id] = {d.name.rsplit("-", 1)[-1] for d in (tmp_path / "run" / "wandb").glob("offline-run-*")}
    logged = {r["step"] for r in read_metrics(tmp_path / "run") if any(k != "step" for k in r)}
    assert history_steps(tmp_path / "run" / "wandb", run_id) == logged
    assert logged == set(range(0, 25))
