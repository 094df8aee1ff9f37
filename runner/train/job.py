"""RestoreableJob: the lifecycle every runner job shares, as one template.

load (the newest complete checkpoint, if any) -> done? -> train -> save (awaited) -> conclude.
A finished run that is launched again says so and exits cleanly without doing any work. A job
fills in the steps; it never replaces `run`.
"""

from __future__ import annotations

import abc
import importlib
import pkgutil
from pathlib import Path
from typing import Any, Generic, TypeVar

from runner.checkpoint.storage import path as storage_path
from runner.errors import ConfigError
from runner.exits import HookError
from runner.registry import Registry
from runner.spec import ExecutionSpec

C = TypeVar("C")  # the job's model config type

JOBS: Registry[type["RestoreableJob"]] = Registry("job class", "job.trainer")


def load_job_modules(package: str = "jobs") -> None:
    """Import every module of the user's jobs package so their classes register themselves:
    adding a job is one class in jobs/ plus one conf/job/*.yaml."""
    try:
        pkg = importlib.import_module(package)
    except ImportError:
        return
    for info in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
        importlib.import_module(f"{package}.{info.name}")


class RestoreableJob(abc.ABC, Generic[C]):
    """A job that can be killed at any point and continued by running it again."""

    def __init__(self, spec: ExecutionSpec) -> None:
        self.spec = spec
        self.run_dir = storage_path(spec.run.dir)  # a local directory or a gs:// URL (runner.checkpoint.storage)

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the run has already reached its goal (a relaunch then does nothing)."""

    @abc.abstractmethod
    def load(self, suffix: Path | None = None) -> bool:
        """Restore from the newest complete checkpoint (or `suffix`); False if none exists."""

    @abc.abstractmethod
    def save(self, suffix: Path | None = None) -> None:
        """Save a checkpoint (also under the name `suffix`, if given) and wait until it is committed."""

    @abc.abstractmethod
    def train(self) -> Any:
        """Do the work, from wherever `load` left the state; returns what `conclude` needs."""

    def conclude(self, outcome: Any) -> None:
        """After the final save: report, or raise what the exit code should say."""

    def close(self) -> None:
        """Release what the run holds open (always called, however the run ends)."""

    def finished_already(self) -> None:
        """Called when a relaunched run has nothing left to do."""

    def run(self) -> None:
        """Main entry point, called on every process: restore, work, final save, conclude."""
        try:
            self.load()
            if self.done:
                self.finished_already()
                return
            try:
                outcome = self.train()
            except HookError:  # user code failed between steps: the state is good, keep it
                self.save()
                raise
            self.save()
            self.conclude(outcome)
        finally:
            self.close()


def check_spec(spec: ExecutionSpec) -> None:
    """The job section: job.trainer names a job class."""
    job = JOBS.get(spec.job.trainer)
    if not (isinstance(job, type) and issubclass(job, RestoreableJob)):
        raise ConfigError("job.trainer", spec.job.trainer, "it is not a job class (a RestoreableJob).",
                          f"name one of: {', '.join(JOBS.names())}, or your own subclass of "
                          "runner.train.trainer.BaseTrainer by import path.")
