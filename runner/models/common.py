"""What the model families share that is not plumbing: dtypes by name and activations by
transformers' names (so a Hugging Face config's `hidden_act` maps to one function)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

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
