"""The step loop. It only says that a step happened; every periodic concern (metrics, evaluation,
checkpoints, profiler, stops, guards) is a `Component` that owns its cadence.

One iteration: tell the components a step is about to run; dispatch it; fetch the next batch
while it runs (the loop never waits for the device here); hand the previous step's metrics on,
now that the next step is queued (one step late); if a component acts at this step and needs
its metrics first (an evaluation, a save, a stop), hand them on now instead; then let the
components act. The only host syncs are those reads.

A component may ask the loop to go back (`rewind`: runner.train.rewind after a loss spike): once
this step's components are told, the loop drops the metrics not yet handed on, lets the request
put the holder back at an earlier step and give the batches from there, tells every component
(`rewound`), and carries on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import jax


class Holder(Protocol):
    """What the loop advances: the train state and the number of steps taken (the trainer)."""

    state: Any
    step: int


@dataclass(frozen=True)
class Ending:
    """Why the loop ended: it reached the last step, was asked to stop early (resumable), or
    was halted by a guard (not resumable as is)."""

    step: int
    stop: Optional[str] = None
    halt: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.stop is None and self.halt is None


class Component:
    """A periodic concern of the loop; every method is optional. `step` is 1-based: the number
    of steps taken once that step is done."""

    def start(self, loop: "Loop") -> None:
        """Before the first step of this launch."""

    def before_step(self, loop: "Loop", step: int) -> None:
        """Step `step` is about to be dispatched."""

    def needs_metrics(self, loop: "Loop", step: int) -> bool:
        """Whether this component acts at `step` and wants its metrics read first. Asked of every
        component at every step, in order (a component may agree something across processes)."""
        return False

    def on_metrics(self, loop: "Loop", step: int, metrics: dict[str, float]) -> None:
        """Step `step`'s metrics, as floats (normally while the next step runs). One dict goes
        to every component in turn: one may add derived values for those after it."""

    def after_step(self, loop: "Loop", step: int) -> None:
        """Step `step` is done and its metrics were handed on if anyone needed them."""

    def rewound(self, loop: "Loop", step: int) -> None:
        """The loop went back: the holder is at step `step` now, the steps after it are undone."""

    def end(self, loop: "Loop") -> None:
        """After the last step of this launch, whatever ended it."""


class Loop:
    """Runs `step_fn(state, batch) -> (state, metrics)` from `holder.step` to `total`."""

    def __init__(self, holder: Holder, step_fn: Callable[[Any, Any], tuple[Any, Any]], batches: Iterator[Any],
                 components: Sequence[Component], total: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.holder = holder
        self.step_fn = step_fn
        self.batches = batches
        self.components = list(components)
        self.total = total
        self.clock = clock
        self.stop_reason: Optional[str] = None
        self.halt_reason: Optional[str] = None
        self.step_seconds = 0.0  # wall time between the latest two metric reads: one step
        self._last_read = clock()
        self._rewind: Optional[Callable[[], Iterator[Any]]] = None

    @property
    def state(self) -> Any:
        return self.holder.state

    @property
    def stopping(self) -> bool:
        """The loop will not go on from this step as it is: a stop, a halt or a rewind is asked."""
        return self.stop_reason is not None or self.halt_reason is not None or self._rewind is not None

    def stop(self, reason: str) -> None:
        """End after this step, resumably (a signal, a limit, the stop file)."""
        self.stop_reason = self.stop_reason or reason

    def halt(self, reason: str) -> None:
        """End after this step because continuing would be wrong (a guard)."""
        self.halt_reason = self.halt_reason or reason

    def rewind(self, go_back: Callable[[], Iterator[Any]]) -> None:
        """Go back after this step: `go_back()` puts the holder at an earlier step (its state and
        step) and returns the batches from there. Checked before a stop, so a run asked to stop
        at the same step saves the state it went back to, not the one it left."""
        self._rewind = go_back

    @property
    def rewinding(self) -> bool:
        return self._rewind is not None

    def run(self) -> Ending:
        h = self.holder
        for c in self.components:
            c.start(self)
        self._last_read = self.clock()
        pending: Optional[tuple[int, Any]] = None
        batch = next(self.batches) if h.step < self.total else None
        while True:
            while h.step < self.total:
                step = h.step + 1
                for c in self.components:
                    c.before_step(self, step)
                h.state, metrics = self.step_fn(h.state, batch)
                h.step = step
                if step < self.total:  # overlaps with the running step
                    batch = next(self.batches)
                if pending is not None:
                    self._hand_on(*pending)
                pending = (step, metrics)
                wanted = [c.needs_metrics(self, step) for c in self.components]  # all asked, always
                if any(wanted) or self.stopping:
                    self._hand_on(*pending)
                    pending = None
                if self.halt_reason:
                    break
                for c in self.components:
                    c.after_step(self, step)
                if self._rewind is not None:
                    batch, pending = self._go_back(), None
                if self.stopping:
                    break
            if pending is not None:  # the last step's metrics may still ask for a rewind
                self._hand_on(*pending)
                pending = None
            if self._rewind is None or self.halt_reason:
                break
            batch = self._go_back()
            if self.stopping:
                break
        for c in self.components:
            c.end(self)
        return Ending(h.step, self.stop_reason, self.halt_reason)

    def _go_back(self) -> Any:
        """Carry out the rewind asked for: the holder goes back, the components are told; returns
        the first batch from there."""
        go_back, self._rewind = self._rewind, None
        assert go_back is not None
        self.batches = go_back()
        for c in self.components:
            c.rewound(self, self.holder.step)
        self._last_read = self.clock()
        return next(self.batches) if self.holder.step < self.total else None

    def _hand_on(self, step: int, metrics: Any) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = self.clock()
        self.step_seconds, self._last_read = now - self._last_read, now
        for c in self.components:
            c.on_metrics(self, step, values)
