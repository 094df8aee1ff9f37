"""BaseTrainer: the theseus BaseTrainer API as a thin face over runner's parts.

A job subclasses it and says how to build its model config and model. The parts it wires:

    runner.train.state       the train state: abstract shapes and shardings, sharded init
    runner.train.steps       the pure train/val steps, compiled with shardings
    runner.train.loop        the step loop, and the components (runner.train.hooks) that own each cadence
    runner.train.checkpointing  the checkpoints: restore, saves at the policy's cadence, the final save
    runner.evaluation  evaluators, which see an EvalContext, not this class

`RestoreableJob.run` (runner.train.job) is the template: load -> done? -> train -> final save ->
conclude. Hot-loop rules: no host sync per step (metrics are read one step late), the state is
donated, the next batch is placed while the current step runs, saves are asynchronous.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import itertools
import signal
import time
from pathlib import Path
from typing import Any, Generic, Iterator, Mapping, Optional, Sequence, Tuple, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from runner.checkpoint import checkpointer as ckpt
from runner.data.documents import DocumentMasked
from runner.data.loader import BatchLoader
from runner.data.strategies import DatasetStrategy, build_strategy
from runner.errors import UserError
from runner.evaluation.base import EvalContext, Evaluator, build_evaluators, prepare_all, run_all
from runner.exits import HookError, Preempted, TrainingHalted
from runner.models import ModelFamily, context_choice, family_for, pipeline, tiling
from runner.models.hf import HF_PREFIX
from runner.observability import debug, goodput, runcard
from runner.observability.goodput import Goodput
from runner.observability.metrics import METRICS_FILE, MetricsLogger, truncate_jsonl
from runner.observability.throughput import Throughput
from runner.parallel.compile import attention_summary
from runner.parallel.mesh import make_mesh, mesh_shape
from runner.parallel.topology import check_devices, parse_topology
from runner.spec import ExecutionSpec
from runner.train import faults, steps
from runner.train import state as st
from runner.train.callbacks import CallbackList
from runner.train.checkpointing import Checkpointing
from runner.train.guards import GuardMonitor
from runner.train.heap import frozen_heap
from runner.train.hooks import Evaluation, GuardStop, MetricsReport, ProfilerWindow, StepHooks, StopRequests
from runner.train.job import C, RestoreableJob
from runner.train.loop import Ending, Loop
from runner.train.program import Program
from runner.train.state import TrainState
from runner.train.stopping import StopConditions, consume_stop_file
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
        self.topology = parse_topology(spec.topology)
        self.devices = list(jax.devices() if devices is None else devices)
        check_devices(self.topology, self.devices)
        shape = mesh_shape(spec, len(self.devices))
        self.mesh = make_mesh(shape, self.devices, num_slices=max(self.topology.num_slices or 1, 1))
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
        self.restored_step: Optional[int] = None
        self.restored_from = ""  # where the restore came from (tier and directory)
        self.restored_tier = ""  # "durable" or "local" once restored
        self.wandb_run_id: Optional[str] = None
        self.last_metrics: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.last_texts: dict[str, str] = {}  # text made by the latest evaluation (samples)
        self.logger: Optional[MetricsLogger] = None
        self.callbacks = CallbackList([*CallbackList.from_spec(spec).callbacks, *faults.callbacks()])
        self.goodput = Goodput()  # where this run's wall time goes (runner.observability.goodput)
        self.checkpoints = Checkpointing(spec, self.run_dir, self, warn=self.warn)
        self._loader: Any = None
        self.watchdog: Optional[Watchdog] = None  # run.hang_timeout, from the first step of train()

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
        """The launch's line on the tiles of each row's tokens (runner.models.tiling); empty when none."""
        return tiling.describe(self.model_config, self.spec)

    def pipeline_schedule(self) -> str:
        """The launch's line on the layers' pipeline stages and their bubble (runner.models.pipeline);
        empty with one stage."""
        return pipeline.describe(self.model_config)

    def check_vocab(self) -> None:
        if self.strategy.vocab_size > self.model_vocab_size():
            raise UserError(
                f"The data's vocabulary ({self.strategy.vocab_size} tokens, from data.strategy="
                f"{self.spec.data.strategy}) is larger than the model's (job.model.vocab_size="
                f"{self.model_vocab_size()}). Fix: raise job.model.vocab_size to at least "
                f"{self.strategy.vocab_size}, or use data prepared with a smaller tokenizer."
            )

    # ================================================================== seed API

    @property
    def done(self) -> bool:
        """The one place that decides "finished": train.steps steps taken."""
        return self.step >= self.spec.train.steps

    @staticmethod
    def sharded_init(model: Any, key: jax.Array, *args: Any, mesh: jax.sharding.Mesh,
                     rules: Sequence[tuple[str, Any]] = (), **kwargs: Any) -> Tuple[Any, Any]:
        """Initialize parameters sharded across `mesh` from the start: eval_shape gives the
        logical axes without materializing anything, then init is jitted with out_shardings
        so every array is born on its devices. Returns (variables, var_sharding)."""
        init = functools.partial(model.init, **kwargs)
        abstract = jax.eval_shape(init, key, *args)
        sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            variables = st.init_sharded(lambda k, *a: nn.meta.unbox(init(k, *a)), sharding, key, *args)
        return variables, sharding

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
        return BatchLoader(
            self.strategy.train(self.spec.train.seq_len, self.spec.seed, global_batch=self.spec.train.batch_size),
            global_batch=self.spec.train.batch_size,
            accumulate_steps=self.spec.train.accumulate_steps,
            start_step=self.step,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            prefetch=self.spec.data.prefetch,
            num_threads=self.spec.data.num_threads,
        )

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
        self.callbacks("on_init_start", self)
        abstract, self.program.state_sharding = self.program.abstract_state()
        self.model_shapes = st.model_shapes(abstract.params)
        with self.goodput.timing("restore"):
            restored = self.checkpoints.restore(abstract, suffix, check=self.check_compatible)
        self.checkpoints.forget_stale_local()
        if restored is None:
            self.state = self.program.init_state()
            if self.spec.run.init_from:
                with self.goodput.timing("restore"):
                    self.warm_start(abstract)
            self.step = int(self.state.step)
            lost = truncate_jsonl(self.run_dir / METRICS_FILE, -1)  # a fresh start logs everything anew
            self.goodput.carry(None, lost, 0)
        else:
            self.state = abstract.replace(**restored.state)
            self.step = self.restored_step = int(restored.step)
            self.wandb_run_id = restored.meta.get("wandb_run_id")
            lost = truncate_jsonl(self.run_dir / METRICS_FILE, self.step)
            self.goodput.carry(restored.meta.get("goodput"), lost, self.step)
            self.restored_from = self.checkpoints.restored_from(restored)
            self.restored_tier = restored.tier
            if restored.tier == "local":
                self.goodput.local_tier_spared_steps = self.step - (self.checkpoints.durable_newest or 0)
        self.callbacks("on_init_end", self)
        return restored is not None

    def save(self, suffix: Path | None = None) -> None:
        """The final save of a launch (this step, unless saved already), awaited; with `suffix`,
        also a snapshot of that name under <run.dir>/snapshots/, outside the keep policies."""
        if self.state is not None:
            self.checkpoints.save_final(suffix)

    # run() is RestoreableJob.run: load -> done? -> train -> save -> conclude.

    # ================================================================== wiring

    @functools.cached_property
    def throughput(self) -> Throughput:
        """Per-device rates and MFU for the progress line and metrics (runner.observability.throughput)."""
        return Throughput.for_run(self.flops_per_token(), self.topology, self.devices,
                                  self.spec.job.model.quantization)

    def eval_context(self) -> EvalContext:
        return EvalContext(spec=self.spec, mesh=self.mesh, strategy=self.strategy, val_step=self.program.val_step,
                           to_device=self.program.to_device, model=self.model, model_config=self.model_config)

    # ================================================================== checkpoints

    @property
    def checkpointer(self) -> ckpt.Checkpointer:
        """The run's checkpoint store (runner.train.checkpointing opens it on first use)."""
        return self.checkpoints.checkpointer

    @contextlib.contextmanager
    def saving(self, step: int, tier: str = "durable") -> Iterator[None]:
        """Around every save: the callbacks, the metrics it covers logged before it can commit,
        and its time counted as checkpointing, per tier (runner.train.checkpointing calls this)."""
        self.callbacks("on_save_start", self, step=step)
        if self.logger is not None:
            try:
                self.logger.sync()
            except ckpt.StorageUnavailable as err:  # the durable tier stops the run; a local save still protects it
                if tier == "durable":
                    raise
                self.warn(f"{err} The local save of step {step} goes ahead; its metrics stay in memory until an "
                          "upload succeeds.")
        category = "checkpoint" if tier == "durable" else "checkpoint_local"
        with self.watching("save", step), self.goodput.timing(category):
            yield
        self.callbacks("on_save_end", self, step=step)

    def warm_start(self, abstract: TrainState) -> None:
        """run.init_from: another run's parameters (fresh optimizer, step 0), or its whole state;
        or with `hf:DIR`, a Hugging Face model's parameters (see `import_hf`)."""
        if self.spec.run.init_from.startswith(HF_PREFIX):
            params = self.import_hf(abstract.params)
            self.state = self.state.replace(params=jax.tree.map(
                lambda a, s: jax.device_put(np.asarray(a, s.dtype), s.sharding), params, abstract.params))
            if jax.process_index() == 0:
                m = self.spec.job.model
                print(f"warm start: parameters from the Hugging Face model {self.spec.run.init_from[3:]} "
                      f"({m.hf.architecture or m.family}: d_model={m.d_model}, n_layers={m.n_layers}, "
                      f"n_heads={m.n_heads}, vocab_size={m.vocab_size}; job.model settings from its config.json)",
                      flush=True)
            return
        tree = ckpt.warm_start(self.spec.run.init_from, self.spec.run.init_mode, st.state_tree(abstract))
        self.state = abstract.replace(**tree) if self.spec.run.init_mode == "full" else \
            self.state.replace(params=tree["params"])

    def import_hf(self, abstract_params: Any) -> Any:
        """The parameters of the Hugging Face model `run.init_from=hf:DIR` names, as numpy arrays in
        this model's layout. Jobs whose model family has a Hugging Face layout implement it."""
        raise UserError(f"run.init_from={self.spec.run.init_from!r}: the job {type(self).__name__} cannot read "
                        "Hugging Face models. Fix: use job.trainer=lm with a family that has a Hugging Face layout.")

    def check_compatible(self, saved: Mapping[str, Any]) -> None:
        """Refuse to resume a checkpoint of another model, or of other data unless allowed."""
        ckpt.check_compatible(saved, self.model_shapes, self.strategy.fingerprint,
                              self.spec.checkpoint.allow_data_change, self.checkpointer.directory, self.warn)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "spec": self.spec.to_dict(),
            "data_fingerprint": self.strategy.fingerprint,
            "model_shapes": self.model_shapes,
            "wandb_run_id": self.wandb_run_id,
            "best": self.checkpointer.policy.best,
            "saved_unix": time.time(),
            "goodput": self.goodput.to_meta(self.goodput_totals()),
        }

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

    def _hook(self, name: str, *args: Any) -> None:
        try:
            getattr(self, name)(*args)
        except Exception as err:
            raise HookError(f"{type(self).__qualname__}.{name}", err) from err

    def _before_step(self, step: int) -> None:
        self._hook("on_step_start", self.state, step)
        self.callbacks("on_step_start", self, step=step)

    def _after_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self.last_metrics = dict(metrics)
        self._hook("on_step_end", self.state, metrics, step)
        self.callbacks("on_step_end", self, step=step, metrics=dict(metrics))

    def prepare_evaluators(self) -> None:
        with self.program.context():
            prepare_all(self.evaluators, self.eval_context())

    def evaluate(self, only: Optional[Sequence[Evaluator[M]]] = None) -> dict[str, float]:
        """Run the evaluators (or `only` these) on the current state: metrics as `eval/<name>`;
        their texts, if any, go to `last_texts`."""
        with self.program.context():
            results, self.last_texts = run_all(self.evaluators if only is None else only, self.eval_context(),
                                               self.state)
        self.last_eval = {**self.last_eval, **results}
        return results

    def _log_eval(self, only: Optional[Sequence[Evaluator[M]]] = None) -> None:
        """Evaluate; log metrics and texts (metrics.jsonl strings, a wandb table); show the headline
        numbers; tell the checkpoint policy (best-K)."""
        assert self.logger is not None
        self.callbacks("on_eval_start", self, step=self.step)
        with self.watching("eval", self.step), self.goodput.timing("eval"):
            results = self.evaluate(only)
        self.callbacks("on_eval_end", self, step=self.step, results=results)
        self.logger.log_eval(self.step, results, self.last_texts)
        self.checkpoints.note_evaluation(self.step, results, complete=only is None)

    def watching(self, phase: str, step: int) -> contextlib.AbstractContextManager[None]:
        """A save or an evaluation, as the watchdog sees it (progress at both ends)."""
        return self.watchdog.busy(phase, step) if self.watchdog is not None else contextlib.nullcontext()

    def components(self, logger: MetricsLogger, stops: StopConditions, loader: Any) -> list[Any]:
        """The loop's components, in the order they act at a step (see runner.train.hooks)."""
        spec = self.spec
        return [
            *([self.watchdog] if self.watchdog is not None else []),
            ProfilerWindow(debug.Profiler(self.run_dir, spec.debug.profile_start, spec.debug.profile_steps)),
            MetricsReport(spec, logger, self.step, data_wait=lambda: getattr(loader, "wait_seconds", 0.0),
                          warn=self.warn, throughput=self.throughput, goodput=self.goodput_report),
            StepHooks(self._before_step, self._after_step),
            GuardStop(GuardMonitor(spec.guard)),
            StopRequests(stops),
            Evaluation(self.evaluators, self.eval_every, self._log_eval),
            *faults.components(self.checkpoints.wait, lambda: stops.signal is not None),
            self.checkpoints,
        ]

    def train(self) -> Ending:
        """Train from the restored step to train.steps (or an early stop), then evaluate."""
        self.logger = logger = MetricsLogger.for_run(self.spec, self.run_dir, self.wandb_run_id, self.restored_step)
        self.wandb_run_id = logger.wandb_run_id
        self._stops = stops = StopConditions(self.spec, self.run_dir, self.step)
        previous = {s: signal.signal(s, stops.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        loader = self._loader = self.batch("train")
        self._t_start = time.perf_counter()
        try:
            self.callbacks("on_train_start", self)
            if self.restored_step:
                logger.progress.message(f"resumed from step {self.restored_step} ({self.restored_from})")
            with self.goodput.timing("eval"):
                self.prepare_evaluators()
            with self.goodput.timing("compile"):
                step_fn = self.program.train_executable(self.state)
            self.watchdog = Watchdog.for_run(self.spec, self.run_dir, lambda: self.goodput.spent["compile"])
            self.write_run_card()
            loop = Loop(self, step_fn, self._device_batches(loader), self.components(logger, stops, loader),
                        self.spec.train.steps)
            self.goodput.start_loop()
            with self.program.context(), frozen_heap():
                ending = loop.run()
            self.goodput.end_loop()
            if ending.finished:
                self._log_eval()
            return ending
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            close = getattr(loader, "close", None)
            if close:
                close()

    def _device_batches(self, loader: Iterator[Mapping[str, np.ndarray]]) -> Iterator[Batch]:
        """Batches on the devices; with debug.overfit_batch, the first one again and again."""
        if self.spec.debug.overfit_batch:
            return itertools.repeat(self.program.to_device(next(loader)))
        return (self.program.to_device(local) for local in loader)

    def conclude(self, ending: Ending) -> None:
        """After the final save: report, or raise what the exit code says."""
        assert self.logger is not None
        if ending.halt:
            self.logger.ending(TrainingHalted.exit_code)
            raise TrainingHalted(
                f"Training stopped at step {self.step}: {ending.halt} (guard.nonfinite={self.spec.guard.nonfinite}). "
                f"The last good state is saved in {self.checkpointer.directory / str(self.step)}. Fix: lower "
                "optimizer.lr or tighten optimizer.clip_norm, or set guard.nonfinite=skip to step over bad "
                "batches; then rerun the same command.")
        if ending.stop:
            consume_stop_file(self._stops, ending.stop)
            self.logger.progress.message(f"stopped by {ending.stop} at step {self.step}; "
                                         "checkpoint saved. Rerun the same command to resume.")
            self.logger.ending(Preempted.exit_code, preempted=True)
            raise Preempted()
        self.callbacks("on_train_end", self)
        report = self.goodput_report()
        self.logger.log(self.step, report)
        self._summary(time.perf_counter() - self._t_start)
        self.logger.progress.message(goodput.summary_line(report))
        self.write_run_card(final=True)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        self.checkpoints.close()

    def finished_already(self) -> None:
        """Nothing left to train. A last step restored from the local tier is not in the durable
        tier yet (the launch that reached it stopped when its durable save failed): saved there now,
        before the local tier (a host's disk) can be lost (unless that save committed after all)."""
        if self.restored_tier == "local" and self.step not in self.checkpointer.steps():
            self.save()
            if jax.process_index() == 0:
                print(f"Run {self.run_dir} had reached step {self.step} (train.steps={self.spec.train.steps}), but that "
                      f"step was only in the local tier ({self.restored_from}); it is now saved to "
                      f"{self.checkpointer.directory}.", flush=True)
            return
        if jax.process_index() == 0:
            print(f"Run {self.run_dir} already finished at step {self.step} (train.steps={self.spec.train.steps}); "
                  f"nothing to do. Raise train.steps to continue it.", flush=True)

    # ================================================================== reporting

    def write_run_card(self, final: bool = False) -> None:
        assert self.logger is not None
        if not final:
            self._facts = runcard.run_facts(self.state.params, self.flops_per_token(), self.mesh,
                                            self.program.train_executable(self.state), self.state)
            self._facts["throughput"] = self.throughput.describe()
            active = self.active_param_count()
            if active is not None and active != self._facts["parameters"]:
                self._facts["active_parameters"] = active
            if getattr(self, "attention", ""):
                self._facts["attention"] = attention_summary(self)
            self._facts["tiling"] = self.tiling()
            self._facts["pipeline"] = self.pipeline_schedule()
            self._facts["checkpoints"] = self.checkpoints.describe(self.restored_step, self.restored_from)
            if getattr(self, "quantization", ""):
                self._facts["quantization"] = self.quantization
                for warning in self.quantization_warnings():
                    self.warn(warning)
            for line in runcard.summary_lines(self._facts):
                self.logger.progress.message(line)
        else:  # the tiers' line again, with the local saves this launch had to skip
            self._facts["checkpoints"] = self.checkpoints.describe(self.restored_step, self.restored_from)
        if jax.process_index() == 0:
            runcard.write(self.run_dir, self.spec, self._facts,
                          {**self.last_metrics, **self.last_eval} if final else None)

    def _summary(self, seconds: float) -> None:
        assert self.logger is not None
        self.logger.progress.message(runcard.summary(
            self.spec, self.step, self.restored_step, seconds, self.last_metrics, self.last_eval,
            self.checkpointer.directory / str(self.step), self.run_dir / METRICS_FILE))
