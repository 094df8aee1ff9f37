"""When to stop before train.steps: a signal, a wall-clock limit, a step limit for this launch,
or a kill-switch file. Each reason is agreed across processes, and each stop saves a checkpoint, so
rerunning the same command continues the run. Its exit code says who asked: a stop you asked for (the
stop file, SIGINT) exits runner.exits.STOPPED_ON_REQUEST_EXIT_CODE, which no supervisor restarts by the
code (SkyPilot's error budget aside: docs/launching.md); the others (SIGTERM, the time and step limits)
PREEMPTED_EXIT_CODE, which every supervisor does.
Whether it was asked for is agreed too, so every process exits with the same code."""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any, Callable, Iterator, Optional

from runner.checkpoint import storage
from runner.exits import Preempted, StoppedOnRequest
from runner.parallel.distributed import any_process

REASONS = ("signal", "time limit", "launch step limit", "stop file")


class StopConditions:
    # Looking for a stop file in a bucket is a request: at most this often (locally: every check).
    REMOTE_STOP_FILE_EVERY_S = 10.0

    def __init__(self, spec: Any, run_dir: Any, start_step: int, clock: Callable[[], float] = time.monotonic,
                 warn: Callable[[str], None] = lambda text: print(f"warning: {text}", flush=True)) -> None:
        self.spec, self.warn = spec, warn
        self._stop_file_failed = False
        self.start_step = start_step
        self.clock = clock
        self.started = clock()
        self.signal: Optional[int] = None
        stop_file = spec.train.stop_file
        absolute = stop_file.startswith("/") or storage.is_remote(stop_file)
        self.stop_file = (storage.path(stop_file) if absolute else run_dir / stop_file) if stop_file else None
        self._stop_file_every_s = self.REMOTE_STOP_FILE_EVERY_S if storage.is_remote(self.stop_file or "") else 0.0
        self._stop_file_looked = -float("inf")
        self.longest_step_s = 0.0
        self._asked = False  # this process saw a stop you asked for (the stop file, SIGINT)
        self.on_request = False  # agreed across processes once a stop is: any process saw one asked for

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signal = signum

    @contextlib.contextmanager
    def catching_signals(self) -> Iterator[None]:
        """While training, SIGTERM and SIGINT are a stop request (saved, then exit 75; SIGINT, a person's,
        76), not an abrupt end."""
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _local(self, step: int, step_seconds: float) -> Optional[str]:
        if self.signal is not None:
            self._asked = self.signal == signal.SIGINT
            return f"signal {signal.Signals(self.signal).name}"
        limit = self.spec.train.time_limit_minutes * 60
        if limit:
            self.longest_step_s = max(self.longest_step_s, step_seconds)
            # leave room for a few more steps and a final save
            margin = 3 * self.longest_step_s + self.spec.train.time_limit_margin_s
            if self.clock() - self.started + margin >= limit:
                return f"the time limit (train.time_limit_minutes={self.spec.train.time_limit_minutes})"
        if self.stop_file is not None and self.clock() - self._stop_file_looked >= self._stop_file_every_s:
            self._stop_file_looked = self.clock()
            if self._stop_file_present():
                self._asked = True
                return f"the stop file {self.stop_file}"  # removed by consume_stop_file once honoured
        return None

    def _stop_file_present(self) -> bool:
        """A look that fails (a bucket answering 503 past its client's retries) is not a stop
        request and must not end the run: it is warned about once (by the process that saw it) and
        tried again at the next look. Whether the storage is down for good is the durable tier's
        call, at its next save."""
        assert self.stop_file is not None
        try:
            return bool(self.stop_file.exists())
        except Exception as err:
            if not self._stop_file_failed:
                self.warn(f"cannot look for the stop file {self.stop_file} ({type(err).__name__}: "
                          f"{str(err)[:200]}); training goes on and it is looked for again later.")
            self._stop_file_failed = True
            return False

    def check(self, step: int, step_seconds: float, processes: int) -> Optional[str]:
        """The agreed reason to stop at this step boundary, or None. With several processes the
        local reasons are combined every `distributed.stop_check_every` steps (a tiny allgather),
        not every step."""
        launch_limit = self.spec.train.max_steps_this_launch
        # the same step on every host; a limit that falls on the last step lets the run finish
        if launch_limit and step - self.start_step >= launch_limit and step < self.spec.train.steps:
            return f"the step limit for this launch (train.max_steps_this_launch={launch_limit})"
        if processes == 1:
            local = self._local(step, step_seconds)
            self.on_request = local is not None and self._asked
            return local
        if step % self.spec.distributed.stop_check_every:
            return None
        local = self._local(step, step_seconds)
        if any_process(local is not None):
            self.on_request = any_process(local is not None and self._asked)  # one exit code on every process
            return local or "a stop request from another process"
        return None


def stopped(conditions: "StopConditions", reason: str, step: int, logger: Any) -> Preempted:
    """A stop honoured, once its save is done: the stop file removed, the run told how to resume,
    the logger's ending marked preempted (resumable). Returns the exception that exits with the
    stop's code: 76 when asked for, else 75."""
    stop = StoppedOnRequest() if conditions.on_request else Preempted()
    consume_stop_file(conditions)
    logger.progress.message(f"stopped by {reason} at step {step}; checkpoint saved. Rerun the same command to resume.")
    logger.ending(stop.exit_code, preempted=True)
    return stop


def consume_stop_file(conditions: "StopConditions") -> None:
    """Remove the stop file once a stop asked for is saved, so rerunning continues (process 0; the
    file may be what another process saw)."""
    import jax

    if conditions.on_request and conditions.stop_file is not None and jax.process_index() == 0:
        conditions.stop_file.unlink(missing_ok=True)
