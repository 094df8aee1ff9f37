"""Held-out loss, perplexity, bits per byte and next-token accuracy on each validation source.

The evaluated windows are the first `eval.rows` of each source's validation split: the same
ones at every evaluation and after a resume, whatever the topology.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np

from runner.evaluation.base import EVALUATORS
from runner.spec import ExecutionSpec


@EVALUATORS.register("heldout")
class HeldOutLoss:
    name = "heldout"

    def __init__(self, spec: ExecutionSpec) -> None:
        self.spec = spec
        self._batches: dict[str, list[dict[str, np.ndarray]]] | None = None

    def _prepare(self, trainer: Any) -> dict[str, list[dict[str, np.ndarray]]]:
        """Validation rows per source, padded (mask 0) to whole eval batches; this process's rows."""
        rows, batch = self.spec.eval.rows, self.spec.eval.batch_size
        procs, me = jax.process_count(), jax.process_index()
        per_proc = batch // procs
        out: dict[str, list[dict[str, np.ndarray]]] = {}
        for source, dataset in trainer.strategy.validation(self.spec.train.seq_len, rows).items():
            examples = [dataset[i] for i in range(min(rows, len(dataset)))]
            if not examples:
                continue
            pad = -len(examples) % batch
            blank = {k: np.zeros_like(v) for k, v in examples[0].items()}
            examples += [blank] * pad
            batches = []
            for start in range(0, len(examples), batch):
                mine = examples[start + me * per_proc: start + (me + 1) * per_proc]
                batches.append({k: np.stack([e[k] for e in mine])[None] for k in ("x", "y", "mask")})
            out[source] = batches
        return out

    def evaluate(self, trainer: Any, state: Any) -> Mapping[str, float]:
        if self._batches is None:
            self._batches = self._prepare(trainer)
        val_step = trainer.compiled_val_step()
        # With the byte-level tokenizer one token is one byte, so bits per token are bits per byte.
        unit = "byte" if getattr(trainer.strategy, "tokenizer", None) == "byte" else "token"
        results: dict[str, float] = {}
        totals = [0.0, 0.0, 0.0]
        for source, batches in self._batches.items():
            loss_sum, count, correct = 0.0, 0.0, 0.0
            for local in batches:
                s, c, meta = jax.device_get(val_step(state, trainer.to_device(local)))
                loss_sum, count, correct = loss_sum + float(s), count + float(c), correct + float(meta["correct"])
            for i, v in enumerate((loss_sum, count, correct)):
                totals[i] += v
            results.update(_metrics(f"{source}/", loss_sum, count, correct, unit))
        if len(self._batches) > 1:  # all sources together, weighted by their token counts
            results.update(_metrics("all/", *totals, unit))
        return results


def _metrics(prefix: str, loss_sum: float, count: float, correct: float, unit: str) -> dict[str, float]:
    loss = loss_sum / max(count, 1.0)
    return {
        f"{prefix}loss": loss,
        f"{prefix}perplexity": math.exp(min(loss, 50.0)),
        f"{prefix}bits_per_{unit}": loss / math.log(2),
        f"{prefix}accuracy": correct / max(count, 1.0),
    }
