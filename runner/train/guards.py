"""Numerical guards, inside the compiled step so they cost no host synchronisation.

A step whose loss or gradient norm is not finite, or (optionally) whose loss exceeds
`spike_factor` times a rolling mean of recent losses, does not change the parameters or the
optimizer state; the step counter still advances, so the data and PRNG positions move on.
The host learns of it when it reads the step's metrics (one step late) and applies the policy:
`stop` (save the last good state and stop) or `skip` (continue, up to `max_consecutive_skips`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from runner.spec import GuardSpec


def initial_guard_state() -> dict[str, jax.Array]:
    return {"loss_ema": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.int32)}


def guard_update(spec: GuardSpec, old: Any, new: Any, loss: jax.Array,
                 grad_norm: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
    """Keep `new` (a TrainState) if the step is healthy, else `old`'s parameters and optimizer
    state with `new`'s step counter. Returns (state, {"skipped", "nonfinite", "spike"})."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ema, count = old.guard["loss_ema"], old.guard["count"]
    if spec.spike_factor > 0:
        spike = finite & (count >= spec.spike_warmup) & (loss > spec.spike_factor * ema)
    else:
        spike = jnp.zeros((), bool)
    ok = finite & ~spike if spec.nonfinite != "off" else ~spike
    decay = 1.0 - 1.0 / spec.spike_window
    new_ema = jnp.where(count == 0, loss, decay * ema + (1.0 - decay) * loss)
    guard = {"loss_ema": jnp.where(ok, new_ema, ema).astype(jnp.float32),
             "count": jnp.where(ok, count + 1, count)}
    keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(ok, x, y), a, b)  # noqa: E731
    kept = {"model_state": keep(new.model_state, old.model_state)} if getattr(new, "model_state", None) else {}
    state = new.replace(params=keep(new.params, old.params), opt_state=keep(new.opt_state, old.opt_state),
                        guard=guard, **kept)
    return state, {"skipped": (~ok).astype(jnp.float32), "nonfinite": (~finite).astype(jnp.float32),
                   "spike": spike.astype(jnp.float32)}


class GuardMonitor:
    """Host side: counts consecutive skipped steps and says when the policy wants a stop."""

    def __init__(self, spec: GuardSpec) -> None:
        self.spec = spec
        self.consecutive = 0
        self.total = 0

    def observe(self, step: int, values: dict[str, float]) -> str | None:
        """A reason to stop, or None."""
        if not values.get("skipped"):
            self.consecutive = 0
            return None
        self.consecutive += 1
        self.total += 1
        what = "a non-finite loss or gradient norm" if values.get("nonfinite") else "a loss spike"
        if self.spec.nonfinite == "stop" and values.get("nonfinite"):
            return (f"{what} at step {step} (loss {values.get('loss')}, grad norm {values.get('grad_norm')}); "
                    "the update was not applied")
        if self.consecutive > self.spec.max_consecutive_skips:
            return (f"{self.consecutive} consecutive steps skipped for {what}, more than "
                    f"guard.max_consecutive_skips={self.spec.max_consecutive_skips}")
        return None
