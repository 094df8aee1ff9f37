"""Pipeline stages' step time against the unpipelined step at the same global batch, beside the
bubble formula's prediction, on fake CPU devices, side by side in one process (interleaved rounds,
so the machine's drift falls on all alike).

    .venv/bin/python tools/bench/bench_pipeline.py                       # llama_tiny, 8 layers, 4 devices
    .venv/bin/python tools/bench/bench_pipeline.py --rounds 5 --out docs/records/bench_pipeline.jsonl
    .venv/bin/python tools/bench/bench_pipeline.py --memory   # temporaries with and without iteration remat

`flat` is the unpipelined step (mesh.data=4); every other configuration splits the same 4 devices
into stages (gpipe and circular, several microbatch counts). Each one's tokens/s is the median over
rounds, its ratio to `flat` the median of the per-round ratios, and `predicted` is 1 - bubble =
M*R / (M*R + S - 1).

What it can show on one CPU: the fake devices share this machine's cores, so nothing runs in
parallel and a stage's idle iterations are not idle: it computes on zeros, work the cores do. The
step therefore costs the pipeline's whole schedule, iterations x stages x layers a stage, against
the unpipelined step's layers once: the ratio should follow 1 - bubble, less what small
microbatches and the extra copies cost. What it cannot show: the speed-up stages give by running
at once on separate chips, and the time activations take to cross links between them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import emit  # noqa: E402
from bench_moe import build  # noqa: E402

BASE = ["job=llama_tiny", "topology=cpu-4", "job.model.n_layers=8", "train.batch_size=32", "train.seq_len=128",
        "job.model.context_length=128", "eval.batch_size=32"]
CONFIGS: dict[str, tuple[list[str], tuple[int, int, int]]] = {  # overrides, (stages, microbatches, repeats)
    "flat": (["mesh.data=4"], (1, 1, 1)),
    "gpipe_s2_m2": (["mesh.stage=2", "mesh.data=2", "pipeline.microbatches=2"], (2, 2, 1)),
    "gpipe_s2_m8": (["mesh.stage=2", "mesh.data=2", "pipeline.microbatches=8"], (2, 8, 1)),
    "gpipe_s4_m4": (["mesh.stage=4", "mesh.data=1", "pipeline.microbatches=4"], (4, 4, 1)),
    "gpipe_s4_m16": (["mesh.stage=4", "mesh.data=1", "pipeline.microbatches=16"], (4, 16, 1)),
    "circular_s2_r2_m2": (["mesh.stage=2", "mesh.data=2", "pipeline.schedule=circular", "pipeline.repeats=2",
                           "pipeline.microbatches=2"], (2, 2, 2)),
    "circular_s4_r2_m4": (["mesh.stage=4", "mesh.data=1", "pipeline.schedule=circular", "pipeline.repeats=2",
                           "pipeline.microbatches=4"], (4, 4, 2)),
}


def predicted(stages: int, microbatches: int, repeats: int) -> float:
    """1 - bubble: the share of the schedule's stage-iterations that do kept work."""
    return microbatches * repeats / (microbatches * repeats + stages - 1)


def memory() -> int:
    """The compiled loss-and-gradient step's temporaries a device (XLA's memory analysis) for a
    d_model 1,024, 8-layer llama, 8 rows of 512 tokens, full remat: unpipelined (fsdp 4), and in 2
    gpipe stages of 4 microbatches (fsdp 2) with the iterations rematerialised (what runs) and not."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    from runner.models.common import pipeline
    from runner.models.llama.model import Llama, LlamaConfig, LlamaFamily
    from runner.parallel.mesh import make_mesh

    cfg = LlamaConfig(vocab_size=256, context_length=512, d_model=1024, n_layers=8, n_heads=8, head_dim=128,
                      d_ff=4096, n_kv_heads=8, remat="full")
    tokens = jnp.zeros((8, 512), jnp.int32)
    abstract = jax.eval_shape(lambda: Llama(cfg).init(jax.random.PRNGKey(0), tokens[:1]))
    specs, params = nn.get_partition_spec(abstract)["params"], nn.unbox(abstract)["params"]

    def temporaries(config: Any, shape: dict[str, int]) -> float:
        mesh, rules = make_mesh(shape, jax.devices()), LlamaFamily.axis_rules(config, shape)
        sharding = nn.logical_to_mesh_sharding(specs, mesh, rules)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            step = jax.jit(jax.value_and_grad(lambda p: jnp.mean(Llama(config).apply({"params": p}, tokens))),
                           in_shardings=(sharding,), out_shardings=(None, sharding))
            return step.lower(params).compile().memory_analysis().temp_size_in_bytes / 2**20

    staged = dataclasses.replace(cfg, pipeline_stages=2, pipeline_microbatches=4)
    rows = {"unpipelined, fsdp 4": temporaries(cfg, {"fsdp": 4, "data": 1, "tensor": 1}),
            "gpipe 2 stages x fsdp 2, iterations rematerialised": temporaries(staged, {"stage": 2, "fsdp": 2,
                                                                                       "data": 1, "tensor": 1})}
    run = pipeline.run
    pipeline.run = lambda *a, **k: run(*a, **{**k, "remat": False})
    rows["gpipe 2 stages x fsdp 2, iterations not rematerialised"] = temporaries(
        staged, {"stage": 2, "fsdp": 2, "data": 1, "tensor": 1})
    pipeline.run = run
    for name, mib in rows.items():
        print(f"{name:<56} {mib:8,.0f} MiB of temporaries a device")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every configuration")
    parser.add_argument("--steps", type=int, default=5, help="steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations")
    parser.add_argument("--out", default=None)
    parser.add_argument("--memory", action="store_true", help="compiled temporaries with and without iteration remat")
    args = parser.parse_args(argv)
    if args.memory:
        return memory()
    names = args.only.split(",")
    configs = {name: [*BASE, *CONFIGS[name][0], *args.overrides] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        built = {name: build(name, [], Path(tmp), configs) for name in names}
        rates: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                step, info = built[name]
                rates[name].append(info["tokens_per_step"] / step.run(args.steps))
    record: dict[str, Any] = {"bench": "pipeline", "base": BASE, "overrides": args.overrides, "steps": args.steps,
                              "rounds": args.rounds, "configs": {}}
    for name in names:
        shape = CONFIGS[name][1]
        ratios = [a / b for a, b in zip(rates[name], rates[names[0]])]
        record["configs"][name] = {"stages": shape[0], "microbatches": shape[1], "repeats": shape[2],
                                   "tokens_per_s": statistics.median(rates[name]), "tokens_per_s_rounds": rates[name],
                                   f"ratio_to_{names[0]}": statistics.median(ratios), "predicted": predicted(*shape)}
    emit(record, args.out)
    print(f"{'config':<20} {'S':>2} {'M':>3} {'R':>2} {'tok/s':>9} {'ratio':>6} {'1-bubble':>8}")
    for name, c in record["configs"].items():
        print(f"{name:<20} {c['stages']:>2} {c['microbatches']:>3} {c['repeats']:>2} {c['tokens_per_s']:>9,.0f} "
              f"{c[f'ratio_to_{names[0]}']:>6.2f} {c['predicted']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
