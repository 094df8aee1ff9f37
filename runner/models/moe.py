"""A mixture-of-experts feed-forward block: a router picks `top_k` of `n_experts` SwiGLU experts per
token, the chosen experts run on just their tokens, and the outputs are summed by the routing
weights. The llama family uses it when job.model.moe.n_experts > 0; the dispatches are tested
against the plain reference.

Dispatches:
  ragged    tokens sorted by expert, one grouped matmul per weight (`jax.lax.ragged_dot`): no
            token is dropped, nothing is padded (dropless, as MaxText and torchtitan default to)
  capacity  each expert takes at most `capacity` tokens (capacity_factor x an even share); the
            rest are dropped, pass through the residual, and are counted
  dense     every expert on every token, masked by the routing: the reference the others are
            tested against (E times the FLOPs; for tests and tiny models)

Balancing: the Switch/Mixtral load-balancing loss and the router z-loss (both in the training
loss), and the functions for DeepSeek-V3's per-expert selection bias (added to the scores for
choosing experts only, never to the weights; not yet kept in the train state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from runner.models.common import LOSSES, REPORTS, normal_init, residual_std

DISPATCHES = ("ragged", "capacity", "dense")
SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """One batch's routing: for each token its `top_k` experts and their weights, the router's
    probabilities over all experts (for the balancing loss) and its logits (for the z-loss)."""

    experts: jax.Array  # (T, k) int32
    weights: jax.Array  # (T, k)
    probs: jax.Array  # (T, E)
    logits: jax.Array  # (T, E)


def route(logits: jax.Array, top_k: int, score: str = "softmax", normalize: bool = True,
          bias: jax.Array | None = None) -> Routing:
    """Pick each token's experts. `score`: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3).
    `bias` (E,) shifts which experts are chosen, not their weights. `normalize`: the chosen
    weights sum to one."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    chooser = probs if bias is None else probs + bias
    _, experts = jax.lax.top_k(chooser, top_k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-9)
    return Routing(experts=experts.astype(jnp.int32), weights=weights, probs=probs, logits=logits)


def expert_load(routing: Routing, n_experts: int, mask: jax.Array | None = None) -> jax.Array:
    """Each expert's share of the token-slots routed, relative to an even share (1.0 = even)."""
    hits = jax.nn.one_hot(routing.experts, n_experts, dtype=jnp.float32).sum(axis=1)  # (T, E)
    if mask is not None:
        hits = hits * mask[:, None]
    total = jnp.maximum(jnp.sum(hits), 1.0)
    return jnp.sum(hits, axis=0) / total * n_experts


def balance_loss(routing: Routing, n_experts: int, mask: jax.Array | None = None) -> jax.Array:
    """Switch/Mixtral: E * sum_e (fraction of slots routed to e) * (mean probability of e);
    1.0 when routing is even, larger when it collapses onto few experts."""
    probs = routing.probs if mask is None else routing.probs * mask[:, None]
    real = jnp.maximum(jnp.sum(mask), 1.0) if mask is not None else routing.probs.shape[0]
    mean_prob = jnp.sum(probs, axis=0) / real
    return jnp.sum(expert_load(routing, n_experts, mask) / n_experts * mean_prob) * n_experts


def z_loss(routing: Routing, mask: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: the mean squared log-partition of the router logits (keeps them small)."""
    z = jax.nn.logsumexp(routing.logits, axis=-1) ** 2
    if mask is None:
        return jnp.mean(z)
    return jnp.sum(z * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def updated_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower
    the over-loaded ones', by `rate` each step (the sign of the imbalance, not its size)."""
    return bias + rate * jnp.sign(1.0 - load)


Activation = Callable[[jax.Array], jax.Array]


def _swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, act: Activation) -> jax.Array:
    return act(x @ gate) * (x @ up)


def dense_experts(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                  act: Activation = jax.nn.silu) -> jax.Array:
    """The reference: every expert on every token, then the routing weights (zero for experts a
    token did not choose) combine them. x: (T, d); w_gate, w_up: (E, d, f); w_down: (E, f, d)."""
    n_experts = w_gate.shape[0]
    hidden = act(jnp.einsum("td,edf->tef", x, w_gate)) * jnp.einsum("td,edf->tef", x, w_up)
    out = jnp.einsum("tef,efd->ted", hidden, w_down)
    combine = jnp.sum(jax.nn.one_hot(routing.experts, n_experts, dtype=x.dtype)
                      * routing.weights[..., None].astype(x.dtype), axis=1)  # (T, E)
    return jnp.einsum("ted,te->td", out, combine)


def ragged_experts(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   act: Activation = jax.nn.silu) -> jax.Array:
    """Dropless: the (token, expert) pairs sorted by expert, each weight applied to its expert's
    contiguous rows by one grouped matmul, the rows scattered back and weighted."""
    n_experts, top_k = w_gate.shape[0], routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // top_k
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    rows = x[token]
    hidden = act(jax.lax.ragged_dot(rows, w_gate, sizes)) * jax.lax.ragged_dot(rows, w_up, sizes)
    out = jax.lax.ragged_dot(hidden, w_down, sizes)
    weights = routing.weights.reshape(-1)[order].astype(out.dtype)
    return jnp.zeros_like(x).at[token].add(out * weights[:, None])


def capacity(tokens: int, n_experts: int, top_k: int, factor: float) -> int:
    """Token-slots per expert: `factor` times an even share, at least one."""
    return max(1, math.ceil(tokens * top_k / n_experts * factor))


def capacity_experts(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                     factor: float = 1.25, act: Activation = jax.nn.silu) -> tuple[jax.Array, jax.Array]:
    """Fixed shapes: each expert takes its first `capacity` token-slots (in token order, first
    choices before second ones); a slot past it is dropped (adds nothing: the residual carries the
    token). Returns (output, fraction of token-slots dropped)."""
    n_experts, top_k = w_gate.shape[0], routing.experts.shape[1]
    tokens = x.shape[0]
    cap = capacity(tokens, n_experts, top_k, factor)
    choice_major = routing.experts.T.reshape(-1)  # (k*T,): every token's first choice, then the second ...
    onehot = jax.nn.one_hot(choice_major, n_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # slot within its expert
    kept = position < cap
    token = jnp.tile(jnp.arange(tokens), top_k)
    slot = jnp.where(kept, choice_major * cap + position, n_experts * cap)  # dropped: one spare row
    buffer = jnp.zeros((n_experts * cap + 1, x.shape[1]), x.dtype).at[slot].set(x[token])
    grouped = buffer[:-1].reshape(n_experts, cap, x.shape[1])
    hidden = act(jnp.einsum("ecd,edf->ecf", grouped, w_gate)) * jnp.einsum("ecd,edf->ecf", grouped, w_up)
    out = jnp.einsum("ecf,efd->ecd", hidden, w_down).reshape(n_experts * cap, x.shape[1])
    out = jnp.concatenate([out, jnp.zeros((1, x.shape[1]), out.dtype)])[slot]
    weights = routing.weights.T.reshape(-1).astype(out.dtype) * kept
    combined = jnp.zeros_like(x).at[token].add(out * weights[:, None])
    return combined, 1.0 - jnp.mean(kept.astype(jnp.float32))


class MoEMLP(nn.Module):
    """The MoE feed-forward of one layer, (B, T, d) -> (B, T, d): a float32 router (embed, expert),
    SwiGLU experts stacked on a leading "expert" axis, optional shared experts every token uses."""

    cfg: Any  # the family's config: d_model, n_layers, dtype, params_dtype, activation and the moe_* fields
    act: Activation = jax.nn.silu

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        n, f, d = cfg.moe_experts, cfg.moe_d_ff, cfg.d_model
        router = self.param("router", normal_init(0.02, ("embed", "expert")), (d, n), jnp.float32)
        w_gate = self.param("gate", normal_init(0.02, ("expert", "embed", "mlp")), (n, d, f), cfg.params_dtype)
        w_up = self.param("up", normal_init(0.02, ("expert", "embed", "mlp")), (n, d, f), cfg.params_dtype)
        w_down = self.param("down", normal_init(residual_std(cfg.n_layers), ("expert", "mlp", "embed")), (n, f, d),
                            cfg.params_dtype)
        tokens = x.reshape(-1, d)
        routing = route(tokens.astype(jnp.float32) @ router, cfg.moe_top_k, cfg.moe_score, cfg.moe_normalize)
        weights = [w.astype(cfg.dtype) for w in (w_gate, w_up, w_down)]
        dropped = jnp.zeros((), jnp.float32)
        if cfg.moe_dispatch == "ragged":
            y = ragged_experts(tokens, routing, *weights, act=self.act)
        elif cfg.moe_dispatch == "capacity":
            y, dropped = capacity_experts(tokens, routing, *weights, factor=cfg.moe_capacity_factor, act=self.act)
        else:
            y = dense_experts(tokens, routing, *weights, act=self.act)
        balance, z = balance_loss(routing, n), z_loss(routing)
        load = expert_load(routing, n)
        self.sow(LOSSES, "moe_balancing", cfg.moe_aux_loss * balance + cfg.moe_z_loss * z)
        for name, value in (("aux_loss", balance), ("z_loss", z), ("load_max", jnp.max(load)),
                            ("load_min", jnp.min(load)), ("dropped", dropped)):
            self.sow(REPORTS, f"moe/{name}", value)
        y = y.reshape(x.shape)
        if cfg.moe_shared:
            width = cfg.moe_shared * f
            gate = nn.Dense(width, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                            kernel_init=normal_init(0.02, ("embed", "mlp")), name="shared_gate")
            up = nn.Dense(width, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                          kernel_init=normal_init(0.02, ("embed", "mlp")), name="shared_up")
            down = nn.Dense(d, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.params_dtype,
                            kernel_init=normal_init(residual_std(cfg.n_layers), ("mlp", "embed")), name="shared_down")
            y = y + down(self.act(gate(x)) * up(x))
        return y
