"""BaseTrainer: the theseus BaseTrainer API as a thin face over runner's parts.

A job subclasses it and says how to build its model config and model. The parts it wires:

    runner.train.program     the optimizer, the state's shapes and shardings, the jitted steps
    runner.train.loop        the step loop; components own each cadence: runner.train.hooks, callbacks (the
                             user's hooks), checkpointing (restore, saves, the final save), watchdog
    runner.train.evaluations the evaluators' runs (runner.evaluation: they see an EvalContext, not this class)
    runner.observability     the metrics, goodput, the run card

`RestoreableJob.run` (runner.train.job) is the template: load -> done? -> train -> final save ->
conclude. Hot-loop rules: no host sync per step (metrics are read one step late), the state is
donated, the next batch is placed while the current step runs, saves are asynchronous.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import itertools
import time
from pathlib import Path
from typing import Any, Generic, Iterator, Mapping, Optional, Sequence, Tuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from runner.checkpoint import checkpointer as ckpt
from runner.data.documents import DocumentMasked
from runner.data.loader import BatchLoader
from runner.data.strategies import DatasetStrategy, build_strategy
from runner.errors import UserError
from runner.evaluation.base import EvalContext, Evaluator, build_evaluators
from runner.exits import Preempted, TrainingHalted
from runner.models import ModelFamily, context_choice, family_for
from runner.models.common import pipeline, tiling
from runner.observability import debug, goodput
from runner.observability.metrics import MetricsLogger
from runner.observability.runcard import RunCard
from runner.observability.throughput import Throughput
from runner.parallel.mesh import run_mesh
from runner.spec import ExecutionSpec
from runner.train import faults, guards, init, rewind, steps
from runner.train import state as st
from runner.train.callbacks import Callbacks
from runner.train.checkpointing import Checkpointing, Resumed
from runner.train.evaluations import Evaluations
from runner.train.heap import frozen_heap
from runner.train.hooks import Evaluation, GuardStop, MetricsReport, ProfilerWindow, StopRequests
from runner.train.job import C, RestoreableJob
from runner.train.loop import Ending, Loop
from runner.train.program import Program
from runner.train.state import TrainState
from runner.train.stopping import StopConditions, stopped
from runner.train.watchdog import Watchdog

M = TypeVar("M")  # the model type

Batch = steps.Batch

__all__ = ["BaseTrainer", "TrainState", "Preempted", "TrainingHalted"]


class BaseTrainer(RestoreableJob[C], Generic[C, M]):
    """Generic pretrainer: restores on start, trains on every host, evaluates, saves."""

    logical_axis_rules: Sequence[tuple[str, Any]] = ()

    def __init__(self, spec: ExecutionSpec, devices: Sequence[Any] | None = None,
                 family: Optional[ModelFamily] = None) -> None:
        """``devices`` defaults to ``jax.devices()``; mode=compile passes a topology's
        compile-only devices instead, so the same mesh and shardings exist without the hardware.
        ``family`` (the model family `build_model` uses) defaults to the one job.model.family names."""
        super().__init__(spec)
        self.family: ModelFamily = family if family is not None else family_for(spec)
        assert spec.topology, "ExecutionSpec.topology is required"
        self.topology, self.devices, self.mesh = run_mesh(spec, devices)
        self.model_config: C = self.config_from_spec(spec)
        self.context_reason = context_choice(spec)[1]  # why context_parallel=auto chose its kind (the launch says)
        self.model: M = self.build_model(self.model_config)
        self.strategy: DatasetStrategy = build_strategy(spec.data.strategy, spec.data)
        if spec.data.document_mask:
            self.strategy = DocumentMasked(self.strategy)
        self.check_vocab()
        self.program = Program(self)  # optimizer, schedule, state shapes and shardings, the jitted steps
        self.state: Optional[TrainState] = None
        self.step = 0
        self.resumed = Resumed()  # where this launch took up the run (runner.train.checkpointing)
        self.wandb_run_id: Optional[str] = None
        self.logger: Optional[MetricsLogger] = None
        self.callbacks = Callbacks.from_spec(spec, self, extra=faults.callbacks())  # the user's hooks
        self.goodput = goodput.Goodput()  # where this run's wall time goes (runner.observability.goodput)
        self.checkpoints = Checkpointing(spec, self.run_dir, self, warn=self.warn)
        self.evaluations = Evaluations(self)
        self.run_card = RunCard(self)
        self._loader: Any = None
        self.watchdog: Optional[Watchdog] = None  # run.hang_timeout, from the first step of train()

    # read as attributes: views of the records that own them
    restored_step = property(lambda self: self.resumed.step, doc="The step this launch restored (None: fresh).")
    restored_from = property(lambda self: self.resumed.source, doc="Where the restore came from (tier, directory).")
    restored_tier = property(lambda self: self.resumed.tier, doc='"durable" or "local" once restored.')
    last_metrics = property(lambda self: self.callbacks.last_metrics, doc="The newest step's metrics.")
    last_eval = property(lambda self: self.evaluations.last, doc="Every evaluator's newest metrics.")
    last_texts = property(lambda self: self.evaluations.texts, doc="The latest evaluation's texts (samples).")

    # ================================================================== job-specific parts

    @classmethod
    @abc.abstractmethod
    def config_from_spec(cls, spec: ExecutionSpec) -> C:
        """The model config this job trains, from the spec."""

    @classmethod
    @abc.abstractmethod
    def build_model(cls, config: C) -> M:
        """The flax module for `config`."""

    def init_args(self) -> tuple[Any, ...]:
        """Example inputs for model.init."""
        return (jnp.zeros((1, self.spec.train.seq_len), jnp.int32),)

    def model_vocab_size(self) -> int:
        return self.spec.job.model.vocab_size

    def flops_per_token(self) -> Optional[float]:
        """Training FLOPs per token (forward and backward), if the job knows them (the run card,
        mode=compile and the benchmark report it)."""
        return None

    def active_param_count(self) -> Optional[int]:
        """The parameters one token uses, if fewer than all (a mixture of experts): the run card
        shows both."""
        return None

    def tiling(self) -> str:
        """The launch's line on the tiles of each row's tokens (runner.models.common.tiling); empty: none."""
        return tiling.describe(self.model_config, self.spec)

    def pipeline_schedule(self) -> str:
        """The launch's line on the pipeline stages and their bubble (common.pipeline); empty with one stage."""
        return pipeline.describe(self.model_config)

    def check_vocab(self) -> None:
        data, model = self.strategy.vocab_size, self.model_vocab_size()
        if data > model:
            raise UserError(f"The data's vocabulary ({data} tokens, from data.strategy={self.spec.data.strategy}) is "
                            f"larger than the model's (job.model.vocab_size={model}). Fix: raise job.model.vocab_size "
                            f"to at least {data}, or use data prepared with a smaller tokenizer.")

    # ================================================================== seed API

    @property
    def done(self) -> bool:
        """The one place that decides "finished": train.steps steps taken."""
        return self.step >= self.spec.train.steps

    sharded_init = staticmethod(init.sharded_init)  # (model, key, *args, mesh, rules=()) -> (variables, sharding)

    def evaluator(self) -> Optional[Evaluator[M] | Sequence[Evaluator[M]]]:
        """What the job evaluates with (by default, what eval.evaluators configures). Called
        once per job (see `evaluators`), so evaluators may keep their prepared data."""
        return build_evaluators(self.spec)

    @functools.cached_property
    def evaluators(self) -> list[Evaluator[M]]:
        """`evaluator()` as a list, built once."""
        chosen = self.evaluator()
        return [] if chosen is None else (list(chosen) if isinstance(chosen, Sequence) else [chosen])

    def eval_every(self, evaluator: Evaluator[M]) -> int:
        """An evaluator's cadence in steps: its own `every` if it has one, else eval.every."""
        every = getattr(evaluator, "every", None)
        return self.spec.eval.every if every is None else int(every)

    @classmethod
    def optimizer(cls) -> str | optax.GradientTransformation:
        """A registered optimizer name, or an optax optimizer; by default the spec's choice."""
        return ""

    @classmethod
    def schedule(cls) -> Optional[str | optax.Schedule]:
        """A registered schedule name, an optax schedule, or None for a constant rate."""
        return ""

    def batch(self, slice: str = "train") -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of the batches for each step from the current one on."""
        if slice != "train":
            raise ValueError("validation batches come from the evaluators")
        train, data = self.spec.train, self.spec.data
        return BatchLoader(self.strategy.train(train.seq_len, self.spec.seed, global_batch=train.batch_size),
                           global_batch=train.batch_size, accumulate_steps=train.accumulate_steps,
                           start_step=self.step, process_index=jax.process_index(), process_count=jax.process_count(),
                           prefetch=data.prefetch, num_threads=data.num_threads, skips=self.checkpoints.journal.skips)

    @classmethod
    def token_loss(cls, state: TrainState, params: Any, micro: Mapping[str, jax.Array],
                   key: jax.Array) -> tuple[jax.Array, ...]:
        """(summed loss over real targets, number of real targets[, what to report]): the
        cross-entropy plus what the model's layers add (an MoE router's balancing terms), and
        their reports. An override may return the first two alone."""
        return steps.token_loss(state, params, micro, key)

    @classmethod
    def train_step(cls, state: TrainState, batch: Batch, key: jax.Array,
                   accumulate_steps: int, layer_norms: bool = False) -> Tuple[TrainState, jax.Array, Any]:
        """Gradients over S micro-batches, then one optimizer step: (state, loss, meta)."""
        return steps.train_step(state, batch, key, accumulate_steps, layer_norms, loss_fn=cls.token_loss)

    @classmethod
    def val_step(cls, state: TrainState, batch: Batch) -> Tuple[jax.Array, jax.Array, Any]:
        """Summed validation loss over S micro-batches: (loss_sum, token_count, {"correct"})."""
        return steps.val_step(state, batch)

    def load(self, suffix: Path | None = None) -> bool:
        """Restore the newest complete checkpoint (with `suffix`: the snapshot of that name under
        <run.dir>/snapshots/, or that step of checkpoints/); without one, a fresh (or warm-started)
        state. Returns whether a checkpoint was restored."""
        self.callbacks.dispatch("on_init_start")
        abstract, self.program.state_sharding = self.program.abstract_state()
        self.model_shapes = st.model_shapes(abstract.params)
        with self.goodput.timing("restore"):
            restored = self.checkpoints.restore(abstract, suffix, check=self.check_compatible)
        self.checkpoints.forget_stale_local()
        if restored is None:
            self.state = self.program.init_state()
            if self.spec.run.init_from:
                with self.goodput.timing("restore"):
                    self.state = self.checkpoints.warm_start(abstract, self.state, self.import_hf)
        else:
            self.state = abstract.replace(**restored.state)
        self.step = int(self.state.step) if restored is None else int(restored.step)
        self.resumed = self.checkpoints.resumed(restored, self.goodput)
        self.wandb_run_id = self.resumed.wandb_run_id
        self.callbacks.dispatch("on_init_end")
        return restored is not None

    def save(self, suffix: Path | None = None) -> None:
        """The final save of a launch (this step, unless saved already), awaited; with `suffix`,
        also a snapshot of that name under <run.dir>/snapshots/, outside the keep policies."""
        if self.state is not None:
            self.checkpoints.save_final(suffix)

    # ================================================================== what the parts use

    @functools.cached_property
    def throughput(self) -> Throughput:
        """Per-device rates and MFU for the progress line and metrics (runner.observability.throughput)."""
        return Throughput.for_run(self.flops_per_token(), self.topology, self.devices, self.spec.job.model.quantization)

    def eval_context(self) -> EvalContext:
        return EvalContext(spec=self.spec, mesh=self.mesh, strategy=self.strategy, val_step=self.program.val_step,
                           to_device=self.program.to_device, model=self.model, model_config=self.model_config)

    @property
    def checkpointer(self) -> ckpt.Checkpointer:
        """The run's checkpoint store (runner.train.checkpointing opens it on first use)."""
        return self.checkpoints.checkpointer

    def import_hf(self, abstract_params: Any) -> Any:
        """The parameters of the Hugging Face model `run.init_from=hf:DIR` names, as numpy arrays in
        this model's layout. Jobs whose model family has a Hugging Face layout implement it."""
        raise UserError(f"run.init_from={self.spec.run.init_from!r}: the job {type(self).__name__} cannot read "
                        "Hugging Face models. Fix: use job.trainer=lm with a family that has a Hugging Face layout.")

    def check_compatible(self, saved: Mapping[str, Any]) -> None:
        """Refuse to resume a checkpoint of another model, or of other data unless allowed."""
        ckpt.check_compatible(saved, self.model_shapes, self.strategy.fingerprint,
                              self.spec.checkpoint.allow_data_change, self.checkpointer.directory, self.warn)
        guards.check_saved(saved, self.spec.guard, self.checkpointer.directory)

    def checkpoint_meta(self) -> dict[str, Any]:
        """The record saved beside the state (`check_compatible` and the restore read it back)."""
        return {"step": self.step, "spec": self.spec.to_dict(), "data_fingerprint": self.strategy.fingerprint,
                "model_shapes": self.model_shapes, "wandb_run_id": self.wandb_run_id,
                "best": self.checkpointer.policy.best, "saved_unix": time.time(),
                "data_skips": self.checkpoints.journal.describe(),
                "goodput": self.goodput.to_meta(self.goodput_totals())}

    def goodput_totals(self) -> dict[str, float]:
        return self.goodput.totals(float(getattr(self._loader, "wait_seconds", 0.0)))

    def goodput_report(self) -> dict[str, float]:
        """goodput/percent and seconds per category, over all launches (runner.observability.goodput)."""
        return self.goodput.report(self.goodput_totals())

    # ================================================================== the loop

    def warn(self, text: str) -> None:
        if jax.process_index() == 0:
            print(f"warning: {text}", flush=True)

    def on_step_start(self, state: TrainState, step: int) -> None:
        """Subclass hook: called before step `step` (1-based) is dispatched."""

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float], step: int) -> None:
        """Subclass hook: called with step `step`'s metrics when they are read (one step late);
        `state` is the newest state."""

    def evaluate(self, only: Optional[Sequence[Evaluator[M]]] = None) -> dict[str, float]:
        """Run the evaluators (or `only` these) on the current state: metrics as `eval/<name>`;
        their texts, if any, go to `last_texts`."""
        return self.evaluations.run(only)

    def watching(self, phase: str, step: int) -> contextlib.AbstractContextManager[None]:
        """A save or an evaluation, as the watchdog sees it (progress at both ends)."""
        return self.watchdog.busy(phase, step) if self.watchdog is not None else contextlib.nullcontext()

    def components(self, logger: MetricsLogger, stops: StopConditions) -> list[Any]:
        """The loop's components, in the order they act at a step (see runner.train.hooks)."""
        spec = self.spec
        return [
            *([self.watchdog] if self.watchdog is not None else []),
            ProfilerWindow(debug.Profiler(self.run_dir, spec.debug.profile_start, spec.debug.profile_steps)),
            MetricsReport(spec, logger, self.step, data_wait=lambda: getattr(self._loader, "wait_seconds", 0.0),
                          warn=self.warn, throughput=self.throughput, goodput=self.goodput_report),
            self.callbacks,
            GuardStop(guards.GuardMonitor(spec.guard)),
            *rewind.components(spec, self.checkpoints, self.go_back, logger, self.goodput),
            StopRequests(stops),
            Evaluation(self.evaluators, self.eval_every, self.evaluations.log),
            *faults.components(self.checkpoints.wait, lambda: stops.signal is not None),
            self.checkpoints,
        ]

    def train(self) -> Ending:
        """Train from the restored step to train.steps (or an early stop), then evaluate."""
        self.logger = logger = MetricsLogger.for_run(self.spec, self.run_dir, self.wandb_run_id, self.restored_step)
        self.wandb_run_id = logger.wandb_run_id
        self._stops = stops = StopConditions(self.spec, self.run_dir, self.step)
        with stops.catching_signals():
            self._loader = self.batch("train")
            self._t_start = time.perf_counter()
            try:
                self.callbacks.dispatch("on_train_start")
                if self.restored_step:
                    logger.progress.message(f"resumed from step {self.restored_step} ({self.restored_from})")
                with self.goodput.timing("eval"):
                    self.evaluations.prepare()
                with self.goodput.timing("compile"):
                    step_fn = self.program.train_executable(self.state)
                self.watchdog = Watchdog.for_run(self.spec, self.run_dir, lambda: self.goodput.spent["compile"])
                self.run_card.start(logger.progress.message)
                loop = Loop(self, step_fn, self._device_batches(self._loader), self.components(logger, stops),
                            self.spec.train.steps)
                self.goodput.start_loop(self.run_dir, self.resumed)  # and its line in launches.jsonl
                with self.program.context(), frozen_heap():
                    ending = loop.run()
                self.goodput.end_loop()
                if ending.finished:
                    self.evaluations.log()
                return ending
            finally:
                getattr(self._loader, "close", lambda: None)()  # a job's own batch() may give a plain iterator

    def go_back(self, step: int) -> Iterator[Batch]:
        """A rewind (runner.train.rewind): checkpoint `step` restored, and the batches from there."""
        abstract = ckpt.abstract_like(self.state)  # the layout it trains in (no tracing inside the mesh context)
        restored = self.checkpoints.restore(abstract, Path(str(step)), check=self.check_compatible)
        self.state, self.step = self.state.replace(**restored.state), step
        getattr(self._loader, "close", lambda: None)()
        self._loader = self.batch("train")
        return self._device_batches(self._loader)

    def _device_batches(self, loader: Iterator[Mapping[str, np.ndarray]]) -> Iterator[Batch]:
        """Batches on the devices; with debug.overfit_batch, the first one again and again."""
        if self.spec.debug.overfit_batch:
            return itertools.repeat(self.program.to_device(next(loader)))
        return (self.program.to_device(local) for local in loader)

    def conclude(self, ending: Ending) -> None:
        """After the final save: report, or raise what the exit code says."""
        assert self.logger is not None
        if ending.halt:
            raise guards.halted(ending.halt, self.spec.guard, self.step, self.checkpointer.directory / str(self.step),
                                self.logger)
        if ending.stop:
            raise stopped(self._stops, ending.stop, self.step, self.logger)
        self.callbacks.dispatch("on_train_end")
        report = self.goodput_report()
        self.logger.log(self.step, report)
        self.run_card.end(time.perf_counter() - self._t_start, goodput.summary_line(report),
                          self.logger.progress.message)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        self.checkpoints.close()

    def finished_already(self) -> None:
        """Nothing left to train: said (after a last step found only in the local tier is saved durably)."""
        self.checkpoints.finished_already(self.resumed)
