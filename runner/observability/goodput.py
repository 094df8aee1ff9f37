"""Goodput: where a run's wall time went, per launch and over all its launches.

    startup     launch to the loop, less the parts below (imports, data, initialisation)
    restore     reading the checkpoint (or the warm start)
    compile     compiling the train step
    train       steps whose work was kept: loop time less data waits, evaluation and saves
    data_wait   the loop waiting for the next batch
    eval        evaluators (and compiling them)
    checkpoint  durable saves (run.dir), as far as the loop waits for them (asynchronous saves
                overlap training)
    checkpoint_local  local-tier saves (checkpoint.local.dir), likewise
    recomputed  steps an earlier launch trained after its last checkpoint and lost when it died;
                this launch trains them again. Counted up to the last step it logged (so to within
                train.log_every), at the mean time of its logged steps. Also the steps a rewind
                undid (runner.train.rewind), at the time of the step before it; its restore is
                "restore"

goodput = (train - recomputed) / wall, summed over launches. The totals of earlier launches travel
in every checkpoint's metadata, so a resumed run adds to them; a launch's time after its last
checkpoint is counted through the steps it lost (the rest of a killed launch is not recoverable).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

CATEGORIES = ("startup", "restore", "compile", "train", "data_wait", "eval", "checkpoint", "checkpoint_local",
              "recomputed")
PAUSES = ("eval", "checkpoint", "checkpoint_local", "restore")  # loop time that is not training (restore: a rewind)

_launch_started: Optional[float] = None


def mark_launch(when: Optional[float] = None) -> None:
    """Note when this launch (a process, or one sweep member) started."""
    global _launch_started
    _launch_started = time.time() if when is None else when


def launch_started() -> float:
    return time.time() if _launch_started is None else _launch_started


@dataclass
class Goodput:
    """This launch's seconds per category, plus the totals carried from earlier launches."""

    started: float = field(default_factory=launch_started)
    clock: Callable[[], float] = time.time
    spent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    before: dict[str, float] = field(default_factory=dict)  # earlier launches' totals (and "wall")
    launches_before: int = 0
    recomputed_steps: int = 0
    local_tier_spared_steps: int = 0  # steps a local-tier restore saved over the durable tier's newest
    # saves per category ("checkpoint", "checkpoint_local") over all launches, carried like the seconds: a
    # save's blocking cost is the category's seconds over its count (checkpoint.cadence=auto, the forecast)
    saves: dict[str, int] = field(default_factory=dict)
    # the attempt of a supervisor that restarts the run (the Ray launcher sets RUNNER_ATTEMPT): 1 is the first
    attempt: int = field(default_factory=lambda: int(os.environ.get("RUNNER_ATTEMPT") or 1))
    loop_started: Optional[float] = None
    loop_ended: Optional[float] = None
    _marks: list[dict[str, float]] = field(default_factory=list)  # PAUSES' seconds at loop start, end

    @contextlib.contextmanager
    def timing(self, category: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.spent[category] += self.clock() - start

    def carry(self, saved: Optional[Mapping[str, Any]], lost_steps: Sequence[Mapping[str, Any]], restored: int) -> None:
        """Take the totals a checkpoint carried, and count the logged steps after it that the
        previous launch trained and lost (`lost_steps`: its metrics records past `restored`)."""
        if saved:
            self.before = {k: float(v) for k, v in saved.get("seconds", {}).items()}
            self.launches_before = int(saved.get("launches", 0))
            for category, count in (saved.get("saves") or {}).items():
                self.saves[category] = self.saves.get(category, 0) + int(count)
        lost = {int(r["step"]): float(r.get("step_time_s", 0.0)) for r in lost_steps
                if "loss" in r and int(r.get("step", 0)) > restored}
        # Steps up to the last one it logged (train.log_every apart), at the logged steps' mean time.
        self.recomputed_steps = max(lost, default=restored) - restored
        self.spent["recomputed"] = self.recomputed_steps * (sum(lost.values()) / len(lost) if lost else 0.0)
        if lost:  # the dead launch spent this too, after the checkpoint that carried the totals
            self.before["wall"] = self.before.get("wall", 0.0) + self.spent["recomputed"]
            self.before["train"] = self.before.get("train", 0.0) + self.spent["recomputed"]
        if not saved and lost:  # it died before its first checkpoint: one more launch than any meta says
            self.launches_before = 1
        # A launch later than the checkpoint's writer may have died before its own save committed
        # (then the checkpoint undercounts): the lost records say which launch logged them.
        self.launches_before = max([self.launches_before, *(
            int(r["goodput/launches"]) for r in lost_steps if "goodput/launches" in r and int(r["step"]) > restored)])

    def saved(self, category: str) -> None:
        """One more save of `category` ("checkpoint" or "checkpoint_local"), once its blocking part is timed."""
        self.saves[category] = self.saves.get(category, 0) + 1

    def undone(self, steps: int, seconds: float) -> None:
        """A rewind undid `steps` steps trained in `seconds`: they count as recomputed, not useful."""
        self.recomputed_steps += steps
        self.spent["recomputed"] += seconds

    def _mark(self) -> dict[str, float]:
        return {c: self.spent[c] for c in PAUSES}

    def start_loop(self, run_dir: Any = None, resumed: Any = None) -> None:
        """The loop starts: what came before it is startup. With `run_dir`, process 0 also writes this
        launch's line (where it resumed, what starting cost) in its launches.jsonl, for supervisors
        (runner.observability.launches)."""
        self.loop_started = self.clock()
        self.spent["startup"] = max(0.0, self.loop_started - self.started - sum(
            self.spent[c] for c in {"compile", *PAUSES}))
        self._marks = [self._mark()]
        if run_dir is not None:
            import jax

            from runner.observability import launches
            from runner.parallel.distributed import hosts_by_process

            hosts = len(set(hosts_by_process()))  # (every process: a gather)
            if jax.process_index() == 0:
                launches.append(run_dir, launches.record(self, resumed, jax.process_count(), hosts=hosts))

    def end_loop(self) -> None:
        self.loop_ended = self.clock()
        self._marks = self._marks[:1] + [self._mark()]

    def totals(self, data_wait: float = 0.0) -> dict[str, float]:
        """Seconds per category over all launches, with "wall" and "other" (what no category covers)."""
        now = self.clock()
        this = dict(self.spent)
        this["data_wait"] = data_wait
        if self.loop_started is not None:
            end, at_end = (now, self._mark()) if self.loop_ended is None else (self.loop_ended, self._marks[-1])
            inside = sum(at_end[c] - self._marks[0][c] for c in at_end)  # eval and saves during the loop
            this["train"] = max(0.0, end - self.loop_started - data_wait - inside)
        this["wall"] = now - self.started
        # (recomputed time was spent by the launch that died, not this one)
        this["other"] = max(0.0, this["wall"] - sum(this[c] for c in CATEGORIES if c != "recomputed"))
        return {k: self.before.get(k, 0.0) + this.get(k, 0.0) for k in (*CATEGORIES, "other", "wall")}

    def report(self, totals: Mapping[str, float]) -> dict[str, float]:
        """The metrics: goodput/percent, goodput/launches, goodput/restarts (a supervisor's, RUNNER_ATTEMPT - 1),
        goodput/recomputed_steps, goodput/saves and saves_local (durable and local saves made), goodput/<category>_s."""
        useful = totals["train"] - totals["recomputed"]
        out = {"goodput/percent": 100.0 * useful / totals["wall"] if totals["wall"] > 0 else 0.0,
               "goodput/launches": float(self.launches_before + 1),
               "goodput/recomputed_steps": float(self.recomputed_steps),
               "goodput/local_tier_spared_steps": float(self.local_tier_spared_steps),
               "goodput/restarts": float(self.attempt - 1),
               "goodput/saves": float(self.saves.get("checkpoint", 0)),
               "goodput/saves_local": float(self.saves.get("checkpoint_local", 0))}
        out.update({f"goodput/{k}_s": v for k, v in totals.items()})
        return out

    def to_meta(self, totals: Mapping[str, float]) -> dict[str, Any]:
        """What a checkpoint carries to the next launch."""
        return {"seconds": dict(totals), "launches": self.launches_before + 1, "saves": dict(self.saves)}


def summary_line(report: Mapping[str, float]) -> str:
    parts = ", ".join(f"{c.replace('_', ' ')} {report[f'goodput/{c}_s']:.1f}s" for c in (*CATEGORIES, "other")
                      if report.get(f"goodput/{c}_s", 0.0) >= 0.05)
    launches = int(report["goodput/launches"])
    recomputed = int(report["goodput/recomputed_steps"])
    redo = f"; {recomputed} steps recomputed after a crash or a rewind" if recomputed else ""
    return (f"  goodput {report['goodput/percent']:.1f}% of {report['goodput/wall_s']:.1f}s over {launches} "
            f"launch{'es' if launches != 1 else ''}{redo}: {parts}")
