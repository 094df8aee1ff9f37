"""Loss-spike rewinds end to end (`python -m runner`): a run whose data has a poisoned stretch (a
`sequential` stage of random bytes at data batches 50-52) spikes at step 51, goes back to
checkpoint 40, skips batches [40, 60) and finishes; it ends with the same parameters, bit for bit,
as a run started from scratch with that window as train.skip_batches and the detector off. The
in-process tests (the detector, the windows, the loop's rewind) are tests/train/test_spikes.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runner.exits import HALTED_EXIT_CODE
from tests.conftest import TINY, read_metrics, run_runner
from tests.train.test_multiprocess import finish, launch
from tests.train.test_restore import params_of

POISON = (50, 53)  # data-stream batches of random bytes


@pytest.fixture(scope="module")
def noise(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of random bytes: a stretch of it makes the loss and the gradient norm jump."""
    from runner.data.store import write_store
    from runner.data.tokenizer import TOKENIZERS

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, 4096) for _ in range(8)]
    path = tmp_path_factory.mktemp("noise") / "noise"
    write_store(path, {"train": docs, "val": docs[:1]}, TOKENIZERS.get("byte")(), [{"kind": "random bytes"}])
    return path


def poisoned(noise: Path, run_dir: str, *extra: str) -> list[str]:
    stages = (f"[{{until_step: {POISON[0]}, sources: [{{path: default}}]}}, {{until_step: {POISON[1]}, sources: "
              f"[{{path: {noise}}}]}}, {{sources: [{{path: default}}]}}]")
    return [*TINY, f"run.dir={run_dir}", "train.steps=80", "checkpoint.every_steps=10", "eval.every=0",
            "optimizer.lr=3e-3", "data.strategy=sequential", f"data.stages={stages}", "guard.spike=rewind",
            "guard.spike_window=32", "guard.spike_warmup=20", "guard.rewind_back=5", "guard.rewind_skip=20", *extra]


def records(run_dir: Path) -> list[tuple]:
    return [(r["spike_step"], r["first_spike"], r["restored_step"], r["window"])
            for r in json.loads((run_dir / "rewinds.json").read_text())["rewinds"]]


def same_params(a: Path, b: Path, step: int = 80) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(params_of(a, step), params_of(b, step), strict=True))


@pytest.fixture(scope="module")
def rewound(noise: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("rewound")
    result = run_runner(poisoned(noise, "run"), tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run", result.stdout


@pytest.mark.e2e
def test_a_run_rewinds_past_its_poisoned_data_bit_exact_with_the_manual_skip(rewound, noise, tmp_path) -> None:
    run, out = rewound
    assert records(run) == [(51, 51, 40, [40, 60])]
    figures = json.loads((run / "rewinds.json").read_text())["rewinds"][0]["figures"]
    assert figures["loss"] > figures["loss_band"] or figures["grad_norm"] > figures["grad_norm_band"]
    assert ("rewind 1/3: a loss spike at step 51" in out and "back to checkpoint 40 (newer ones set aside: 50) "
            "(restored in " in out and "data batches [40, 60) skipped" in out), out
    assert "also the newest one at least 5 steps old, whatever checkpoint.keep says" in out
    assert [p.name.split("-")[0] for p in (run / "abandoned_checkpoints").iterdir()] == ["50"]
    metrics = read_metrics(run)
    marks = [r for r in metrics if "rewind/count" in r]
    assert [(r["step"], r["rewind/restored_step"], r["rewind/skip_start"], r["rewind/skip_end"]) for r in marks] == \
        [(40, 40, 40, 60)]
    trained = [r["step"] for r in metrics if "loss" in r]
    assert trained == list(range(1, 81))  # each step once: the undone steps' records were dropped
    assert not any(r.get("spike") for r in metrics)  # the spiking steps 51-52 were undone; the rewind keeps them
    assert "data batches skipped: [[40, 60]] (1 rewinds)" in (run / "RUN_CARD.md").read_text()
    # the same windows by hand, from scratch, with the detector off: the same parameters, bit for bit
    manual = run_runner(poisoned(noise, "manual", "guard.spike=off", "train.skip_batches=[[40,60]]"), tmp_path)
    assert manual.returncode == 0, manual.stderr[-3000:]
    assert same_params(run, tmp_path / "manual") and not (tmp_path / "manual" / "rewinds.json").exists()


@pytest.mark.deep
def test_a_kill_after_the_rewind_and_the_same_command_end_bit_exact(rewound, noise, tmp_path) -> None:
    """Killed at step 65 after the rewind (SIGKILL): the relaunch reads rewinds.json, restores
    checkpoint 60 of the new timeline and skips the recorded window."""
    killed = run_runner(poisoned(noise, "run"), tmp_path, RUNNER_FAULT="kill_at_step:65")
    assert killed.returncode == -9 and records(tmp_path / "run") == [(51, 51, 40, [40, 60])]
    again = run_runner(poisoned(noise, "run"), tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 60" in again.stdout and "rewind 2/" not in again.stdout  # it spikes no more
    assert records(tmp_path / "run") == records(rewound[0]) and same_params(tmp_path / "run", rewound[0])


@pytest.mark.deep
def test_two_processes_rewind_together_and_end_bit_exact_with_one(noise, tmp_path) -> None:
    """Two processes of one device each, and one process of two devices: the same rewind, the same
    parameters (two devices' gradients summed in either order are the same numbers)."""
    one = run_runner(poisoned(noise, "one"), tmp_path, devices=2)
    assert one.returncode == 0, one.stderr[-3000:]
    results = finish(launch(poisoned(noise, "two"), tmp_path, processes=2, devices=1))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    assert "rewind 1/3: a loss spike at step 51" in results[0][1]
    assert records(tmp_path / "two") == records(tmp_path / "one") == [(51, 51, 40, [40, 60])]
    assert same_params(tmp_path / "one", tmp_path / "two")


@pytest.mark.deep
def test_a_spike_with_nothing_to_rewind_to_stops_with_one_paragraph(noise, tmp_path) -> None:
    result = run_runner(poisoned(noise, "run", "guard.rewind_back=60"), tmp_path)
    assert result.returncode == HALTED_EXIT_CODE
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: Training stopped at step 52: a loss spike at step 51"), err
    assert ("no checkpoint is at least guard.rewind_back=60 steps older than the first spike (step 51)" in err[0]
            and "train.skip_batches=[[0,51]]" in err[0] and "Traceback" not in result.stderr)
    run = tmp_path / "run"
    assert not (run / "rewinds.json").exists() and not (run / "abandoned_checkpoints").exists()
    # keep=3 and the one old enough to rewind to (40), and the last good state
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [40, 50, 52]


@pytest.mark.deep
def test_a_stop_then_the_window_by_hand_ends_as_the_automatic_rewind(rewound, noise, tmp_path) -> None:
    """guard.spike=stop halts at the spike (exit 65, the last good state saved); the relaunch with
    train.skip_batches sets aside the checkpoints trained on the window, restores the newest one
    before it and ends with the parameters of the run that rewound by itself."""
    stopped = run_runner(poisoned(noise, "run", "guard.spike=stop"), tmp_path)
    assert stopped.returncode == HALTED_EXIT_CODE and "guard.spike=stop" in stopped.stderr, stopped.stderr[-2000:]
    by_hand = run_runner(poisoned(noise, "run", "guard.spike=stop", "train.skip_batches=[[40,60]]"), tmp_path)
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    assert "resumed from step 40" in by_hand.stdout
    aside = sorted(int(p.name.split("-")[0]) for p in (tmp_path / "run" / "abandoned_checkpoints").iterdir())
    assert aside == [50, 52] and same_params(tmp_path / "run", rewound[0])
