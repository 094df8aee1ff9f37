"""job.model.remat=offload on a machine whose runtime has host memory (a GPU or TPU; the CPU
refuses it): the same losses as remat=full, step for step, and a run killed mid-training resumes
onto them. Prints one JSON line.

    python3 tools/bench/offload_check.py topology=h100-1            # extra overrides for every run

Three runs through `python -m runner` (20 steps each, a checkpoint every 5): remat=full,
remat=offload, and remat=offload killed at step 12 (RUNNER_FAULT) and launched again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = ["job=llama_tiny", "train.steps=20", "train.log_every=1", "checkpoint.every_steps=5", "eval.every=0",
        "logging.wandb=disabled", "logging.progress=plain"]


def run(args: list[str], fault: str = "") -> int:
    env = {**os.environ, **({"RUNNER_FAULT": fault} if fault else {})}
    proc = subprocess.run([sys.executable, "-m", "runner", *args], env=env, capture_output=True, text=True)
    if proc.returncode not in (0, -9):
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def main(overrides: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        codes = {
            "full": run([*BASE, *overrides, "job.model.remat=full", f"run.dir={where / 'full'}"]),
            "offload": run([*BASE, *overrides, "job.model.remat=offload", f"run.dir={where / 'offload'}"]),
            "killed": run([*BASE, *overrides, "job.model.remat=offload", f"run.dir={where / 'killed'}"],
                          "kill_at_step:12"),
            "resumed": run([*BASE, *overrides, "job.model.remat=offload", f"run.dir={where / 'killed'}"]),
        }
        if any(code for name, code in codes.items() if name != "killed"):
            print(json.dumps({"check": "offload", "exit_codes": codes}))
            return 1
        full, offload, resumed = (losses(where / name) for name in ("full", "offload", "killed"))
        record = {"check": "offload", "exit_codes": codes, "steps": sorted(offload),
                  "max_abs_loss_difference_full_vs_offload": max(abs(full[s] - offload[s]) for s in full),
                  "resumed_steps_equal": all(resumed.get(s) == offload[s] for s in range(11, 21)),
                  "final_loss": offload[20]}
        print(json.dumps(record))
        return 0 if record["resumed_steps_equal"] and record["max_abs_loss_difference_full_vs_offload"] < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
