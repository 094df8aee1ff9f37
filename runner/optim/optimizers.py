"""Optimizers by name, built from optax, with weight decay kept off norms, biases and embeddings.

Every builder has the signature ``(learning_rate, settings) -> optax.GradientTransformation``.
`build_optimizer` validates the settings, resolves the name (or takes an optax object a job
returned directly) and puts global-norm clipping in front.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax import contrib as optax_contrib

from runner.errors import ConfigError
from runner.registry import Registry

OptimizerBuilder = Callable[[optax.ScalarOrSchedule, "OptimizerSettings"], optax.GradientTransformation]

OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer", "optimizer.name")

# A parameter whose path contains one of these (case-insensitive) is an embedding table.
EMBEDDING_MARKERS = ("embed", "wte", "wpe", "embedding")
# Flax's names for parameters that are vectors however they are shaped (a bias over heads x
# head_dim is 2-D, and 3-D once layers are stacked).
VECTOR_NAMES = ("bias", "scale")


@dataclass(frozen=True)
class OptimizerSettings:
    """The knobs shared by all optimizers; each builder uses the ones that apply to it."""

    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    nesterov: bool = False
    decay_embeddings_and_norms: bool = False
    # Not a config key: the model's logical axis names per parameter (a pytree like the params,
    # of `PartitionSpec`s of names), filled in by the trainer so muon can tell a weight matrix's
    # input, output and stacked-layer axes apart. None: judge by rank alone.
    param_axes: Any = field(default=None, compare=False)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def is_embedding_path(path: tuple[Any, ...]) -> bool:
    """True when any component of a pytree key path names an embedding table."""
    names = [_key_name(k).lower() for k in path]
    return any(marker in name for name in names for marker in EMBEDDING_MARKERS)


# Parameters no gradient moves (DeepSeek-V3's fixed selection bias, `score_bias`, an import's
# e_score_correction_bias): decay alone would shrink them, and the export would write the shrunk value.
FIXED_PARAMETERS = ("score_bias",)


def decay_mask(params: Any) -> Any:
    """True only for >=2-D weight matrices that are not embeddings (nor fixed parameters).

    Decaying norm scales, biases and embedding rows pulls them toward zero for no benefit
    (the usual GPT recipe), so they are masked off.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.ndim(x) >= 2 and not is_embedding_path(path)
        and _key_name(path[-1]) not in FIXED_PARAMETERS, params
    )


def _mask(settings: OptimizerSettings) -> Callable[[Any], Any] | None:
    return None if settings.decay_embeddings_and_norms else decay_mask


@OPTIMIZERS.register("adamw")
def adamw(learning_rate: optax.ScalarOrSchedule, settings: OptimizerSettings) -> optax.GradientTransformation:
    """AdamW (optax.adamw): Adam with decoupled weight decay."""
    return optax.adamw(learning_rate, b1=settings.b1, b2=settings.b2, eps=settings.eps,
                       weight_decay=settings.weight_decay, mask=_mask(settings))


@OPTIMIZERS.register("adafactor")
def adafactor(learning_rate: optax.ScalarOrSchedule, settings: OptimizerSettings) -> optax.GradientTransformation:
    """optax's Adafactor defaults (its eps/decay_rate mean other things than Adam's b2/eps).

    optax adds Adafactor's decay *after* the learning rate, so it is scaled by the learning
    rate here to give the same decoupled ``p -= lr * wd * p`` as adamw.
    """
    wd = settings.weight_decay
    rate: optax.ScalarOrSchedule | None
    if wd == 0:
        rate = None
    elif callable(learning_rate):
        rate = lambda step: wd * learning_rate(step)  # noqa: E731
    else:
        rate = wd * learning_rate
    return optax.adafactor(learning_rate, weight_decay_rate=rate, weight_decay_mask=_mask(settings))


@OPTIMIZERS.register("lion")
def lion(learning_rate: optax.ScalarOrSchedule, settings: OptimizerSettings) -> optax.GradientTransformation:
    """Lion (optax.lion): the sign of an interpolated momentum; use a 3-10x smaller learning rate than AdamW."""
    return optax.lion(learning_rate, b1=settings.b1, b2=settings.b2,
                      weight_decay=settings.weight_decay, mask=_mask(settings))


@OPTIMIZERS.register("sgd")
def sgd(learning_rate: optax.ScalarOrSchedule, settings: OptimizerSettings) -> optax.GradientTransformation:
    """SGD with (Nesterov) momentum; weight decay is added to the gradient as in torch.optim.SGD."""
    tx = optax.sgd(learning_rate, momentum=settings.momentum or None, nesterov=settings.nesterov)
    if settings.weight_decay == 0:
        return tx
    return optax.chain(optax.add_decayed_weights(settings.weight_decay, _mask(settings)), tx)


def _matrix_axes(names: tuple[Any, ...]) -> optax_contrib.MuonDimensionNumbers | None:
    """Muon's (reduction, output) axes of one weight, from its logical axis names.

    Stacked layers (``layers``) are batch axes, orthogonalised one layer at a time, and so are
    stacked experts (``expert`` beside two matrix axes: each expert's matrices apart). Every
    transformer matrix either reads the residual stream (``embed`` first: the rest is its
    output, e.g. the heads x head_dim of a query projection) or writes it (``embed`` last: the
    rest is its input). Vectors (biases, norm scales) and vocabulary tables are not matrices.
    """
    if "vocab" in names:
        return None
    free = [i for i, name in enumerate(names) if name != "layers"]
    if len(free) > 2 and "expert" in (names[i] for i in free):
        free = [i for i in free if names[i] != "expert"]
    if len(free) < 2:
        return None
    if names[free[0]] == "embed":
        return optax_contrib.MuonDimensionNumbers(free[0], tuple(free[1:]))
    if names[free[-1]] == "embed":
        return optax_contrib.MuonDimensionNumbers(tuple(free[:-1]), free[-1])
    if len(free) == 2:  # a plain (in, out) matrix
        return optax_contrib.MuonDimensionNumbers(free[0], free[1])
    return None


def _dims_of(path: tuple[Any, ...], names: tuple[Any, ...]) -> optax_contrib.MuonDimensionNumbers | None:
    """One parameter's Muon axes from its path and its per-axis names (None where unnamed)."""
    if is_embedding_path(path) or (path and _key_name(path[-1]) in VECTOR_NAMES):
        return None
    if all(name is None for name in names):  # no layout known: only a 2-D leaf is a matrix
        return optax_contrib.MuonDimensionNumbers() if len(names) == 2 else None
    return _matrix_axes(names)


def param_axis_names(params: Any, specs: Any) -> Any:
    """Per-parameter logical names padded to the parameter's rank, as `PartitionSpec`s (leaves)."""
    return jax.tree.map(lambda x, spec: P(*tuple(spec), *(None,) * (jnp.ndim(x) - len(tuple(spec)))),
                        params, specs, is_leaf=lambda x: isinstance(x, P))


def muon_dimension_numbers(params: Any, param_axes: Any = None) -> Any:
    """Muon's dimension numbers per parameter; ``None`` sends that parameter to Adam.

    With the model's logical axis names (`param_axes`, see `param_axis_names`), every weight
    matrix goes to Muon, also when stacked over scanned layers or shaped (embed, heads,
    head_dim); see `_matrix_axes`. Without them only 2-D leaves count as matrices (a leading
    layer axis can't be told from a matrix axis by shape alone). Embeddings always go to Adam:
    orthogonalising a lookup table's update is not what Muon is for (Jordan et al.).
    """
    if param_axes is None:
        return jax.tree_util.tree_map_with_path(lambda path, x: _dims_of(path, (None,) * jnp.ndim(x)), params)

    def dims(path: tuple[Any, ...], spec: P, leaf: Any) -> Any:
        # Inside muon's partition, parameters that are not Muon's arrive as MaskedNodes.
        return leaf if isinstance(leaf, optax.MaskedNode) else _dims_of(path, tuple(spec))

    return jax.tree_util.tree_map_with_path(dims, param_axes, params, is_leaf=lambda x: isinstance(x, P))


def _has_matrix(param_axes: Any) -> bool:
    named = jax.tree_util.tree_leaves_with_path(param_axes, is_leaf=lambda x: isinstance(x, P))
    return any(_dims_of(path, tuple(spec)) is not None for path, spec in named)


@OPTIMIZERS.register("muon")
def muon(learning_rate: optax.ScalarOrSchedule, settings: OptimizerSettings) -> optax.GradientTransformation:
    """optax.contrib.muon: ``momentum``/``nesterov`` drive Muon, ``b1``/``b2`` its Adam half.

    Which parameters are matrices is decided by `muon_dimension_numbers`. optax gives the Adam
    half (norms, biases, embeddings) one unmasked decay rate, so it takes none unless
    ``decay_embeddings_and_norms`` is set: the same parameters adamw's mask leaves undecayed.
    A model with no weight matrix at all is refused here, before any device work.
    """
    if settings.param_axes is not None and not _has_matrix(settings.param_axes):
        raise ConfigError(
            "optimizer.name", "muon",
            "Muon orthogonalises the updates of weight matrices, and this model has none it can use "
            "(every parameter is a vector, an embedding table or of unknown layout).",
            f"choose another optimizer for this model: one of "
            f"{', '.join(n for n in OPTIMIZERS.names() if n != 'muon')}.")
    return optax_contrib.muon(
        learning_rate,
        beta=settings.momentum,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        weight_decay_mask=_mask(settings),
        nesterov=settings.nesterov,
        adam_b1=settings.b1,
        adam_b2=settings.b2,
        adam_weight_decay=settings.weight_decay if settings.decay_embeddings_and_norms else 0.0,
        muon_weight_dimension_numbers=lambda params: muon_dimension_numbers(params, settings.param_axes),
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_settings(settings: OptimizerSettings) -> None:
    """Raise a ConfigError naming the first bad field."""
    for name in ("b1", "b2", "momentum"):
        value = getattr(settings, name)
        if not _is_number(value) or not 0 <= value < 1:
            raise ConfigError(f"optimizer.{name}", value, "must be a number in [0, 1).",
                              f"use a decay rate such as {getattr(OptimizerSettings, name)}.")
    if not _is_number(settings.eps) or settings.eps <= 0:
        raise ConfigError("optimizer.eps", settings.eps, "must be a number > 0.", "use e.g. 1e-8.")
    if not _is_number(settings.weight_decay) or settings.weight_decay < 0:
        raise ConfigError("optimizer.weight_decay", settings.weight_decay, "must be a number >= 0.",
                          "use 0 for no weight decay, or e.g. 0.1.")
    for name in ("nesterov", "decay_embeddings_and_norms"):
        value = getattr(settings, name)
        if not isinstance(value, bool):
            raise ConfigError(f"optimizer.{name}", value, "must be true or false.",
                              f"set optimizer.{name} to true or false.")


def _resolve(
    name: str | optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    settings: OptimizerSettings,
) -> optax.GradientTransformation:
    if isinstance(name, optax.GradientTransformation):
        return name
    if not isinstance(name, str):
        raise ConfigError("optimizer.name", name, "must be an optimizer name or an optax GradientTransformation.",
                          f"use one of: {', '.join(OPTIMIZERS.names())}.")
    found = OPTIMIZERS.get(name)
    if isinstance(found, optax.GradientTransformation):  # an import path to a ready-made object
        return found
    tx = found(learning_rate, settings)
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError("optimizer.name", name,
                          f"it built a {type(tx).__name__}, not an optax.GradientTransformation.",
                          "make the builder return an optax optimizer, e.g. optax.adamw(...).")
    return tx


STATE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _cast_floats(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x, tree)


def state_stored_in(inner: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """`inner` with its floating-point state (moments, momentum, factored statistics) stored in
    `dtype` and computed in float32: every update reads the state up to float32, runs `inner` and
    rounds the new state back, so only storage (memory, checkpoints) is narrowed. Counts stay
    integers."""

    def init(params: Any) -> Any:
        return _cast_floats(inner.init(params), dtype)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        new_updates, new_state = inner.update(updates, _cast_floats(state, jnp.float32), params)
        return new_updates, _cast_floats(new_state, dtype)

    return optax.GradientTransformation(init, update)


def build_optimizer(
    name: str | optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    settings: OptimizerSettings = OptimizerSettings(),
    clip_norm: float | None = None,
    state_dtype: str = "float32",
) -> optax.GradientTransformation:
    """The optimizer called ``name`` (or the optax object given), after global-norm clipping,
    its state stored in ``state_dtype`` (`state_stored_in`; float32 also with bfloat16 parameters,
    whose optax moments would otherwise be bfloat16 too).

    An optax object is used as-is (unless clipping or a narrower state is asked for):
    ``learning_rate`` and ``settings`` are then ignored, since the job already baked its own into it.
    """
    validate_settings(settings)
    if clip_norm is not None and (not _is_number(clip_norm) or clip_norm <= 0):
        raise ConfigError("optimizer.clip_norm", clip_norm, "must be a number > 0, or null.",
                          "use e.g. 1.0, or null to turn clipping off.")
    if state_dtype not in STATE_DTYPES:
        raise ConfigError("optimizer.state_dtype", state_dtype, "it is not a storage type for optimizer state.",
                          f"use one of: {', '.join(STATE_DTYPES)}.")
    tx = _resolve(name, learning_rate, settings)
    if clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    if tx is name and state_dtype == "float32":  # a ready-made optax object, nothing to add
        return tx
    return state_stored_in(tx, STATE_DTYPES[state_dtype])

