"""Callbacks: user code that runs at the lifecycle points of a run, selected from config.

`callbacks=[my_pkg.hooks:MyCallback]` constructs each class with the ExecutionSpec. A callback
defines any of the methods below (all optional); each receives the trainer and keyword details.
A callback (or a trainer hook) that raises stops the run: the last good state is saved and the
message names the hook. `on_step_end` runs when a step's metrics are read, which is one step
late (after the next step has been dispatched), so the loop never waits for the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from runner.exits import HookError
from runner.registry import Registry

if TYPE_CHECKING:
    from runner.spec import ExecutionSpec

EVENTS = (
    "on_init_start", "on_init_end", "on_train_start", "on_train_end", "on_step_start", "on_step_end",
    "on_eval_start", "on_eval_end", "on_save_start", "on_save_end",
)

CALLBACKS: Registry[type] = Registry("callback", "callbacks")


class CallbackList:
    """Calls one event on every configured callback, naming the culprit if one raises."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = list(callbacks)
        self._by_event = {e: [(cb, getattr(cb, e)) for cb in self.callbacks if callable(getattr(cb, e, None))]
                          for e in EVENTS}

    @classmethod
    def from_spec(cls, spec: "ExecutionSpec") -> "CallbackList":
        return cls([CALLBACKS.get(name)(spec) for name in spec.callbacks])

    def __call__(self, event: str, trainer: Any, **info: Any) -> None:
        for cb, method in self._by_event[event]:
            try:
                method(trainer, **info)
            except Exception as err:
                raise HookError(f"{type(cb).__module__}.{type(cb).__qualname__}.{event}", err) from err


def check_spec(spec: "ExecutionSpec") -> None:
    """The callbacks list: every entry imports."""
    for name in spec.callbacks:
        CALLBACKS.get(name)
