"""The GPT pretraining job: GPT-2 style decoder trained by the generic BaseTrainer."""

from __future__ import annotations

import dataclasses

from runner.job import JOBS
from runner.models.gpt import GPT, LOGICAL_AXIS_RULES, GPTConfig
from runner.spec import ExecutionSpec
from runner.trainer import BaseTrainer


@JOBS.register("gpt")
class GPTTrainer(BaseTrainer[GPTConfig, GPT]):
    logical_axis_rules = LOGICAL_AXIS_RULES

    @classmethod
    def config_from_spec(cls, spec: ExecutionSpec) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(GPTConfig)}
        return GPTConfig(**{k: v for k, v in dataclasses.asdict(spec.job.model).items() if k in known})

    @classmethod
    def build_model(cls, config: GPTConfig) -> GPT:
        return GPT(config)
