"""Numerical guards and the loss-spike detector, inside the compiled step: no host synchronisation.

A step whose loss or gradient norm is not finite, or (guard.spike other than off) is a spike, does
not change the parameters or the optimizer state; the step counter still advances, so the data
and PRNG positions move on. A spike is a loss (guard.spike_on=loss, the default), a gradient
norm (grad_norm) or either of them (either: OLMo-core's and MaxText's rule) above the band of its
rolling window: the mean plus `spike_sigma` standard deviations of the last `spike_window` healthy
steps' values, judged once `spike_warmup` healthy steps were seen (128 steps and 6 sigma by
default, as theirs). The window and the rule's count of recent spikes live in the train
state (`TrainState.guard`), so they are checkpointed and a resumed or rewound run judges exactly as
the run that was not interrupted.

The rule: `spike_count` spikes within `spike_within` steps of the first of them fire it (1 and 1:
every spike). The host learns of a step's flags when it reads its metrics (one step late) and
applies the policies: `GuardMonitor` says when the run must stop; a rule that fires under
guard.spike=rewind is runner.train.rewind's to act on.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from runner.errors import ConfigError, UserError
from runner.exits import TrainingHalted
from runner.spec import GuardSpec


def initial_guard_state(window: int = 128) -> dict[str, jax.Array]:
    """An empty window of `window` steps' losses and gradient norms, and no open run of spikes."""
    zeros, zero = jnp.zeros((window,), jnp.float32), jnp.zeros((), jnp.int32)
    return {"losses": zeros, "grad_norms": zeros, "count": zero, "first_spike": zero, "spikes": zero}


def band(values: jax.Array, count: jax.Array, sigma: float) -> jax.Array:
    """The top of the band over the first min(count, len(values)) entries: mean + sigma * std."""
    n = jnp.minimum(count, values.shape[0])
    valid = jnp.arange(values.shape[0]) < n
    denom = jnp.maximum(n, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / denom
    var = jnp.sum(jnp.where(valid, jnp.square(values - mean), 0.0)) / denom
    return mean + sigma * jnp.sqrt(var)


def guard_update(spec: GuardSpec, old: Any, new: Any, loss: jax.Array, grad_norm: jax.Array,
                 step: Optional[jax.Array] = None) -> tuple[Any, dict[str, jax.Array]]:
    """Keep `new` (a TrainState) if step `step` (1-based; by default old's step + 1) is healthy,
    else `old`'s parameters, optimizer and model state with `new`'s step counter. Returns (state,
    flags): "skipped", "nonfinite", "spike", and with guard.spike on also "spike_fire" (the rule
    fired at this step), "spike_first" (the step of the first spike the rule counted) and the
    bands' tops ("loss_band", "grad_norm_band")."""
    g = old.guard
    step = jnp.asarray(old.step + 1 if step is None else step, jnp.int32)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    count = g["count"]
    loss_band, grad_band = band(g["losses"], count, spec.spike_sigma), band(g["grad_norms"], count, spec.spike_sigma)
    if spec.spike != "off":
        high = {"loss": loss > loss_band, "grad_norm": grad_norm > grad_band}
        judged = (high["loss"] | high["grad_norm"]) if spec.spike_on == "either" else high[spec.spike_on]
        spike = finite & (count >= spec.spike_warmup) & judged
    else:
        spike = jnp.zeros((), bool)
    ok = (finite if spec.nonfinite != "off" else True) & ~spike
    healthy = ok & finite  # what enters the window
    slot = count % g["losses"].shape[0]
    losses = jnp.where(healthy, g["losses"].at[slot].set(loss.astype(jnp.float32)), g["losses"])
    grad_norms = jnp.where(healthy, g["grad_norms"].at[slot].set(grad_norm.astype(jnp.float32)), g["grad_norms"])
    # the rule: spikes counted from the first one until spike_within steps have passed
    expired = (g["first_spike"] > 0) & (step - g["first_spike"] >= spec.spike_within)
    first = jnp.where(expired, 0, g["first_spike"])
    first = jnp.where(spike & (first == 0), step, first)
    spikes = jnp.where(expired, 0, g["spikes"]) + spike.astype(jnp.int32)
    fire = spike & (spikes >= spec.spike_count)
    guard = {"losses": losses, "grad_norms": grad_norms, "count": jnp.where(healthy, count + 1, count),
             "first_spike": jnp.where(fire, 0, first), "spikes": jnp.where(fire, 0, spikes)}
    keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(ok, x, y), a, b)  # noqa: E731
    kept = {"model_state": keep(new.model_state, old.model_state)} if getattr(new, "model_state", None) else {}
    state = new.replace(params=keep(new.params, old.params), opt_state=keep(new.opt_state, old.opt_state),
                        guard=guard, **kept)
    flags = {"skipped": (~ok).astype(jnp.float32), "nonfinite": (~finite).astype(jnp.float32),
             "spike": spike.astype(jnp.float32)}
    if spec.spike != "off":
        flags.update({"spike_fire": fire.astype(jnp.float32), "spike_first": first.astype(jnp.float32),
                      "loss_band": loss_band, "grad_norm_band": grad_band})
    return state, flags


class GuardMonitor:
    """Host side: counts consecutive skipped steps and says when the policies want a stop (a
    non-finite step under guard.nonfinite=stop; the spike rule under guard.spike=stop; too many
    skips in a row)."""

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
        if self.spec.spike == "stop" and values.get("spike_fire"):
            return (f"{spike_words(self.spec, step, values)}; the update was not applied "
                    f"(guard.spike=stop)")
        if self.consecutive > self.spec.max_consecutive_skips:
            return (f"{self.consecutive} consecutive steps skipped for {what}, more than "
                    f"guard.max_consecutive_skips={self.spec.max_consecutive_skips}")
        return None

    def rewound(self) -> None:
        """The run went back to a checkpoint: the steps counted here are undone."""
        self.consecutive = 0


def spike_words(spec: GuardSpec, step: int, values: dict[str, float]) -> str:
    """The spike rule's firing, in words: the step, the figures and the band."""
    first = int(values.get("spike_first") or step)
    rule = "" if spec.spike_count == 1 else \
        f" ({spec.spike_count} spikes within {spec.spike_within} steps from step {first})"
    shown = lambda key: f"{values[key]:.4g}" if key in values else "?"  # noqa: E731
    return (f"a loss spike at step {step}{rule}: loss {shown('loss')} (band top {shown('loss_band')}), grad norm "
            f"{shown('grad_norm')} (band top {shown('grad_norm_band')}), over the last {spec.spike_window} healthy "
            f"steps at {spec.spike_sigma:g} sigma")


def check_saved(saved: Any, spec: GuardSpec, where: Any) -> None:
    """Refuse a checkpoint whose guard state this run cannot restore: one written before the spike
    window existed, or with another guard.spike_window (the window's length is its shape)."""
    guard = ((saved or {}).get("spec") or {}).get("guard") or {}
    if guard and "spike" not in guard:
        raise UserError(
            f"The checkpoint in {where} was written by a runner whose numerical guard kept a moving average "
            "(guard.spike_factor), not the spike window this one keeps in the train state, so its state cannot "
            "be restored. Fix: finish that run with the runner that wrote it, or start a new run from its "
            "parameters: run.init_from=<its run dir> run.init_mode=params (docs/spikes.md, Migrating).")
    window = guard.get("spike_window")
    if window is not None and window != spec.spike_window:
        raise ConfigError("guard.spike_window", spec.spike_window,
                          f"the run's checkpoints in {where} keep a spike window of {window} steps, and its length "
                          "is part of the train state.", f"keep guard.spike_window={window} for this run.")


def halted(reason: str, spec: GuardSpec, step: int, saved_in: Any, logger: Any) -> TrainingHalted:
    """A guard's halt, once the last good state is saved: the logger's ending marked, and the
    exception that exits with runner.exits.HALTED_EXIT_CODE (65: never restarted by a supervisor), with
    the fix (the reason's own when it has one)."""
    logger.ending(TrainingHalted.exit_code)
    fix = "" if "Fix:" in reason else (
        " Fix: lower optimizer.lr or tighten optimizer.clip_norm, or set guard.nonfinite=skip to step over bad "
        "batches (guard.spike=rewind to rewind past spikes); then rerun the same command.")
    return TrainingHalted(f"Training stopped at step {step}: {reason} (guard.nonfinite={spec.nonfinite}, guard.spike="
                          f"{spec.spike}). The last good state is saved in {saved_in}.{fix}")
