"""Every exit code of `python -m runner`, and the exceptions that end a run with one.

0 finished; 1 a run that stopped itself after saving its last good state (a guard, a failing
hook); 2 a usage error (one paragraph, no traceback); 3 mode=compile found that the step does not
fit; 75 (EX_TEMPFAIL) stopped early on request after saving: rerun the same command to resume.
"""

from __future__ import annotations

# Each constant's comment is its line in docs/reference/exit-codes.md (tools/reference.py).
HALTED_EXIT_CODE = 1  # the run stopped itself after saving its last good state: the numerical guard or a hook
USAGE_EXIT_CODE = 2  # a usage error (a setting, missing data, an unwritable path): one paragraph, no traceback
DOES_NOT_FIT_EXIT_CODE = 3  # mode=compile found that the train step does not fit in the chips' memory
# EX_TEMPFAIL: stopped early after saving (SIGTERM, a time or step limit, the stop file, the watchdog, storage
# down): rerun the same command to resume
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
