"""Every exit code of `python -m runner`, and the exceptions that end a run with one.

Each outcome a supervisor must tell apart has a code of its own, so every supervisor (Ray's
launcher, `tools/launch_tpu.py --restart`, a SLURM resubmission, a shell loop; SkyPilot as far as
its settings allow) decides by the code alone, never by what the run printed: 0 finished;
2, 3, 65 and 76 are ends a rerun cannot change (a setting, does not fit, a halt, a stop the user
asked for); 75 and a crash (1, or a signal's 128 + N) are what running the same command again may
fix, and it resumes from the newest checkpoint. The codes above 3 are in sysexits' range (64-78),
which no shell or signal uses (a signal is 128 + N, the shell's own 126-127). `restartable` is the
rule; docs/launching.md, "What restarts what", what each supervisor does with it.

This module imports nothing: tools that must run without runner's dependencies (tools/launch_tpu.py,
tools/sky_task.py) read it by its path.
"""

from __future__ import annotations

from typing import Iterable

# Each constant's comment is its line in docs/reference/exit-codes.md (tools/reference.py).

# a crash: an uncaught exception (Python's own exit, with its traceback); a rerun may fix it
CRASHED_EXIT_CODE = 1
USAGE_EXIT_CODE = 2  # a usage error (a setting, missing data, an unwritable path): one paragraph, no traceback
DOES_NOT_FIT_EXIT_CODE = 3  # mode=compile found that the train step does not fit in the chips' memory
# EX_DATAERR: the run halted itself after saving its last good state (the numerical guard, a raising hook, a
# spike with nothing to rewind to); a rerun would halt again: fix the cause first
HALTED_EXIT_CODE = 65
# EX_TEMPFAIL: stopped early after saving (SIGTERM, a time or step limit for this launch, the watchdog, storage
# down): rerun the same command to resume, as every supervisor does
PREEMPTED_EXIT_CODE = 75
# stopped after saving because you asked (the stop file, SIGINT or Ctrl-C, `launch_tpu.py stop`): not restarted
# (SkyPilot cannot tell it from a crash: see docs/launching.md); rerun the same command when you want it to go on
STOPPED_ON_REQUEST_EXIT_CODE = 76

# Never run again by a supervisor: finished, or an end a rerun cannot change; 130 (128 + SIGINT) is Ctrl-C
# before training catches it, a person's stop too.
NEVER_RESTARTED = (0, USAGE_EXIT_CODE, DOES_NOT_FIT_EXIT_CODE, HALTED_EXIT_CODE, STOPPED_ON_REQUEST_EXIT_CODE,
                   128 + 2)


def restartable(code: int) -> bool:
    """Whether a supervisor runs the same command again after exit `code`: 75 and every crash, not the
    ends in NEVER_RESTARTED. A negative code is a process killed by that signal, as Python's subprocess
    reports it (-9: SIGKILL), the shell's 128 + N."""
    return (128 - code if code < 0 else code) not in NEVER_RESTARTED


def of_members(codes: Iterable[int]) -> int:
    """The exit code of a sweep, from its members' (each independent of the others): one that a rerun
    may fix first (the rerun skips the finished members), else the first other failure, else 0."""
    failed = [c for c in codes if c]
    return next((c for c in failed if restartable(c)), failed[0] if failed else 0)


class Preempted(Exception):
    """Raised after a stop-early save completed; the CLI exits with PREEMPTED_EXIT_CODE."""

    exit_code = PREEMPTED_EXIT_CODE


class StoppedOnRequest(Preempted):
    """A stop the user asked for (the stop file, SIGINT), saved: resumable, but not to be restarted."""

    exit_code = STOPPED_ON_REQUEST_EXIT_CODE


class TrainingHalted(Exception):
    """The numerical guard stopped the run after saving the last good state."""

    exit_code = HALTED_EXIT_CODE


class HookError(Exception):
    """A hook raised; the run saves its last good state and stops."""

    exit_code = HALTED_EXIT_CODE

    def __init__(self, hook: str, error: BaseException) -> None:
        self.hook = hook
        super().__init__(f"hook {hook} raised {type(error).__name__}: {error}")
