"""Fault injection for the restore tests: SIGKILL this process at a chosen point.

RUNNER_FAULT=kill_at_step:N      die right after step N has been dispatched (before its own save,
                                 once earlier saves have committed: "between checkpoints")
RUNNER_FAULT=kill_after_save:N   die right after the asynchronous save of step N has started,
                                 while it is still being written
RUNNER_FAULT=stall_in_step:N     stop for good as step N is about to be dispatched (a read that never
                                 returns): the watchdog's case (run.hang_timeout)
RUNNER_FAULT=wedge_in_step:N     the same, in a native call that holds the interpreter lock, so no
                                 Python thread of this process runs again (a wedged driver)
RUNNER_FAULT=slow_steps:S        every step takes S seconds more (a run a test can change mid-way)

`@P` after N limits a fault to process P (`stall_in_step:6@1`); without it every process acts.
RUNNER_FAULT_ATTEMPT=K limits it to the K-th attempt of a supervisor that restarts the run and says
which attempt it is in RUNNER_ATTEMPT (the Ray launcher), so the restarted run gets past it.

The kill is a real SIGKILL, so nothing gets a chance to clean up, exactly as in a preemption
without notice. It rides on the loop's components and the callbacks: unset (the normal case),
neither list holds anything of it, and the loop never looks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any, Callable

from runner.train.loop import Component, Loop

_spec = os.environ.get("RUNNER_FAULT", "")
_event, _, _where = _spec.partition(":")
_step, _, _process = _where.partition("@")


_attempt = os.environ.get("RUNNER_FAULT_ATTEMPT", "")


def armed(event: str, step: int) -> bool:
    if not (_spec and event == _event and str(step) == _step):
        return False
    if _attempt and os.environ.get("RUNNER_ATTEMPT", "1") != _attempt:
        return False
    if _process:
        import jax

        return str(jax.process_index()) == _process
    return True


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


def stall_in_step() -> None:
    """Never returns; sleeps, so this process's other threads (the watchdog's) go on."""
    while True:
        time.sleep(3600)


def wedge_in_step() -> None:
    """Never returns, holding the interpreter lock: libc's sleep called through ctypes.PyDLL,
    which (unlike CDLL) does not release it."""
    while True:
        ctypes.PyDLL(None).sleep(3600)


class StallInStep(Component):
    """stall_in_step / wedge_in_step: before step N is dispatched, this process stops for good."""

    def before_step(self, loop: Loop, step: int) -> None:
        if armed("stall_in_step", step):
            stall_in_step()
        if armed("wedge_in_step", step):
            wedge_in_step()


class SlowSteps(Component):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def before_step(self, loop: Loop, step: int) -> None:
        time.sleep(self.seconds)


def components(wait_for_saves: Callable[[], None]) -> list[Component]:
    if _event == "kill_at_step":
        return [KillAtStep(wait_for_saves)]
    if _event == "slow_steps":
        return [SlowSteps(float(_step))]
    return [StallInStep()] if _event in ("stall_in_step", "wedge_in_step") else []


def callbacks() -> list[Any]:
    return [KillAfterSave()] if _event == "kill_after_save" else []
