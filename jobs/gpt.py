"""The language-model job: any registered model family (`job.model.family`: gpt, llama, or your
own by import path), trained by the generic BaseTrainer. Registered as `lm`, and as `gpt`, the
name the GPT jobs have always used."""

from __future__ import annotations

import functools
from typing import Any, Sequence

from runner.train.job import JOBS
from runner.models import family_for, import_hf_params, model_config
from runner.spec import ExecutionSpec
from runner.train.trainer import BaseTrainer


@JOBS.register("lm")
@JOBS.register("gpt")
class LMTrainer(BaseTrainer[Any, Any]):
    @classmethod
    def config_from_spec(cls, spec: ExecutionSpec) -> Any:
        return model_config(spec)

    def build_model(self, config: Any) -> Any:  # type: ignore[override]
        return self._family.module(config)

    def __init__(self, spec: ExecutionSpec, devices: Sequence[Any] | None = None) -> None:
        self._family = family_for(spec)
        super().__init__(spec, devices)
        self.attention = getattr(self.model_config, "attention", "")  # resolved for the platform

    @functools.cached_property
    def logical_axis_rules(self) -> Sequence[tuple[str, Any]]:  # type: ignore[override]
        return tuple(self._family.axis_rules(self.model_config, dict(self.mesh.shape)))

    def flops_per_token(self) -> float:
        return float(self._family.flops_per_token(self.model_config, self.spec.train.seq_len))

    def param_count(self) -> int:
        return int(self._family.param_count(self.model_config))

    def import_hf(self, abstract_params: Any) -> Any:
        """The model's settings already come from config.json (runner.models.with_hf_settings)."""
        return import_hf_params(self.spec, self.model_config, abstract_params)


GPTTrainer = LMTrainer  # the name user code subclasses
