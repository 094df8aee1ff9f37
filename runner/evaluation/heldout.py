"""Held-out loss, perplexity, bits per byte and next-token accuracy on each validation source.

The evaluated windows are the first `rows` (the evaluator's own, else `eval.rows`) of each
source's validation split: the same ones at every evaluation and after a resume, whatever the
topology. Metric names are `<source>/loss` etc. (with the evaluator's label in front if it has
one), plus `all/...` over every source, weighted by token count, when there are several.

Bits per byte need the bytes behind each token. With the byte tokenizer that is 1 (an
end-of-document token counts as one byte); a dataset strategy with another tokenizer can say
so with a `bytes_per_token` attribute (a float, or {source: float}). Without either, the
metric is `bits_per_token` instead, so a number is never mislabelled.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import jax
import numpy as np

from runner.evaluation.base import EVALUATORS, EvaluatorBase, process_batches
from runner.spec import EvaluatorSpec, ExecutionSpec


@EVALUATORS.register("heldout")
class HeldOutLoss(EvaluatorBase):
    """Held-out loss, perplexity, bits per byte and next-token accuracy on each validation source."""

    name = "heldout"
    metrics = ("*/loss", "*/perplexity", "*/accuracy", "*/bits_per_byte", "*/bits_per_token")

    @classmethod
    def metric_patterns(cls, settings: EvaluatorSpec, spec: ExecutionSpec) -> tuple[str, ...] | None:
        """Per validation source (by name) of a mixture, and `all` when there are several."""
        patterns = super().metric_patterns(settings, spec) or ()
        if spec.data.strategy != "mixture":
            return patterns
        from runner.data.store import TokenStore

        names = []
        for source in spec.data.sources:
            if source.name or source.path in ("", "default"):
                names.append(source.name or "stdlib")
                continue
            try:
                names.append(TokenStore.open(source.path).name)
            except Exception:  # the data check reports a bad store; here it only widens the patterns
                return patterns
        if len(names) > 1:
            names.append("all")
        return tuple(p.replace("*/", f"{name}/", 1) for p in patterns for name in names)

    def __init__(self, spec: ExecutionSpec, settings: Optional[EvaluatorSpec] = None) -> None:
        super().__init__(spec, settings)
        self._batches: dict[str, list[dict[str, np.ndarray]]] | None = None

    def prepare(self, context: Any) -> None:
        """Validation rows per source, padded (mask 0) to whole eval batches; this process's rows."""
        if self._batches is not None:
            return
        out: dict[str, list[dict[str, np.ndarray]]] = {}
        for source, dataset in context.strategy.validation(self.spec.train.seq_len, self.rows).items():
            examples = [dataset[i] for i in range(min(self.rows, len(dataset)))]
            if examples:
                out[source] = [{k: v[None] for k, v in b.items()}  # one micro-batch: (1, B, T)
                               for b in process_batches([{k: e[k] for k in ("x", "y", "mask")} for e in examples],
                                                        self.spec.eval.batch_size)]
        self._batches = out

    def evaluate(self, context: Any, state: Any) -> Mapping[str, float]:
        self.prepare(context)
        assert self._batches is not None
        bytes_per_token = _bytes_per_token(context.strategy)
        results: dict[str, float] = {}
        totals = np.zeros(4)  # nats, tokens, correct, bytes
        for source, batches in self._batches.items():
            loss_sum, count, correct = 0.0, 0.0, 0.0
            for local in batches:
                s, c, meta = jax.device_get(context.val_step(state, context.to_device(local)))
                loss_sum, count, correct = loss_sum + float(s), count + float(c), correct + float(meta["correct"])
            ratio = bytes_per_token(source)
            nbytes = float("nan") if ratio is None else count * ratio
            totals += (loss_sum, count, correct, nbytes)
            results.update(heldout_metrics(self.key(source), loss_sum, count, correct, nbytes))
        if len(self._batches) > 1:  # all sources together, weighted by their token counts
            results.update(heldout_metrics(self.key("all"), *totals))
        return results


def _bytes_per_token(strategy: Any) -> Any:
    """source -> bytes per token, or None when unknown."""
    declared = getattr(strategy, "bytes_per_token", None)
    if declared is None and getattr(strategy, "tokenizer", None) == "byte":
        declared = 1.0
    if isinstance(declared, Mapping):
        return lambda source: declared.get(source)
    return lambda source: declared


def heldout_metrics(prefix: str, loss_sum: float, count: float, correct: float, nbytes: float) -> dict[str, float]:
    """Mean loss (nats per token), perplexity, bits per byte (bits per token when the byte count
    is NaN, i.e. unknown) and next-token accuracy, from sums over the evaluated tokens."""
    loss = loss_sum / max(count, 1.0)
    out = {
        f"{prefix}/loss": loss,
        f"{prefix}/perplexity": math.exp(min(loss, 50.0)),
        f"{prefix}/accuracy": correct / max(count, 1.0),
    }
    if math.isnan(nbytes):
        out[f"{prefix}/bits_per_token"] = loss / math.log(2)
    else:
        out[f"{prefix}/bits_per_byte"] = loss_sum / math.log(2) / max(nbytes, 1e-12)
    return out
