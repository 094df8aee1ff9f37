"""mode=eval in-process: a checkpoint's parameters, restored alone, give the numbers training logged
for them; its results file is written beside the checkpoint."""

from __future__ import annotations

import dataclasses
import json

import pytest

from runner.errors import UserError
from runner.main.evaluate import RESULTS_FILE, evaluate_checkpoint
from tests.conftest import read_metrics


def test_evaluating_the_final_checkpoint_gives_the_final_evaluation(trained_run) -> None:
    spec, run_dir = trained_run
    logged = [r for r in read_metrics(run_dir) if r.get("step") == 4 and any(k.startswith("eval/") for k in r)]
    assert logged, "the run logged no evaluation at its last step"
    final = {k: v for k, v in logged[-1].items() if k.startswith("eval/")}
    record = evaluate_checkpoint(dataclasses.replace(spec, mode="eval"))
    assert record["step"] == 4 and record["checkpoint"].endswith("checkpoints/4")
    for key, value in final.items():
        assert record["metrics"][key] == pytest.approx(value, rel=1e-5), key
    assert json.loads((run_dir / "checkpoints" / "4" / RESULTS_FILE).read_text())["metrics"] == record["metrics"]


def test_a_run_without_checkpoints_is_refused(tmp_path, trained_run) -> None:
    spec, _ = trained_run
    empty = dataclasses.replace(spec, mode="eval", run=dataclasses.replace(spec.run, dir=str(tmp_path)))
    with pytest.raises(UserError, match="mode=eval found no checkpoint"):
        evaluate_checkpoint(empty)
