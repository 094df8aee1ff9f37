"""Optimizers and learning-rate schedules, chosen by name from the job spec."""

from runner.optim.optimizers import OPTIMIZERS, OptimizerSettings, build_optimizer, decay_mask
from runner.optim.schedules import SCHEDULES, build_schedule

__all__ = ["OPTIMIZERS", "SCHEDULES", "OptimizerSettings", "build_optimizer", "build_schedule", "decay_mask"]
