"""Mixture-of-experts speed, side by side in one process: the compiled train step of each
configuration in a bare loop, in interleaved rounds (so the machine's drift falls on all alike).

    .venv/bin/python tools/bench/bench_moe.py                      # moe_tiny's dispatches against llama_tiny
    .venv/bin/python tools/bench/bench_moe.py --steps 20 --rounds 5 --out moe.jsonl

The configurations: `dense` is llama_tiny (its MLP as wide as moe_tiny's two chosen experts
together: the same active parameters per token); `ragged`, `capacity` and `dense_experts` are
moe_tiny with job.model.moe.dispatch set so (dense_experts: every expert on every token, the
reference). Extra Hydra overrides apply to all. Reports each one's tokens/s (median over rounds),
its ratio to `dense` (median of the per-round ratios), and its MFU from the analytic FLOPs per
token (active parameters) against this machine's float32 matmul peak measured in this run.
Prints ONE JSON line (``--out`` also appends it) and then a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import StepOnly, compose, emit, matmul_peak  # noqa: E402

CONFIGS = {
    "dense": ["job=llama_tiny"],
    "ragged": ["job=moe_tiny", "job.model.moe.dispatch=ragged"],
    "capacity": ["job=moe_tiny", "job.model.moe.dispatch=capacity"],
    "dense_experts": ["job=moe_tiny", "job.model.moe.dispatch=dense"],
}


def build(name: str, overrides: list[str], where: Path,
          configs: dict[str, list[str]] = CONFIGS) -> tuple[StepOnly, dict[str, Any]]:
    """The job's compiled step on a fresh state, and what a token costs."""
    from runner.models import family_for
    from runner.train.job import JOBS

    spec = compose([*configs[name], *overrides, f"run.dir={where / name}", "logging.wandb=disabled"])
    job = JOBS.get(spec.job.trainer)(spec)
    job.state = job.program.init_state()
    family = family_for(spec)
    info = {"parameters": int(family.param_count(job.model_config)),
            "active_parameters": int(getattr(family, "active_param_count", family.param_count)(job.model_config)),
            "flops_per_token": float(family.flops_per_token(job.model_config, spec.train.seq_len)),
            "tokens_per_step": spec.train.batch_size * spec.train.seq_len}
    return StepOnly(job), info


def compare(configs: dict[str, list[str]], argv: list[str] | None, bench: str, description: str) -> int:
    """Build every configuration, time each one's step in interleaved rounds, print the record
    (one JSON line) and a table of tokens/s, the ratio to the first configuration and MFU."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every configuration")
    parser.add_argument("--steps", type=int, default=10, help="steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=",".join(configs), help="comma-separated configurations")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    names = args.only.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        built = {name: build(name, args.overrides, Path(tmp), configs) for name in names}
        peak = matmul_peak()
        rates: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                step, info = built[name]
                rates[name].append(info["tokens_per_step"] / step.run(args.steps))
    record: dict[str, Any] = {"bench": bench, "overrides": args.overrides, "steps": args.steps, "rounds": args.rounds,
                              "peak_flops_per_s": peak, "configs": {}}
    for name in names:
        info = built[name][1]
        tps = statistics.median(rates[name])
        ratios = [a / b for a, b in zip(rates[name], rates[names[0]])]
        record["configs"][name] = {**info, "tokens_per_s": tps, "tokens_per_s_rounds": rates[name],
                                   f"ratio_to_{names[0]}": statistics.median(ratios),
                                   "mfu": tps * info["flops_per_token"] / peak}
    emit(record, args.out)
    print(f"{'config':<14} {'params':>12} {'active':>12} {'tok/s':>9} {'ratio':>6} {'MFU':>6}")
    for name, c in record["configs"].items():
        print(f"{name:<14} {c['parameters']:>12,} {c['active_parameters']:>12,} {c['tokens_per_s']:>9,.0f} "
              f"{c[f'ratio_to_{names[0]}']:>6.2f} {100 * c['mfu']:>5.1f}%")
    return 0


def main(argv: list[str] | None = None) -> int:
    return compare(CONFIGS, argv, "moe", __doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
