"""Model families: the plug-ins a job picks with `job.model.family`.

A family turns the spec's `job.model` section into its config and flax module, and says how
its parameters shard (logical-axis rules), how many there are and what a token costs. Generic
code (the trainer, mode=compile, the run card, the benchmark) asks the family and imports no
model. A family in your own module is named by import path: `job.model.family=my_pkg.models:MyFamily`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from runner import hf
from runner.errors import ConfigError
from runner.models import attention, gpt, llama  # noqa: F401  (register the built-in families)
from runner.models.family import MODEL_FAMILIES, ModelFamily
from runner.spec import ExecutionSpec
from runner.topology import parse_topology

__all__ = ["MODEL_FAMILIES", "ModelFamily", "check_spec", "family_for", "model_config"]


def family_for(spec: ExecutionSpec) -> Any:
    """The family `job.model.family` names."""
    return MODEL_FAMILIES.get(spec.job.model.family)


def platform(spec: ExecutionSpec) -> str:
    """The platform the run targets: its topology's, or (topology=auto) the one JAX sees."""
    named = parse_topology(spec.topology).platform if spec.topology else "auto"
    if named != "auto":
        return named
    import jax

    return attention.platform_of(jax.devices()[0])


def model_config(spec: ExecutionSpec) -> Any:
    """The family's config for job.model, its attention resolved for the target platform (auto
    picks one; a platform that cannot run the one named is a ConfigError)."""
    config = family_for(spec).config(spec.job.model)
    if not dataclasses.is_dataclass(config) or not hasattr(config, "attention"):
        return config
    impl = attention.check(config.attention, platform(spec), spec.job.model.compute_dtype, spec.train.seq_len)
    return dataclasses.replace(config, attention=impl)


def check_spec(spec: ExecutionSpec) -> None:
    """The job.model section: the family exists and accepts these settings; a Hugging Face model to
    start from (run.init_from=hf:DIR) has this family's architecture and these dims."""
    family = family_for(spec)
    config = family.config(spec.job.model)
    named = parse_topology(spec.topology).platform if spec.topology else "auto"
    attention.check(spec.job.model.attention, named, spec.job.model.compute_dtype, spec.train.seq_len)
    if spec.run.init_from.startswith(hf.HF_PREFIX):
        where = hf.hf_dir(spec.run.init_from)
        if not hasattr(family, "hf_dims"):
            raise ConfigError("run.init_from", spec.run.init_from, f"the model family {spec.job.model.family!r} "
                              "has no Hugging Face layout.", "use a family that has one (gpt, llama).")
        hf.check_dims(family.hf_dims(hf.read_config(where)), config, where)
