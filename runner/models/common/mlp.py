"""The gated feed-forward block (SwiGLU, GeGLU: the gate's activation by name), Llama's layout:
``gate``, ``up`` and ``down`` projections. The config gives d_model, d_ff, n_layers, activation,
mlp_bias and the dtypes."""

from __future__ import annotations

from typing import Any

import jax
from flax import linen as nn

from runner.models.common.layers import activation, dense, residual_std


class GatedMLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)), SwiGLU with act = silu."""

    cfg: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        act = activation(cfg.activation)
        gate = dense(cfg, cfg.d_ff, ("embed", "mlp"), 0.02, cfg.mlp_bias, "gate")
        up = dense(cfg, cfg.d_ff, ("embed", "mlp"), 0.02, cfg.mlp_bias, "up")
        h = nn.with_logical_constraint(act(gate(x)) * up(x), ("batch", "length", "mlp"))
        return dense(cfg, cfg.d_model, ("mlp", "embed"), residual_std(cfg.n_layers), cfg.mlp_bias, "down")(h)
