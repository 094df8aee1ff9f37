"""End-to-end training benchmark: runner's real loop against a minimal hand-written jitted loop.

    .venv/bin/python tools/bench/bench.py                                   # gpt_tiny, 5 rounds of 30 steps
    .venv/bin/python tools/bench/bench.py --steps 40 job=gpt_10m            # the ~10M-parameter model
    .venv/bin/python tools/bench/bench.py --steps 12 --block 4 --rounds 2 --out bench.jsonl job=gpt_tiny topology=cpu-1

Positional arguments are Hydra overrides, composed exactly as ``python -m runner`` composes them
(runner.main.cli.precheck, then runner.main.config.build_spec). How it measures, all in this one process:

* runner: the real ``BaseTrainer.run()`` (restore-or-init, compile, loader, the step loop with its
  metrics, evaluation at start and end, an asynchronous checkpoint save in the middle of the run and
  one at the end) in a fresh run directory per round; step times are the ``step_time_s`` the loop
  itself writes to metrics.jsonl (train.log_every=1 is forced). The warm-up (the first tenth of the
  steps, at least two: compilation, pipeline fill), the last step (it carries the final save), the
  two steps after each baseline block, and the mid-run save's window (from the save until its
  asynchronous commit has finished; reported separately as the save stall) are left out of the
  steady-state figures.
* baseline: the same model, the same optimizer (the job's own optax transformation), the same
  micro-batch (the first of the job's loader, kept on the device), as
  ``jax.jit(value_and_grad + optax update, donate_argnums=(0, 1))``: no loader, no metrics, no
  checkpoints, one block_until_ready at the end of a block.
* interleaved: every ``--block`` steady steps of a runner round, its step-end hook waits for the step
  in flight and times ``--block`` baseline steps, so the two alternate every second or so and the
  machine's drift and other tenants' load fall on both alike. A round's ratio is runner tokens/s
  over the baseline's in that round; the headline is the median over rounds.
* runner's step function in a bare loop (its compiled ``train_executable()`` on one device batch)
  separates the cost of the step from the cost of the loop around it.
* MFU: against the topology's chip peak (runner.parallel.topology), or on CPU against a float32 matmul peak
  measured in this run.

Prints ONE JSON line (``--out`` also appends it to a file) and then a human-readable table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for runner
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

T_PROCESS = time.perf_counter()

FORCED = ["train.log_every=1", "logging.wandb=disabled", "logging.progress=none", "eval.every=0"]


def compose(overrides: list[str]) -> Any:
    """Overrides -> ExecutionSpec, as `python -m runner` does it."""
    from runner.main.cli import precheck
    from runner.main.config import build_spec
    from runner.spec import register_schema
    from runner.train.job import load_job_modules

    register_schema()
    load_job_modules()
    cfg = precheck(overrides)
    return build_spec(cfg, overrides)


def matmul_peak(n: int = 1024, reps: int = 5) -> float:
    """This machine's float32 matmul FLOP/s (best of a few), the CPU MFU denominator."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(4):
            out = f(a)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t) / 4)
    return 2 * n ** 3 / best


def runner_round(base: list[str], steps: int, save_at: int, run_dir: Path, baseline: "Baseline | None",
                 block: int) -> dict[str, Any]:
    """One fresh run of the real training loop, with blocks of the baseline interleaved.

    Runner's step times come from its metrics.jsonl. Every ``block`` steady steps the step-end hook
    waits for the step in flight, then times ``block`` steps of the baseline: the two alternate
    every second or so, so the machine's drift and other tenants fall on both alike. Steady state
    leaves out the warm-up (``warmup_steps(steps)``: compilation, pipeline fill), the last step (it
    carries the final checkpoint save), the two steps after each baseline block (the pause itself,
    and the refill of the pipeline) and the mid-run save's window: from the save's step until the
    first step that starts after its asynchronous commit has finished. The window's steps are the
    save stall."""
    import jax

    from runner.train.job import JOBS

    overrides = [*base, *FORCED, f"train.steps={steps}", f"checkpoint.every_steps={save_at}",
                 f"run.dir={run_dir}"]
    t0 = time.perf_counter()
    spec = compose(overrides)
    job = JOBS.get(spec.job.trainer)(spec)
    seen: dict[int, float] = {}
    committed: list[int] = []  # the first step whose metrics were read with the mid-run save done
    paused: set[int] = set()  # runner steps that contain a baseline block or follow one
    base_times: list[float] = []
    warm = warmup_steps(steps)

    def on_step_end(state: Any, metrics: Any, step: int) -> None:
        seen.setdefault(step, time.perf_counter())
        if step >= save_at and not committed and not job.checkpointer.manager.is_saving_in_progress():
            committed.append(step)
        saving = save_at and step >= save_at - 1 and not committed
        if baseline is not None and step > warm and step % block == 0 and step < steps - 2 and not saving:
            jax.block_until_ready(state)
            if not base_times:  # untimed: inside the loop's mesh context jit compiles anew, twice (the
                baseline.run(2)  # first call's outputs come back with the mesh's sharding)
            base_times.append(baseline.run(block))
            paused.update((step + 1, step + 2))

    job.on_step_end = on_step_end  # type: ignore[method-assign]
    job.run()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = {int(r["step"]): float(r["step_time_s"]) for r in records if "step_time_s" in r}
    # Metrics of step s are read while step s + 1 runs: a commit seen done at s leaves s + 2 on clean.
    window_end = min((committed[0] if committed else steps) + 1, steps - 1)
    window = set(range(save_at, window_end + 1)) if save_at else set()
    steady = [times[s] for s in sorted(times) if warm < s < steps and s not in window | paused]
    saving = [times[s] for s in sorted(window) if s in times]
    # restore: a new job object over the same run directory, timed through load()
    job2 = JOBS.get(spec.job.trainer)(spec)
    t = time.perf_counter()
    job2.load()
    jax.block_until_ready(job2.state)
    restore_s = time.perf_counter() - t
    job2.checkpointer.close()
    out = {"job": job, "spec": spec, "first_step_s": seen.get(1, float("nan")) - t0, "steady": steady,
           "saving": saving, "restore_s": restore_s, "baseline": base_times,
           "data_wait_s": max((float(r.get("data_wait_s", 0.0)) for r in records), default=0.0)}
    return out


def warmup_steps(steps: int) -> int:
    """Steps left out at the start of a runner round: compilation, pipeline fill."""
    return max(2, steps // 10)


class Baseline:
    """The minimal loop: same model, optimizer and batch; jit + donation; nothing else."""

    def __init__(self, job: Any) -> None:
        import jax
        import jax.numpy as jnp
        import optax

        model, tx = job.model, job.program.tx
        batch = next(iter(job.batch("train")))
        self.x = jnp.asarray(batch["x"][0])
        self.y = jnp.asarray(batch["y"][0])
        self.tokens = int(self.x.size)
        dropout_key = jax.random.PRNGKey(1)

        def loss_fn(params: Any, x: Any, y: Any) -> Any:
            logits = model.apply({"params": params}, x, deterministic=False, rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        def step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = jax.jit(step, donate_argnums=(0, 1))
        t = time.perf_counter()
        params = jax.jit(lambda k: model.init(k, job.init_args()[0])["params"])(jax.random.PRNGKey(0))
        import flax.linen as nn

        self.params = nn.meta.unbox(params)
        self.opt_state = tx.init(self.params)
        self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.x, self.y)
        loss.block_until_ready()
        self.first_step_s = time.perf_counter() - t

    def run(self, steps: int) -> float:
        """Seconds per step over `steps` steps (one sync at the end)."""
        t = time.perf_counter()
        for _ in range(steps):
            self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.x, self.y)
        loss.block_until_ready()
        return (time.perf_counter() - t) / steps


class StepOnly:
    """runner's own compiled train step (job.program.train_executable) in a bare loop on one device batch:
    separates the cost of the step function from the cost of the loop around it."""

    def __init__(self, job: Any) -> None:
        import jax

        self.exe = job.program.train_executable()
        self.state = job.state
        self.batch = job.program.to_device(next(iter(job.batch("train"))))
        self.state, metrics = self.exe(self.state, self.batch)
        jax.block_until_ready(metrics)

    def run(self, steps: int) -> float:
        import jax

        t = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.exe(self.state, self.batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - t) / steps


def loader_throughput(job: Any, steps: int) -> float:
    """Tokens/s the job's BatchLoader alone delivers (after the prefetch queue is drained)."""
    loader = job.batch("train")
    try:
        for _ in range(job.spec.data.prefetch + 2):
            first = next(loader)
        t = time.perf_counter()
        for _ in range(steps):
            next(loader)
        dt = time.perf_counter() - t
    finally:
        close = getattr(loader, "close", None)
        if close:
            close()
    return steps * first["x"].size / dt


def device_memory(job: Any) -> tuple[int | None, str]:
    import jax

    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        pass
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "jax device memory_stats peak_bytes_in_use"
    try:
        m = job.program.train_executable().memory_analysis()
        return (int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                    - m.alias_size_in_bytes), "compiled train step memory_analysis")
    except Exception:
        return None, "unavailable"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m runner")
    parser.add_argument("--steps", type=int, default=30, help="steps per round (default 30)")
    parser.add_argument("--rounds", type=int, default=5, help="runner rounds (default 5)")
    parser.add_argument("--block", type=int, default=10,
                        help="runner steps between baseline blocks, and baseline steps per block (default 10)")
    parser.add_argument("--loader-steps", type=int, default=50)
    parser.add_argument("--label", default="", help="name of this configuration in the output")
    parser.add_argument("--out", default=None, help="also append the JSON line to this file")
    parser.add_argument("--dir", default=None, help="where run directories go (default: a temporary one)")
    args = parser.parse_args(argv)
    save_at = args.steps // 2
    if args.steps < 8:
        parser.error("--steps must be at least 8 (warm-up steps, steady steps, a save window)")
    if args.block < 1 or (warmup_steps(args.steps) // args.block + 1) * args.block >= save_at - 1:
        parser.error(f"--steps {args.steps} leaves no room for a baseline block every {args.block} steps before the "
                     "mid-run save; raise --steps or lower --block")

    import jax
    import numpy as np

    from runner.parallel.topology import parse_topology
    from runner.train.job import JOBS

    runner_rates: list[float] = []
    base_rates: list[float] = []
    steady_all: list[float] = []
    saving_all: list[float] = []
    stalls: list[float] = []  # per round: the save window's time over the round's steady median
    windows: list[int] = []
    restore: list[float] = []
    first_steps: list[float] = []
    waits: list[float] = []
    base_step_times: list[float] = []
    step_only_times: list[float] = []
    step_only: StepOnly | None = None
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-") as tmp:
        # The baseline needs the job's model, optimizer and batch: take them from a job not run.
        probe = compose([*args.overrides, *FORCED, f"run.dir={Path(tmp) / 'probe'}"])
        baseline = Baseline(JOBS.get(probe.job.trainer)(probe))
        job = None
        for i in range(args.rounds):
            res = runner_round(args.overrides, args.steps, save_at, Path(tmp) / f"run{i}", baseline, args.block)
            job = res["job"]
            if not res["steady"] or not res["baseline"]:
                sys.exit(f"bench: round {i} left no steady runner steps or no baseline block (the mid-run save's "
                         f"commit took too long?); raise --steps (now {args.steps}) or lower --block.")
            tokens_per_step = job.spec.train.batch_size * job.spec.train.seq_len
            runner_rates.append(tokens_per_step / statistics.mean(res["steady"]))
            base_step_times.append(statistics.mean(res["baseline"]))
            base_rates.append(baseline.tokens / base_step_times[-1])
            steady_all += res["steady"]
            saving_all += res["saving"]
            stalls.append(sum(res["saving"]) - len(res["saving"]) * statistics.median(res["steady"]))
            windows.append(len(res["saving"]))
            restore.append(res["restore_s"])
            first_steps.append(res["first_step_s"])
            waits.append(res["data_wait_s"])
            if step_only is None:
                step_only = StepOnly(job)  # takes over the finished run's state
            step_only_times.append(step_only.run(args.block * 2))
        assert job is not None
        spec = job.spec
        loader_tps = loader_throughput(job, args.loader_steps)
        dev_mem, dev_mem_source = device_memory(job)

    topo = parse_topology(spec.topology)
    fpt = job.flops_per_token()
    chip_peak = topo.peak_bf16_flops
    if chip_peak:
        peak, peak_source = float(chip_peak), f"{topo.chip.name if topo.chip else topo.name} bf16 peak x {topo.num_chips}"
    else:
        peak, peak_source = matmul_peak() * (1 if jax.default_backend() == "cpu" else jax.device_count()), \
            "measured float32 matmul peak of this machine (1024^3, jax.jit)"
    runner_tps = statistics.median(runner_rates)
    base_tps = statistics.median(base_rates)
    round_ratios = [a / b for a, b in zip(runner_rates, base_rates)]
    steady_med = statistics.median(steady_all)
    record = {
        "bench": "train",
        "label": args.label or spec.job.name,
        "overrides": args.overrides,
        "job": spec.job.name,
        "topology": spec.topology,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "cpus": os.cpu_count(),
        "parameters": int(job.param_count()),
        "batch_size": spec.train.batch_size,
        "seq_len": spec.train.seq_len,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "time_to_first_step_s": first_steps[0],
        "time_to_first_step_later_rounds_s": first_steps[1:],
        "baseline_first_step_s": baseline.first_step_s,
        "step_time_s": steady_med,
        "step_time_p90_s": float(np.percentile(steady_all, 90)),
        "baseline_step_time_s": statistics.median(base_step_times),
        "tokens_per_s": runner_tps,
        "runner_step_only_step_time_s": statistics.median(step_only_times) if step_only_times else None,
        # What the loop adds per step: runner's step time minus its own step function's in a bare
        # loop (both medians; negative means within this machine's noise).
        "loop_overhead_s": steady_med - statistics.median(step_only_times) if step_only_times else None,
        "baseline_tokens_per_s": base_tps,
        "ratio": statistics.median(round_ratios),
        "ratio_per_round": round_ratios,
        "baseline_block_steps": args.block,
        "runner_tokens_per_s_rounds": runner_rates,
        "baseline_tokens_per_s_rounds": base_rates,
        "flops_per_token": fpt,
        "achieved_flops_per_s": runner_tps * fpt,
        "baseline_flops_per_s": base_tps * fpt,
        "peak_flops_per_s": peak,
        "peak_source": peak_source,
        "mfu": runner_tps * fpt / peak,
        "baseline_mfu": base_tps * fpt / peak,
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device_memory_bytes": dev_mem,
        "device_memory_source": dev_mem_source,
        "loader_tokens_per_s": loader_tps,
        "data_wait_s": max(waits) if waits else 0.0,
        "save_step_time_s": max(saving_all) if saving_all else None,
        "save_stall_s": statistics.median(stalls) if saving_all else None,
        "save_window_steps": int(statistics.median(windows)) if windows else 0,
        "restore_s": statistics.median(restore),
        "process_s": time.perf_counter() - T_PROCESS,
    }
    emit(record, args.out)
    print(table(record), flush=True)
    return 0


def emit(record: dict[str, Any], out: str | None) -> None:
    """Print a benchmark's record as one JSON line, and append it to `out` if given."""
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def table(r: dict[str, Any]) -> str:
    def si(v: float, unit: str) -> str:
        for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(v) >= div:
                return f"{v / div:.2f} {p}{unit}"
        return f"{v:.2f} {unit}"

    mem = "n/a" if r["device_memory_bytes"] is None else f"{r['device_memory_bytes'] / 2**20:.1f} MiB"
    rows = [
        ("configuration", f"{r['label']} ({r['parameters'] / 1e6:.2f}M params, batch {r['batch_size']} x "
                          f"seq {r['seq_len']}, {r['backend']} x{r['devices']}, {r['cpus']} CPUs)"),
        ("time to first step", f"{r['time_to_first_step_s']:.2f} s (start-up + compile; baseline "
                               f"init + compile {r['baseline_first_step_s']:.2f} s)"),
        ("step time (median, p90)", f"{r['step_time_s'] * 1e3:.1f} ms, {r['step_time_p90_s'] * 1e3:.1f} ms "
                                    f"(baseline {r['baseline_step_time_s'] * 1e3:.1f} ms)"),
        ("tokens/s runner", f"{r['tokens_per_s']:,.0f}"),
        ("runner's step fn, bare loop", "n/a" if r.get("runner_step_only_step_time_s") is None else
         f"{r['runner_step_only_step_time_s'] * 1e3:.1f} ms/step "
         f"({r['batch_size'] * r['seq_len'] / r['runner_step_only_step_time_s']:,.0f} tokens/s)"),
        ("loop around the step", "n/a" if r.get("loop_overhead_s") is None else
         f"{r['loop_overhead_s'] * 1e3:+.2f} ms/step ({r['loop_overhead_s'] / r['step_time_s']:+.1%} of the step)"),
        ("tokens/s baseline", f"{r['baseline_tokens_per_s']:,.0f}"),
        ("runner / baseline", f"{r['ratio']:.3f} (rounds: {', '.join(f'{x:.3f}' for x in r['ratio_per_round'])})"),
        ("model FLOPs per token", si(r["flops_per_token"], "FLOP")),
        ("achieved FLOP/s", f"{si(r['achieved_flops_per_s'], 'FLOP/s')} (baseline "
                            f"{si(r['baseline_flops_per_s'], 'FLOP/s')})"),
        ("MFU", f"{r['mfu']:.1%} of {si(r['peak_flops_per_s'], 'FLOP/s')} ({r['peak_source']}); "
                f"baseline {r['baseline_mfu']:.1%}"),
        ("peak host memory (RSS)", f"{r['host_peak_rss_bytes'] / 2**20:.0f} MiB"),
        ("device memory", f"{mem} ({r['device_memory_source']})"),
        ("loader-only throughput", f"{r['loader_tokens_per_s']:,.0f} tokens/s "
                                   f"({r['loader_tokens_per_s'] / r['tokens_per_s']:.0f}x the step's need)"),
        ("loader wait in the loop", f"{r['data_wait_s']:.3f} s total"),
        ("async save: slowest step", "n/a" if r["save_step_time_s"] is None else
         f"{r['save_step_time_s'] * 1e3:.1f} ms; {r['save_stall_s'] * 1e3:.1f} ms extra over the "
         f"{r['save_window_steps']} steps until the commit finished"),
        ("restore", f"{r['restore_s']:.3f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


if __name__ == "__main__":
    sys.exit(main())
