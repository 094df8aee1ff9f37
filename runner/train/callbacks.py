"""Hooks: user code that runs at the points of a run, as one loop component.

`callbacks=[my_pkg.hooks:MyCallback]` constructs each class with the ExecutionSpec. A callback
defines any of the EVENTS below (all optional); each receives the trainer and keyword details. A
job class may also override the trainer's own `on_step_start(state, step)` and
`on_step_end(state, metrics, step)`. Both kinds run through `Callbacks`, a loop component: the
loop's step events become on_step_start / on_step_end (the trainer's hook first), and the run's
other events reach the callbacks through `dispatch`. A hook that raises stops the run: the last
good state is saved and the message names the hook (`call_hook`). `on_step_end` runs when a
step's metrics are read, which is one step late (after the next step has been dispatched), so the
loop never waits for the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from runner.exits import HookError
from runner.registry import Registry
from runner.train.loop import Component, Loop

if TYPE_CHECKING:
    from runner.spec import ExecutionSpec

EVENTS = (
    "on_init_start", "on_init_end", "on_train_start", "on_train_end", "on_step_start", "on_step_end",
    "on_eval_start", "on_eval_end", "on_save_start", "on_save_end", "on_rewind",
)

CALLBACKS: Registry[type] = Registry("callback", "callbacks")


def call_hook(owner: Any, event: str, *args: Any, **info: Any) -> None:
    """`owner.<event>(*args, **info)`, if `owner` defines it: the one place where a user hook's
    failure becomes a HookError, named `<module>.<class>.<event>`, so the run saves and says whose."""
    method = getattr(owner, event, None)
    if not callable(method):
        return
    try:
        method(*args, **info)
    except Exception as err:
        raise HookError(f"{type(owner).__module__}.{type(owner).__qualname__}.{event}", err) from err


class Callbacks(Component):
    """The trainer's step hooks and the configured callbacks (and the fault points' own,
    runner.train.faults), in that order at every event."""

    def __init__(self, trainer: Any, callbacks: Sequence[Any]) -> None:
        self.trainer = trainer
        self.callbacks = list(callbacks)
        self.last_metrics: dict[str, float] = {}  # the newest step's, as the hooks saw them

    @classmethod
    def from_spec(cls, spec: "ExecutionSpec", trainer: Any, extra: Sequence[Any] = ()) -> "Callbacks":
        return cls(trainer, [*(CALLBACKS.get(name)(spec) for name in spec.callbacks), *extra])

    def dispatch(self, event: str, **info: Any) -> None:
        """One of the EVENTS on every callback that defines it, with the trainer and `info`."""
        for callback in self.callbacks:
            call_hook(callback, event, self.trainer, **info)

    def before_step(self, loop: Loop, step: int) -> None:
        call_hook(self.trainer, "on_step_start", self.trainer.state, step)
        self.dispatch("on_step_start", step=step)

    def on_metrics(self, loop: Loop, step: int, metrics: dict[str, float]) -> None:
        self.last_metrics = dict(metrics)
        call_hook(self.trainer, "on_step_end", self.trainer.state, metrics, step)
        self.dispatch("on_step_end", step=step, metrics=dict(metrics))

    def rewound(self, loop: Loop, step: int) -> None:
        self.dispatch("on_rewind", step=step)  # the steps after `step` are undone (runner.train.rewind)


def check_spec(spec: "ExecutionSpec") -> None:
    """The callbacks list: every entry imports."""
    for name in spec.callbacks:
        CALLBACKS.get(name)
