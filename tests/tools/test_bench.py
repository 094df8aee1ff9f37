"""tools/bench/bench.py's output format: one JSON line with the documented keys and types, then the table.

The FLOPs formula is checked against a hand count in tests/models/test_gpt.py. No test asserts a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, runner_env

BENCH = ROOT / "tools" / "bench"  # the benchmarks: run as scripts, some imported by path

NUMBERS = ("time_to_first_step_s", "baseline_first_step_s", "step_time_s", "step_time_p90_s",
           "baseline_step_time_s", "tokens_per_s", "baseline_tokens_per_s", "ratio", "flops_per_token",
           "achieved_flops_per_s", "baseline_flops_per_s", "peak_flops_per_s", "mfu", "baseline_mfu",
           "loader_tokens_per_s", "data_wait_s", "restore_s", "process_s")
INTEGERS = ("parameters", "batch_size", "seq_len", "devices", "host_peak_rss_bytes", "steps_per_round", "rounds",
            "baseline_block_steps", "save_window_steps")


@pytest.mark.deep
def test_bench_output_format(tmp_path: Path) -> None:
    overrides = [*TINY, "eval.evaluators=[]"]  # no evaluator: one compilation fewer
    args = [sys.executable, str(BENCH / "bench.py"), "--steps", "12", "--block", "4", "--rounds", "1",
            "--loader-steps", "3",
            "--label", "fmt", "--out", str(tmp_path / "bench.jsonl"), "--dir", str(tmp_path), *overrides]
    proc = subprocess.run(args, cwd=tmp_path, env=runner_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    record = json.loads(lines[0])
    assert json.loads((tmp_path / "bench.jsonl").read_text().splitlines()[-1]) == record
    assert record["bench"] == "train" and record["label"] == "fmt" and record["overrides"] == overrides
    for key in NUMBERS:
        assert isinstance(record[key], float) and record[key] >= 0, key
    for key in INTEGERS:
        assert isinstance(record[key], int) and record[key] > 0, key
    assert isinstance(record["ratio_per_round"], list) and len(record["ratio_per_round"]) == 1
    assert isinstance(record["peak_source"], str) and isinstance(record["device_memory_source"], str)
    assert record["device_memory_bytes"] is None or isinstance(record["device_memory_bytes"], int)
    assert record["save_step_time_s"] is None or isinstance(record["save_step_time_s"], float)
    assert record["loop_overhead_s"] is None or isinstance(record["loop_overhead_s"], float)
    assert record["flops_per_token"] > 0 and record["parameters"] > 0
    table = proc.stdout.split(lines[0], 1)[1]
    for row in ("time to first step", "step time", "tokens/s runner", "tokens/s baseline", "runner / baseline",
                "loop around the step",
                "model FLOPs per token", "MFU", "peak host memory", "device memory", "loader-only throughput",
                "async save", "restore"):
        assert row in table, row

    matplotlib = __import__("importlib").util.find_spec("matplotlib")
    if matplotlib is not None:  # the plot, when the bench extra is installed
        out = tmp_path / "bench.png"
        subprocess.run([sys.executable, str(BENCH / "plot_bench.py"), str(tmp_path / "bench.jsonl"),
                        "-o", str(out)], check=True, capture_output=True, timeout=120)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_envs_parses_environments_and_compares_each_with_the_first() -> None:
    import argparse

    import pytest

    sys.path.insert(0, str(BENCH))
    try:
        import bench_envs
    finally:
        sys.path.remove(str(BENCH))
    assert bench_envs.parse_env("after=.venv/bin/python:XLA_FLAGS=--xla_a=1 --xla_b=2:OMP=1") == (
        "after", ".venv/bin/python", {"XLA_FLAGS": "--xla_a=1 --xla_b=2", "OMP": "1"})
    with pytest.raises(argparse.ArgumentTypeError):
        bench_envs.parse_env("no-python")
    records = [{"job": "gpt_tiny", "env": env, "repeat": rep, "tokens_per_s": tps, "baseline_tokens_per_s": tps,
                "time_to_first_step_s": first, "baseline_first_step_s": first}
               for env, rep, tps, first in (("before", 0, 100.0, 10.0), ("after", 0, 150.0, 5.0),
                                            ("before", 1, 200.0, 12.0), ("after", 1, 220.0, 6.0),
                                            ("before", 2, 100.0, 10.0), ("after", 2, 130.0, 4.0))]
    text = bench_envs.summary(records, ["before", "after"])
    # medians 100 vs 150; paired ratios 1.5, 1.1, 1.3 -> 1.3 (not 150 / 100)
    assert "runner tok/s 150 (1.300x)" in text and "first step s 5 (0.500x)" in text, text


@pytest.mark.deep
def test_bench_device_reports_each_configuration_and_a_failing_one_apart(tmp_path: Path) -> None:
    """tools/bench/bench_device.py on this CPU: a configuration of the user's own (llama_tiny in fp8, whose
    matmuls the CPU runs dequantized), and one that is refused, reported with its error while the
    other still runs."""
    args = [sys.executable, str(BENCH / "bench_device.py"), "--steps", "2", "--rounds", "2",
            "--out", str(tmp_path / "device.jsonl"), "--hlo", str(tmp_path),
            "--config", "fp8=job=llama_tiny,job.model.attention=xla,job.model.quantization=fp8,train.batch_size=4",
            "--config", "refused=job.model.attention=cudnn", "--only", "fp8,refused",
            "topology=cpu-1", "train.seq_len=64", "job.model.context_length=64"]
    done = subprocess.run(args, cwd=tmp_path, env=runner_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "device.jsonl").read_text().splitlines()]
    fp8, refused = records
    assert fp8["config"] == "fp8" and len(fp8["step_s_rounds"]) == 2 and fp8["tokens_per_step"] == 4 * 64
    assert fp8["mfu"] is None  # topology=cpu-1 has no published peak
    assert fp8["matmul_kernels"] == {} and (tmp_path / "fp8.hlo.txt").is_file()  # no cuBLAS on a CPU
    assert "cuDNN attention runs on NVIDIA GPUs" in refused["error"]
    assert "refused" in done.stdout and "failed" in done.stdout  # the table says so too


@pytest.mark.deep
def test_bench_maxtext_alternates_both_loops_and_reads_maxtext_s_step_lines(tmp_path: Path) -> None:
    """tools/bench/bench_maxtext.py with a stand-in for MaxText's environment (a script that answers as
    its Python would: the package's directory, then the training loop's step lines), and runner's
    real loop, scanned and unrolled, on a smaller model (runner's extra overrides)."""
    fake = tmp_path / "maxtext-python"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *import\\ maxtext*) echo /opt/maxtext;; *pre_train.train*)\n"
                    "  for i in 1 2 3 4 5 6 7 8; do echo \"completed step: $i, seconds: 0.250, TFLOP/s/device: 1\"; done;;\n"
                    "esac\n")
    fake.chmod(0o755)
    env = runner_env(tmp_path)
    sys.path.insert(0, str(BENCH))
    try:
        import bench_maxtext
    finally:
        sys.path.pop(0)
    assert bench_maxtext.steady([9.0, 1.0, 2.0, 3.0, 7.0], 1) == 2.0  # no warm-up, no last step
    args = [sys.executable, str(BENCH / "bench_maxtext.py"), "--maxtext-python", str(fake), "--rounds", "2",
            "--steps", "8", "--warmup", "2", "--out", str(tmp_path / "mt.jsonl"),
            "job.model.d_model=32", "job.model.n_layers=2", "job.model.n_heads=2", "job.model.d_ff=64",
            "train.seq_len=32", "job.model.context_length=32"]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "mt.jsonl").read_text())
    configs = record["configs"]
    assert configs["maxtext_scanned"]["step_s_rounds"] == [0.25, 0.25]
    assert configs["runner_scanned"]["ratio_to_runner_scanned"] == 1.0
    assert all(t > 0 for t in configs["runner_unrolled"]["step_s_rounds"])
    order = [line.split()[2] for line in done.stdout.splitlines() if line.startswith("round ")]
    assert order[:3] == ["runner_scanned", "maxtext_scanned", "runner_unrolled"] and order[3:] == order[2::-1]
