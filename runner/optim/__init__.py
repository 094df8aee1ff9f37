"""Optimizers and learning-rate schedules, chosen by name from the job spec."""

from __future__ import annotations

from typing import Any

from runner.optim.optimizers import OPTIMIZERS, OptimizerSettings, build_optimizer, decay_mask
from runner.optim.schedules import SCHEDULES, build_schedule
from runner.spec import ExecutionSpec

__all__ = ["OPTIMIZERS", "SCHEDULES", "OptimizerSettings", "build_optimizer", "build_schedule", "check_spec",
           "decay_mask", "optimizer_settings", "schedule_extra"]


def schedule_extra(spec: ExecutionSpec) -> dict[str, Any]:
    """Schedule settings that only some schedules take."""
    return {"decay_fraction": spec.schedule.decay_fraction} if spec.schedule.name == "wsd" else {}


def optimizer_settings(spec: ExecutionSpec) -> OptimizerSettings:
    o = spec.optimizer
    return OptimizerSettings(weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                             momentum=o.momentum, nesterov=o.nesterov)


def check_spec(spec: ExecutionSpec) -> None:
    """The optimizer and schedule sections: the names exist and build with these settings."""
    o, s, t = spec.optimizer, spec.schedule, spec.train
    if not isinstance(o.name, str) or o.name not in OPTIMIZERS and not OPTIMIZERS.is_import_path(o.name):
        OPTIMIZERS.get(o.name)
    schedule = build_schedule(s.name, o.lr, t.steps, min(s.warmup_steps, t.steps),
                              o.lr * s.final_lr_fraction, schedule_extra(spec))
    build_optimizer(o.name, schedule, optimizer_settings(spec), o.clip_norm, o.state_dtype)
