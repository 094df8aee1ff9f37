"""BaseTrainer: the generic pretrainer for GPT-style models (the theseus BaseTrainer API).

A job subclasses it and says how to build its model config and model; everything else (mesh,
sharded init, data, optimizer, the step loop, evaluation, checkpoints, metrics) lives here.

Hot-loop rules: no host synchronisation per step (each step's metrics are read after the next
step has been dispatched), the state buffers are donated, the next batch is placed on the
devices while the current step runs, and checkpoint saves are asynchronous.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any, Generic, Iterator, Mapping, Optional, Sequence, Tuple, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from runner import checkpoint as ckpt
from runner import debug, faults, runcard
from runner.callbacks import CallbackList, HookError
from runner.guards import GuardMonitor, guard_update, initial_guard_state
from runner.heap import frozen_heap
from runner.stopping import StopConditions, consume_stop_file
from runner.data.loader import BatchLoader
from runner.data.strategies import DatasetStrategy, build_strategy
from runner.errors import UserError
from runner.evaluation.base import Evaluator, build_evaluators
from runner.job import C, RestoreableJob
from runner.mesh import make_mesh, microbatch_sharding, resolve_mesh_shape
from runner.metrics import METRICS_FILE, MetricsLogger, Timer, truncate_jsonl
from runner.optim import build_optimizer, build_schedule
from runner.optim.optimizers import param_axis_names
from runner.optim.sharding import opt_state_sharding
from runner.spec import ExecutionSpec, optimizer_settings, schedule_extra
from runner.topology import check_devices, parse_topology

M = TypeVar("M")  # the model type

Batch = Mapping[str, jax.Array]  # {"x", "y", "mask"}, each (S, B, T)

# Exit code of a run that stopped on SIGTERM/SIGINT after saving: rerun the command to resume.
PREEMPTED_EXIT_CODE = 75


class TrainState(train_state.TrainState):
    """Flax's TrainState plus the base PRNG key (the key for step s is fold_in(rng, s)) and the
    numerical guard's rolling statistics, so both are checkpointed and resume exactly."""

    rng: jax.Array
    guard: Any = None


class Preempted(Exception):
    """Raised after a stop-early save completed; the CLI exits with PREEMPTED_EXIT_CODE."""


class TrainingHalted(Exception):
    """The numerical guard stopped the run after saving the last good state (exit code 1)."""

    exit_code = 1


class BaseTrainer(RestoreableJob[C], Generic[C, M]):
    """Generic pretrainer: restores on start, trains on every host, evaluates, saves."""

    logical_axis_rules: Sequence[tuple[str, Any]] = ()

    def __init__(self, spec: ExecutionSpec, devices: Sequence[Any] | None = None) -> None:
        """``devices`` defaults to ``jax.devices()``; mode=compile passes a topology's
        compile-only devices instead, so the same mesh and shardings exist without the hardware."""
        super().__init__(spec)
        assert spec.topology, "ExecutionSpec.topology is required"
        self.topology = parse_topology(spec.topology)
        self.devices = list(jax.devices() if devices is None else devices)
        check_devices(self.topology, self.devices)
        shape = resolve_mesh_shape(spec.mesh.data, spec.mesh.fsdp, spec.mesh.tensor, len(self.devices))
        self.mesh = make_mesh(shape, self.devices, num_slices=max(self.topology.num_slices or 1, 1))
        self.model_config: C = self.config_from_spec(spec)
        self.model: M = self.build_model(self.model_config)
        self.strategy: DatasetStrategy = build_strategy(spec.data.strategy, spec.data)
        self.check_vocab()
        self.lr_schedule = self._schedule()
        self.tx = self._optimizer()
        self.state: Optional[TrainState] = None
        self.state_sharding: Any = None
        self.step = 0
        self.restored_step: Optional[int] = None
        self.meta: dict[str, Any] = {"best": {}, "wandb_run_id": None}
        self.last_metrics: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.last_texts: dict[str, str] = {}  # text made by the latest evaluation (samples)
        self._measured: Optional[tuple[int, float]] = None  # (step, checkpoint.best_metric) last evaluated
        self._last_saved_step: Optional[int] = None
        self._compiled: dict[str, Any] = {}
        self.callbacks = CallbackList.from_spec(spec)
        self.stops: Optional[StopConditions] = None

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

    def check_vocab(self) -> None:
        if self.strategy.vocab_size > self.model_vocab_size():
            raise UserError(
                f"The data's vocabulary ({self.strategy.vocab_size} tokens, from data.strategy="
                f"{self.spec.data.strategy}) is larger than the model's (job.model.vocab_size="
                f"{self.model_vocab_size()}). Fix: raise job.model.vocab_size to at least "
                f"{self.strategy.vocab_size}, or use data prepared with a smaller tokenizer."
            )

    @functools.cached_property
    def checkpointer(self) -> ckpt.Checkpointer:
        """Opened on first use, so mode=compile never touches (or cleans up in) the run directory."""
        return ckpt.Checkpointer(self.run_dir / "checkpoints", self.spec.checkpoint)

    # ================================================================== seed API

    @property
    def done(self) -> bool:
        return self.step >= self.spec.train.steps

    @staticmethod
    def sharded_init(model: Any, key: jax.Array, *args: Any, mesh: jax.sharding.Mesh,
                     rules: Sequence[tuple[str, Any]] = (), **kwargs: Any) -> Tuple[Any, Any]:
        """Initialize parameters sharded across `mesh` from the start: eval_shape gives the
        logical axes without materializing anything, then init is jitted with out_shardings
        so every array is born on its devices. Returns (variables, var_sharding)."""
        init = partial(model.init, **kwargs)
        abstract = jax.eval_shape(init, key, *args)
        sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            variables = jax.jit(lambda k, *a: nn.meta.unbox(init(k, *a)), out_shardings=sharding)(key, *args)
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
                   key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(sum of per-token cross-entropy over real targets, number of real targets)."""
        logits = state.apply_fn({"params": params}, micro["x"], deterministic=False, rngs={"dropout": key})
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, micro["y"])
        mask = micro["mask"].astype(jnp.float32)
        return jnp.sum(losses * mask), jnp.sum(mask)

    @classmethod
    def train_step(cls, state: TrainState, batch: Batch, key: jax.Array,
                   accumulate_steps: int, layer_norms: bool = False) -> Tuple[TrainState, jax.Array, Any]:
        """Gradients over S micro-batches, weighted by target-token count (a padded token
        counts for nothing), then one optimizer step. Returns (state, loss, meta); with
        `layer_norms`, meta also holds per-layer gradient norms."""
        grad_fn = jax.value_and_grad(lambda p, micro, k: cls.token_loss(state, p, micro, k), has_aux=True)

        def accumulate(carry, inputs):
            grads, loss_sum, count = carry
            micro, k = inputs
            (micro_loss, micro_count), micro_grads = grad_fn(state.params, micro, k)
            grads = jax.tree.map(jnp.add, grads, micro_grads)
            return (grads, loss_sum + micro_loss, count + micro_count), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        keys = jax.random.split(key, accumulate_steps)
        (grads, loss_sum, count), _ = jax.lax.scan(
            accumulate, (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), (batch, keys))
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = loss_sum / denom
        new_state = state.apply_gradients(grads=grads)
        meta = {"grad_norm": optax.tree.norm(grads), "tokens": count}
        if layer_norms:
            meta.update(debug.layer_norms(grads, "grad_norm"))
        return new_state, loss, meta

    @classmethod
    def val_step(cls, state: TrainState, batch: Batch) -> Tuple[jax.Array, jax.Array, Any]:
        """Summed validation loss over S micro-batches: (loss_sum, token_count, {"correct": the
        number of real targets that are the argmax prediction})."""

        def one(carry, micro):
            logits = state.apply_fn({"params": state.params}, micro["x"], deterministic=True)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, micro["y"])
            mask = micro["mask"].astype(jnp.float32)
            correct = (jnp.argmax(logits, -1) == micro["y"]).astype(jnp.float32) * mask
            loss_sum, count, right = carry
            return (loss_sum + jnp.sum(losses * mask), count + jnp.sum(mask), right + jnp.sum(correct)), None

        zero = jnp.zeros((), jnp.float32)
        (loss_sum, count, correct), _ = jax.lax.scan(one, (zero, zero, zero), batch)
        return loss_sum, count, {"correct": correct}

    # ================================================================== building blocks

    def _schedule(self) -> optax.Schedule:
        s, o, t = self.spec.schedule, self.spec.optimizer, self.spec.train
        chosen = self.schedule()
        if chosen is None:
            return optax.constant_schedule(o.lr)
        if callable(chosen):
            return chosen
        return build_schedule(chosen or s.name, o.lr, t.steps, min(s.warmup_steps, t.steps),
                              o.lr * s.final_lr_fraction, schedule_extra(self.spec))

    def _optimizer(self) -> optax.GradientTransformation:
        chosen = self.optimizer() or self.spec.optimizer.name
        params = nn.meta.unbox(self.abstract_variables)["params"]
        settings = dataclasses.replace(optimizer_settings(self.spec),
                                       param_axes=param_axis_names(params, self.param_specs))
        return build_optimizer(chosen, self.lr_schedule, settings, self.spec.optimizer.clip_norm)

    def _context(self):
        """Mesh and logical-axis rules, active while tracing so activation constraints apply."""
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.logical_axis_rules))
        return stack

    def _create_state(self, key: jax.Array) -> TrainState:
        """The fresh state, parameters unboxed before the optimizer sees them (its state then
        carries no stale partition metadata; `abstract_state` derives its shardings)."""
        init_key, rng = jax.random.split(key)
        variables = self.model.init(init_key, *self.init_args())  # type: ignore[attr-defined]
        return TrainState.create(apply_fn=self.model.apply, params=nn.meta.unbox(variables["params"]),  # type: ignore[attr-defined]
                                 tx=self.tx, rng=rng, guard=initial_guard_state())

    @functools.cached_property
    def abstract_variables(self) -> Any:
        """The model's variables as shapes, still boxed with their logical axis names."""
        init_key = jax.random.split(jax.random.PRNGKey(self.spec.seed))[0]
        return jax.eval_shape(self.model.init, init_key, *self.init_args())  # type: ignore[attr-defined]

    @property
    def param_specs(self) -> Any:
        """The parameters' logical partition specs (axis names per dimension)."""
        return nn.get_partition_spec(self.abstract_variables)["params"]

    def abstract_state(self) -> tuple[Any, Any]:
        """(abstract state, its shardings), computed without touching a device. Parameters are
        sharded by their logical axes; the optimizer state by what each of its leaves is (see
        runner.optim.sharding); step, key and guard statistics are replicated."""
        abstract = jax.eval_shape(self._create_state, jax.random.PRNGKey(self.spec.seed))
        params = nn.logical_to_mesh_sharding(self.param_specs, self.mesh, self.logical_axis_rules)
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        sharding = jax.tree.map(lambda _: replicated, abstract).replace(
            params=params, opt_state=opt_state_sharding(abstract.opt_state, abstract.params, params, self.mesh))
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sharding)
        return abstract, sharding

    def init_state(self) -> TrainState:
        """A fresh state, every array created directly on its devices."""
        key = jax.random.PRNGKey(self.spec.seed)
        with self._context():
            return jax.jit(self._create_state, out_shardings=self.state_sharding)(key)

    @staticmethod
    def state_tree(state: TrainState) -> dict[str, Any]:
        return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng,
                "guard": state.guard}

    def model_shapes(self, abstract: TrainState) -> dict[str, list[int]]:
        flat = jax.tree_util.tree_flatten_with_path(abstract.params)[0]
        return {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in flat}

    def compiled_train_step(self) -> Any:
        if "train" not in self._compiled:
            batch_sharding = microbatch_sharding(self.mesh)
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            cls, s, guard = type(self), self.spec.train.accumulate_steps, self.spec.guard
            norms = self.spec.debug.norms_every > 0

            def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
                key = jax.random.fold_in(state.rng, state.step)
                new_state, loss, meta = cls.train_step(state, batch, key, s, layer_norms=norms)
                new_state, flags = guard_update(guard, state, new_state, loss, meta["grad_norm"])
                if norms:
                    meta.update(debug.param_and_update_norms(state.params, new_state.params))
                lr = jnp.asarray(self.lr_schedule(state.step), jnp.float32)
                return new_state, {"loss": loss, "lr": lr, **meta, **flags}

            self._compiled["train"] = jax.jit(
                step, donate_argnums=0,
                in_shardings=(self.state_sharding, {k: batch_sharding for k in ("x", "y", "mask")}),
                out_shardings=(self.state_sharding, replicated))
        return self._compiled["train"]

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global (S, B, T) batch the train step takes, as shapes with shardings."""
        t = self.spec.train
        shape = (t.accumulate_steps, t.batch_size // t.accumulate_steps, t.seq_len)
        sharding = microbatch_sharding(self.mesh)
        return {k: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
                for k, dt in (("x", jnp.int32), ("y", jnp.int32), ("mask", jnp.float32))}

    def train_executable(self) -> Any:
        """The train step compiled ahead of time, once: the loop runs it, and its memory
        analysis feeds the run card."""
        if "train_exe" not in self._compiled:
            with self._context():
                self._compiled["train_exe"] = self.compiled_train_step().lower(
                    self.state, self.abstract_batch()).compile()
        return self._compiled["train_exe"]

    def compiled_val_step(self) -> Any:
        if "val" not in self._compiled:
            batch_sharding = microbatch_sharding(self.mesh)
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            self._compiled["val"] = jax.jit(
                type(self).val_step,
                in_shardings=(self.state_sharding, {k: batch_sharding for k in ("x", "y", "mask")}),
                out_shardings=replicated)
        return self._compiled["val"]

    def to_device(self, local: Mapping[str, np.ndarray]) -> Batch:
        """Assemble global (S, B, T) arrays from this process's rows."""
        sharding = microbatch_sharding(self.mesh)
        if jax.process_count() == 1:  # one batched transfer: about a third cheaper per step
            return jax.device_put(dict(local), sharding)
        return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()}

    # ================================================================== restore / save

    def load(self, suffix: Path | None = None) -> bool:
        abstract, self.state_sharding = self.abstract_state()
        self.meta["model_shapes"] = self.model_shapes(abstract)
        restored = self.checkpointer.restore_latest(self.state_tree(abstract), self.spec.checkpoint.on_damaged,
                                                    warn=self.warn, check=self.check_compatible)
        if restored is None:
            self.state = self.init_state()
            if self.spec.run.init_from:
                self.warm_start(abstract)
            self.step = int(self.state.step)
            truncate_jsonl(self.run_dir / METRICS_FILE, -1)  # a fresh start logs everything anew
            return False
        self.state = abstract.replace(**restored.state)
        self.step = self.restored_step = int(restored.step)
        self.meta.update({k: restored.meta[k] for k in ("best", "wandb_run_id") if k in restored.meta})
        truncate_jsonl(self.run_dir / METRICS_FILE, self.step)
        return True

    def warm_start(self, abstract: TrainState) -> None:
        """Initialize a new run from another run's checkpoint: its parameters (fresh optimizer,
        step 0), or with run.init_mode=full its whole state."""
        state_dir = ckpt.find_state_dir(self.spec.run.init_from)
        try:
            if self.spec.run.init_mode == "full":
                tree = ckpt.restore_tree(state_dir, self.state_tree(abstract), partial=False)
                self.state = abstract.replace(**tree)
            else:
                tree = ckpt.restore_tree(state_dir, {"params": abstract.params}, partial=True)
                self.state = self.state.replace(params=tree["params"])
        except (ValueError, KeyError) as err:
            raise UserError(
                f"Cannot warm start from {state_dir}: {str(err).splitlines()[0][:300]}. Fix: the source run "
                "must have the same model shapes (and, with run.init_mode=full, the same optimizer)."
            ) from None
        if jax.process_index() == 0:
            print(f"warm start: {self.spec.run.init_mode} from {state_dir}", flush=True)

    def check_compatible(self, saved: Mapping[str, Any]) -> None:
        """Refuse to resume a checkpoint of another model, or of other data unless allowed."""
        shapes = saved.get("model_shapes")
        if shapes is not None and shapes != self.meta["model_shapes"]:
            changed = sorted(k for k in set(shapes) | set(self.meta["model_shapes"])
                             if shapes.get(k) != self.meta["model_shapes"].get(k))
            raise UserError(
                f"The checkpoints in {self.checkpointer.directory} are of a different model: parameter "
                f"shapes differ at {', '.join(changed[:5])}. Fix: use the model settings of that run "
                "(see its spec.yaml), or a new run.dir for the new model."
            )
        fingerprint = saved.get("data_fingerprint")
        if fingerprint is not None and fingerprint != self.strategy.fingerprint:
            if self.spec.checkpoint.allow_data_change:
                self.warn(f"resuming on different data (fingerprint {fingerprint[:12]} -> "
                          f"{self.strategy.fingerprint[:12]}), as checkpoint.allow_data_change allows")
                return
            raise UserError(
                f"The checkpoints in {self.checkpointer.directory} were trained on other data (data "
                f"fingerprint {fingerprint[:12]} there, {self.strategy.fingerprint[:12]} now; sources "
                f"there: {saved.get('spec', {}).get('data', {}).get('sources')}). Fix: use the data settings "
                "of that run, set checkpoint.allow_data_change=true to continue on the new data on purpose, "
                "or use a new run.dir."
            )

    def checkpoint_meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "spec": self.spec.to_dict(),
            "data_fingerprint": self.strategy.fingerprint,
            "model_shapes": self.meta["model_shapes"],
            "wandb_run_id": self.meta.get("wandb_run_id"),
            "best": self.meta.get("best", {}),
            "saved_unix": time.time(),
        }

    def save(self, suffix: Path | None = None, wait: bool = True) -> None:
        """Save the current state (unless this step is saved already) and wait for it."""
        if self.state is not None and self._last_saved_step != self.step:
            self.callbacks("on_save_start", self, step=self.step)
            self.checkpointer.save(self.step, self.state_tree(self.state), self.checkpoint_meta(), force=True,
                                   metrics=self._best_metrics())
            self._last_saved_step = self.step
            self.callbacks("on_save_end", self, step=self.step)
        if wait:
            self.checkpointer.wait()

    def maybe_save(self) -> None:
        # With checkpoint.keep_best, every evaluation of best_metric is saved, so it can be kept.
        measured = self._best_metrics()
        if measured is None and self.spec.checkpoint.keep_best and self.step >= self.spec.train.steps:
            return  # the final save comes right after the final evaluation, and carries its metric
        if measured is not None or self.checkpointer.should_save(self.step):
            self.callbacks("on_save_start", self, step=self.step)
            self.checkpointer.save(self.step, self.state_tree(self.state), self.checkpoint_meta(),
                                   force=measured is not None, metrics=measured)
            self._last_saved_step = self.step
            self.callbacks("on_save_end", self, step=self.step)
            if faults.armed("kill_after_save", self.step):
                faults.die()

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

    def prepare_evaluators(self) -> None:
        """Let each evaluator load and check its data now, so a bad file or prompt stops the job
        before training (or before the first evaluation of a resumed run)."""
        with self._context():
            for ev in self.evaluators:
                prepare = getattr(ev, "prepare", None)
                if callable(prepare):
                    prepare(self)

    def evaluate(self, only: Optional[Sequence[Evaluator[M]]] = None) -> dict[str, float]:
        """Run the evaluators (or `only` these) on the current state: metrics as `eval/<name>`;
        their texts, if any, go to `last_texts`."""
        results: dict[str, float] = {}
        texts: dict[str, str] = {}
        with self._context():
            for ev in self.evaluators if only is None else only:
                results.update({f"eval/{k}": float(v) for k, v in ev.evaluate(self, self.state).items()})
                made = getattr(ev, "texts", None)
                if callable(made):
                    texts.update({f"eval/{k}": str(v) for k, v in made().items()})
        self.last_eval = {**self.last_eval, **results}
        self.last_texts = texts
        return results

    def train(self) -> None:
        spec = self.spec
        total = spec.train.steps
        tokens_per_step = spec.train.batch_size * spec.train.seq_len
        logger = MetricsLogger(
            self.run_dir, progress=spec.logging.progress, total_steps=total, log_every=spec.train.log_every,
            wandb_mode=spec.logging.wandb, wandb_project=spec.logging.project, wandb_entity=spec.logging.entity,
            wandb_run_id=self.meta.get("wandb_run_id"), run_name=Path(spec.run.dir).name,
            config=spec.to_dict(), wandb_group=spec.run.sweep)
        self.meta["wandb_run_id"] = logger.wandb_run_id
        self.logger = logger
        self.stops = StopConditions(spec, self.run_dir, self.step)
        previous = {s: signal.signal(s, self.stops.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        guard = GuardMonitor(spec.guard)
        profiler = debug.Profiler(self.run_dir, spec.debug.profile_start, spec.debug.profile_steps)
        loader = self.batch("train")
        t_start = time.perf_counter()
        reason: Optional[str] = None  # why the loop stopped early (resumable)
        halt: Optional[str] = None  # why the guard stopped the run (not resumable as is)
        try:
            self.callbacks("on_train_start", self)
            if self.restored_step:
                logger.progress.message(f"resumed from step {self.restored_step} ({self.checkpointer.directory})")
            self.prepare_evaluators()
            step_fn = self.train_executable()
            self.write_run_card(logger)
            if self.step == 0:  # the baseline every later evaluation is compared with
                self._log_eval(logger)
            timer = Timer(self.step, total)
            with self._context(), frozen_heap():
                batch = self.to_device(next(loader))
                fixed = batch if spec.debug.overfit_batch else None  # overfit mode: the first batch, always
                pending: Optional[tuple[int, dict[str, jax.Array]]] = None
                while self.step < total:
                    profiler.before_step(self.step + 1, self.state)
                    self._hook("on_step_start", self.state, self.step + 1)
                    self.callbacks("on_step_start", self, step=self.step + 1)
                    self.state, metrics = step_fn(self.state, batch)
                    self.step += 1
                    if self.step < total:  # overlaps with the running step
                        batch = fixed if fixed is not None else self.to_device(next(loader))
                    if pending is not None:
                        halt = halt or self._report(logger, timer, *pending, tokens_per_step, loader, guard)
                    pending = (self.step, metrics)
                    reason = self.stops.check(self.step, timer.last_dt, jax.process_count())
                    eval_due = [ev for ev in self.evaluators if self.step < total
                                and self.eval_every(ev) and self.step % self.eval_every(ev) == 0]
                    if eval_due or reason or halt:
                        late = self._report(logger, timer, *pending, tokens_per_step, loader, guard)
                        halt, pending = halt or late, None
                    if halt:
                        break
                    if eval_due:
                        self._log_eval(logger, eval_due)
                    if faults.armed("kill_at_step", self.step):
                        self.checkpointer.wait()
                        faults.die()
                    if reason:
                        break
                    self.maybe_save()
                if pending is not None:
                    late = self._report(logger, timer, *pending, tokens_per_step, loader, guard)
                    halt = halt or late
            profiler.stop(self.state)
            if halt:
                self.save()
                raise TrainingHalted(
                    f"Training stopped at step {self.step}: {halt} (guard.nonfinite={spec.guard.nonfinite}). "
                    f"The last good state is saved in {self.checkpointer.directory / str(self.step)}. Fix: lower "
                    "optimizer.lr or tighten optimizer.clip_norm, or set guard.nonfinite=skip to step over bad "
                    "batches; then rerun the same command.")
            if reason or self.step < total:
                self.save()
                consume_stop_file(self.stops, reason)
                logger.progress.message(f"stopped by {reason or 'a stop request'} at step {self.step}; "
                                        "checkpoint saved. Rerun the same command to resume.")
                raise Preempted()
            self._log_eval(logger)
            self.save()
            self.callbacks("on_train_end", self)
            self._summary(logger, time.perf_counter() - t_start)
            self.write_run_card(logger, final=True)
        except HookError:
            self.save()  # the last good state
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            close = getattr(loader, "close", None)
            if close:
                close()
            logger.close()

    def run_facts(self) -> dict[str, Any]:
        """Parameter count, FLOPs per token, mesh and per-device memory, for the run card."""
        from runner.models.gpt import flops_per_token

        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.params))
        facts: dict[str, Any] = {
            "parameters": params,
            "flops_per_token": flops_per_token(self.model_config, self.spec.train.seq_len),
            "mesh": dict(self.mesh.shape), "devices": jax.device_count(), "processes": jax.process_count(),
        }
        try:  # the compiled step knows its memory (arguments, outputs, temporaries)
            stats = self.train_executable().memory_analysis()
            facts["memory_per_device_bytes"] = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                                                + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
            facts["memory_source"] = "compiled train step: arguments + outputs + temporaries"
        except Exception:  # some backends report no memory analysis
            shards = [s.data for x in jax.tree.leaves(self.state) for s in getattr(x, "addressable_shards", [])[:1]]
            facts["memory_per_device_bytes"] = sum(int(np.prod(d.shape)) * d.dtype.itemsize for d in shards)
            facts["memory_source"] = "train state only"
        return facts

    def write_run_card(self, logger: MetricsLogger, final: bool = False) -> None:
        if not final:
            self._facts = self.run_facts()
            for line in runcard.summary_lines(self._facts):
                logger.progress.message(line)
        if jax.process_index() == 0:
            runcard.write(self.run_dir, self.spec, self._facts,
                          {**self.last_metrics, **self.last_eval} if final else None)

    def run(self) -> None:
        """Restore, train, evaluate and save; a finished run says so and does nothing."""
        self.callbacks("on_init_start", self)
        self.load()
        self.callbacks("on_init_end", self)
        if self.done:
            self.finished_already()
            return
        try:
            self.train()
        finally:
            self.checkpointer.close()

    def finished_already(self) -> None:
        if jax.process_index() == 0:
            print(f"Run {self.run_dir} already finished at step {self.step} (train.steps={self.spec.train.steps}); "
                  f"nothing to do. Raise train.steps to continue it.", flush=True)
        self.checkpointer.close()

    def _report(self, logger: MetricsLogger, timer: Timer, step: int, metrics: dict[str, jax.Array],
                tokens_per_step: int, loader: Any, guard: GuardMonitor) -> Optional[str]:
        """Read step `step`'s metrics (the step after it is already running), log them, run the
        step-end hooks, and return the guard's reason to stop, if any."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        dt, eta = timer.tick(step)
        values["tokens_per_s"] = tokens_per_step / dt if dt > 0 else 0.0
        values["tokens_seen"] = float(step * tokens_per_step)
        values["step_time_s"] = dt
        values["data_wait_s"] = float(getattr(loader, "wait_seconds", 0.0))
        if values.get("skipped"):
            self.warn(f"step {step} skipped: loss {values['loss']}, grad norm {values['grad_norm']}")
        self.last_metrics = values
        logger.progress.update(step, values, eta)
        norms_every = self.spec.debug.norms_every
        if step % self.spec.train.log_every == 0 or step == self.spec.train.steps or values.get("skipped"):
            logger.log(step, {k: values[k] for k in sorted(values) if "_norm/" not in k})
        if norms_every and step % norms_every == 0:
            logger.log(step, {k: v for k, v in values.items() if "_norm/" in k})
            if logger.wandb_run is not None:
                logger.wandb_run.log(debug.histograms(self.state.params), step=step)
        self._hook("on_step_end", self.state, values, step)
        self.callbacks("on_step_end", self, step=step, metrics=values)
        return guard.observe(step, values)

    def _log_eval(self, logger: MetricsLogger, only: Optional[Sequence[Evaluator[M]]] = None) -> None:
        """Evaluate, log metrics and texts (metrics.jsonl strings, a wandb table), show the
        headline numbers, and note checkpoint.best_metric for best-K checkpoints."""
        self.callbacks("on_eval_start", self, step=self.step)
        results = self.evaluate(only)
        self.callbacks("on_eval_end", self, step=self.step, results=results)
        texts = self.last_texts
        if results or texts:
            logger.log(self.step, {**results, **texts})
            wandb_run = getattr(logger, "wandb_run", None)
            if texts and wandb_run is not None:
                import wandb

                table = wandb.Table(columns=["step", "name", "text"],
                                    data=[[self.step, k, v] for k, v in texts.items()])
                wandb_run.log({"eval/texts": table}, step=self.step)
            shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in results.items()
                              if k.endswith(("/loss", "/acc", "/acc_norm")))
            logger.progress.message(f"eval @ step {self.step}: {shown or f'{len(results)} metrics'}")
        self._note_best(results, complete=only is None)

    def _best_metric(self) -> str:
        return ckpt.best_metric_name(self.spec.checkpoint)

    def _note_best(self, results: Mapping[str, float], complete: bool) -> None:
        """Remember this evaluation's best_metric (saved with this step's checkpoint) and keep
        meta["best"], the best value so far and its step, in every checkpoint's meta."""
        c = self.spec.checkpoint
        if not c.keep_best:
            return
        name = self._best_metric()
        if name not in results:
            if complete and results:
                problem = (f"checkpoint.best_metric={c.best_metric!r} is not a metric the evaluators log. "
                           f"Fix: use one of: {', '.join(sorted(results))}.")
                if self.step == 0:
                    raise UserError(problem)
                self.warn(problem)
            return
        if self.step == 0:  # the untrained baseline is never saved, so it is no candidate
            return
        value = float(results[name])
        self._measured = (self.step, value)
        best = self.meta.get("best") or {}
        if best.get("metric") != name or best.get("mode") != c.best_mode:
            best = {}
        if not best or (value < best["value"] if c.best_mode == "min" else value > best["value"]):
            best = {"metric": name, "mode": c.best_mode, "step": self.step, "value": value}
        self.meta["best"] = best

    def _best_metrics(self) -> Optional[dict[str, float]]:
        """{best_metric: value} when it was evaluated at this very step (else None)."""
        if not self.spec.checkpoint.keep_best or self._measured is None or self._measured[0] != self.step:
            return None
        return {self._best_metric(): self._measured[1]}

    def _summary(self, logger: MetricsLogger, seconds: float) -> None:
        spec = self.spec
        trained = self.step - (self.restored_step or 0)
        tokens = trained * spec.train.batch_size * spec.train.seq_len
        lines = [
            "",
            f"Finished {spec.job.name}: {self.step} steps ({trained} this launch), "
            f"{tokens:,} tokens in {seconds:.1f}s",
            f"  final train loss {self.last_metrics.get('loss', float('nan')):.4f}",
        ]
        lines += [f"  final eval {k.removeprefix('eval/')} {v:.4f}" for k, v in self.last_eval.items()
                  if k.endswith(("loss", "perplexity"))]
        lines.append(f"  checkpoint: {self.checkpointer.directory / str(self.step)}")
        lines.append(f"  metrics:    {self.run_dir / METRICS_FILE}")
        logger.progress.message("\n".join(lines))

    # ================================================================== mode=eval

    def run_eval(self) -> dict[str, Any]:
        """mode=eval: restore only the parameters (and step) of the checkpoint eval.checkpoint
        names (else the newest under run.dir), run every configured evaluator once, and write
        eval_results.json into that checkpoint's step directory. Nothing is reused: a rerun
        recomputes and replaces the file. No optimizer state is read or built."""
        from runner.evaluation.standalone import RESULTS_FILE, checkpoint_step_dir

        step_dir = checkpoint_step_dir(self.spec)
        abstract, sharding = self.abstract_state()
        wanted = {"step": abstract.step, "params": abstract.params, "rng": abstract.rng, "guard": abstract.guard}
        try:
            tree = ckpt.restore_tree(step_dir / ckpt.STATE, wanted, partial=True)
        except (ValueError, KeyError) as err:
            raise UserError(
                f"Cannot evaluate {step_dir}: its parameters do not fit this model "
                f"({str(err).splitlines()[0][:300]}). Fix: evaluate it with the model settings it was "
                "trained with (its checkpoints/<step>/meta holds them), or point eval.checkpoint elsewhere."
            ) from None
        self.state_sharding = sharding.replace(opt_state=())
        self.state = TrainState(step=tree["step"], apply_fn=self.model.apply, params=tree["params"],  # type: ignore[attr-defined]
                                tx=self.tx, opt_state=(), rng=tree["rng"], guard=tree["guard"])
        self.step = int(tree["step"])
        self.prepare_evaluators()
        t0 = time.perf_counter()
        metrics = self.evaluate()
        record = {
            "step": self.step,
            "checkpoint": str(step_dir),
            "metrics": metrics,
            "texts": self.last_texts,
            "evaluators": self.spec.to_dict()["eval"]["evaluators"],
            "topology": self.spec.topology,
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "seconds": time.perf_counter() - t0,
            "computed_unix": time.time(),
        }
        if jax.process_index() == 0:
            out = step_dir / RESULTS_FILE
            tmp = out.with_name(f".{RESULTS_FILE}.tmp")
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            os.replace(tmp, out)
            lines = [f"Evaluated {step_dir} (step {self.step}) in {record['seconds']:.1f}s:"]
            lines += [f"  {k.removeprefix('eval/')} {v:.4f}" for k, v in metrics.items()]
            lines += [f"  {k.removeprefix('eval/')}: {v!r}" for k, v in self.last_texts.items()]
            lines.append(f"  results: {out}")
            print("\n".join(lines), flush=True)
        return record
