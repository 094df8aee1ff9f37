"""The layers every family builds from, written once so no family imports another: dtypes by
name, activations by transformers' names (a Hugging Face config's `hidden_act` maps to one
function), the logical axis rules, and the initialisers and layers that carry logical axis names.

Parameter names, shapes, logical axes and initialisers are the families' own; moving them here
changed none (checkpoints written before still restore).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from runner.models.common.pipeline import STAGES

COMPUTE_DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


# transformers' ACT2FN names -> the same function. gelu is the exact (erf) one; gelu_new,
# gelu_pytorch_tanh and gelu_fast are the tanh approximation (equal up to float rounding).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": _quick_gelu,
    "relu": jax.nn.relu,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    return ACTIVATIONS[name]


class Dtypes:
    """The ``dtype`` (compute) and ``params_dtype`` properties of a config with ``compute_dtype``
    and ``param_dtype`` fields naming entries of COMPUTE_DTYPES."""

    compute_dtype: str
    param_dtype: str

    @property
    def dtype(self) -> Any:
        return COMPUTE_DTYPES[self.compute_dtype]

    @property
    def params_dtype(self) -> Any:
        return COMPUTE_DTYPES[self.param_dtype]


# ----------------------------------------------------------------------------- logical axes

# Logical axis name -> mesh axes for a ("data", "fsdp", "expert", "tensor") mesh.  Order
# matters: flax assigns rules first-come and never reuses a mesh axis within one
# array, so "batch" claims "fsdp" before "embed" does on activations, while
# weights (which have no batch axis) are FSDP-sharded along "embed".
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("length", "context"),
    ("layers", "stage"),  # the stacked layers: consecutive ones on each pipeline stage (runner.models.common.pipeline)
    (STAGES, "stage"),
)


def state_over_context(rules: Sequence[tuple[str, Any]], mesh_shape: Any) -> tuple[tuple[str, Any], ...]:
    """`rules` with the weights' "embed" axis split over fsdp x context when the mesh has a context
    axis: the batch is not split over context, so without this each context shard would hold a
    whole fsdp shard of the state; with it the state is split over both, like FSDP (gathered per
    layer, gradients reduce-scattered). Activations keep "embed" whole (their length claims
    context first)."""
    if int(dict(mesh_shape).get("context", 1)) <= 1:
        return tuple(rules)
    return tuple((name, ("fsdp", "context")) if (name, axes) == ("embed", "fsdp") else (name, axes)
                 for name, axes in rules)


Axes = tuple[str | None, ...]
Q_AXES = ("batch", "length", "heads", "kv")  # attention's (B, T, N, H) queries


def fit_spec(names: tuple[str, ...], shape: tuple[int, ...], mesh: Any) -> jax.sharding.PartitionSpec:
    """The mesh axes the logical `names` map to, dropping any that do not divide the dimension (a
    one-row batch at initialisation stays whole)."""
    spec = nn.logical_to_mesh_axes(names)
    fitted = []
    for size, axes in zip(shape, (*spec, *[None] * (len(shape) - len(spec)))):
        group = (axes,) if isinstance(axes, str) else tuple(axes or ())
        fitted.append(axes if size % math.prod(mesh.shape[a] for a in group) == 0 else None)
    return jax.sharding.PartitionSpec(*fitted)


# What a layer may sow (flax `sow`) for the train step (runner.train.steps.token_loss): LOSSES are
# added to the loss it differentiates, REPORTS are logged with the step's metrics (a name ending
# in _max or _min by its largest or smallest value over layers, any other by the mean).
LOSSES, REPORTS = "losses", "reports"
# What a layer sows instead, when its caller makes this collection mutable (a pipeline, which
# calls each layer once per microbatch): sums over the call's tokens that add up over the
# microbatches to the batch's. The block's `settle` turns the batch's sums into the LOSSES, REPORTS
# and MODEL_STATE the layer would have made in one call (runner.models.common.decoder.pipelined_blocks).
LAYER_SUMS = "layer_sums"
# What a layer keeps between steps that is not trained (an MoE router's selection bias): the train
# state carries it (TrainState.model_state), checkpoints hold it, and every apply passes it; the
# train step lets the layers update it (mutable) and keeps the mean of their updates over micro-batches.
MODEL_STATE = "model_state"


def normal_init(std: float, names: Axes) -> Callable[..., Any]:
    """Normal(0, std) weights with logical axes ``names``."""
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), names)


def zeros_init(names: Axes) -> Callable[..., Any]:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def ones_init(names: Axes) -> Callable[..., Any]:
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


def residual_std(n_layers: int) -> float:
    """GPT-2's init for projections that write into the residual stream: scaled down so the
    stream's variance does not grow with depth."""
    return 0.02 / math.sqrt(2 * n_layers)


# ----------------------------------------------------------------------------- layers
# Call these inside a compact method: the layer they make is a child of that module.


def dense(cfg: Any, features: int, names: tuple[str, str], std: float, use_bias: bool, name: str) -> nn.Dense:
    """A Dense layer, kernel axes ``names``, its bias along the output axis ``names[1]``."""
    return nn.Dense(features, use_bias=use_bias, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                    kernel_init=normal_init(std, names), bias_init=zeros_init((names[1],)), name=name)


class Embed(nn.Embed):
    """flax's Embed whose `attend` (the tied output head) is an einsum, the op a quantization
    library intercepts (flax's is a jnp.dot, which Qwix does not see): the same product."""

    def attend(self, query: jax.Array) -> jax.Array:
        query, table = self.promote_dtype(query, self.embedding, dtype=self.dtype)
        return jnp.einsum("...d,vd->...v", query, table)


def embedding(cfg: Any, count: int, names: Axes, name: str) -> Embed:
    """A table of ``count`` d_model-wide embeddings, Normal(0, 0.02), logical axes ``names``."""
    return Embed(count, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                 embedding_init=normal_init(0.02, names), name=name)


def project_heads(cfg: Any, x: jax.Array, heads: int, axis: str, use_bias: bool, name: str) -> jax.Array:
    """(B, T, d_model) -> (B, T, heads, head_dim), the heads on logical axis ``axis``.

    Projections are ``nn.Einsum`` rather than ``nn.DenseGeneral``: DenseGeneral initialises a
    flattened 2-D kernel and, under a mesh, flax constrains that flat array with the 3-D logical
    spec and fails (flax 0.12.8)."""
    y = nn.Einsum((cfg.d_model, heads, cfg.head_dim), "btd,dnh->btnh", use_bias=use_bias, dtype=cfg.dtype,
                  param_dtype=cfg.params_dtype, kernel_init=normal_init(0.02, ("embed", axis, "kv")),
                  bias_init=zeros_init((axis, "kv")), name=name)(x)
    return nn.with_logical_constraint(y, ("batch", "length", axis, "kv"))


def merge_heads(cfg: Any, y: jax.Array, use_bias: bool) -> jax.Array:
    """Attention's output projection ``out``: (B, T, n_heads, head_dim) -> (B, T, d_model)."""
    kernel_init = normal_init(residual_std(cfg.n_layers), ("heads", "kv", "embed"))
    return nn.Einsum((cfg.n_heads, cfg.head_dim, cfg.d_model), "btnh,nhd->btd", use_bias=use_bias, dtype=cfg.dtype,
                     param_dtype=cfg.params_dtype, kernel_init=kernel_init, bias_init=zeros_init(("embed",)),
                     name="out")(y)
