"""Fault injection for the restore tests: SIGKILL this process at a chosen point.

RUNNER_FAULT=kill_at_step:N      die right after step N has been dispatched (before its own save,
                                 once earlier saves have committed: "between checkpoints")
RUNNER_FAULT=kill_after_save:N   die right after the asynchronous save of step N has started,
                                 while it is still being written

The kill is a real SIGKILL, so nothing gets a chance to clean up, exactly as in a preemption
without notice. Unset (the normal case), every call is a dictionary lookup.
"""

from __future__ import annotations

import os
import signal

_spec = os.environ.get("RUNNER_FAULT", "")
_event, _, _step = _spec.partition(":")


def armed(event: str, step: int) -> bool:
    return bool(_spec) and event == _event and str(step) == _step


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
