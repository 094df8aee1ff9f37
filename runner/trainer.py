"""The public path of the seed API: `from runner.trainer import BaseTrainer` (the code lives in
runner.train.trainer)."""

from runner.train.trainer import BaseTrainer, Preempted, TrainingHalted, TrainState

__all__ = ["BaseTrainer", "TrainState", "Preempted", "TrainingHalted"]
