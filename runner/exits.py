"""Every exit code of `python -m runner`, and the exceptions that end a run with one.

0 finished; 1 a run that stopped itself after saving its last good state (a guard, a failing
hook); 2 a usage error (one paragraph, no traceback); 3 mode=compile found that the step does not
fit; 75 (EX_TEMPFAIL) stopped early on request after saving: rerun the same command to resume.
"""

from __future__ import annotations

HALTED_EXIT_CODE = 1
USAGE_EXIT_CODE = 2
DOES_NOT_FIT_EXIT_CODE = 3
PREEMPTED_EXIT_CODE = 75


class Preempted(Exception):
    """Raised after a stop-early save completed; the CLI exits with PREEMPTED_EXIT_CODE."""

    exit_code = PREEMPTED_EXIT_CODE


class TrainingHalted(Exception):
    """The numerical guard stopped the run after saving the last good state."""

    exit_code = HALTED_EXIT_CODE


class HookError(Exception):
    """A hook raised; the run saves its last good state and stops."""

    exit_code = HALTED_EXIT_CODE

    def __init__(self, hook: str, error: BaseException) -> None:
        self.hook = hook
        super().__init__(f"hook {hook} raised {type(error).__name__}: {error}")
