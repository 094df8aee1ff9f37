"""The loop's components: each periodic concern of a run, with the cadence it owns.

    ProfilerWindow  a jax.profiler trace of debug.profile_start .. + debug.profile_steps
    MetricsReport   derived rates, the progress line, metrics.jsonl and wandb every train.log_every
    GuardStop       the numerical guard's policy (guard.*): halts the run
    StopRequests    signals, time limit, launch step limit, stop file (agreed across processes)
    Evaluation      the evaluators, each at its own cadence, plus the start and final evaluations

The checkpoints are a component too (runner.train.checkpointing), and so are the user's hooks
(runner.train.callbacks: the trainer's on_step_start/on_step_end and the configured callbacks).
The order of the list the trainer builds is the order they act in at a step.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import jax

from runner.observability import debug
from runner.observability.metrics import MetricsLogger, Timer
from runner.observability.throughput import Throughput
from runner.spec import ExecutionSpec
from runner.train.guards import GuardMonitor
from runner.train.loop import Component, Loop
from runner.train.stopping import StopConditions


class ProfilerWindow(Component):
    def __init__(self, profiler: debug.Profiler) -> None:
        self.profiler = profiler

    def before_step(self, loop: Loop, step: int) -> None:
        self.profiler.before_step(step, loop.state)

    def end(self, loop: Loop) -> None:
        self.profiler.stop(loop.state)


class MetricsReport(Component):
    """Adds tokens/s (and per device, TFLOP/s per device and MFU: runner.observability.throughput), tokens seen,
    step time and data wait to each step's metrics, and goodput (runner.observability.goodput) to the logged
    ones; updates the progress line; logs every train.log_every steps, the last step and every
    skipped step; logs per-layer norms (and wandb histograms) every debug.norms_every steps."""

    def __init__(self, spec: ExecutionSpec, logger: MetricsLogger, start_step: int,
                 data_wait: Callable[[], float] = lambda: 0.0, warn: Callable[[str], None] = print,
                 clock: Optional[Callable[[], float]] = None, throughput: Optional[Throughput] = None,
                 goodput: Optional[Callable[[], Mapping[str, float]]] = None) -> None:
        self.spec, self.logger, self.data_wait, self.warn = spec, logger, data_wait, warn
        self.throughput, self.goodput = throughput, goodput
        self.tokens_per_step = spec.train.batch_size * spec.train.seq_len
        self.timer = Timer(start_step, spec.train.steps, **({"clock": clock} if clock else {}))
        self.last: dict[str, float] = {}

    def rewound(self, loop: Loop, step: int) -> None:
        """The restore is no step: the rates start again from the step the run went back to."""
        self.timer = Timer(step, self.spec.train.steps, self.timer.clock)

    def on_metrics(self, loop: Loop, step: int, metrics: dict[str, float]) -> None:
        values = dict(metrics)
        dt, eta = self.timer.tick(step)
        values["tokens_per_s"] = self.tokens_per_step / dt if dt > 0 else 0.0
        if self.throughput is not None:
            values.update(self.throughput.rates(values["tokens_per_s"]))
        values["tokens_seen"] = float(step * self.tokens_per_step)
        values["step_time_s"] = dt
        values["data_wait_s"] = float(self.data_wait())
        if values.get("skipped"):
            why = "a loss spike" if values.get("spike") else "a non-finite loss or gradient norm"
            self.warn(f"step {step} skipped ({why}): loss {values['loss']}, grad norm {values['grad_norm']}")
        self.last = values
        self.logger.progress.update(step, values, eta)
        if step % self.spec.train.log_every == 0 or step == self.spec.train.steps or values.get("skipped"):
            if self.goodput is not None:
                values.update(self.goodput())
            self.logger.log(step, {k: values[k] for k in sorted(values) if "_norm/" not in k})
        every = self.spec.debug.norms_every
        if every and step % every == 0:
            self.logger.log(step, {k: v for k, v in values.items() if "_norm/" in k})
            if self.logger.wandb_run is not None:
                self.logger.wandb_run.log(debug.histograms(loop.state.params), step=step)
        metrics.update(values)  # the components after this one see the derived values too


class GuardStop(Component):
    def __init__(self, monitor: GuardMonitor) -> None:
        self.monitor = monitor

    def on_metrics(self, loop: Loop, step: int, metrics: Mapping[str, float]) -> None:
        reason = self.monitor.observe(step, dict(metrics))
        if reason:
            loop.halt(reason)

    def rewound(self, loop: Loop, step: int) -> None:
        self.monitor.rewound()


class StopRequests(Component):
    def __init__(self, conditions: StopConditions) -> None:
        self.conditions = conditions

    def needs_metrics(self, loop: Loop, step: int) -> bool:
        reason = self.conditions.check(step, loop.step_seconds, jax.process_count())
        if reason:
            loop.stop(reason)
        return reason is not None


class Evaluation(Component):
    """Runs each evaluator at its cadence (never at the last step: the final evaluation follows the
    loop), and the baseline at step 0 of a fresh run."""

    def __init__(self, evaluators: Sequence[Any], every: Callable[[Any], int],
                 evaluate: Callable[[Optional[Sequence[Any]]], Any]) -> None:
        self.evaluators, self.every, self.evaluate = list(evaluators), every, evaluate
        self._due: list[Any] = []

    def start(self, loop: Loop) -> None:
        if loop.holder.step == 0:  # the baseline every later evaluation is compared with
            self.evaluate(None)

    def needs_metrics(self, loop: Loop, step: int) -> bool:
        self._due = [ev for ev in self.evaluators
                     if step < loop.total and self.every(ev) and step % self.every(ev) == 0]
        return bool(self._due)

    def after_step(self, loop: Loop, step: int) -> None:
        if self._due and not loop.rewinding:  # a step about to be undone is not evaluated
            self.evaluate(self._due)
