"""Optimizers by name, built from optax, with weight decay kept off norms, biases and embeddings.

Every builder has the signature ``(learning_rate, settings) -> optax.GradientTransformation``.
`build_optimizer` validates the settings, resolves the name (or takes an optax object a job
returned directly) and puts global-norm clipping in front.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from optax import contrib as optax_contrib

from runner.errors import ConfigError
from runner.registry import Registry

OptimizerBuilder = Callable[[optax.ScalarOrSchedule, "OptimizerSettings"], optax.GradientTransformation]

OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer", "optimizer.name")

# A parameter whose path contains one of these (case-insensitive) is an embedding table.
EMBEDDING_MARKERS = ("embed", "wte", "wpe", "embedding")


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


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def is_embedding_path(path: tuple[Any, ...]) -> bool:
    """True when any component of a pytree key path names an embedding table."""
    names = [_key_name(k).lower() for k in path]
    return any(marker in name for name in names for marker in EMBEDDING_MARKERS)


def decay_mask(params: Any) -> Any:
    """True only for >=2-D weight matrices that are not embeddings.

    Decaying norm scales, biases and embedding rows pulls them toward zero for no benefit
    (the usual GPT recipe), so they are masked off.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.ndim(x) >= 2 and not is_embedding_path(path), params
    )


def _mask(settings: OptimizerSettings) -> Callable[[Any], Any] | None:
    return None if settings.decay_embeddings_and_norms else decay_mask


@OPTIMIZERS.register("adamw")
def adamw(learning_rate: optax.ScalarOrSchedule, settings: OptimizerSettings) -> optax.GradientTransformation:
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
    return optax.lion(learning_rate, b1=settings.b1, b2=settings.b2,
                      weight_decay=settings.weight_decay, mask=_mask(settings))


@OPTIMIZERS.register("sgd")
def sgd(learning_rate: optax.ScalarOrSchedule, settings: OptimizerSettings) -> optax.GradientTransformation:
    """SGD with (Nesterov) momentum; weight decay is added to the gradient as in torch.optim.SGD."""
    tx = optax.sgd(learning_rate, momentum=settings.momentum or None, nesterov=settings.nesterov)
    if settings.weight_decay == 0:
        return tx
    return optax.chain(optax.add_decayed_weights(settings.weight_decay, _mask(settings)), tx)


def muon_dimension_numbers(params: Any) -> Any:
    """Muon for 2-D non-embedding matrices; ``None`` sends everything else to Adam.

    optax's default already sends non-2-D leaves to Adam; embeddings go there too because
    orthogonalising a lookup table's update is not what Muon is for (Jordan et al.). 3-D+
    kernels (stacked layers, multi-head projections) go to Adam as well: which of their axes
    form the matrix is model-specific, so a job wanting Muon there should pass its own optax
    object built with ``muon_weight_dimension_numbers``.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x: optax_contrib.MuonDimensionNumbers()
        if jnp.ndim(x) == 2 and not is_embedding_path(path) else None,
        params,
    )


@OPTIMIZERS.register("muon")
def muon(learning_rate: optax.ScalarOrSchedule, settings: OptimizerSettings) -> optax.GradientTransformation:
    """optax.contrib.muon: ``momentum``/``nesterov`` drive Muon, ``b1``/``b2`` its Adam half.

    optax gives the Adam half (norms, biases, embeddings, non-2-D leaves) one unmasked decay
    rate, so it takes none unless ``decay_embeddings_and_norms`` is set. Unlike adamw, that
    leaves 3-D+ kernels undecayed by default.
    """
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
        muon_weight_dimension_numbers=muon_dimension_numbers,
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_settings(settings: OptimizerSettings) -> None:
    """Raise a ConfigError naming the first bad field."""
    for field in ("b1", "b2", "momentum"):
        value = getattr(settings, field)
        if not _is_number(value) or not 0 <= value < 1:
            raise ConfigError(f"optimizer.{field}", value, "must be a number in [0, 1).",
                              f"use a decay rate such as {getattr(OptimizerSettings, field)}.")
    if not _is_number(settings.eps) or settings.eps <= 0:
        raise ConfigError("optimizer.eps", settings.eps, "must be a number > 0.", "use e.g. 1e-8.")
    if not _is_number(settings.weight_decay) or settings.weight_decay < 0:
        raise ConfigError("optimizer.weight_decay", settings.weight_decay, "must be a number >= 0.",
                          "use 0 for no weight decay, or e.g. 0.1.")
    for field in ("nesterov", "decay_embeddings_and_norms"):
        value = getattr(settings, field)
        if not isinstance(value, bool):
            raise ConfigError(f"optimizer.{field}", value, "must be true or false.",
                              f"set optimizer.{field} to true or false.")


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


def build_optimizer(
    name: str | optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    settings: OptimizerSettings = OptimizerSettings(),
    clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """The optimizer called ``name`` (or the optax object given), after global-norm clipping.

    An optax object is used as-is: ``learning_rate`` and ``settings`` are then ignored, since
    the job already baked its own into it.
    """
    validate_settings(settings)
    if clip_norm is not None and (not _is_number(clip_norm) or clip_norm <= 0):
        raise ConfigError("optimizer.clip_norm", clip_norm, "must be a number > 0, or null.",
                          "use e.g. 1.0, or null to turn clipping off.")
    tx = _resolve(name, learning_rate, settings)
    if clip_norm is None:
        return tx
    return optax.chain(optax.clip_by_global_norm(clip_norm), tx)

