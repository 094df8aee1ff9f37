"""The one object a family declares to move its models to and from Hugging Face (`hf = MyAdapter`
on the family class): which config.json model types it imports, how each field becomes job.model
settings (or is refused), which transformers architecture a config exports as, and the tensor
layout both ways (runner.models.hf.mapping). A family without one neither imports nor exports."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from runner.models.hf.mapping import HFTensor


class HFAdapter:
    """A family's Hugging Face mapping; every method a staticmethod over the family's config."""

    model_types: tuple[str, ...] = ()  # config.json model_type values it imports
    base_prefix: str = ""  # the prefix of the base model's tensors a headless checkpoint drops

    @staticmethod
    def settings(init_from: str, config: Mapping[str, Any], model: Any) -> dict[str, Any]:
        """config.json -> the job.model settings (dotted keys below job.model); a field runner
        cannot honour raises runner.models.hf.mapping.HFConfigError."""
        raise NotImplementedError

    @staticmethod
    def architecture(cfg: Any, exporting: bool = False) -> tuple[str, str]:
        """(the transformers class, its model_type) this config exports as; a ConfigError when none
        holds it."""
        raise NotImplementedError

    @staticmethod
    def config(cfg: Any) -> dict[str, Any]:
        """The exported config.json."""
        raise NotImplementedError

    @staticmethod
    def layout(cfg: Any) -> list[HFTensor]:
        """Every Hugging Face tensor and the parameters it is made of."""
        raise NotImplementedError

    @staticmethod
    def buffers(cfg: Any) -> dict[str, Callable[[Any, Callable[[str], Any]], bool]]:
        """Tensors some checkpoints carry that are computed, not learned: name -> whether a value is
        the one this model computes (accepted on import when it is)."""
        return {}


def adapter_of(family: Any) -> type[HFAdapter] | None:
    """The family's Hugging Face adapter, or None."""
    return getattr(family, "hf", None)
