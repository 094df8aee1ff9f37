"""guard.spike=rewind: after a loss spike, go back to an older checkpoint and skip the data that
follows it (PaLM's recipe: restart about 100 steps before the spike, skip 200-500 batches).

The detector is in the compiled step (runner.train.guards): its rule fires at a step, and the host
reads that one step late. `Rewinds`, a loop component beside the checkpoints and the guards, then
finds the newest checkpoint at least guard.rewind_back steps before the rule's first spike, sets
aside the newer ones (they were trained on the data now skipped), records the rewind, restores
that checkpoint and goes on with guard.rewind_skip batches of the data stream skipped from its
position, and always past the batch of the step the rule fired at (runner.data.skips). The step
counter and the learning-rate schedule do not move back with the data: they are the checkpoint's.

`RewindJournal` is the record, `rewinds.json` in the run directory: each rewind's spike (its step
and figures), the checkpoint restored and the window skipped. Every launch reads it, so the same
command relaunched after a kill skips what the killed launch decided to skip, and a run started
from scratch with the recorded windows as train.skip_batches trains on the same batches at every
step: both end with the same parameters, bit for bit.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator, Mapping

import jax

from runner.checkpoint import storage
from runner.checkpoint.files import atomic_write_json
from runner.data.skips import DataSkips
from runner.errors import UserError
from runner.spec import ExecutionSpec
from runner.train.guards import spike_words
from runner.train.loop import Component, Loop

RECORD = "rewinds.json"


class RewindJournal:
    """The rewinds a run made (rewinds.json) and the data windows in force: train.skip_batches
    plus every recorded window."""

    def __init__(self, spec: ExecutionSpec, run_dir: Any) -> None:
        self.path = storage.path(run_dir) / RECORD
        self.records: list[dict[str, Any]] = self._read()
        self.skips = DataSkips.of(spec.train.skip_batches, (r["window"] for r in self.records))

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            records = list(json.loads(self.path.read_text())["rewinds"])
            if not all(len(r["window"]) == 2 and r["window"][0] < r["window"][1] for r in records):
                raise ValueError("a window is not a pair [start, end) with start < end")
            return records
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"The rewind record {self.path} cannot be read ({type(err).__name__}: {err}). It lists "
                            "the data windows this run skips after its loss spikes, so the run cannot go on "
                            "without it. Fix: restore the file from a backup, or give its windows by hand as "
                            "train.skip_batches=[[start,end],...] and delete it.") from None

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: dict[str, Any]) -> None:
        """Record a rewind (process 0 writes the file, in one atomic write) and skip its window."""
        self.records.append(record)
        self.skips = DataSkips.of(self.skips.windows, [record["window"]])
        if jax.process_index() == 0:
            atomic_write_json(self.path, {"rewinds": self.records}, durable=True, indent=1)

    def ours(self, meta: Mapping[str, Any]) -> bool:
        """Whether a checkpoint (its record) was trained on the batches this run trains on up to its
        step: not on data the run now skips."""
        saved = DataSkips.of(meta.get("data_skips") or [])
        return saved.agrees_until(self.skips, int(meta.get("step", 0)))

    def describe(self) -> list[list[int]]:
        return self.skips.to_json()


class Rewinds(Component):
    """Acts on the spike rule under guard.spike=rewind (see the module's docstring). `go_back(step)`
    puts the trainer at that checkpoint and gives the batches from there, with the journal's windows
    skipped; `logger` (a MetricsLogger) says and records each rewind; `goodput` counts the restore
    and the steps undone (runner.observability.goodput)."""

    def __init__(self, spec: ExecutionSpec, journal: RewindJournal, checkpoints: Any,
                 go_back: Callable[[int], Iterator[Any]], logger: Any, goodput: Any) -> None:
        self.guard, self.journal, self.checkpoints = spec.guard, journal, checkpoints
        self.go_back, self.logger, self.goodput = go_back, logger, goodput

    def start(self, loop: Loop) -> None:
        g = self.guard
        self.logger.progress.message(
            f"spikes: rewind after {g.spike_count} spike(s) within {g.spike_within} step(s) of the {g.spike_on} above "
            f"{g.spike_sigma:g} sigma of the last {g.spike_window} steps, to the newest checkpoint {g.rewind_back}+ "
            f"steps before, skipping {g.rewind_skip} batches; at most {g.max_rewinds} rewinds ({len(self.journal)} "
            f"made). Checkpoints kept: also the newest one at least {g.rewind_back + g.spike_within - 1} steps old, "
            "whatever checkpoint.keep says.")

    def on_metrics(self, loop: Loop, step: int, metrics: dict[str, float]) -> None:
        # a stop asked at this step waits for the rewind (its save is then the checkpoint gone back to);
        # a halt does not
        if not metrics.get("spike_fire") or loop.halt_reason or loop.rewinding:
            return
        g, spike = self.guard, spike_words(self.guard, step, metrics)
        if len(self.journal) >= g.max_rewinds:
            loop.halt(f"{spike}, after {len(self.journal)} rewinds (guard.max_rewinds={g.max_rewinds}; the record: "
                      f"{self.journal.path}). Fix: find the cause (the data at the skipped windows, the learning "
                      "rate); to go on, raise guard.max_rewinds and rerun the same command")
            return
        first = int(metrics.get("spike_first") or step)
        self.checkpoints.wait()
        steps = [s for s in self.checkpoints.checkpointer.steps() if s <= first - g.rewind_back]
        if not steps:
            held = self.checkpoints.checkpointer.steps()
            loop.halt(f"{spike}, and no checkpoint is at least guard.rewind_back={g.rewind_back} steps older than "
                      f"the first spike (step {first}) to rewind to (checkpoints kept: "
                      f"{', '.join(map(str, held)) or 'none'}). Fix: rerun the same command with the window by hand, "
                      f"train.skip_batches={self._window_words(first)}, which restores the newest checkpoint before it "
                      "(or the start); or lower guard.rewind_back, or save more often (checkpoint.every_steps)")
            return
        target, skips = max(steps), self.journal.skips
        start = skips.position(target)
        end = max(start + g.rewind_skip, skips.position(step - 1) + 1)  # always past the batch the rule fired at
        record = {"spike_step": step, "first_spike": first,
                  "figures": {k: metrics[k] for k in ("loss", "loss_band", "grad_norm", "grad_norm_band")
                              if k in metrics},
                  "restored_step": target, "window": [start, end], "unix": round(time.time(), 3)}
        undone = loop.holder.step - target  # the steps trained since, counted as recomputed
        self.goodput.undone(undone, undone * loop.step_seconds)
        loop.rewind(lambda: self._go_back(record))

    def _window_words(self, first: int) -> str:
        """The windows to give by hand: the recorded ones, and one from guard.rewind_back steps before
        the first spike, as a rewind would skip."""
        skips, g = self.journal.skips, self.guard
        start = skips.position(max(first - 1 - g.rewind_back, 0))
        end = max(start + g.rewind_skip, skips.position(first - 1) + 1)
        return str(DataSkips.of(skips.windows, [(start, end)]).to_json()).replace(" ", "")

    def _go_back(self, record: dict[str, Any]) -> Iterator[Any]:
        """Set aside the newer checkpoints, record, restore, and the batches past the window. A kill
        anywhere in here is safe: before the record is written, a relaunch replays from the newest
        checkpoint left and decides the same rewind; after, it restores the same checkpoint and
        skips the recorded window."""
        target, (start, end) = record["restored_step"], record["window"]
        abandoned = self.checkpoints.abandon_after(target)
        self.journal.add(record)
        started = time.perf_counter()
        with self.goodput.timing("restore"):
            batches = self.go_back(target)
        restore_s = time.perf_counter() - started
        self.logger.rewound(target)
        n, g = len(self.journal), self.guard
        figures = {**record["figures"], "spike_first": record["first_spike"]}
        aside = f" (newer ones set aside: {', '.join(map(str, abandoned))})" if abandoned else ""
        self.logger.event(f"rewind {n}/{g.max_rewinds}: {spike_words(g, record['spike_step'], figures)}; back to "
                          f"checkpoint {target}{aside} (restored in {restore_s:.1f}s), data batches [{start}, {end}) "
                          f"skipped; recorded in {self.journal.path}")
        self.logger.log(target, {
            "rewind/count": float(n), "rewind/spike_step": float(record["spike_step"]),
            "rewind/first_spike": float(record["first_spike"]), "rewind/restored_step": float(target),
            "rewind/skip_start": float(start), "rewind/skip_end": float(end),
            **{f"rewind/{k}": float(v) for k, v in record["figures"].items()}})
        return batches


def components(spec: ExecutionSpec, checkpoints: Any, go_back: Callable[[int], Iterator[Any]], logger: Any,
               goodput: Any) -> list[Component]:
    """The loop's `Rewinds` under guard.spike=rewind (`checkpoints`: runner.train.checkpointing's,
    which keeps the journal); nothing otherwise."""
    if spec.guard.spike != "rewind":
        return []
    return [Rewinds(spec, checkpoints.journal, checkpoints, go_back, logger, goodput)]
