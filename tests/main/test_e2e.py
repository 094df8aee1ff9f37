"""`python -m runner` end to end in subprocesses: checkpoints, metrics, falling loss, relaunch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import read_metrics, run_runner

pytestmark = pytest.mark.e2e  # every test here starts a process

STEPS = 40


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, request):
    from tests.conftest import TINY

    tmp = tmp_path_factory.mktemp("e2e")
    args = [*TINY, f"train.steps={STEPS}", "eval.every=20", "checkpoint.every_steps=20",
            "optimizer.lr=1e-2", "logging.wandb=offline"]
    result = run_runner(args, tmp)
    return tmp, args, result


def test_run_trains_and_writes_everything(finished_run) -> None:
    tmp, args, result = finished_run
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = next((tmp / "runs" / "gpt_tiny").iterdir())
    assert (run_dir / "spec.yaml").exists()
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [20, 40]
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "tokens_per_s_per_device",
                "tflops_per_device", "mfu"):
        assert key in train[0]
    assert "TFLOP/s/dev, MFU" in result.stdout and "MFU peak per device" in result.stdout
    assert np.mean([r["loss"] for r in train[-5:]]) < np.mean([r["loss"] for r in train[:5]]) - 0.5
    evals = [r for r in records if "eval/stdlib/loss" in r]
    assert [r["step"] for r in evals] == [0, 20, 40]
    assert evals[-1]["eval/stdlib/loss"] < evals[0]["eval/stdlib/loss"] - 0.5
    assert "Finished gpt_tiny" in result.stdout and "checkpoints/40" in result.stdout
    assert list((run_dir / "wandb").glob("offline-run-*")), "offline wandb run expected"


def test_checkpoint_loads_with_plain_orbax(finished_run) -> None:
    tmp, _, _ = finished_run
    run_dir = next((tmp / "runs" / "gpt_tiny").iterdir())
    code = (
        "import jax, orbax.checkpoint as ocp, sys\n"
        "with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:\n"
        f"    s = c.restore(r'{(run_dir / 'checkpoints' / '40' / 'state').absolute()}', args=ocp.args.StandardRestore(\n"
        "        fallback_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])))\n"
        "print(int(s['step']), s['params']['wte']['embedding'].shape)\n"
        "assert 'runner' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "40"


def test_relaunching_a_finished_run_does_nothing(finished_run) -> None:
    tmp, args, _ = finished_run
    run_dir = next((tmp / "runs" / "gpt_tiny").iterdir())
    before = (run_dir / "metrics.jsonl").read_text()
    again = run_runner(args, tmp)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already finished at step 40" in again.stdout
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_raising_steps_continues_the_same_run(finished_run) -> None:
    tmp, args, _ = finished_run
    run_dir = next((tmp / "runs" / "gpt_tiny").iterdir())
    more = run_runner([a for a in args if not a.startswith("train.steps")] + ["train.steps=50",
                                                                              "checkpoint.cadence=auto"], tmp)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "resumed from step 40" in more.stdout
    # auto chooses at launch from the saves and the launch the checkpoint carried (docs/cadence.md)
    assert "checkpoint cadence auto: durable every " in more.stdout and "(2 launches)" in more.stdout
    assert "expected goodput" in more.stdout
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, 51))
    assert 50 in [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]


def test_four_fake_devices_with_fsdp(tmp_path) -> None:
    from tests.conftest import TINY

    result = run_runner([*TINY, "train.steps=3", "topology=cpu-4", "mesh.data=2", "mesh.fsdp=2",
                         "eval.every=0"], tmp_path, devices=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Finished gpt_tiny" in result.stdout


def test_topology_mismatch_stops_before_training(tmp_path) -> None:
    result = run_runner(["topology=v4-32", "train.batch_size=16", "logging.wandb=disabled"], tmp_path)
    assert result.returncode == 2
    assert "mode=compile" in result.stderr and "Traceback" not in result.stderr


def test_a_default_run_makes_no_deprecated_calls(tmp_path) -> None:
    """Every deprecation warning shown, and none of them pointing at runner's own code."""
    import re

    from tests.conftest import TINY

    result = run_runner([*TINY, "train.steps=3", "checkpoint.every_steps=2"], tmp_path,
                        PYTHONWARNINGS="always::DeprecationWarning,always::PendingDeprecationWarning,"
                                       "always::FutureWarning")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = re.compile(r"/(runner|jobs)/[\w/]+\.py:\d+: \w*(Deprecation|Future)Warning")
    assert not [line for line in (result.stdout + result.stderr).splitlines() if ours.search(line)]
