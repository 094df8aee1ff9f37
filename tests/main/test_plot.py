"""`runner plot`: a real sweep's members drawn from their metrics.jsonl, labelled by what differs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runner.main.plot import load_runs
from tests.conftest import TINY, run_runner, runner_env

@pytest.mark.deep
def test_plot_a_sweep_and_runs(tmp_path) -> None:
    swept = run_runner(["-m", *TINY, "train.steps=4", "eval.every=2", "run.sweep=lr", "optimizer.lr=1e-3,0.0123456789012345"],
                       tmp_path)
    assert swept.returncode == 0, swept.stderr[-3000:]
    sweep = tmp_path / "runs" / "sweeps" / "lr"

    def plot(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "runner", "plot", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env=runner_env(tmp_path))

    result = plot(str(sweep), "--out", "sweep.png")
    assert result.returncode == 0, result.stderr
    assert "2 run(s); panels: train loss, held-out loss: stdlib, learning rate" in result.stdout
    assert "optimizer.lr=0.001:" in result.stdout and "optimizer.lr=0.01235:" in result.stdout  # rounded
    import matplotlib.image

    picture = matplotlib.image.imread(tmp_path / "sweep.png")
    assert picture.shape[0] > 600 and picture.shape[1] > 600 and picture.std() > 0.05  # drawn, not blank

    runs = load_runs([str(sweep)])
    assert sorted(run.label for run in runs) == ["optimizer.lr=0.001", "optimizer.lr=0.01235"]
    from runner.main.plot import panel_title

    assert panel_title("eval/hellaswag/acc") == "accuracy: hellaswag"  # not "held-out"
    assert panel_title("eval/lm_eval/mini_mc/acc_norm") == "accuracy, length-normalised: lm_eval/mini_mc"
    for run in runs:
        assert run.series("loss", "step")[0] == [1, 2, 3, 4]
        assert run.series("eval/stdlib/loss", "step")[0] == [0, 2, 4]
        tokens, _ = run.series("loss", "tokens_seen")
        assert tokens == sorted(tokens) and tokens[0] > 0
    by_tokens = plot(*(run.directory for run in runs), "--x", "tokens", "--out", "runs.svg")
    assert by_tokens.returncode == 0 and (tmp_path / "runs.svg").read_text().startswith("<?xml")
    missing = plot(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Fix:" in missing.stderr


def test_plot_in_process_draws_a_trained_runs_metrics(tmp_path, trained_run, capsys) -> None:
    from runner.main.plot import main

    _, run_dir = trained_run
    out = tmp_path / "run.png"
    assert main([str(run_dir), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000 and "panels:" in capsys.readouterr().out
    assert main([str(tmp_path / "nothing-here"), "--out", str(out)]) == 2
