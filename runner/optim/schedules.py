"""Learning-rate schedules by name, all with a linear warmup from 0 to the peak.

Every builder has the signature ``(peak_lr, total_steps, warmup_steps, final_lr, **extra)``
and returns an ``optax.Schedule``. Schedule-specific options are keyword-only parameters of
the builder, so `build_schedule` can reject unknown ``schedule.<key>`` entries by name.

The built-in ones return a `Schedule`: its lengths (warmup, decay, the stable phase: all derived
from train.steps) are values the train step takes as arguments, not constants compiled into it,
so runs that differ only in length (or a finished run extended) share one compiled step. A
builder may return any other optax schedule; its constants are then compiled into the step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
import optax

from runner.errors import ConfigError
from runner.registry import Registry

ScheduleBuilder = Callable[..., optax.Schedule]

SCHEDULES: Registry[ScheduleBuilder] = Registry("schedule", "schedule.name")

DECAY_SHAPES = ("linear", "cosine", "sqrt")

Values = Mapping[str, Any]  # a schedule's lengths by name: Python numbers, or the train step's arguments
Formula = Callable[[Any, Values], Any]  # (step, values) -> learning rate


class Schedule:
    """An optax schedule, ``schedule(step)``, whose length-dependent constants are named `values`
    (Python ints and floats) that `at` takes from elsewhere: the train step passes them as weakly
    typed scalar arguments, so they promote as the Python numbers do, and one program serves runs of
    any length.

    The formulas are optax's (linear_schedule, cosine_decay_schedule, join_schedules), written so
    that both give the same bits under jit: XLA turns a division by a constant into a
    multiplication by its float32 reciprocal, so a division by a length is written as that
    multiplication, by a reciprocal computed here (`_length`). Which phases there are (a warmup,
    steps left to decay) is part of the formula: a run shorter than its warmup compiles its own."""

    def __init__(self, formula: Formula, values: Mapping[str, int | float]) -> None:
        self.formula, self.values = formula, dict(values)

    def __call__(self, step: Any) -> Any:
        return self.formula(step, self.values)

    def at(self, values: Values) -> optax.Schedule:
        """This schedule, reading its lengths from `values` (named as `self.values`)."""
        return lambda step: self.formula(step, values)


def values_of(schedule: optax.Schedule) -> dict[str, int | float]:
    """What the train step passes a schedule: its values, or nothing for a schedule of constants."""
    return dict(schedule.values) if isinstance(schedule, Schedule) else {}


def at(schedule: optax.Schedule, values: Values) -> optax.Schedule:
    """`schedule` reading its lengths from `values` (a schedule of constants as it is)."""
    return schedule.at(values) if isinstance(schedule, Schedule) else schedule


def _length(name: str, steps: int) -> dict[str, int | float]:
    """One length as a formula reads it: ``name`` (the count), ``name:float`` (it as a float, as optax's
    cosine converts it) and ``1/name`` (the float32 reciprocal XLA multiplies by for ``/ steps``)."""
    return {name: steps, f"{name}:float": float(steps),
            f"1/{name}": float(np.float32(1) / np.float32(steps)) if steps > 0 else 0.0}


def _constant(value: float) -> Schedule:
    return Schedule(lambda step, v: value, {})  # optax.constant_schedule


def _linear(init: float, end: float, name: str, steps: int) -> Schedule:
    """optax.linear_schedule(init, end, steps) for steps > 0 (held at ``init`` otherwise, as optax does)."""
    if steps <= 0:
        return _constant(init)

    def formula(count: Any, v: Values) -> Any:
        count = jnp.clip(count, 0, v[name])
        frac = 1 - count.astype(jnp.float32) * v[f"1/{name}"]  # optax: 1 - count / steps
        return (init - end) * frac + end

    return Schedule(formula, _length(name, steps))


def _joined(first: Schedule, then: Schedule, name: str, boundary: int) -> Schedule:
    """optax.join_schedules([first, then], [boundary]): `then` counts from the boundary."""

    def formula(step: Any, v: Values) -> Any:
        return jnp.where(step < v[name], first.formula(step, v), then.formula(step - v[name], v))

    return Schedule(formula, {**first.values, **then.values, name: boundary})


def _with_warmup(peak_lr: float, warmup_steps: int, after: Schedule) -> Schedule:
    """Linear 0 -> peak over ``warmup_steps``, then ``after`` (which counts from the warmup's end)."""
    if warmup_steps <= 0:
        return after
    return _joined(_linear(0.0, peak_lr, "warmup", warmup_steps), after, "warmup", warmup_steps)


def _decay(shape: str, peak_lr: float, final_lr: float, steps: int) -> Schedule:
    """Peak -> final over ``steps``; a zero-length decay holds the peak (nothing left to decay)."""
    if steps <= 0:
        return _constant(peak_lr)
    if shape == "linear":
        return _linear(peak_lr, final_lr, "decay", steps)
    if shape == "cosine":
        alpha, exponent = final_lr / peak_lr, 1.0

        def cosine_decay(count: Any, v: Values) -> Any:  # optax.cosine_decay_schedule(peak_lr, steps, alpha)
            count = jnp.minimum(count, v["decay:float"])
            cosine = 0.5 * (1 + jnp.cos(jnp.pi * count * v["1/decay"]))  # optax: jnp.pi * count / steps
            return peak_lr * ((1 - alpha) * cosine**exponent + alpha)

        return Schedule(cosine_decay, _length("decay", steps))
    if shape == "sqrt":
        # "1 - sqrt" cooldown (Hägele et al. 2024); optax has no built-in for it.
        def sqrt_decay(step: Any, v: Values) -> Any:
            progress = jnp.clip(jnp.asarray(step, jnp.float32) * v["1/decay"], 0.0, 1.0)  # step / steps
            return final_lr + (peak_lr - final_lr) * (1.0 - jnp.sqrt(progress))

        return Schedule(sqrt_decay, _length("decay", steps))
    raise ConfigError("schedule.decay_shape", shape, "unknown decay shape.",
                      f"use one of: {', '.join(DECAY_SHAPES)}.")


@SCHEDULES.register("constant")
def constant(peak_lr: float, total_steps: int, warmup_steps: int, final_lr: float) -> optax.Schedule:
    """Warmup, then the peak forever; ``final_lr`` is ignored."""
    # Not optax.warmup_constant_schedule: with warmup_steps=0 it holds its init value (0).
    return _with_warmup(peak_lr, warmup_steps, _constant(peak_lr))


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
    decay = _decay(decay_shape, peak_lr, final_lr, decay_steps)
    after_warmup = _joined(_constant(peak_lr), decay, "stable", total_steps - warmup_steps - decay_steps)
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

    def decay(step_after_warmup: Any, v: Values) -> Any:
        step = jnp.asarray(step_after_warmup, jnp.float32) + v["warmup"]
        return jnp.maximum(peak_lr * jnp.sqrt(v["timescale"] / jnp.maximum(step, v["timescale"])), final_lr)

    return _with_warmup(peak_lr, warmup_steps, Schedule(decay, {"warmup": warmup_steps, "timescale": timescale}))


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
