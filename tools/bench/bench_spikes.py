"""Loss spikes (docs/spikes.md): what a rewind costs against a relaunch by hand, and how often the
detector fires on a healthy run.

    .venv/bin/python tools/bench/bench_spikes.py cost [--rounds 3] [--out docs/records/bench_spikes.jsonl]
    .venv/bin/python tools/bench/bench_spikes.py healthy [--spike-on loss|grad_norm|either] [--out ...]

`cost`: gpt_tiny (the default job) on data with a poisoned stretch (a `sequential` stage of random
bytes at data batches 300-302), checkpoints every 100 steps, the detector's defaults (128 steps,
6 sigma) and PaLM's rewind (back 100 steps, skip 200 batches). Three commands a round, interleaved:
  auto      guard.spike=rewind: the run spikes at step 301, goes back to 200, skips [200, 400)
  by hand   guard.spike=stop (exit 65 at the spike), then the same command with
            train.skip_batches=[[200,400]] (restores 200, sets aside 300): what a person does, less
            the time the person takes to notice
  reference the run from scratch with train.skip_batches=[[200,400]], which never spikes
The cost of each fix is its wall time minus the reference's: the steps trained twice (201-302), the
restore, and for the relaunch a second start (interpreter, compile, restore).

`healthy`: guard.spike=skip on the default job's 800 steps and on llama_tiny for 3,000 steps, the
detector's defaults (or another guard.spike_on): the steps it flags (the target is none).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WINDOW = "[[200,400]]"


def noise_store(where: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from runner.data.store import write_store
    from runner.data.tokenizer import TOKENIZERS

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, 4096) for _ in range(32)]
    write_store(where, {"train": docs, "val": docs[:1]}, TOKENIZERS.get("byte")(), [{"kind": "random bytes"}])
    return where


def runner(run_dir: Path, *args: str) -> tuple[int, float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "runner", f"run.dir={run_dir}", "logging.wandb=disabled",
                           "logging.progress=none", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return done.returncode, time.perf_counter() - start, done.stdout + done.stderr


def cost(rounds: int, out: Path | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_spikes_"))
    noise = noise_store(tmp / "noise")
    poisoned = ["job=gpt_tiny", "train.steps=600", "checkpoint.every_steps=100", "eval.every=0",
                "data.strategy=sequential",
                f"data.stages=[{{until_step: 300, sources: [{{path: default}}]}}, {{until_step: 303, sources: "
                f"[{{path: {noise}}}]}}, {{sources: [{{path: default}}]}}]"]
    for r in range(rounds):
        times: dict[str, float] = {}
        code, times["auto"], text = runner(tmp / f"auto{r}", *poisoned, "guard.spike=rewind")
        assert code == 0 and "rewind 1/3" in text, text[-2000:]
        code, first, text = runner(tmp / f"hand{r}", *poisoned, "guard.spike=stop")
        assert code == 65, text[-2000:]  # runner.exits.HALTED_EXIT_CODE
        code, second, text = runner(tmp / f"hand{r}", *poisoned, "guard.spike=stop", f"train.skip_batches={WINDOW}")
        assert code == 0, text[-2000:]
        times["by_hand"] = first + second
        code, times["reference"], text = runner(tmp / f"ref{r}", *poisoned, "guard.spike=off",
                                                f"train.skip_batches={WINDOW}")
        assert code == 0, text[-2000:]
        record = {"bench": "spike_rewind_cost", "round": r, **{f"{k}_s": round(v, 2) for k, v in times.items()},
                  "auto_cost_s": round(times["auto"] - times["reference"], 2),
                  "by_hand_cost_s": round(times["by_hand"] - times["reference"], 2)}
        emit(record, out)


def healthy(spike_on: str, out: Path | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_spikes_"))
    for name, args in (("gpt_tiny 800 steps", ["job=gpt_tiny"]),
                       ("llama_tiny 3000 steps", ["job=llama_tiny", "train.steps=3000", "checkpoint.every_steps=500"])):
        run_dir = tmp / name.split()[0]
        code, seconds, text = runner(run_dir, *args, "guard.spike=skip", f"guard.spike_on={spike_on}", "eval.every=0")
        assert code == 0, text[-2000:]
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        flagged = sorted({r["step"] for r in lines if r.get("spike")})
        emit({"bench": "spike_false_positives", "run": name, "spike_on": spike_on,
              "steps": max(r["step"] for r in lines),
              "flagged_steps": flagged, "false_positives": len(flagged), "wall_s": round(seconds, 1)}, out)


def emit(record: dict, out: Path | None) -> None:
    print(json.dumps(record), flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("cost", "healthy"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spike-on", default="loss", choices=("loss", "grad_norm", "either"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cost(args.rounds, args.out) if args.what == "cost" else healthy(args.spike_on, args.out)


if __name__ == "__main__":
    main()
