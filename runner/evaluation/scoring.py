"""Log-likelihood of a continuation given a context, batched over the mesh.

The one scoring path behind `multiple_choice` and the lm-evaluation-harness adapter, so both
give the same numbers for the same text. Text becomes tokens by lm-eval's rules
(`encode_pair`); each (context, continuation) pair becomes one right-padded row of
train.seq_len tokens (`pair_row`), cut from the left when it is longer; `Scorer` runs the rows
through the model in fixed-shape batches (one compilation) and returns, per pair, the sum of
the continuation's token log-probabilities and whether greedy decoding would have produced it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from runner.errors import UserError
from runner.evaluation.base import global_batch, process_batches, replicated, to_global

Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


def encode_pair(encode: Callable[[str], Sequence[int]], context: str, continuation: str, prefix_id: int) -> Pair:
    """Tokens of (context, continuation) exactly as lm-eval's causal models make them: trailing
    spaces of the context move to the continuation, the continuation's tokens are those of the
    whole text after the context's, and an empty context is the end-of-document token (unless
    the continuation already starts with it)."""
    if not context:
        cont = [int(t) for t in encode(continuation)]
        return ([prefix_id], cont) if not cont or cont[0] != prefix_id else (cont[:1], cont[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = [int(t) for t in encode(context + continuation)]
    context_ids = [int(t) for t in encode(context)]
    return context_ids, whole[len(context_ids):]


def pair_row(context: Sequence[int], continuation: Sequence[int], seq_len: int) -> dict[str, np.ndarray]:
    """One scored row: inputs, targets and a mask over the continuation's tokens (right-padded;
    the context is cut from the left if both do not fit)."""
    whole = (list(context) + list(continuation))[-(seq_len + 1):]
    x, y = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32)
    mask = np.zeros(seq_len, np.float32)
    n = len(whole) - 1
    x[:n], y[:n] = whole[:-1], whole[1:]
    mask[n - len(continuation): n] = 1.0
    return {"x": x, "y": y, "mask": mask}


def row_scores(state: Any, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row: (sum of log p(target) over its masked tokens, whether every masked target is the
    argmax, the row id)."""
    logits = state.apply_fn(state.variables(), batch["x"], deterministic=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target = jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]
    greedy = jnp.all((jnp.argmax(logp, axis=-1) == batch["y"]) | (batch["mask"] == 0), axis=-1)
    return jnp.sum(target * batch["mask"], axis=-1), greedy, batch["id"]


class Scorer:
    """Scores (context, continuation) token pairs with a state's parameters, `batch_size` rows at
    a time (None: the fewest rows that hold them all and split evenly over the mesh)."""

    def __init__(self, ctx: Any, batch_size: Optional[int] = None, where: str = "") -> None:
        self.ctx = ctx
        self.seq_len = int(ctx.spec.train.seq_len)
        self.batch_size = batch_size
        self.where = where  # names the setting or request in errors
        self._fn: Any = None

    def rows(self, pairs: Sequence[Pair]) -> list[dict[str, np.ndarray]]:
        out = []
        for n, (context, continuation) in enumerate(pairs):
            if not continuation or len(continuation) > self.seq_len:
                raise UserError(
                    f"Continuation {n + 1} of {self.where or 'the requests'} is {len(continuation)} tokens; a scored "
                    f"continuation needs 1 to train.seq_len={self.seq_len} tokens. Fix: shorten it, or evaluate "
                    "with a model trained on longer sequences."
                )
            out.append({**pair_row(context, continuation, self.seq_len), "id": np.int32(n)})
        return out

    def batches(self, pairs: Sequence[Pair]) -> list[dict[str, np.ndarray]]:
        """This process's share of every batch of the pairs' rows (computed once by callers that
        score the same pairs again and again)."""
        rows = self.rows(pairs)
        return process_batches(rows, global_batch(len(rows), self.ctx, self.batch_size))

    def score(self, state: Any, batches: Sequence[Mapping[str, np.ndarray]], count: int) -> tuple[np.ndarray, np.ndarray]:
        """(log-likelihood sums, greedy flags), one per pair, for batches from `batches`."""
        if self._fn is None:
            self._fn = jax.jit(row_scores, out_shardings=replicated(self.ctx))
        sums, greedy = np.zeros(count, np.float64), np.zeros(count, bool)
        for local in batches:
            s, g, ids = jax.device_get(self._fn(state, to_global(self.ctx, local)))
            keep = ids >= 0
            sums[ids[keep]], greedy[ids[keep]] = s[keep], g[keep]
        return sums, greedy
