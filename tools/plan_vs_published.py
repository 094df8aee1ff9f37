"""The roofline of mode=compile and mode=plan beside published MFU: MaxText's v5p table.

Each row is a model and mesh MaxText publishes an MFU for (its README's "TPU v5p" table; the
configs are MaxText/configs/v5p/{32b,64b,128b}.sh: `global_parameter_scale` over base.yml's
2048-wide, 16-layer, 16-head model with a 7168-wide SwiGLU and a 32,000-token vocabulary, 2,048-token
rows, `per_device_batch_size` rows a chip, fsdp over the slice with `ici_tensor_parallelism`,
remat_policy=minimal). runner compiles the same model, batch and mesh for the same slice (llama
family) and prints its estimate beside the published figure. One difference is forced: MaxText
shards the activations' embedding over its tensor axis, runner's tensor parallelism keeps each
shard's residual stream whole, so at MaxText's batch runner fits only with remat=full (remat=dots,
the nearest to MaxText's minimal, needs 141 GiB a chip on 32b), and pays the forward pass twice:

    .venv/bin/python tools/plan_vs_published.py            # all three, one compile each
    .venv/bin/python tools/plan_vs_published.py 32b        # one of them

The last line is the table as JSON. docs/planning.md has the figures and what the gap says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _maxtext(d_model: int, layers: int, heads: int, d_ff: int, rows_per_chip: int, chips: int, fsdp: int,
             tensor: int) -> list[str]:
    """A MaxText scaled model as runner settings (vocabulary 32,000, head width 128, untied)."""
    return [
        "job=llama3_8b", "data.strategy=synthetic", "job.model.vocab_size=32000", "job.model.context_length=2048",
        f"job.model.d_model={d_model}", f"job.model.n_layers={layers}", f"job.model.n_heads={heads}",
        f"job.model.n_kv_heads={heads}", "job.model.head_dim=128", f"job.model.d_ff={d_ff}",
        "job.model.rope.theta=10000", "job.model.remat=full", "train.seq_len=2048",
        f"train.batch_size={rows_per_chip * chips}", "train.accumulate_steps=1",
        f"eval.batch_size={rows_per_chip * chips}", "mesh.data=1", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}",
    ]


# name: (topology, settings, MaxText's published MFU)
PUBLISHED = {
    "32b": ("v5p-128", _maxtext(8192, 32, 64, 28672, 7, 64, 16, 4), 0.7147),
    "64b": ("v5p-128", _maxtext(8192, 64, 64, 28672, 3, 64, 16, 4), 0.7031),
    "128b": ("v5p-256", _maxtext(8192, 64, 128, 57344, 1, 128, 16, 8), 0.6868),
}


def compile_one(topology: str, settings: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "runner", "mode=compile", f"topology={topology}", *settings],
                          capture_output=True, text=True, cwd=ROOT)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if not last.startswith('{"report": "compile"'):
        raise SystemExit(f"error: mode=compile for {topology} failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-800:]}")
    return json.loads(last)


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in PUBLISHED]
    if unknown:
        print(f"error: unknown configuration {unknown[0]!r}. Fix: name one of {', '.join(PUBLISHED)}, or none for all.",
              file=sys.stderr)
        return 2
    rows = []
    print(f"{'config':<6} {'topology':<9} {'parameters':>14} {'fits':>5} {'memory':>10} {'bound':>8} "
          f"{'estimated MFU':>14} {'published':>10} {'ratio':>6}")
    for name in names or list(PUBLISHED):
        topology, settings, published = PUBLISHED[name]
        report = compile_one(topology, settings)
        estimate = report["estimate"] or {}
        mfu = float(estimate.get("mfu", 0.0))
        row = {"config": name, "topology": topology, "parameters": report["parameters"], "fits": report["fits"],
               "memory_gib": (report["memory"] or {}).get("total", 0) / 2**30, "estimate": estimate,
               "published_mfu": published, "estimated_mfu": mfu,
               "command": "python -m runner mode=compile topology=" + topology + " " + " ".join(settings)}
        rows.append(row)
        print(f"{name:<6} {topology:<9} {report['parameters']:>14,} {str(report['fits']):>5} "
              f"{row['memory_gib']:>8.2f} G {estimate.get('bound', '-'):>8} {mfu:>14.1%} {published:>10.1%} "
              f"{mfu / published if published else 0:>6.2f}", flush=True)
    print(json.dumps({"report": "plan_vs_published", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
