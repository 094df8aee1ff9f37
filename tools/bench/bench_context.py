"""Context parallelism's speed on this CPU, side by side in one process: a llama_150m-shaped
layer (width 768, 12 heads of 64, 4 key/value heads; one layer and a 512-token vocabulary, to
fit a step in this machine's memory) on rows of 8,192 tokens, two rows a step, on 2 CPU
devices, in interleaved rounds of its compiled step.

    .venv/bin/python tools/bench/bench_context.py             # context 1 (a row per device) vs 2, allgather vs ring
    .venv/bin/python tools/bench/bench_context.py --steps 2 --rounds 3 --out context.jsonl

`data2` splits the batch (each device one whole row); `context2_allgather` and `context2_ring`
split every row over both devices (job.model.context_parallel). Reports tokens/s, the ratio to
`data2` and MFU from the analytic FLOPs (runner.models) against a float32 matmul peak measured
in this run. Prints ONE JSON line (``--out`` also appends it) and then a table.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"])
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import compare  # noqa: E402

MODEL = ["job=llama_150m", "job.model.n_layers=1", "job.model.vocab_size=512", "job.model.context_length=8192",
         "train.seq_len=8192",
         "train.batch_size=2", "train.accumulate_steps=1", "eval.batch_size=2", "topology=cpu-2",
         "job.model.attention=xla", "job.model.remat=full", "data.strategy=synthetic"]
CONFIGS = {
    "data2": [*MODEL, "mesh.data=2"],
    "context2_allgather": [*MODEL, "mesh.data=1", "mesh.context=2", "job.model.context_parallel=allgather"],
    "context2_ring": [*MODEL, "mesh.data=1", "mesh.context=2", "job.model.context_parallel=ring"],
}

if __name__ == "__main__":
    sys.exit(compare(CONFIGS, None, "context", __doc__.split("\n\n")[0]))
