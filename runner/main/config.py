"""From a composed Hydra config to a checked ExecutionSpec, before any device work.

The spec checks what its values alone decide (runner.spec.validate); each component then checks
its own section, so the spec module knows no component. Every check raises a ConfigError: one
paragraph naming the key, the value and the fix, exit code 2.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from runner import evaluation, models, optim
from runner.data import strategies
from runner.parallel import distributed, mesh, topology
from runner.spec import ExecutionSpec, resolve_spec
from runner.train import callbacks, job

SECTION_CHECKS: tuple[Callable[[ExecutionSpec], None], ...] = (
    job.check_spec,  # job.trainer
    models.check_spec,  # job.model
    topology.check_spec,  # topology
    mesh.check_spec,  # mesh against topology and batch sizes
    strategies.check_spec,  # data
    optim.check_spec,  # optimizer, schedule
    evaluation.check_spec,  # eval.evaluators
    callbacks.check_spec,  # callbacks
    distributed.check_spec,  # distributed
)


# What mode=plan chooses itself: the job's own mesh need not fit the topology (each layout the plan
# tries is checked in full, as a run, before it is compiled: runner.main.plan).
PLANNED: tuple[Callable[[ExecutionSpec], None], ...] = (mesh.check_spec,)


def check(spec: ExecutionSpec) -> ExecutionSpec:
    for check_section in SECTION_CHECKS:
        if spec.mode != "plan" or check_section not in PLANNED:
            check_section(spec)
    return spec


def build_spec(cfg: Any, overrides: Sequence[str] = (), sweep_root: str | None = None) -> ExecutionSpec:
    """Composed config -> validated, frozen ExecutionSpec (see runner.spec.resolve_spec); a model
    imported from Hugging Face takes its settings from its config.json (runner.models)."""
    spec = models.with_hf_settings(resolve_spec(cfg, list(overrides), sweep_root), list(overrides))
    return check(spec)
