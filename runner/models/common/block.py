"""The pre-norm decoder block the llama and deepseek families share: norm, attention, residual;
norm, a gated MLP or the mixture of experts, residual. A family's subclass names its attention
(`attention_cls`, called as ``(cfg, name="attn")(x, positions, segment_ids, cache, index)``);
parameter names are the block's own, whichever family runs it."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax
from flax import linen as nn

from runner.models.common import moe, tiling
from runner.models.common.decoder import KVCache, layer_input
from runner.models.common.layers import activation
from runner.models.common.mlp import GatedMLP
from runner.models.common.norms import RMSNorm


class PreNormBlock(nn.Module):
    """Pre-norm block, ``(carry, cache) -> (carry, new cache)`` to fit ``nn.scan``; `sparse`: its
    feed-forward is the mixture of experts."""

    attention_cls: ClassVar[type[nn.Module]]
    cfg: Any
    sparse: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, index: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        cfg = self.cfg
        x = layer_input(x)
        norm = functools.partial(RMSNorm, cfg.norm_eps, cfg.dtype, param_dtype=cfg.params_dtype)
        y, cache = self.attention_cls(cfg, name="attn")(norm(name="attn_norm")(x), positions, segment_ids, cache,
                                                        index)
        x = x + y
        h = norm(name="mlp_norm")(x)
        if self.sparse:
            x = x + moe.MoEMLP(cfg, activation(cfg.activation), name="moe")(h)
        else:  # tiled when training (a cache: decoding a token or a prompt)
            x = x + tiling.feed_forward(GatedMLP(cfg, name="mlp"), h, cfg.mlp_tiles if cache is None else 1)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), cache

    @staticmethod
    def settle(cfg: Any, sums: Any, state: Any) -> tuple[Any, Any, Any]:
        """A pipeline's (LOSSES, REPORTS, MODEL_STATE) of the layers, stacked, from their routing
        sums over the batch (runner.models.common.decoder.pipelined_blocks): what their calls make."""
        bias = state.get("moe", {}).get("router_bias")
        loss, reports, moved = moe.settle(cfg, sums["moe"]["routing"][0], bias)
        return ({"moe": {"moe_balancing": (loss,)}}, {"moe": {f"moe/{k}": (v,) for k, v in reports.items()}},
                {} if moved is None else {"moe": {"router_bias": moved}})
