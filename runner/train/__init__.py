"""The training spine: the job template, BaseTrainer, the step loop and the components that act
at their own cadence (metrics, evaluation, checkpoints, stops), the pure steps and the state."""
