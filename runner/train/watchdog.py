"""run.hang_timeout: a watchdog that ends a run stuck on a host, so whatever supervises it relaunches.

A host can be alive and stuck: a collective whose partner never arrives, a data read that never
returns, a wedged accelerator. Nothing fails, so nothing restarts; the pod waits forever. The
watchdog is a thread on every process that watches for progress (a step read, a save or an
evaluation starting or ending). When none comes for the timeout it writes every thread's Python
stack and the last step it saw to `<run.dir>/hangs/process-<i>.txt`, says so in one line, tells the
other processes through the coordination service, and exits 75 (the code every supervisor runner
documents relaunches on). A process that is told stops the same way, even if its own timer would
fire later or never (a stuck collective may leave only one process able to notice).

A process so wedged that Python cannot run at all (a native call holding the interpreter lock) is
ended by faulthandler's own C timer, re-armed by the thread: it writes the stacks to stderr and
can only exit 1; the other processes still exit 75.

The timeout: a duration (`90s`, `10m`, `1h`, a bare number of seconds) applies from the first step
of a launch to its end; `auto` arms once the first step is read, at the largest of ten minutes,
three compile times and twenty median steps (an evaluation may take three times the longest one
before it, a save the storage bound more); `0` turns it off.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Optional

from runner.exits import PREEMPTED_EXIT_CODE
from runner.spec import duration_seconds
from runner.train.loop import Component, Loop

AUTO_FLOOR_S = 600.0
AUTO_COMPILES = 3.0
AUTO_STEPS = 20.0
AUTO_EVALS = 3.0
ACK_WAIT_S = 10.0  # how long a stopping process waits for the others to have heard (process 0 hosts the service)
# faulthandler's C timer fires this long after the Python thread should have (which cancels it first)
FALLBACK_GRACE_S = 5.0
HANG_KEY = "runner/watchdog/hang"
ACK_PREFIX = "runner/watchdog/ack/"
GONE_PREFIX = "runner/watchdog/gone/"
GONE_GRACE_S = 1.0  # after the last peer said it leaves: its os._exit is microseconds away


class Peers:
    """The other processes of the run, through jax.distributed's key-value store (no devices: a
    stuck collective does not block it). One process: nobody to tell."""

    def __init__(self, index: int, count: int, client: Any = None) -> None:
        self.index, self.count, self.client = index, count, client

    @classmethod
    def of_this_run(cls) -> "Peers":
        import jax

        client = None
        if jax.process_count() > 1:
            from jax._src.distributed import global_state

            client = global_state.client
        return cls(jax.process_index(), jax.process_count(), client)

    def hang_reported(self) -> Optional[str]:
        if self.client is None:
            return None
        try:
            return self.client.key_value_try_get(HANG_KEY)
        except Exception:  # not set (NOT_FOUND), or the service is gone: nothing to act on here
            return None

    def report_hang(self, text: str) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):  # another process reported first
                self.client.key_value_set(HANG_KEY, text)

    def acknowledge(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{ACK_PREFIX}{self.index}", "1")

    def wait_for_all(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """Until every process has acknowledged (or `timeout_s`): leaving first would take the
        coordination service (on process 0) away from those still writing their stacks."""
        if self.client is None:
            return
        deadline = clock() + timeout_s
        while clock() < deadline:
            try:
                if len(self.client.key_value_dir_get(ACK_PREFIX)) >= self.count:
                    return
            except Exception:
                return
            time.sleep(0.2)

    def leave_in_order(self, leave: Callable[[int], None], code: int, timeout_s: float) -> None:
        """Process 0 hosts the coordination service and leaves last: a peer still alive when it
        goes is aborted by jax's error poller (exit -6, not `code`). The others leave at once."""
        if self.client is None or self.index != 0:
            if self.client is not None:
                with contextlib.suppress(Exception):
                    self.client.key_value_set(f"{GONE_PREFIX}{self.index}", "1")
            leave(code)
            return
        from jax.errors import JaxRuntimeError

        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                try:
                    gone = len(self.client.key_value_dir_get(GONE_PREFIX))
                except JaxRuntimeError:  # the client's own error (the service failing): stop waiting
                    break
                if gone >= self.count - 1:
                    time.sleep(GONE_GRACE_S)
                    break
                time.sleep(0.1)
        finally:  # leaves with `code` whatever the wait met; any other error surfaces if `leave` returns
            leave(code)


class Watchdog(Component):
    """Progress is a beat; a thread checks the time since the last one against the limit."""

    def __init__(self, setting: str, run_dir: Any, peers: Peers, compile_seconds: Callable[[], float],
                 storage_bound_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 leave: Callable[[int], None] = os._exit, poll_s: Optional[float] = None,
                 say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True),
                 use_faulthandler: bool = True) -> None:
        self.setting, self.run_dir, self.peers = setting, run_dir, peers
        self.fixed = duration_seconds(setting) if setting != "auto" else None
        self.compile_seconds, self.storage_bound_s = compile_seconds, storage_bound_s
        self.clock, self.leave, self.say = clock, leave, say
        self.poll_s = poll_s if poll_s is not None else min(1.0, (self.fixed or 10.0) / 10)
        self.use_faulthandler = use_faulthandler
        self.last_beat = clock()
        self.last_what = "the start of the loop"
        self.step_read = 0  # the newest step whose metrics were read: done on this process
        self.step_times: list[float] = []
        self.longest: dict[str, float] = {"eval": 0.0, "save": 0.0}
        self.phase = "loop"
        self.armed = False
        self.fired = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._fallback_deadline: Optional[float] = None

    @classmethod
    def for_run(cls, spec: Any, run_dir: Any, compile_seconds: Callable[[], float]) -> Optional["Watchdog"]:
        if duration_seconds(spec.run.hang_timeout) == 0:
            return None
        return cls(spec.run.hang_timeout, run_dir, Peers.of_this_run(), compile_seconds,
                   storage_bound_s=spec.checkpoint.storage_timeout_minutes * 60)

    # ------------------------------------------------------------------ progress

    def beat(self, what: str) -> None:
        self.last_beat, self.last_what = self.clock(), what

    @contextlib.contextmanager
    def busy(self, phase: str, step: int) -> Iterator[None]:
        """Around a save or an evaluation: progress at both ends, its own allowance between."""
        before, start = self.phase, self.clock()
        self.phase = phase
        self.beat(f"the {phase} at step {step} started")
        try:
            yield
        finally:
            self.longest[phase] = max(self.longest[phase], self.clock() - start)
            self.phase = before
            self.beat(f"the {phase} at step {step} ended")

    def limit(self) -> Optional[float]:
        """Seconds without progress allowed now; None: not armed (before the first step)."""
        if self.fixed is not None:
            return self.fixed if self.armed else None
        if not self.step_times:
            return None
        base = max(AUTO_FLOOR_S, AUTO_COMPILES * self.compile_seconds(),
                   AUTO_STEPS * statistics.median(self.step_times))
        if self.phase == "eval":
            return max(base, AUTO_EVALS * self.longest["eval"])
        if self.phase == "save":
            return base + self.storage_bound_s
        return base

    # ------------------------------------------------------------------ the loop's component

    def start(self, loop: Loop) -> None:
        self.beat(f"the start of the loop at step {loop.holder.step}")
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="runner-watchdog", daemon=True)
            self._thread.start()

    def before_step(self, loop: Loop, step: int) -> None:
        # a duration applies from the first step on: the evaluation at the loop's start compiles
        # its program first, which may take longer than a timeout sized for steps
        self.armed = True
        self.beat(f"step {step} being dispatched")

    def on_metrics(self, loop: Loop, step: int, metrics: dict[str, float]) -> None:
        if self.step_read and loop.step_seconds > 0:
            self.step_times.append(loop.step_seconds)
            del self.step_times[:-200]
        self.step_read = step
        self.beat(f"step {step} done")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.use_faulthandler and self._fallback_deadline is not None:
            faulthandler.cancel_dump_traceback_later()
            self._fallback_deadline = None

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check():
                return

    def check(self) -> bool:
        """One look: told by another process, or no progress for the limit. True once it fired."""
        told = self.peers.hang_reported()
        if told is not None and not self.fired:
            self.fire(told=told)
            return True
        limit = self.limit()
        self._arm_fallback(limit)
        if limit is not None and self.clock() - self.last_beat > limit and not self.fired:
            self.fire()
            return True
        return False

    def _arm_fallback(self, limit: Optional[float]) -> None:
        """faulthandler's C timer, for a process whose Python threads cannot run."""
        if not self.use_faulthandler:
            return
        if limit is None:
            if self._fallback_deadline is not None:
                faulthandler.cancel_dump_traceback_later()
                self._fallback_deadline = None
            return
        deadline = self.last_beat + limit + FALLBACK_GRACE_S
        if self._fallback_deadline is None or abs(deadline - self._fallback_deadline) > max(1.0, limit / 10):
            try:  # to the process's own stderr (fd 2), whatever sys.stderr has been replaced by
                faulthandler.dump_traceback_later(max(1.0, deadline - self.clock()), exit=True, file=sys.__stderr__)
            except (ValueError, OSError, AttributeError):  # no file descriptor to write to: no fallback
                self.use_faulthandler = False
                return
            self._fallback_deadline = deadline

    def fire(self, told: Optional[str] = None) -> None:
        self.fired = True
        if self.use_faulthandler:
            faulthandler.cancel_dump_traceback_later()
        idle = self.clock() - self.last_beat
        me = self.peers.index
        if told is None:
            limit = self.limit() or 0.0
            why = (f"no progress for {idle:.0f} s on process {me} (run.hang_timeout={self.setting}: "
                   f"{limit:.0f} s); the last it saw: {self.last_what}")
            self.peers.report_hang(f"process {me} found no progress for {idle:.0f} s after {self.last_what}")
        else:
            why = f"{told}; process {me} stops too (its last progress, {idle:.0f} s ago: {self.last_what})"
        where = self.write_stacks(why)
        self.say(f"error: watchdog: {why}. Every thread's stack: {where}. Every process stops with exit "
                 f"{PREEMPTED_EXIT_CODE}; rerun the same command (or let its supervisor relaunch it) to resume "
                 "from the newest checkpoint.")
        self.peers.acknowledge()
        self.peers.wait_for_all(ACK_WAIT_S)
        sys.stdout.flush()
        self.peers.leave_in_order(self.leave, PREEMPTED_EXIT_CODE, ACK_WAIT_S)

    def write_stacks(self, why: str) -> str:
        """Every thread's Python stack, from faulthandler (it needs a file descriptor: a temporary
        file, then copied into the run directory, which may be a bucket), bounded in time."""
        from runner.checkpoint import storage

        with tempfile.TemporaryFile("w+") as tmp:
            tmp.write(f"{why}\nlast step done on this process: {self.step_read}\n"
                      f"time: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\n")
            tmp.flush()
            faulthandler.dump_traceback(file=tmp, all_threads=True)
            tmp.seek(0)
            text = tmp.read()
        target = self.run_dir / "hangs" / f"process-{self.peers.index}.txt"
        written = threading.Event()

        def write() -> None:
            with contextlib.suppress(Exception):
                storage.makedirs(target.parent)
                target.write_text(text)
                written.set()

        threading.Thread(target=write, daemon=True).start()
        if written.wait(30):
            return str(target)
        sys.stderr.write(text)  # the run directory is unreachable (perhaps what hangs): stderr keeps it
        return f"stderr ({target} could not be written)"
