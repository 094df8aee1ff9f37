"""What a job compiles: the optimizer and schedule it chose, the train state's shapes and
shardings, the sharded init, and the jitted train and val steps over the job's mesh.

Everything here is computed from the job's choices without touching a device until asked
(`init_state`, `train_executable`), so mode=compile builds the very program training runs on a
topology's compile-only devices. Nothing here reads or writes files or runs a loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax

from runner.models.common.layers import MODEL_STATE
from runner.optim import build_optimizer, build_schedule, offload, optimizer_settings, schedule_extra
from runner.optim.optimizers import param_axis_names
from runner.parallel.mesh import microbatch_sharding
from runner.spec import ExecutionSpec
from runner.train import state as st
from runner.train import steps
from runner.train.state import TrainState


class Chooser(Protocol):
    """What a program is built from (BaseTrainer): the spec, mesh, model and data, and the job's
    own choices of inputs, optimizer, schedule and step functions (the seed API)."""

    spec: ExecutionSpec
    mesh: jax.sharding.Mesh
    model: Any
    strategy: Any
    logical_axis_rules: Sequence[tuple[str, Any]]
    train_step: Callable[..., Any]
    val_step: Callable[..., Any]

    def init_args(self) -> tuple[Any, ...]: ...

    def optimizer(self) -> str | optax.GradientTransformation: ...

    def schedule(self) -> Optional[str | optax.Schedule]: ...


class Program:
    """The compiled side of one job. `state_sharding` may be replaced (mode=eval drops the
    optimizer state's) before the steps are first built."""

    def __init__(self, job: Chooser) -> None:
        self.job, self.spec, self.mesh = job, job.spec, job.mesh
        offload.check_devices(self.spec.optimizer.offload, self.mesh.devices.flat)
        self.lr_schedule = self._schedule()
        self.tx = self.optimizer_with(self.lr_schedule)

    def _schedule(self) -> optax.Schedule:
        s, o, t = self.spec.schedule, self.spec.optimizer, self.spec.train
        chosen = self.job.schedule()
        if chosen is None:
            return optax.constant_schedule(o.lr)
        if callable(chosen):
            return chosen
        return build_schedule(chosen or s.name, o.lr, t.steps, min(s.warmup_steps, t.steps),
                              o.lr * s.final_lr_fraction, schedule_extra(self.spec))

    def optimizer_with(self, schedule: optax.Schedule) -> optax.GradientTransformation:
        """The job's optimizer following `schedule`: the state's (`self.lr_schedule`), and the one the
        train step builds around the same schedule reading its lengths from the step's arguments."""
        if "_optimizer_settings" not in self.__dict__:
            params = nn.meta.unbox(self.abstract_variables)["params"]
            self._optimizer_settings = (self.job.optimizer() or self.spec.optimizer.name, dataclasses.replace(
                optimizer_settings(self.spec), param_axes=param_axis_names(params, self.param_specs)))
        chosen, settings = self._optimizer_settings
        return build_optimizer(chosen, schedule, settings, self.spec.optimizer.clip_norm,
                               self.spec.optimizer.state_dtype)

    def context(self) -> contextlib.ExitStack:
        """Mesh and logical-axis rules, active while tracing so activation constraints apply."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.job.logical_axis_rules))
        return stack

    @functools.cached_property
    def abstract_variables(self) -> Any:
        """The model's variables as shapes, still boxed with their logical axis names."""
        return st.abstract_variables(self.job.model, jax.random.PRNGKey(self.spec.seed), self.job.init_args())

    @property
    def param_specs(self) -> Any:
        """The parameters' logical partition specs (axis names per dimension)."""
        return nn.get_partition_spec(self.abstract_variables)["params"]

    def abstract_state(self) -> tuple[Any, Any]:
        """(abstract state, its shardings), computed without touching a device."""
        variables = nn.meta.unbox(self.abstract_variables)  # the model is traced once, here
        return st.abstract_state(functools.partial(st.state_around, self.job.model, self.tx,
                                                   guard_window=self.spec.guard.spike_window),
                                 (jax.random.PRNGKey(self.spec.seed), variables["params"],
                                  variables.get(MODEL_STATE, {})), self.param_specs, self.mesh,
                                 self.job.logical_axis_rules, offload=self.spec.optimizer.offload == "host")

    @functools.cached_property
    def state_sharding(self) -> Any:
        return self.abstract_state()[1]

    def create_state(self, key: jax.Array) -> TrainState:
        """A fresh state from `key` (traced: `init_state` runs it sharded)."""
        return st.create_state(self.job.model, self.tx, key, self.job.init_args(), self.spec.guard.spike_window)

    def init_state(self) -> TrainState:
        """A fresh state, every array created directly on its devices."""
        sharding = self.state_sharding  # outside the mesh context: unboxing under it would constrain shapes
        with self.context():
            return st.init_sharded(self.create_state, sharding, jax.random.PRNGKey(self.spec.seed))

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global (S, B, T) batch the train step takes, as shapes with shardings (the row shapes
        and dtypes of the job's own data pipeline)."""
        t = self.spec.train
        example = self.job.strategy.train(t.seq_len, self.spec.seed, global_batch=t.batch_size)[0]
        return steps.abstract_batch(self.spec, self.mesh, example)

    @functools.cached_property
    def train_step(self) -> steps.Bound:
        """The jitted (not yet compiled) train step; mode=compile lowers this same function. Called
        and lowered as (state, batch); the schedule's lengths are its bound values (`steps.Bound`)."""
        return steps.make_train_step(self.job.train_step, self.spec, self.lr_schedule, self.state_sharding, self.mesh,
                                     self.optimizer_with)

    @functools.cached_property
    def val_step(self) -> Any:
        return steps.make_val_step(self.job.val_step, self.state_sharding, self.mesh)

    def train_executable(self, state: Optional[TrainState] = None) -> Any:
        """The train step compiled ahead of time, once: the loop runs it, and its memory analysis
        feeds the run card."""
        if "_train_executable" not in self.__dict__:
            state = state if state is not None else self.abstract_state()[0]  # outside the mesh context, as above
            with self.context():
                self._train_executable = self.train_step.lower(state, self.abstract_batch()).compile()
        return self._train_executable

    def to_device(self, local: Mapping[str, np.ndarray]) -> steps.Batch:
        """Assemble global (S, B, T) arrays from this process's rows."""
        sharding = microbatch_sharding(self.mesh)
        if jax.process_count() == 1:  # one batched transfer: about a third cheaper per step
            return jax.device_put(dict(local), sharding)
        return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()}
