"""launches.jsonl: one line per launch of a run, in its run directory, for whatever supervises it.

A supervisor that restarts a run (runner's Ray launcher, a script around SkyPilot or SLURM) wants
to know, without parsing what the run prints, where each launch took the run up and what starting
it cost. Process 0 appends the line when the launch's loop starts (goodput.Goodput.start_loop),
once those costs are known:

    {"launch": 3, "attempt": 2, "restored_step": 8, "tier": "durable", "startup_s": 4.1,
     "restore_s": 0.6, "compile_s": 2.3, "processes": 2, "hosts": 2, "time": 1764000000.0}

launch: the run's launch count (goodput/launches, lost launches included); attempt: the
supervisor's (RUNNER_ATTEMPT, 1 without one); restored_step: the step it resumed from (null: a
fresh start); tier: where from ("durable", "local", "" when fresh); the seconds are goodput's
categories of this launch alone (checkpoint.cadence=auto and tools/goodput_forecast.py take their
mean over the lines as the relaunch cost); processes and hosts: the launch's JAX processes and the
machines they ran on (several processes share one under SLURM, one per GPU); time: Unix seconds at
the loop's start. A launch that ends before
its loop (finished already, a refusal, a crash in start-up) writes none. On gs:// the file is
rewritten whole (objects take no appends), within WRITE_BOUND_S; a write that fails is a warning,
never the run's end.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Mapping, Optional

from runner.checkpoint import storage
from runner.checkpoint.files import atomic_write, read_jsonl

FILE = "launches.jsonl"
WRITE_BOUND_S = 60.0


def path(run_dir: Any) -> Any:
    return storage.path(run_dir) / FILE


def record(goodput: Any, resumed: Any, processes: int, now: Optional[float] = None,
           hosts: Optional[int] = None) -> dict[str, Any]:
    """This launch's line: `goodput` a goodput.Goodput whose loop has started, `resumed` where the
    launch took the run up (runner.train.checkpointing.Resumed: step, tier); `hosts` its machines."""
    step = getattr(resumed, "step", None)
    return {"launch": goodput.launches_before + 1, "attempt": goodput.attempt,
            "restored_step": None if step is None else int(step), "tier": getattr(resumed, "tier", "") or "",
            **{f"{c}_s": round(goodput.spent[c], 3) for c in ("startup", "restore", "compile")},
            "processes": processes, **({} if hosts is None else {"hosts": hosts}),
            "time": round(time.time() if now is None else now, 3)}


def append(run_dir: Any, line: Mapping[str, Any]) -> None:
    """Add `line` to the run's launches.jsonl (rewritten whole: one atomic write, local or remote);
    a failure is said on stderr and training goes on."""
    target = path(run_dir)

    def write() -> None:
        kept = [json.dumps(r) for r in read_jsonl(target)]
        atomic_write(target, "".join(f"{text}\n" for text in [*kept, json.dumps(dict(line))]))

    try:
        storage.bounded(write, WRITE_BOUND_S) if storage.is_remote(target) else write()
    except Exception as err:  # a record for supervisors: never the reason a run stops
        print(f"warning: could not write {target} ({type(err).__name__}: {str(err)[:200]}); training goes on.",
              file=sys.stderr, flush=True)


def read(run_dir: Any) -> list[dict[str, Any]]:
    """Every launch's line, oldest first ([] before the first)."""
    return read_jsonl(path(run_dir))
