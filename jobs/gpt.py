"""The language-model job: any registered model family (`job.model.family`: gpt, llama, or your
own by import path), trained by the generic BaseTrainer, which receives the family (by default
the one the spec names). Registered as `lm`, and as `gpt`, the name the GPT jobs have always used."""

from __future__ import annotations

import functools
from typing import Any, Sequence

from runner.models import import_hf_params, model_config, platform
from runner.models.common import quantization
from runner.spec import ExecutionSpec
from runner.train.job import JOBS
from runner.train.trainer import BaseTrainer


@JOBS.register("lm")
@JOBS.register("gpt")
class LMTrainer(BaseTrainer[Any, Any]):
    """A language model of any registered family (job.model.family), trained by the generic BaseTrainer."""

    @classmethod
    def config_from_spec(cls, spec: ExecutionSpec) -> Any:
        return model_config(spec)

    def build_model(self, config: Any) -> Any:  # type: ignore[override]
        return self.family.module(config)

    @property
    def attention(self) -> str:
        """The attention implementation the model runs, resolved for the platform."""
        return str(getattr(self.model_config, "attention", ""))

    @property
    def quantization(self) -> str:
        """What runs quantized (job.model.quantization), for the run card; empty when nothing does."""
        return quantization.describe(self.model_config, quantization.provider_of(self.model))

    def quantization_warnings(self) -> list[str]:
        """What the target platform runs slowly (runner.models.common.quantization.check)."""
        if self.spec.job.model.quantization == "none":
            return []
        return quantization.check(self.spec.job.model, platform(self.spec), self.topology.chip)

    @functools.cached_property
    def logical_axis_rules(self) -> Sequence[tuple[str, Any]]:  # type: ignore[override]
        return tuple(self.family.axis_rules(self.model_config, dict(self.mesh.shape)))

    def flops_per_token(self) -> float:
        return float(self.family.flops_per_token(self.model_config, self.spec.train.seq_len))

    def param_count(self) -> int:
        return int(self.family.param_count(self.model_config))

    def active_param_count(self) -> int | None:
        """The parameters one token uses, if the family counts them apart (a mixture of experts)."""
        count = getattr(self.family, "active_param_count", None)
        return None if count is None else int(count(self.model_config))

    def import_hf(self, abstract_params: Any) -> Any:
        """The model's settings already come from config.json (runner.models.with_hf_settings)."""
        return import_hf_params(self.spec, self.model_config, abstract_params)


GPTTrainer = LMTrainer  # the name user code subclasses
