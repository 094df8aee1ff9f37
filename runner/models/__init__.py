"""Model families: the plug-ins a job picks with `job.model.family`.

A family turns the spec's `job.model` section into its config and flax module, and says how
its parameters shard (logical-axis rules), how many there are and what a token costs. Generic
code (the trainer, mode=compile, the run card, the benchmark) asks the family and imports no
model. A family in your own module is named by import path: `job.model.family=my_pkg.models:MyFamily`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from runner.errors import ConfigError
from runner.models.attention import context, kernels
from runner.models.common import pipeline, quantization, tiling
from runner.models.common.decoder import OFFLOAD_PLATFORMS
from runner.models.common.runtime import Runtime
from runner.models.family import MODEL_FAMILIES, ModelFamily
from runner.models.deepseek import model as _deepseek  # noqa: F401
from runner.models.gemma import model as _gemma  # noqa: F401
from runner.models.gpt import model as _gpt  # noqa: F401  (each family's model module registers it)
from runner.models.hf import mapping
from runner.models.hf.adapter import adapter_of
from runner.models.llama import model as _llama  # noqa: F401
from runner.parallel.mesh import mesh_shape, ulysses_heads, usp_group_sizes, usp_ways
from runner.parallel.topology import parse_topology
from runner.spec import ExecutionSpec, ModelSpec, validate

__all__ = ["MODEL_FAMILIES", "ModelFamily", "check_spec", "context_choice", "family_for", "import_hf_params",
           "model_config", "place_hf_params", "with_hf_settings"]


def family_for(spec: ExecutionSpec) -> Any:
    """The family `job.model.family` names."""
    return MODEL_FAMILIES.get(spec.job.model.family)


def platform(spec: ExecutionSpec) -> str:
    """The platform the run targets: its topology's, or (topology=auto) the one JAX sees."""
    named = parse_topology(spec.topology).platform if spec.topology else "auto"
    if named != "auto":
        return named
    import jax

    return kernels.platform_of(jax.devices()[0])


def model_config(spec: ExecutionSpec) -> Any:
    """The family's config for job.model with its run-time fields (runner.models.common.runtime)
    resolved once for the target platform and mesh: the attention implementation (auto picks one;
    a platform that cannot run the one named is a ConfigError), the context-parallel kind and usp
    groups, the loss tiles, the pipeline, and what the family picks per platform. A user's family
    whose config is not a Runtime runs as it is."""
    config = family_for(spec).config(spec.job.model)
    if not isinstance(config, Runtime):
        return config
    target = platform(spec)
    check_offload(spec, target)
    impl = kernels.check(config.attention, target, spec.job.model.compute_dtype, spec.train.seq_len)
    kind = context_choice(spec, target)[0]
    if spec.mesh.context > 1 and (kind == "usp" or kind != "ulysses" and not context_splash(spec, impl, kind)):
        impl = "xla"  # rows split over the context axis: XLA blocks (ulysses attends whole rows: any kernel)
    ways = usp_ways(spec, spec.mesh.context) if kind == "usp" and spec.mesh.context > 1 else config.ulysses_ways
    config = dataclasses.replace(config, attention=impl, context_parallel=kind, ulysses_ways=ways)
    config = pipeline.resolve(spec, tiling.resolve(spec, config))
    for_platform = getattr(family_for(spec), "for_platform", None)  # what else the family picks per platform
    return for_platform(config, target) if for_platform else config


def context_choice(spec: ExecutionSpec, target: str = "") -> tuple[str, str]:
    """(job.model.context_parallel with auto resolved for the platform and shape, why auto chose it;
    empty when it was named or there is no context axis): runner.models.attention.context.choose."""
    kind = spec.job.model.context_parallel
    if kind != "auto" or spec.mesh.context <= 1:
        return kind, ""
    ways = spec.mesh.context
    heads, _ = ulysses_heads(spec)
    fits = usp_group_sizes(heads, ways)
    return context.choose(target or platform(spec), spec.train.seq_len, ways, heads, fits[-1] if fits else 0)


def context_splash(spec: ExecutionSpec, impl: str, kind: str = "") -> bool:
    """Whether rows split over the context axis are attended by the splash kernel (runner.models
    .context): it is the implementation and each shard's rows fill the kernel's tiles; else XLA
    blocks."""
    return impl in context.SPLASH and context.splash_fits(kind or spec.job.model.context_parallel,
                                                          spec.train.seq_len, spec.mesh.context)


def check_spec(spec: ExecutionSpec) -> None:
    """The job.model section: the family exists and accepts these settings, and a model it can
    export to Hugging Face is one a transformers architecture holds (refused now, not after
    training: job.model.hf.architecture, or a combination no architecture has)."""
    family = family_for(spec)
    config = family.config(spec.job.model)
    named = parse_topology(spec.topology).platform if spec.topology else "auto"
    kernels.check(spec.job.model.attention, named, spec.job.model.compute_dtype, spec.train.seq_len)
    check_offload(spec, named)
    if hasattr(family, "for_platform"):
        family.for_platform(config, named)
    if adapter_of(family):
        adapter_of(family).architecture(config)
    check_quantization(spec, config)
    tiling.check(spec, config)
    if spec.mesh.stage > 1:
        pipeline.check(spec, config, context_choice(spec, named if named != "auto" else "")[0])
    if spec.mesh.stage > 1 and parse_topology(spec.topology).num_devices:
        shape = mesh_shape(spec, parse_topology(spec.topology).num_devices)
        pipeline.check_microbatches(spec, shape["data"] * shape["fsdp"] * shape["expert"])


def check_offload(spec: ExecutionSpec, target: str) -> None:
    """job.model.remat=offload needs a runtime that places arrays in host memory (TPU, GPU): on
    another platform XLA ignores the placement, and the run would keep every layer's input on the
    device as remat=full does, not where it was asked to. `target` auto: not known yet."""
    if spec.job.model.remat == "offload" and target not in (*OFFLOAD_PLATFORMS, "auto"):
        raise ConfigError("job.model.remat", "offload", f"it moves each layer's saved input to the host's pinned "
                          f"memory between the forward and the backward pass, and this run's platform is {target}, "
                          "whose runtime has no host memory apart from the device's: XLA would ignore the move and "
                          "keep them on the device.", "use job.model.remat=full here (the same numbers), or a TPU or "
                          "GPU topology (mode=compile shows the host memory it uses apart).")


def check_quantization(spec: ExecutionSpec, config: Any) -> list[str]:
    """job.model.quantization: a family that quantizes (its config has the field), a format and
    scope runner can honour on the topology's chips (refused) and, returned, what it runs slowly."""
    model = spec.job.model
    if model.quantization != "none" and not hasattr(config, "quantization"):
        raise ConfigError("job.model.quantization", model.quantization, f"the {model.family} family does not "
                          "quantize its matmuls (its config has no quantization field), so the run would train "
                          "unquantized.",
                          "use job.model.quantization=none, or a family that quantizes (gpt, llama, gemma).")
    topology = parse_topology(spec.topology) if spec.topology else None
    named = topology.platform if topology else "auto"
    return quantization.check(model, named, topology.chip if topology else None)


def hf_family(init_from: str, model_type: Any) -> Any:
    """The registered family that imports config.json's model_type."""
    for name in MODEL_FAMILIES.names():
        family = MODEL_FAMILIES.get(name)
        if adapter_of(family) and model_type in adapter_of(family).model_types:
            return family
    known = sorted((t, n) for n in MODEL_FAMILIES.names() for t in getattr(adapter_of(MODEL_FAMILIES.get(n)),
                                                                             "model_types", ()))
    raise ConfigError("run.init_from", init_from, f"its config.json says model_type={model_type!r}, an architecture "
                      f"runner does not implement; it imports {', '.join(f'{t} ({n})' for t, n in known)}.",
                      "import a model of one of those architectures.")


def command_line_model_keys(overrides: Sequence[str]) -> set[str]:
    """The job.model keys (below job.model) the command line sets."""
    keys = set()
    for override in overrides:
        key = override.lstrip("+").split("=", 1)[0]
        if key.startswith("job.model."):
            keys.add(key[len("job.model."):])
    return keys


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _replace(obj: Any, dotted: str, value: Any) -> Any:
    head, _, rest = dotted.partition(".")
    return dataclasses.replace(obj, **{head: _replace(getattr(obj, head), rest, value) if rest else value})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def with_hf_settings(spec: ExecutionSpec, overrides: Sequence[str]) -> ExecutionSpec:
    """run.init_from=hf:DIR: the model's settings come from DIR/config.json (its family, dims,
    activation, biases, rope, epsilon; every field read or refused by the family's rules), over
    the job file's values. A job.model key set on the command line that contradicts config.json
    is refused naming both."""
    if not spec.run.init_from.startswith(mapping.HF_PREFIX):
        return spec
    where = mapping.hf_dir(spec.run.init_from)
    config = mapping.read_config(where)
    family = hf_family(spec.run.init_from, config.get("model_type"))
    user_keys = command_line_model_keys(overrides)
    if "scale" in user_keys and spec.job.model.scale:
        raise ConfigError("job.model.scale", spec.job.model.scale, "it sets the model's width, and the imported "
                          f"model's dims come from {where / 'config.json'}.", "drop job.model.scale.")
    settings = adapter_of(family).settings(spec.run.init_from, config, spec.job.model)
    # the job file's model settings do not carry over (another family's keys among them): how to
    # run the model (dtypes, kernel, remat, scan, dropout, the context), and what the command line set, do
    keep = {"compute_dtype", "param_dtype", "attention", "remat", "scan_layers", "dropout", "context_length",
            "quantization", "quantization_scope", "quantization_scaling",
            *(key.split(".")[0] for key in user_keys)}
    model = dataclasses.replace(ModelSpec(), **{key: getattr(spec.job.model, key) for key in keep
                                                if hasattr(spec.job.model, key)})
    for key, value in settings.items():
        if key in user_keys and not _same(_get(model, key), value):
            raise ConfigError(f"job.model.{key}", _get(model, key), f"the model imported by run.init_from="
                              f"{spec.run.init_from} has {value!r} ({where / 'config.json'}).",
                              f"drop job.model.{key} from the command line: an imported model's settings come "
                              "from its config.json.")
        model = _replace(model, key, value)
    model = dataclasses.replace(model, scale=0)
    spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=model))
    validate(spec)
    return spec


def import_hf_params(spec: ExecutionSpec, config: Any, abstract_params: Any) -> dict[str, Any]:
    """The parameters of the Hugging Face model run.init_from=hf:DIR names, as numpy arrays in the
    layout of `abstract_params` (this model's, whose settings came from config.json): every
    tensor in the files placed, or the import refused naming it."""
    import jax

    where = mapping.hf_dir(spec.run.init_from)
    shapes = {tuple(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    adapter = adapter_of(family_for(spec))
    tensors = mapping.HFTensors(where, adapter.base_prefix)
    return mapping.import_params(adapter.layout(config), tensors, shapes, config.scan_layers, where,
                                 adapter.buffers(config))


def place_hf_params(spec: ExecutionSpec, params: Any, abstract_params: Any) -> Any:
    """A warm start's imported parameters (numpy, from the job's `import_hf`) on the devices, in the
    dtypes and shardings of `abstract_params`; process 0 says what was imported and from where."""
    import jax
    import numpy as np

    placed = jax.tree.map(lambda a, s: jax.device_put(np.asarray(a, s.dtype), s.sharding), params, abstract_params)
    if jax.process_index() == 0:
        m = spec.job.model
        print(f"warm start: parameters from the Hugging Face model {spec.run.init_from[len(mapping.HF_PREFIX):]} "
              f"({m.hf.architecture or m.family}: d_model={m.d_model}, n_layers={m.n_layers}, "
              f"n_heads={m.n_heads}, vocab_size={m.vocab_size}; job.model settings from its config.json)",
              flush=True)
    return placed
