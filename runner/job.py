"""The public path of the job API: `from runner.job import JOBS, RestoreableJob` (the code lives
in runner.train.job)."""

from runner.train.job import JOBS, RestoreableJob

__all__ = ["JOBS", "RestoreableJob"]
