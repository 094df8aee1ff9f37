"""runner against MaxText on the same model, side by side: tokens/s of each one's own training
loop, in alternating rounds (each round runs both, the order flipped every round), so this shared
machine's drift falls on both alike.

    python tools/bench/bench_maxtext.py --maxtext-python /path/to/maxtext-venv/bin/python
    python tools/bench/bench_maxtext.py --maxtext-python ... --rounds 4 --steps 40 --remat full --out mt.jsonl

The model (issue 32's match): a 10.9M-parameter GPT-2: width 384, 6 layers of 6 heads, MLP 1536,
vocabulary 512, learned positions, tied embeddings, no dropout; 8 rows of 256 tokens a step,
float32, AdamW, synthetic data, layers scanned (runner ``job.model.scan_layers=true``; MaxText
``scan_layers=true``, its ``gpt3`` decoder block) and, in runner, also unrolled. ``--remat``
picks the rematerialisation both use: ``dots`` (runner's default for scanned layers, saving the
weight matmuls' outputs: MaxText's ``minimal``, which saves the q/k/v/out and MLP projections by
name) or ``full`` (each recomputes the block; MaxText's default).

MaxText runs in its own environment (``pip install maxtext==0.2.5`` and its
``dependencies/requirements/generated_requirements/decoupled-requirements.txt``, the Google Cloud
clients left out: ``DECOUPLE_GCLOUD=TRUE``), as ``python -m maxtext.trainers.pre_train.train``;
its per-step times are the ``completed step: N, seconds: S`` lines it prints. runner runs as
``python -m runner``; its per-step times are metrics.jsonl's ``step_time_s``. Each run's figure
is the median step time after the warm-up (the first ``--warmup`` steps: compilation, the
pipeline) and without the last (runner's carries the final save). Prints one JSON line (``--out``
appends it) and a table: tokens/s per configuration (median over rounds) and each one's ratio to
runner's scanned step (median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench import emit  # noqa: E402

BATCH, SEQ = 8, 256
RUNNER_MODEL = ["job=gpt_tiny", "job.model.d_model=384", "job.model.n_layers=6", "job.model.n_heads=6",
                "job.model.d_ff=1536", "job.model.vocab_size=512", "job.model.context_length=256",
                "job.model.dropout=0.0", "job.model.compute_dtype=float32", "job.model.param_dtype=float32",
                f"train.seq_len={SEQ}", f"train.batch_size={BATCH}", "train.accumulate_steps=1",
                "data.strategy=synthetic", "optimizer=adamw", "topology=cpu-1", "train.log_every=1", "eval.every=0",
                "checkpoint.every_steps=0", "logging.wandb=disabled", "logging.progress=none"]
MAXTEXT_MODEL = ["decoder_block=gpt3", "base_emb_dim=384", "base_num_query_heads=6", "base_num_kv_heads=6",
                 "head_dim=64", "base_mlp_dim=1536", "base_num_decoder_layers=6", "vocab_size=512",
                 f"max_target_length={SEQ}", f"per_device_batch_size={BATCH}", "trainable_position_size=256",
                 "mlp_activations=['gelu']", "logits_via_embedding=true", "normalize_embedding_logits=false",
                 "enable_dropout=false", "dtype=float32", "weight_dtype=float32", "dataset_type=synthetic",
                 "opt_type=adamw", "attention=dot_product", "scan_layers=true", "enable_checkpointing=false",
                 "eval_interval=-1", "log_period=1000000", "ici_fsdp_parallelism=1", "ici_data_parallelism=1"]
MAXTEXT_REMAT = {"dots": "minimal", "full": "full"}  # runner's -> MaxText's name for the same policy
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def steady(times: list[float], warmup: int) -> float:
    kept = times[warmup:-1]
    if not kept:
        raise RuntimeError(f"too few steps to measure ({len(times)}, warm-up {warmup})")
    return statistics.median(kept)


def run_runner(scan: bool, remat: str, steps: int, warmup: int, where: Path, extra: list[str]) -> float:
    """runner's median steady step time, its own loop, a fresh run directory."""
    run_dir = where / f"runner_{scan}_{remat}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    args = [sys.executable, "-m", "runner", *RUNNER_MODEL, f"train.steps={steps}", f"run.dir={run_dir}",
            f"job.model.scan_layers={str(scan).lower()}", f"job.model.remat={remat}", *extra]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"runner failed ({done.returncode}): {done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return steady([r["step_time_s"] for r in records if "step_time_s" in r], warmup)


def run_maxtext(python: str, remat: str, steps: int, warmup: int, where: Path) -> float:
    """MaxText's median steady step time, from its own training loop's per-step lines."""
    config = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("PYTHONPATH", None)
    out = where / f"maxtext_{remat}"
    args = [python, "-m", "maxtext.trainers.pre_train.train", f"{config}/configs/decoupled_base_test.yml",
            f"run_name=bench_{remat}", f"base_output_directory={out}", f"steps={steps}",
            f"learning_rate_schedule_steps={steps}",
            f"remat_policy={MAXTEXT_REMAT[remat]}", *MAXTEXT_MODEL]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800, cwd=where)
    text = done.stdout + done.stderr
    times = [float(s) for _, s in STEP_LINE.findall(text)]
    if done.returncode or not times:
        raise RuntimeError(f"MaxText failed ({done.returncode}): {text[-3000:]}")
    return steady(times, warmup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for runner's runs (for tests: they "
                        "unmatch the model)")
    parser.add_argument("--maxtext-python", required=True, help="the Python of an environment with maxtext 0.2.5")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of each run's median")
    parser.add_argument("--remat", choices=sorted(MAXTEXT_REMAT), default="dots")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sides = {"runner_scanned": lambda w: run_runner(True, args.remat, args.steps, args.warmup, w, args.overrides),
             "maxtext_scanned": lambda w: run_maxtext(args.maxtext_python, args.remat, args.steps, args.warmup, w),
             "runner_unrolled": lambda w: run_runner(False, args.remat, args.steps, args.warmup, w, args.overrides)}
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in (names if round_ % 2 == 0 else names[::-1]):
                where = Path(tmp) / f"round{round_}"
                where.mkdir(exist_ok=True)
                times[name].append(sides[name](where))
                print(f"round {round_ + 1}: {name} {1e3 * times[name][-1]:.1f} ms a step", flush=True)
    record: dict[str, Any] = {"bench": "maxtext", "remat": args.remat, "runner_overrides": args.overrides, "rounds": args.rounds, "steps": args.steps,
                              "tokens_per_step": BATCH * SEQ, "configs": {}}
    for name in names:
        ratios = [base / t for t, base in zip(times[name], times["runner_scanned"])]
        record["configs"][name] = {"step_s_rounds": times[name],
                                   "tokens_per_s": BATCH * SEQ / statistics.median(times[name]),
                                   "ratio_to_runner_scanned": statistics.median(ratios)}
    emit(record, args.out)
    print(f"{'config':<18} {'tok/s':>9} {'vs runner scanned':>18}")
    for name, c in record["configs"].items():
        print(f"{name:<18} {c['tokens_per_s']:>9,.0f} {c['ratio_to_runner_scanned']:>17.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
