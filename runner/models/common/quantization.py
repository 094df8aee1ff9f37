"""Quantized training: a model's matmuls in int8 or fp8 (``job.model.quantization``), through Qwix.

Qwix (google/qwix, the library MaxText trains int8 and fp8 with; AQT, its predecessor, is
deprecated) intercepts ``jax.lax.dot_general``, ``jnp.einsum`` and ``jax.lax.ragged_dot`` inside a
flax module's call and, for the module paths a rule matches, quantizes both operands of the
forward matmul and, with a backward type, the gradient matmuls too. The parameters stay in
``job.model.param_dtype`` (quantized on the fly each step): checkpoints, exports and the optimizer
see the usual weights.

Formats (FORMATS):

  int8  operands int8 forward and backward (TPU v4 and later, NVIDIA GPUs).
  fp8   float8_e4m3fn forward, float8_e5m2 gradients (the Transformer Engine recipe; H100, H200,
        TPU7x).

Scaling is dynamic ("current scaling"): every matmul scales its operands by their absolute
maximum (``job.model.quantization_scaling``: per channel, or per tensor, which fp8 matrix units
fuse into the matmul; auto: tensor for fp8, channel for int8) when it runs, so there is no amax
history and no scaling state to carry: a checkpoint of a quantized run holds exactly what an
unquantized one does, and resumes bit-exact as one does.

Scope (``job.model.quantization_scope``): which matmuls. A family names the module paths of each
kind (its ``QUANTIZED``): ``attention`` (the query, key, value and output projections; never the
scores), ``mlp`` (the dense feed-forward), ``experts`` (a mixture of experts' expert matmuls and
shared experts; never the router), ``head`` (the output projection, the tied embedding's too).
The embedding lookup is a gather, not a matmul: nothing to quantize.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from typing import Any, Mapping, Sequence

import jax.numpy as jnp

from runner.errors import ConfigError
from runner.registry import Registry

SCOPES = ("attention", "mlp", "experts", "head")
DEFAULT_SCOPE = ("attention", "mlp", "experts")  # job.model.quantization_scope's default: what applies of it
_PROVIDERS: "weakref.WeakKeyDictionary[type, Any]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Format:
    """A quantized training format: the operand type of the forward matmuls and of the gradient
    matmuls; `name` also names the chips' rate (runner.parallel.topology: peak_<name>_ops)."""

    name: str
    forward: Any
    backward: Any
    scaling: str = "channel"  # what quantization_scaling=auto means for it


FORMATS: Registry[Format] = Registry("quantization format", "job.model.quantization", allow_import_paths=False)
FORMATS.register("none")(Format("none", None, None))  # no quantization: every matmul in job.model.compute_dtype
FORMATS.register("int8")(Format("int8", jnp.int8, jnp.int8))  # int8 operands, forward and backward
# float8: e4m3 operands forward, e5m2 in the gradient matmuls (quantization_scaling=auto: per tensor)
FORMATS.register("fp8")(Format("fp8", jnp.float8_e4m3fn, jnp.float8_e5m2, "tensor"))

# A family's table of what each scope quantizes (its ``QUANTIZED``): scope -> (module path regex,
# the ops to quantize in those modules) pairs. The path is matched whole (e.g. ``blocks/attn/query``).
QuantizedModules = Mapping[str, Sequence[tuple[str, tuple[str, ...]]]]


def check(model: Any, platform: str, chip: Any = None) -> list[str]:
    """Refuse a format or scope runner cannot honour on this platform; return warnings for the
    ones it runs slowly. `model` is the spec's job.model; `chip` the topology's (or None)."""
    fmt = FORMATS.get(model.quantization)
    if fmt.name == "none":
        return []
    for scope in model.quantization_scope:
        if scope not in SCOPES:
            raise ConfigError("job.model.quantization_scope", list(model.quantization_scope),
                              f"{scope!r} is not a kind of matmul runner quantizes.",
                              f"name some of: {', '.join(SCOPES)}.")
    if not model.quantization_scope:
        raise ConfigError("job.model.quantization_scope", [], "it names no matmul, so "
                          f"job.model.quantization={fmt.name} would change nothing.",
                          f"name some of {', '.join(SCOPES)}, or set job.model.quantization=none.")
    present = {"attention", "head", *(["experts"] if model.moe.n_experts else []),
               *(["mlp"] if not model.moe.n_experts or model.moe.first_dense_layers else [])}
    absent = [scope for scope in model.quantization_scope if scope not in present]
    if absent and (set(absent) == set(model.quantization_scope) or tuple(model.quantization_scope) != DEFAULT_SCOPE):
        raise ConfigError("job.model.quantization_scope", list(model.quantization_scope),
                          f"this model has no {' and no '.join(absent)} matmuls "
                          f"({'a dense model' if not model.moe.n_experts else 'every layer has experts'}), so "
                          "that part of the scope would quantize nothing.",
                          f"name only some of: {', '.join(s for s in SCOPES if s in present)}.")
    if "experts" in model.quantization_scope and model.moe.n_experts and model.moe.dispatch == "gmm":
        raise ConfigError("job.model.moe.dispatch", "gmm", f"megablox's gmm kernel is not one Qwix quantizes, so "
                          f"the experts would train unquantized under job.model.quantization={fmt.name}.",
                          "use job.model.moe.dispatch=ragged (or capacity), or drop experts from "
                          "job.model.quantization_scope.")
    warnings = []
    if chip is not None:
        peak = getattr(chip, f"peak_{fmt.name}_ops")
        if peak == 0:
            others = [f for f in FORMATS.names() if f not in (fmt.name, "none") and getattr(chip, f"peak_{f}_ops")]
            raise ConfigError("job.model.quantization", fmt.name, f"the {chip.name} chips of this topology have no "
                              f"{fmt.name} matrix units, so its matmuls would run no faster than in bfloat16, "
                              "after the extra work of quantizing them.",
                              f"use job.model.quantization={others[0]} or none." if others
                              else "use job.model.quantization=none.")
        if peak is None:
            warnings.append(f"job.model.quantization={fmt.name}: the {chip.name}'s {fmt.name} rate is not published; "
                            "MFU is against its bfloat16 peak.")
        elif peak <= chip.peak_bf16_flops:
            warnings.append(f"job.model.quantization={fmt.name}: the {chip.name} runs {fmt.name} matmuls no faster "
                            "than bfloat16 ones; expect no speed-up.")
    if platform == "gpu" and fmt.name == "int8":
        warnings.append("job.model.quantization=int8 on a GPU: XLA runs most of the int8 matmuls dequantized, so "
                        "it measured slower than bf16 on an H100 (docs/performance.md); use fp8 there.")
    if platform == "cpu":
        warnings.append(f"job.model.quantization={fmt.name} on a CPU: Qwix emulates the {fmt.name} matmuls, "
                        "slower than float32; for testing only.")
    return warnings


def scaling(config: Any) -> str:
    """channel or tensor: config.quantization_scaling, auto resolved by the format."""
    setting = getattr(config, "quantization_scaling", "auto")
    return FORMATS.get(config.quantization).scaling if setting == "auto" else setting


def rules(fmt: Format, scope: Sequence[str], modules: QuantizedModules, per: str = "channel") -> list[Any]:
    """Qwix rules for the scopes a family has modules for; `per`: channel or tensor scaling."""
    import qwix

    return [qwix.QtRule(module_path=pattern, op_names=ops, weight_qtype=fmt.forward, act_qtype=fmt.forward,
                        bwd_qtype=fmt.backward, disable_channelwise_axes=per == "tensor")
            for s in scope for pattern, ops in modules.get(s, ())]


def _provider_class() -> type:
    import qwix

    class RecordingProvider(qwix.QtProvider):
        """Qwix's quantized-training provider that also records which module paths and ops it
        quantized (the run card and the tests read `quantized`)."""

        def __init__(self, rules: Sequence[Any]) -> None:
            super().__init__(rules)
            self.quantized: set[tuple[str, str]] = set()

        def _get_current_rule_and_op_id(self, op_name: str, **kwargs: Any) -> Any:
            rule, op_id = super()._get_current_rule_and_op_id(op_name, **kwargs)
            if rule is not None and rule.weight_qtype is not None:
                from qwix._src.utils import flax_util

                self.quantized.add(("/".join(map(str, flax_util.get_current_module_path())), op_name))
            return rule, op_id

    return RecordingProvider


def quantized(module: Any, config: Any, modules: QuantizedModules) -> Any:
    """`module` with the matmuls config.quantization_scope names quantized to
    config.quantization (itself when that is none); `modules`: the family's QUANTIZED."""
    if config.quantization == "none":
        return module
    import qwix

    for pairs in modules.values():
        for pattern, _ in pairs:
            re.compile(pattern)  # a family's typo fails here, not as a silently unmatched rule
    provider = _provider_class()(rules(FORMATS.get(config.quantization), config.quantization_scope, modules,
                                       scaling(config)))
    module = qwix.quantize_model(module, provider)
    _PROVIDERS[type(module)] = provider  # quantize_model makes a class of its own for each call
    return module


def provider_of(module: Any) -> Any:
    """The recording provider a module `quantized` made runs with (its `quantized` set: the
    (module path, op) pairs traced so far), or None for an unquantized module."""
    return _PROVIDERS.get(type(module))


def describe(config: Any, provider: Any) -> str:
    """The run card's line: the format, its operand types, and the modules Qwix quantized (known
    once the step is traced)."""
    fmt = FORMATS.get(config.quantization)
    if fmt.name == "none":
        return ""
    paths = {path for path, _ in provider.quantized} if provider is not None else set()
    kinds = sorted({re.sub(r"^(dense_)?blocks/|^block_\d+/", "", path) for path in paths})  # one name per layer
    forward, backward = jnp.dtype(fmt.forward).name, jnp.dtype(fmt.backward).name
    return (f"quantization: {fmt.name} via Qwix ({forward} forward, {backward} gradients, scaled per "
            f"{scaling(config)} as each matmul runs); scope {', '.join(config.quantization_scope)}: "
            + (f"{len(paths)} modules ({', '.join(kinds)})" if paths else "no matmul traced yet"))
