"""Where metrics go: a live progress line, metrics.jsonl and wandb. Process 0 only.

Every method is a no-op on the other processes, so the training loop calls them everywhere.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Callable, Mapping

import jax
from rich.console import Console

from runner.checkpoint import storage
from runner.checkpoint.files import atomic_write, read_jsonl
from runner.errors import first_line

TENSORBOARD_DIR = "tensorboard"
METRICS_FILE = "metrics.jsonl"


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _format_rate(tokens_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit}"
    return f"{tokens_per_s:.0f}"


def truncate_jsonl(path: Any, last_step: int) -> list[dict[str, Any]]:
    """Drop records of steps after `last_step`: they belong to an interrupted launch and will be
    recomputed (identically) by the resumed one, so each step appears once. Returns the dropped
    records (goodput counts the steps they lost). Process 0 only: the file is replaced, and a
    writer holding it open must not lose its handle to another process."""
    if jax.process_index() != 0 or not path.exists():
        return []
    kept, dropped = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if record.get("step", 0) <= last_step:
            kept.append(line)
        else:
            dropped.append(record)
    atomic_write(path, "".join(line + "\n" for line in kept))
    return dropped


class JsonLines:
    """An append-only JSON-lines file with one writer. Locally each line is written and flushed
    at once. An object store has no appends: the lines are kept in memory and the whole object
    is rewritten (one atomic upload) at most every `upload_every_s` seconds and whenever `sync()`
    asks, which the trainer does before each checkpoint save, so the metrics of every step a
    checkpoint covers are in the bucket before it can commit; a kill loses only steps that a
    resume recomputes anyway."""

    def __init__(self, path: Any, upload_every_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.clock, self.upload_every_s = path, clock, upload_every_s
        self.remote = storage.is_remote(path)
        self._file = None if self.remote else open(path, "a")
        self._lines: list[str] = []
        if self.remote and path.exists():
            self._lines = [line for line in path.read_text().splitlines() if line.strip()]
        self._pending = False
        self._uploaded = clock()

    def write(self, line: str) -> None:
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
            return
        self._lines.append(line)
        self._pending = True
        if self.clock() - self._uploaded >= self.upload_every_s:
            try:
                self.sync()
            except storage.StorageUnavailable as err:  # kept, and tried again: a save needs it, not a step
                self._uploaded = self.clock()
                print(f"warning: {err}", file=sys.stderr, flush=True)

    def sync(self) -> None:
        """Make every line written so far durable where readers look (a no-op locally); on an object
        store that fails past its client's retries, StorageUnavailable (exit 75)."""
        if not self._pending:
            return
        try:
            atomic_write(self.path, "".join(line + "\n" for line in self._lines))
        except OSError as err:
            if not self.remote:
                raise
            raise storage.StorageUnavailable(
                f"Uploading {self.path} failed ({type(err).__name__}: {first_line(err, 300)}), retries included. "
                "Fix: check the bucket and the network, then rerun the same command to resume.") from None
        self._pending, self._uploaded = False, self.clock()

    def truncate(self, last_step: int) -> None:
        """Drop the records of steps after `last_step` (a rewind undid them), and go on appending."""
        if self._file is not None:
            self._file.close()
            truncate_jsonl(self.path, last_step)
            self._file = open(self.path, "a")
            return
        self._lines = [line for line in self._lines if _step_of(line) <= last_step]
        self._pending = True
        self.sync()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.sync()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, TypeError, ValueError):
        return 0


class Progress:
    """One live line (step, loss, tokens/s, ETA) in a terminal; plain log lines elsewhere."""

    def __init__(self, style: str, total_steps: int, log_every: int) -> None:
        if style == "auto":
            style = "rich" if sys.stdout.isatty() else "plain"
        self.style = style
        self.total_steps = total_steps
        self.log_every = log_every
        self.console = Console(highlight=False, soft_wrap=True)
        self._status = None
        if style == "rich":
            self._status = self.console.status("starting", spinner="dots")
            self._status.start()

    def line(self, step: int, metrics: Mapping[str, float], eta_s: float) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        if "loss" in metrics:
            parts.append(f"loss {metrics['loss']:.4f}")
        if "tokens_per_s" in metrics:
            parts.append(f"{_format_rate(metrics['tokens_per_s'])} tok/s")
        if "tflops_per_device" in metrics:
            mfu = f", MFU {100 * metrics['mfu']:.1f}%" if "mfu" in metrics else ""
            parts.append(f"{metrics['tflops_per_device']:.3g} TFLOP/s/dev{mfu}")
        if "moe/load_max" in metrics:  # the busiest and idlest expert of any layer, against an even share
            dropped = f", dropped {100 * metrics['moe/dropped']:.1f}%" if metrics.get("moe/dropped") else ""
            parts.append(f"experts {metrics['moe/load_min']:.2f}-{metrics['moe/load_max']:.2f}x{dropped}")
        parts.append(f"ETA {_format_duration(eta_s)}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Mapping[str, float], eta_s: float) -> None:
        if self.style == "rich" and self._status is not None:
            self._status.update(self.line(step, metrics, eta_s))
        elif self.style == "plain" and (step % self.log_every == 0 or step == self.total_steps):
            self.console.print(self.line(step, metrics, eta_s))

    def message(self, text: str) -> None:
        if self.style != "none":
            self.console.print(text)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


class MetricsLogger:
    """Writes metrics.jsonl and wandb, and drives the progress line; process 0 only."""

    def __init__(self, run_dir: Any, *, progress: str, total_steps: int, log_every: int,
                 wandb_mode: str, wandb_project: str, wandb_entity: str | None,
                 wandb_run_id: str | None, run_name: str, config: Mapping[str, Any],
                 wandb_group: str | None = None, tensorboard: bool = False,
                 resumed_step: int | None = None) -> None:
        self.active = jax.process_index() == 0
        self.path = run_dir / METRICS_FILE
        self.progress = Progress(progress if self.active else "none", total_steps, log_every)
        self.wandb_run = None
        self.wandb_run_id = wandb_run_id
        self._exit_code = 0  # how this launch ends (`ending`), for wandb
        if self.active and wandb_mode != "disabled":
            self.wandb_run = self._start_wandb(run_dir, wandb_mode, wandb_project, wandb_entity,
                                               wandb_run_id, run_name, config, wandb_group)
            self.wandb_run_id = self.wandb_run.id
            if resumed_step is not None:
                self._replay_to_wandb(run_dir, resumed_step)
        self._file = JsonLines(self.path) if self.active else None
        self.tensorboard = self._start_tensorboard(run_dir, resumed_step) if self.active and tensorboard else None

    @classmethod
    def for_run(cls, spec: Any, run_dir: Any, wandb_run_id: str | None, resumed_step: int | None) -> "MetricsLogger":
        """The logger of one launch of the run `spec` describes (its logging and train sections);
        `wandb_run_id` (from the checkpoint) continues the same wandb run."""
        return cls(run_dir, progress=spec.logging.progress, total_steps=spec.train.steps, log_every=spec.train.log_every,
                   wandb_mode=spec.logging.wandb, wandb_project=spec.logging.project, wandb_entity=spec.logging.entity,
                   wandb_run_id=wandb_run_id, run_name=storage.name(spec.run.dir), config=spec.to_dict(),
                   wandb_group=spec.run.sweep, tensorboard=spec.logging.tensorboard, resumed_step=resumed_step)

    @staticmethod
    def _start_tensorboard(run_dir: Any, resumed_step: int | None) -> Any:
        """One event writer per launch in <run.dir>/tensorboard (process 0). Each launch purges what
        an interrupted one logged after the checkpoint it resumes from (all of it when there is
        none; TensorBoard's own SessionLog START), so each step appears once, as in metrics.jsonl.
        On gs:// tensorboardX uploads the event file whole (google-cloud-storage), at `sync`."""
        from tensorboardX import SummaryWriter

        purge = 0 if resumed_step is None else resumed_step + 1
        return SummaryWriter(logdir=str(run_dir / TENSORBOARD_DIR), purge_step=purge, flush_secs=10)

    @staticmethod
    def _start_wandb(run_dir: Any, mode: str, project: str, entity: str | None, run_id: str | None,
                     name: str, config: Mapping[str, Any], group: str | None) -> Any:
        """One wandb run per run directory; its id is saved with the checkpoints so a resumed run
        continues the same wandb run. Sweep members are grouped by sweep. wandb writes local files
        only: for a gs:// run directory they go to its local mirror (runner.checkpoint.storage.local_mirror)."""
        import wandb

        local = storage.local_mirror(run_dir)
        local.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=project, entity=entity, id=run_id, resume="allow", name=name, mode=mode,
            dir=str(local), config=dict(config), group=group or None,
            settings=wandb.Settings(console="off", silent=True),
        )

    def _replay_to_wandb(self, run_dir: Any, resumed_step: int) -> None:
        """Give wandb the steps up to the checkpoint this launch resumes from that metrics.jsonl has
        and wandb's files lack (lost with a killed launch), in order, before anything new: wandb's
        history then equals metrics.jsonl."""
        from runner.observability.wandb_history import history_steps

        have = history_steps(storage.local_mirror(run_dir) / "wandb", self.wandb_run.id)
        last = max(have, default=-1)
        missing: dict[int, dict[str, float]] = {}
        for record in read_jsonl(self.path):
            step = record.get("step")
            if isinstance(step, int) and last < step <= resumed_step:
                missing.setdefault(step, {}).update(
                    {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))})
        for step in sorted(missing):
            self.wandb_run.log(missing[step], step=step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.active:
            return
        record = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) or hasattr(v, "item") else v)
                                   for k, v in metrics.items()}}
        assert self._file is not None
        self._file.write(json.dumps(record))
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics), step=step)
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, float):
                    self.tensorboard.add_scalar(key, value, step)
            if not self._file.remote:  # remote: uploaded with metrics.jsonl, at sync()
                self.tensorboard.flush()  # as metrics.jsonl: what was logged survives a kill

    def event(self, text: str) -> None:
        """A line the run's reader must see whatever logging.progress says (a rewind); process 0."""
        if self.active:
            self.progress.console.print(text)

    def rewound(self, step: int) -> None:
        """The run went back to `step`: metrics.jsonl and TensorBoard forget the steps after it, as
        after a resume. (wandb cannot: its history keeps them, and the recomputed steps up to the
        newest one it has are dropped by wandb with a warning.)"""
        if not self.active:
            return
        assert self._file is not None
        self._file.truncate(step)
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = self._start_tensorboard(self.path.parent, step)

    def sync(self) -> None:
        """Make everything logged so far durable (before a checkpoint save; see JsonLines)."""
        if self._file is not None and self._file.remote:
            self._file.sync()
            if self.tensorboard is not None:
                self.tensorboard.flush()

    def log_eval(self, step: int, results: Mapping[str, float], texts: Mapping[str, str]) -> None:
        """An evaluation: its metrics and texts in metrics.jsonl (texts as strings) and wandb (texts
        as a table), and its headline numbers on the progress line."""
        if not self.active or not (results or texts):
            return
        self.log(step, {**results, **texts})
        if texts and self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=["step", "name", "text"], data=[[step, k, v] for k, v in texts.items()])
            self.wandb_run.log({"eval/texts": table}, step=step)
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in results.items()
                          if k.endswith(("/loss", "/acc", "/acc_norm")))
        self.progress.message(f"eval @ step {step}: {shown or f'{len(results)} metrics'}")

    def ending(self, exit_code: int, preempted: bool = False) -> None:
        """How this launch ends, for wandb: a preempted launch (stopped early to be resumed) is
        marked preempting, so wandb shows it preempted rather than finished, and every
        non-zero exit code is recorded as such."""
        self._exit_code = exit_code
        if preempted and self.wandb_run is not None:
            self.wandb_run.mark_preempting()

    def close(self) -> None:
        self.progress.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=self._exit_code)
            self.wandb_run = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


class Timer:
    """Throughput and ETA from wall time between reads, excluding the first (compiling) step."""

    def __init__(self, start_step: int, total_steps: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total_steps = total_steps
        self.clock = clock
        self.t0: float | None = None
        self.step0 = start_step
        self.last_t = clock()
        self.last_dt = 0.0

    def tick(self, step: int) -> tuple[float, float]:
        """Returns (seconds for this step, ETA seconds)."""
        now = self.clock()
        dt, self.last_t = now - self.last_t, now
        self.last_dt = dt
        if self.t0 is None:  # first step includes compilation
            self.t0, self.step0 = now, step
            return dt, float("inf")
        rate = (now - self.t0) / max(step - self.step0, 1)
        return dt, rate * (self.total_steps - step)
