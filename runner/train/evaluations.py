"""A training job's evaluations: its evaluators prepared before the loop and run on the current
state (at their cadence, runner.train.hooks.Evaluation, and once the loop ends), with what every
evaluation touches around it, as `Checkpointing.saving` does for a save: the callbacks'
on_eval_start / on_eval_end, the watchdog, goodput, the metrics log and the best-K policy."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from runner.evaluation.base import prepare_all, run_all


class Evaluations:
    """The evaluations of one job (a BaseTrainer), and the newest results and texts they made."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.last: dict[str, float] = {}  # every evaluator's newest metrics, as `eval/<name>`
        self.texts: dict[str, str] = {}  # the text the latest evaluation made (samples)

    def prepare(self) -> None:
        """Each evaluator loads and checks its data now, so a bad file stops the job before training."""
        with self.job.program.context():
            prepare_all(self.job.evaluators, self.job.eval_context())

    def run(self, only: Optional[Sequence[Any]] = None) -> dict[str, float]:
        """The evaluators (or `only` these) on the job's current state."""
        job = self.job
        with job.program.context():
            results, self.texts = run_all(job.evaluators if only is None else only, job.eval_context(), job.state)
        self.last = {**self.last, **results}
        return results

    def log(self, only: Optional[Sequence[Any]] = None) -> None:
        """Evaluate (through the job's `evaluate`, which a job may override); log metrics and texts
        (metrics.jsonl strings, a wandb table); tell the checkpoint policy (best-K)."""
        job, step = self.job, self.job.step
        assert job.logger is not None
        job.callbacks.dispatch("on_eval_start", step=step)
        with job.watching("eval", step), job.goodput.timing("eval"):
            results = job.evaluate(only)
        job.callbacks.dispatch("on_eval_end", step=step, results=results)
        job.logger.log_eval(step, results, self.texts)
        job.checkpoints.note_evaluation(step, results, complete=only is None)
