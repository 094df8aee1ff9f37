"""The model-family interface and its registry."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Protocol, Sequence

from runner.errors import ConfigError
from runner.registry import Registry
from runner.spec import ModelSpec


class ModelFamily(Protocol):
    """What runner asks of a model family. Every method is a classmethod or staticmethod."""

    name: str

    def config(self, model: ModelSpec) -> Any:
        """The family's model config from the spec's job.model section (checked: a bad value is a
        ConfigError naming its key)."""

    def module(self, config: Any) -> Any:
        """The flax module: tokens (B, T) int32 -> logits (B, T, vocab) float32."""

    def axis_rules(self, config: Any, mesh_shape: Mapping[str, int]) -> Sequence[tuple[str, Any]]:
        """Logical axis name -> mesh axes for this config on a mesh of this shape."""

    def param_count(self, config: Any) -> int:
        """Exact parameter count, without building the model."""

    def flops_per_token(self, config: Any, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward).

        Optional: ``active_param_count(config)``, the parameters one token uses (fewer than all
        in a mixture of experts); the run card shows it beside the total."""


MODEL_FAMILIES: Registry[Any] = Registry("model family", "job.model.family")


def refuse_foreign_keys(model: ModelSpec, family: str, keys: Sequence[str], fix: str) -> None:
    """A job.model key another family reads, set away from its default, would be ignored here: refuse it.
    A key may be dotted (`moe.n_group`): a section's field."""
    default = ModelSpec()
    for key in keys:
        value = functools.reduce(getattr, key.split("."), model)
        if value != functools.reduce(getattr, key.split("."), default):
            raise ConfigError(f"job.model.{key}", value, f"the {family} family does not read it (it "
                              "belongs to another family), so it would change nothing.", fix)


def fields_of(config_type: type, model: ModelSpec, **values: Any) -> Any:
    """`config_type` built from the job.model keys it shares with ModelSpec, plus `values`."""
    known = {f.name for f in dataclasses.fields(config_type)}
    shared = {k: v for k, v in dataclasses.asdict(model).items() if k in known}
    try:
        return config_type(**{**shared, **values})
    except ValueError as err:
        raise ConfigError("job.model", model.family, str(err) + ".", "fix the model settings it names.") from None
