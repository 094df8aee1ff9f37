"""Accelerator speed of runner's compiled train step: tokens/s per device and MFU against the
topology's chip peak, one configuration after another in one process.

    python tools/bench/bench_device.py                                   # llama3_1b on one H100: cuDNN vs xla, bf16
    python tools/bench/bench_device.py --config b16=train.batch_size=16,job.model.remat=dots --out gpu.jsonl
    python tools/bench/bench_device.py --only cudnn_b8_full --steps 20 --rounds 3 job.model.n_layers=4

Each configuration (``--config NAME=OVERRIDE,OVERRIDE,...``, on top of the positional overrides,
on top of BASE) is built (a fresh state), compiled, warmed up by one step, timed as ``--rounds``
blocks of ``--steps`` steps of its compiled step on one device batch (runner.train.program's
``train_executable``: the step the loop runs, with its gradient-accumulation scan, guard and
norms), then freed before the next: a large model's state fits once, not once per
configuration. On a GPU the rounds scatter by a percent or two, so the configurations are not
interleaved as the CPU benchmarks are; the per-round figures are in the record. MFU counts the
model's FLOPs per token (runner.models: 6N plus attention, no rematerialisation) against the
topology's peak for the compute dtype (runner.parallel.topology): a quantized run is measured
against the same bf16 peak, so it is not flattered. A configuration that fails (out of memory, an
unsupported kernel) is reported with its error and the others still run.
Prints ONE JSON line per configuration as it finishes (``--out`` also appends it) and a table.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import StepOnly, compose, emit  # noqa: E402

BASE = ["job=llama3_1b", "topology=h100-1", "train.seq_len=2048", "train.accumulate_steps=1",
        "data.strategy=synthetic", "eval.every=0", "logging.wandb=disabled", "logging.progress=none"]
CONFIGS = {
    "cudnn_b8_full": ["job.model.attention=cudnn", "train.batch_size=8", "job.model.remat=full"],
    "cudnn_b8_dots": ["job.model.attention=cudnn", "train.batch_size=8", "job.model.remat=dots"],
    "cudnn_b16_full": ["job.model.attention=cudnn", "train.batch_size=16", "job.model.remat=full"],
    "cudnn_b16_dots": ["job.model.attention=cudnn", "train.batch_size=16", "job.model.remat=dots"],
    "xla_b8_full": ["job.model.attention=xla", "train.batch_size=8", "job.model.remat=full"],
    # quantized training (job.model.quantization) against the best bf16 row
    "fp8_b16_dots": ["job.model.attention=cudnn", "train.batch_size=16", "job.model.remat=dots",
                     "job.model.quantization=fp8"],
    "fp8_channel_b16_dots": ["job.model.attention=cudnn", "train.batch_size=16", "job.model.remat=dots",
                             "job.model.quantization=fp8", "job.model.quantization_scaling=channel"],
    "int8_b8_dots": ["job.model.attention=cudnn", "train.batch_size=8", "job.model.remat=dots",
                     "job.model.quantization=int8"],
}


def measure(name: str, overrides: list[str], steps: int, rounds: int, where: Path,
            hlo_dir: str | None = None) -> dict[str, Any]:
    """Build, compile, time and free one configuration."""
    import jax

    from runner.models import family_for
    from runner.parallel.topology import parse_topology
    from runner.train.job import JOBS

    t0 = time.perf_counter()
    spec = compose([*overrides, f"run.dir={where / name}"])
    job = JOBS.get(spec.job.trainer)(spec)
    job.state = job.program.init_state()
    step = StepOnly(job)
    ready_s = time.perf_counter() - t0
    times = [step.run(steps) for _ in range(rounds)]
    family = family_for(spec)
    flops = float(family.flops_per_token(job.model_config, spec.train.seq_len))
    tokens = spec.train.batch_size * spec.train.seq_len
    devices = jax.device_count()
    per_device = tokens / statistics.median(times) / devices
    topology = parse_topology(spec.topology)
    peak = topology.peak_bf16_flops / devices if topology.peak_bf16_flops else None
    memory = step.exe.memory_analysis()
    hlo = step.exe.as_text()
    if hlo_dir:
        Path(hlo_dir, f"{name}.hlo.txt").write_text(hlo)
    targets = re.findall(r'custom_call_target="([^"]*matmul[^"]*)"', hlo)  # cuBLAS's: $f8 for fp8 operands
    kernels = {"matmul_kernels": {t: targets.count(t) for t in sorted(set(targets))},
               "int8_dots": len(re.findall(r"= s32\[[^=]*? dot\(", hlo))}  # XLA's own int8 dots, if any
    record = {"config": name, "overrides": overrides, "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "devices": devices, "tokens_per_step": tokens,
              "parameters": int(family.param_count(job.model_config)),
              "flops_per_token": flops, "step_s_rounds": times, "step_s": statistics.median(times),
              "tokens_per_s_per_device": per_device, "peak_flops_per_device": peak,
              "mfu": per_device * flops / peak if peak else None,
              "compiled_memory_bytes": int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                           + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
              "build_and_compile_s": ready_s, **kernels}
    del step, job
    gc.collect()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every configuration (after BASE)")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=A,B",
                        help="a configuration of your own: its name and comma-separated overrides")
    parser.add_argument("--only", default="", help="comma-separated configurations to run (default: all)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="also append each JSON line to this file")
    parser.add_argument("--hlo", default=None, help="write each configuration's compiled program to DIR/NAME.hlo.txt")
    args = parser.parse_args(argv)
    configs = dict(CONFIGS)
    for item in args.config:
        name, _, rest = item.partition("=")
        configs[name] = [o for o in rest.split(",") if o]
    names = args.only.split(",") if args.only else list(configs)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                record = measure(name, [*BASE, *args.overrides, *configs[name]], args.steps, args.rounds, Path(tmp),
                                 args.hlo)
            except Exception as e:  # noqa: BLE001 - one failing configuration must not stop the others
                record = {"config": name, "overrides": configs[name], "error": f"{type(e).__name__}: {e}"[:2000]}
                gc.collect()
            records.append(record)
            emit(record, args.out)
    print(f"{'config':<22} {'step ms':>8} {'tok/s/dev':>10} {'MFU':>6} {'memory GiB':>10}")
    for r in records:
        if "error" in r:
            print(f"{r['config']:<22} failed: {r['error'][:200]}")
            continue
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] else "   n/a"
        print(f"{r['config']:<22} {1000 * r['step_s']:8.1f} {r['tokens_per_s_per_device']:10,.0f} {mfu:>6} "
              f"{r['compiled_memory_bytes'] / 2 ** 30:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
