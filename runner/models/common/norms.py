"""Normalisation layers the families share."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from runner.models.common.layers import ones_init


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32."""

    eps: float
    dtype: Any
    axis_name: str = "embed"
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("scale", ones_init((self.axis_name,)), (x.shape[-1],), self.param_dtype)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
        return (weight * h).astype(self.dtype)
