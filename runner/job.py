"""RestoreableJob: the lifecycle every runner job shares.

restore the newest complete checkpoint (if any) -> run -> save a final checkpoint, awaited.
A finished run that is launched again says so and exits cleanly without doing any work.
"""

from __future__ import annotations

import abc
import importlib
import pkgutil
from pathlib import Path
from typing import Generic, TypeVar

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
        self.run_dir = Path(spec.run.dir)

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the run has already reached its goal (a relaunch then does nothing)."""

    @abc.abstractmethod
    def load(self, suffix: Path | None = None) -> bool:
        """Restore from the newest complete checkpoint (or `suffix`); False if none exists."""

    @abc.abstractmethod
    def save(self, suffix: Path | None = None) -> None:
        """Save a checkpoint and wait until it is committed."""

    @abc.abstractmethod
    def train(self) -> None:
        """Do the work, from wherever `load` left the state."""

    def run(self) -> None:
        """Main entry point, called on every process: restore, work, final save."""
        self.load()
        if self.done:
            self.finished_already()
            return
        self.train()
        self.save()

    def finished_already(self) -> None:
        """Called when a relaunched run has nothing left to do."""
