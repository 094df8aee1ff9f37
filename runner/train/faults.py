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
RUNNER_FAULT=hold_alone:N        a run of one process waits before step N until it is signalled
                                 (SIGTERM, SIGINT), then goes on to stop as any signalled run does:
                                 an elastic group shrunk to one host stays up until it is regrown

`@P` after N limits a fault to process P (`stall_in_step:6@1`); without it every process acts.
`#K` at the end limits it to the K-th attempt of a supervisor that restarts the run and says which
attempt it is in RUNNER_ATTEMPT (the Ray launcher), so the restarted run gets past it
(`kill_at_step:6@1#1`). Several faults are separated by commas (`slow_steps:1,hold_alone:16`).

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


def parse(spec: str) -> dict[str, tuple[str, str, str]]:
    """`event:N@P#K,...` as {event: (N, P, K)} (P empty: every process; K empty: every attempt)."""
    faults = {}
    for one in filter(None, (part.strip() for part in spec.split(","))):
        event, _, where = one.partition(":")
        where, _, attempt = where.partition("#")
        step, _, process = where.partition("@")
        faults[event] = (step, process, attempt)
    return faults


def _faults() -> dict[str, tuple[str, str, str]]:
    """The faults asked for, read when a run asks (not on import: a process forked from one that
    imported runner has an environment of its own)."""
    return parse(os.environ.get("RUNNER_FAULT", ""))


def armed(event: str, step: int) -> bool:
    faults = _faults()
    if event not in faults or faults[event][0] != str(step):
        return False
    _, process, attempt = faults[event]
    if attempt and os.environ.get("RUNNER_ATTEMPT", "1") != attempt:
        return False
    if process:
        import jax

        return str(jax.process_index()) == process
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


class HoldAlone(Component):
    """hold_alone: before step N, a lone process sleeps until a signal is recorded in `signalled`."""

    def __init__(self, signalled: Callable[[], bool]) -> None:
        self.signalled = signalled

    def before_step(self, loop: Loop, step: int) -> None:
        if armed("hold_alone", step):
            import jax

            while jax.process_count() == 1 and not self.signalled():
                time.sleep(0.1)


def components(wait_for_saves: Callable[[], None], signalled: Callable[[], bool]) -> list[Component]:
    made: list[Component] = []
    faults = _faults()
    if "kill_at_step" in faults:
        made.append(KillAtStep(wait_for_saves))
    if "slow_steps" in faults:
        made.append(SlowSteps(float(faults["slow_steps"][0])))
    if "stall_in_step" in faults or "wedge_in_step" in faults:
        made.append(StallInStep())
    if "hold_alone" in faults:
        made.append(HoldAlone(signalled))
    return made


def callbacks() -> list[Any]:
    return [KillAfterSave()] if "kill_after_save" in _faults() else []
