"""Learning-rate schedules by name, all with a linear warmup from 0 to the peak.

Every builder has the signature ``(peak_lr, total_steps, warmup_steps, final_lr, **extra)``
and returns an ``optax.Schedule``. Schedule-specific options are keyword-only parameters of
the builder, so `build_schedule` can reject unknown ``schedule.<key>`` entries by name.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import optax

from runner.errors import ConfigError
from runner.registry import Registry

ScheduleBuilder = Callable[..., optax.Schedule]

SCHEDULES: Registry[ScheduleBuilder] = Registry("schedule", "schedule.name")

DECAY_SHAPES = ("linear", "cosine", "sqrt")


def _with_warmup(peak_lr: float, warmup_steps: int, after: optax.Schedule) -> optax.Schedule:
    """Linear 0 -> peak over ``warmup_steps``, then ``after`` (which counts from the warmup's end)."""
    if warmup_steps <= 0:
        return after
    warmup = optax.linear_schedule(0.0, peak_lr, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def _decay(shape: str, peak_lr: float, final_lr: float, steps: int) -> optax.Schedule:
    """Peak -> final over ``steps``; a zero-length decay holds the peak (nothing left to decay)."""
    if steps <= 0:
        return optax.constant_schedule(peak_lr)
    if shape == "linear":
        return optax.linear_schedule(peak_lr, final_lr, steps)
    if shape == "cosine":
        return optax.cosine_decay_schedule(peak_lr, steps, alpha=final_lr / peak_lr)
    if shape == "sqrt":
        # "1 - sqrt" cooldown (Hägele et al. 2024); optax has no built-in for it.
        def sqrt_decay(step: Any) -> Any:
            progress = jnp.clip(jnp.asarray(step, jnp.float32) / steps, 0.0, 1.0)
            return final_lr + (peak_lr - final_lr) * (1.0 - jnp.sqrt(progress))

        return sqrt_decay
    raise ConfigError("schedule.decay_shape", shape, "unknown decay shape.",
                      f"use one of: {', '.join(DECAY_SHAPES)}.")


@SCHEDULES.register("constant")
def constant(peak_lr: float, total_steps: int, warmup_steps: int, final_lr: float) -> optax.Schedule:
    """Warmup, then the peak forever; ``final_lr`` is ignored."""
    # Not optax.warmup_constant_schedule: with warmup_steps=0 it holds its init value (0).
    return _with_warmup(peak_lr, warmup_steps, optax.constant_schedule(peak_lr))


@SCHEDULES.register("cosine")
def cosine(peak_lr: float, total_steps: int, warmup_steps: int, final_lr: float) -> optax.Schedule:
    """Warmup, then a half cosine from the peak to ``final_lr`` at ``total_steps``."""
    return _with_warmup(peak_lr, warmup_steps, _decay("cosine", peak_lr, final_lr, total_steps - warmup_steps))


@SCHEDULES.register("linear")
def linear(peak_lr: float, total_steps: int, warmup_steps: int, final_lr: float) -> optax.Schedule:
    """Warmup, then a straight line from the peak to ``final_lr`` at ``total_steps``."""
    return _with_warmup(peak_lr, warmup_steps, _decay("linear", peak_lr, final_lr, total_steps - warmup_steps))


@SCHEDULES.register("wsd")
def wsd(
    peak_lr: float, total_steps: int, warmup_steps: int, final_lr: float, *,
    decay_fraction: float = 0.2, decay_shape: str = "linear",
) -> optax.Schedule:
    """Warmup-stable-decay: hold the peak, then decay over the last ``decay_fraction`` of the run.

    The flat middle lets a run be extended (or branched into a cooldown) without replanning.
    """
    if isinstance(decay_fraction, bool) or not isinstance(decay_fraction, (int, float)) \
            or not 0.0 <= decay_fraction <= 1.0:
        raise ConfigError("schedule.decay_fraction", decay_fraction, "must be a number in [0, 1].",
                          "set it to the fraction of total steps spent decaying, e.g. 0.2.")
    if decay_shape not in DECAY_SHAPES:
        raise ConfigError("schedule.decay_shape", decay_shape, "unknown decay shape.",
                          f"use one of: {', '.join(DECAY_SHAPES)}.")
    decay_steps = int(round(decay_fraction * total_steps))
    if decay_steps > total_steps - warmup_steps:
        raise ConfigError(
            "schedule.decay_fraction", decay_fraction,
            f"the decay ({decay_steps} steps) overlaps the warmup ({warmup_steps} of {total_steps} steps).",
            f"use a decay_fraction <= {(total_steps - warmup_steps) / total_steps:.4g} or fewer warmup steps.",
        )
    stable = optax.constant_schedule(peak_lr)
    decay = _decay(decay_shape, peak_lr, final_lr, decay_steps)
    after_warmup = optax.join_schedules([stable, decay], [total_steps - warmup_steps - decay_steps])
    return _with_warmup(peak_lr, warmup_steps, after_warmup)


@SCHEDULES.register("inverse_sqrt")
def inverse_sqrt(
    peak_lr: float, total_steps: int, warmup_steps: int, final_lr: float, *,
    timescale: int | None = None,
) -> optax.Schedule:
    """Warmup, then ``peak * sqrt(timescale / step)``, floored at ``final_lr``.

    ``timescale`` defaults to ``warmup_steps`` (so the curve is continuous at the warmup's end),
    or to 1000 without warmup, holding the peak until then. It never reaches zero, so runs can
    be extended; ``total_steps`` is not used.
    """
    if timescale is None:
        timescale = warmup_steps if warmup_steps > 0 else 1000
    if isinstance(timescale, bool) or not isinstance(timescale, int) or timescale <= 0:
        raise ConfigError("schedule.timescale", timescale, "must be a positive integer.",
                          "set it to the step at which the 1/sqrt decay starts, e.g. 1000.")

    def decay(step_after_warmup: Any) -> Any:
        step = jnp.asarray(step_after_warmup, jnp.float32) + warmup_steps
        return jnp.maximum(peak_lr * jnp.sqrt(timescale / jnp.maximum(step, timescale)), final_lr)

    return _with_warmup(peak_lr, warmup_steps, decay)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_extra(builder: ScheduleBuilder, extra: Mapping[str, Any]) -> None:
    """Unknown extras are typos more often than not: reject them by name."""
    params = inspect.signature(builder).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for key, value in extra.items():
        if key not in accepted:
            raise ConfigError(
                f"schedule.{key}", value, "this schedule has no such option.",
                f"remove it, or use one of: {', '.join(accepted)}." if accepted
                else "remove it; this schedule takes no extra options.",
            )


def build_schedule(
    name: str,
    peak_lr: float,
    total_steps: int,
    warmup_steps: int,
    final_lr: float = 0.0,
    extra: Mapping[str, Any] = {},  # noqa: B006 -- read-only
) -> optax.Schedule:
    """Validate the common settings, then build the schedule registered as ``name``."""
    if not isinstance(name, str):
        raise ConfigError("schedule.name", name, "the schedule name must be a string.",
                          f"use one of: {', '.join(SCHEDULES.names())}.")
    if not _is_number(peak_lr) or peak_lr <= 0:
        raise ConfigError("schedule.peak_lr", peak_lr, "the peak learning rate must be a number > 0.",
                          "set a positive learning rate, e.g. 3e-4.")
    if not _is_number(final_lr) or not 0 <= final_lr <= peak_lr:
        raise ConfigError("schedule.final_lr", final_lr, f"must be a number in [0, peak_lr={peak_lr}].",
                          "set it to 0, or to a fraction of the peak such as 0.1 * peak_lr.")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
        raise ConfigError("schedule.total_steps", total_steps, "must be a positive integer.",
                          "set the number of training steps.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError("schedule.warmup_steps", warmup_steps, "must be an integer >= 0.",
                          "set it to 0 for no warmup, or a few percent of total_steps.")
    if warmup_steps > total_steps:
        raise ConfigError("schedule.warmup_steps", warmup_steps,
                          f"the warmup is longer than the run (total_steps={total_steps}).",
                          f"use at most {total_steps} warmup steps.")
    builder = SCHEDULES.get(name)
    _check_extra(builder, extra)
    return builder(peak_lr, total_steps, warmup_steps, final_lr, **extra)
