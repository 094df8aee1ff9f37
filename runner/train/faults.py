"""Fault injection for the restore tests: SIGKILL this process at a chosen point.

RUNNER_FAULT=kill_at_step:N      die right after step N has been dispatched (before its own save,
                                 once earlier saves have committed: "between checkpoints")
RUNNER_FAULT=kill_after_save:N   die right after the asynchronous save of step N has started,
                                 while it is still being written

The kill is a real SIGKILL, so nothing gets a chance to clean up, exactly as in a preemption
without notice. It rides on the loop's components and the callbacks: unset (the normal case),
neither list holds anything of it, and the loop never looks.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

from runner.train.loop import Component, Loop

_spec = os.environ.get("RUNNER_FAULT", "")
_event, _, _step = _spec.partition(":")


def armed(event: str, step: int) -> bool:
    return bool(_spec) and event == _event and str(step) == _step


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAtStep(Component):
    """kill_at_step: placed before the checkpoint component, so step N's own save never starts."""

    def __init__(self, wait_for_saves: Callable[[], None]) -> None:
        self.wait_for_saves = wait_for_saves

    def after_step(self, loop: Loop, step: int) -> None:
        if armed("kill_at_step", step):
            self.wait_for_saves()
            die()


class KillAfterSave:
    """kill_after_save: a callback on the end of the save call, when the write is under way."""

    def on_save_end(self, trainer: Any, step: int, **_: Any) -> None:
        if armed("kill_after_save", step):
            die()


def components(wait_for_saves: Callable[[], None]) -> list[Component]:
    return [KillAtStep(wait_for_saves)] if _event == "kill_at_step" else []


def callbacks() -> list[Any]:
    return [KillAfterSave()] if _event == "kill_after_save" else []
