"""A mixture-of-experts feed-forward block: a router picks `top_k` of `n_experts` SwiGLU experts per
token, the chosen experts run on just their tokens, and the outputs are summed by the routing
weights. The llama family uses it when job.model.moe.n_experts > 0; the dispatches are tested
against the plain reference.

Dispatches:
  ragged    tokens sorted by expert, one grouped matmul per weight (`jax.lax.ragged_dot`): no
            token is dropped, nothing is padded (dropless, as MaxText and torchtitan default to)
  gmm       ragged, with the grouped matmuls by megablox's Pallas TPU kernel (MaxText's; `auto`
            picks it on TPU)
  capacity  each expert takes at most `capacity` tokens (capacity_factor x an even share); the
            rest are dropped, pass through the residual, and are counted
  dense     every expert on every token, masked by the routing: the reference the others are
            tested against (E times the FLOPs; for tests and tiny models)

Balancing: the Switch/Mixtral load-balancing loss and the router z-loss (both in the training
loss), and DeepSeek-V3's per-expert selection bias (added to the scores for choosing experts only,
never to the weights; model state, not a parameter: TrainState.model_state, moved toward even
load after every step by `bias_update_rate`). DeepSeek-V3's group-limited routing (`route`'s
n_group and topk_group) and routed scaling are the deepseek family's.

On a device mesh the experts run in shard_map (`sharded_experts`): the "expert" axis holds an
equal share of the experts each, and tokens travel to them and back (`exchanged_ragged_experts`:
a ragged all-to-all; capacity: GShard's all-to-all).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from runner.errors import ConfigError
from runner.models.common.layers import (LAYER_SUMS, LOSSES, MODEL_STATE, REPORTS, normal_init, residual_std,
                                         zeros_init)

DISPATCHES = ("ragged", "gmm", "capacity", "dense")
# The grouped matmuls of a ragged dispatch: ragged_dot (jax.lax's), gmm (megablox's TPU kernel;
# gmm_interpret: the same run by Pallas' interpreter, anywhere), blocked (for XLA:CPU, whose
# ragged_dot computes every group over every row: each group's rows padded to whole blocks, every
# block one batched matmul with its group's weights; dropless all the same).
KERNELS = ("ragged_dot", "gmm", "gmm_interpret", "blocked")


def grouped_matmul(rows: jax.Array, w: jax.Array, sizes: jax.Array, kernel: str = "ragged_dot") -> jax.Array:
    """rows (m, k) sorted by group, `sizes` rows each, times w (groups, k, n); rows past the
    sizes' sum come out zero. `gmm` is megablox's kernel (TPU), tiled in 128s: the rows are
    padded to whole tiles, and the rows it leaves unwritten are masked (forward and backward)."""
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(rows, w, sizes)
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    m, k = rows.shape
    tm = 128 if m >= 128 else -(-m // 8) * 8
    valid = (jnp.arange(m) < jnp.sum(sizes))[:, None]
    padded = jnp.pad(jnp.where(valid, rows, 0), ((0, -m % tm), (0, 0)))
    out = megablox.gmm(padded, w, sizes, preferred_element_type=rows.dtype,
                       tiling=(tm, min(128, k), min(128, w.shape[2])), interpret=kernel == "gmm_interpret")
    return jnp.where(valid, out[:m], 0)


SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """One batch's routing: for each token its `top_k` experts and their weights, the router's
    probabilities over all experts (for the balancing loss) and its logits (for the z-loss)."""

    experts: jax.Array  # (T, k) int32
    weights: jax.Array  # (T, k)
    probs: jax.Array  # (T, E), summing to one per token (sigmoid scores normalised, as DeepSeek-V3's loss has them)
    logits: jax.Array  # (T, E)


def route(logits: jax.Array, top_k: int, score: str = "softmax", normalize: bool = True,
          bias: jax.Array | None = None, n_group: int = 1, topk_group: int = 1,
          scaling: float = 1.0) -> Routing:
    """Pick each token's experts. `score`: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3).
    `bias` (E,) shifts which experts are chosen, not their weights. `normalize`: the chosen
    weights sum to one. `n_group` > 1: DeepSeek-V3's group-limited routing, a token choosing only
    among the `topk_group` groups of experts whose best two (biased) scores sum highest (`group_mask`).
    `scaling`: the chosen weights times this (DeepSeek-V3's routed_scaling_factor), after normalising.
    n_group 1 and scaling 1 compute exactly what they did before these existed."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    chooser = probs if bias is None else probs + bias
    if n_group > 1 and topk_group < n_group:
        chooser = jnp.where(group_mask(chooser, n_group, topk_group), chooser, -jnp.inf)
    _, experts = jax.lax.top_k(chooser, top_k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-9)
    if scaling != 1.0:
        weights = weights * scaling
    if score == "sigmoid":  # the balancing loss's probabilities: each token's scores normalised (DeepSeek-V3's s')
        probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-9)
    return Routing(experts=experts.astype(jnp.int32), weights=weights, probs=probs, logits=logits)


def group_mask(chooser: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """(T, E) True for the experts in each token's `topk_group` best of `n_group` equal groups, a
    group scored by the sum of its two best scores (its one score when it holds a single expert),
    as DeepSeek-V3 and transformers' DeepseekV3TopkRouter score them."""
    tokens, n_experts = chooser.shape
    grouped = chooser.reshape(tokens, n_group, n_experts // n_group)
    best, _ = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))
    _, groups = jax.lax.top_k(jnp.sum(best, axis=-1), topk_group)  # (T, topk_group)
    chosen = jnp.sum(jax.nn.one_hot(groups, n_group, dtype=jnp.int32), axis=1) > 0  # (T, n_group)
    return jnp.repeat(chosen, n_experts // n_group, axis=1)


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


def routing_sums(routing: Routing, n_experts: int, dropped: jax.Array) -> dict[str, jax.Array]:
    """One call's routing as sums over its tokens: slots routed to each expert (`hits`, E), all
    slots, router probabilities (E), tokens, squared log-partitions (`z`), dropped tokens. Sums, so
    that a pipeline's microbatches add up to the batch's own (`settle` makes the terms from them)."""
    hits = jnp.sum(jax.nn.one_hot(routing.experts, n_experts, dtype=jnp.float32), axis=(0, 1))
    tokens = jnp.asarray(routing.probs.shape[0], jnp.float32)
    return {"hits": hits, "slots": jnp.sum(hits), "probs": jnp.sum(routing.probs, axis=0), "tokens": tokens,
            "z": jnp.sum(jax.nn.logsumexp(routing.logits, axis=-1) ** 2), "dropped": dropped * tokens}


def settle(cfg: Any, sums: Any, bias: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
    """The balancing terms of `routing_sums` (one call's, or a pipeline's microbatches added up;
    leading axes such as layers kept): the loss the train step adds (`moe_aux_loss` x the
    balancing loss + `moe_z_loss` x the z-loss), the reports, and the router bias moved toward
    even load (None without one)."""
    n = sums["hits"].shape[-1]
    load = sums["hits"] / jnp.maximum(sums["slots"], 1.0)[..., None] * n
    balance = jnp.sum(load / n * (sums["probs"] / sums["tokens"][..., None]), axis=-1) * n
    z = sums["z"] / sums["tokens"]
    reports = {"aux_loss": balance, "z_loss": z, "load_max": jnp.max(load, axis=-1),
               "load_min": jnp.min(load, axis=-1), "dropped": sums["dropped"] / sums["tokens"]}
    moved = None if bias is None else updated_bias(bias, jax.lax.stop_gradient(load), cfg.moe_bias_rate)
    return cfg.moe_aux_loss * balance + cfg.moe_z_loss * z, reports, moved


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
    return jnp.sum(out * combine[..., None], axis=1)  # a weighted sum, not a matmul: never quantized


def ragged_experts(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   act: Activation = jax.nn.silu, kernel: str = "ragged_dot") -> jax.Array:
    """Dropless: the (token, expert) pairs sorted by expert, each weight applied to its expert's
    contiguous rows by one grouped matmul, the rows scattered back and weighted."""
    n_experts, top_k = w_gate.shape[0], routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // top_k
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    out = _ragged_swiglu(x[token], w_gate, w_up, w_down, sizes, act, kernel)
    weights = routing.weights.reshape(-1)[order].astype(out.dtype)
    return jnp.zeros_like(x).at[token].add(out * weights[:, None])


def _ragged_swiglu(rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, sizes: jax.Array,
                   act: Activation, kernel: str, expected: int | None = None) -> jax.Array:
    """Rows sorted by expert, `sizes` rows each: one grouped matmul per weight (rows past the
    sizes' sum come out zero). `expected`: how many rows are routed here on average (the blocked
    kernel sizes its blocks from it; default all of them)."""
    if kernel == "blocked":
        return _blocked_swiglu(rows, w_gate, w_up, w_down, sizes, act, expected or rows.shape[0])
    hidden = act(grouped_matmul(rows, w_gate, sizes, kernel)) * grouped_matmul(rows, w_up, sizes, kernel)
    return grouped_matmul(hidden, w_down, sizes, kernel)


def _blocked_swiglu(rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, sizes: jax.Array,
                    act: Activation, expected: int) -> jax.Array:
    """The grouped matmuls by whole blocks: each group's rows start a fresh block (a block of
    about a quarter of an even share, 8 to 128 rows), so every block belongs to one group and is
    one batched matmul with that group's weights (gathered per block). At most `groups` blocks
    are part-empty: the padding is bounded, the shapes static, nothing dropped. Every row of
    `rows` is computed, so an expert-parallel receive buffer (sized for the worst case) costs
    its whole size here."""
    groups, (m, d) = w_gate.shape[0], rows.shape
    block = int(min(128, max(8, expected // (4 * groups))))
    blocks = -(-m // block) + groups
    padded = -(-sizes // block) * block
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(m), side="right")  # `groups` past the sum
    within = jnp.arange(m) - _exclusive(sizes)[jnp.minimum(group, groups - 1)]
    dest = jnp.where(group < groups, _exclusive(padded)[jnp.minimum(group, groups - 1)] + within, blocks * block)
    grouped = jnp.zeros((blocks * block + 1, d), rows.dtype).at[dest].set(rows)[:-1].reshape(blocks, block, d)
    owner = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(blocks) * block, side="right"), groups - 1)
    hidden = act(jnp.einsum("bsd,bdf->bsf", grouped, w_gate[owner])) * jnp.einsum("bsd,bdf->bsf", grouped,
                                                                                    w_up[owner])
    out = jnp.einsum("bsf,bfd->bsd", hidden, w_down[owner]).reshape(blocks * block, -1)
    return jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])[dest]


def capacity(tokens: int, n_experts: int, top_k: int, factor: float) -> int:
    """Token-slots per expert: `factor` times an even share, at least one."""
    return max(1, math.ceil(tokens * top_k / n_experts * factor))


def capacity_experts(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                     factor: float = 1.25, act: Activation = jax.nn.silu,
                     expert_axis: tuple[str, int] | None = None) -> tuple[jax.Array, jax.Array]:
    """Fixed shapes: each expert takes its first `capacity` token-slots (in token order, first
    choices before second ones); a slot past it is dropped (adds nothing: the residual carries the
    token). Returns (output, fraction of token-slots dropped). With `expert_axis` (name, ways), in
    shard_map, the weights are this device's share of the experts and each expert's slots travel
    to its device and back by all-to-all (GShard's dispatch)."""
    ways = expert_axis[1] if expert_axis else 1
    n_experts, top_k = w_gate.shape[0] * ways, routing.experts.shape[1]
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
    if expert_axis:  # (owner, local expert, slot) out; (local expert, source, slot) in; and back
        name, d = expert_axis[0], x.shape[1]
        grouped = jax.lax.all_to_all(grouped.reshape(ways, -1, cap, d), name, 0, 0, tiled=True)
        grouped = grouped.transpose(1, 0, 2, 3).reshape(-1, ways * cap, d)
    hidden = act(jnp.einsum("ecd,edf->ecf", grouped, w_gate)) * jnp.einsum("ecd,edf->ecf", grouped, w_up)
    out = jnp.einsum("ecf,efd->ecd", hidden, w_down)
    if expert_axis:
        out = out.reshape(-1, ways, cap, out.shape[-1]).transpose(1, 0, 2, 3)
        out = jax.lax.all_to_all(out, expert_axis[0], 0, 0, tiled=True)
    out = out.reshape(n_experts * cap, x.shape[1])
    out = jnp.concatenate([out, jnp.zeros((1, x.shape[1]), out.dtype)])[slot]
    weights = routing.weights.T.reshape(-1).astype(out.dtype) * kept
    combined = jnp.zeros_like(x).at[token].add(out * weights[:, None])
    return combined, 1.0 - jnp.mean(kept.astype(jnp.float32))


def exchange(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
             output_offsets: jax.Array, recv_sizes: jax.Array, axis: str, native: bool) -> jax.Array:
    """`jax.lax.ragged_all_to_all` (send_sizes[j] rows from input_offsets[j] to peer j, landing at
    output_offsets[j] in its `output`): the collective itself where the platform has it (TPU,
    GPU); elsewhere (XLA:CPU has no ragged all-to-all) the same result from a padded all_to_all,
    each peer's rows in a slot as long as the most one peer can send."""
    if native:
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis)
    most = min(operand.shape[0], output.shape[0])
    r = jnp.arange(most)
    take = jnp.minimum(input_offsets[:, None] + r, operand.shape[0] - 1)
    packed = jnp.where((r < send_sizes[:, None])[..., None], operand[take], 0)
    got = jax.lax.all_to_all(packed, axis, 0, 0, tiled=True)  # [source]: the rows it sent here
    landing = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # [source]: where they go here
    dest = jnp.where(r < recv_sizes[:, None], landing[:, None] + r, output.shape[0])
    return output.at[dest.reshape(-1)].set(got.reshape(-1, got.shape[-1]), mode="drop")


def _exclusive(sizes: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(sizes, axis=axis) - sizes


def exchanged_ragged_experts(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array,
                             w_down: jax.Array, expert_axis: tuple[str, int], native: bool,
                             act: Activation = jax.nn.silu, kernel: str = "ragged_dot") -> jax.Array:
    """Dropless expert parallelism, in shard_map over `expert_axis` (name, ways): this device's
    token-slots, sorted by expert, travel to the devices that own their experts (ragged
    all-to-all); each device runs its experts on what it received (grouped matmuls) and sends
    the rows back to where they came from. The receive buffer holds the worst case (every slot
    of every peer to one device), so nothing is dropped however the router chooses."""
    name, ways = expert_axis
    local, top_k, d = w_gate.shape[0], routing.experts.shape[1], x.shape[1]
    me = jax.lax.axis_index(name)
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // top_k
    counts = jnp.bincount(flat, length=local * ways).astype(jnp.int32)
    table = jax.lax.all_gather(counts, name).reshape(ways, ways, local)  # [source, owner, its expert]
    pairs = table.sum(-1)  # [source, owner]: the rows each source sends each owner
    send, recv = pairs[me], pairs[:, me]
    slots = flat.shape[0]
    rows = exchange(x[token], jnp.zeros((ways * slots, d), x.dtype), _exclusive(send), send,
                    _exclusive(pairs, 0)[me], recv, name, native)
    mine = table[:, me, :]  # what arrived: by source, then by expert within each
    segment = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), jnp.arange(ways * slots), side="right")
    regroup = jnp.argsort(jnp.where(segment < ways * local, segment % local, local), stable=True)
    out = _ragged_swiglu(rows[regroup], w_gate, w_up, w_down, mine.sum(0), act, kernel, expected=slots)
    out = jnp.zeros_like(out).at[regroup].set(out)
    back = exchange(out, jnp.zeros((slots, d), out.dtype), _exclusive(recv), recv, _exclusive(pairs, 1)[:, me],
                    send, name, native)
    weights = routing.weights.reshape(-1)[order].astype(back.dtype)
    return jnp.zeros_like(x).at[token].add(back * weights[:, None])


def _fitted(axes: tuple[str, ...], size: int, mesh: Any) -> tuple[str, ...] | None:
    """The mesh axes among `axes` (in order) that split `size` evenly, as far as they go."""
    kept: list[str] = []
    for axis in axes:
        if mesh.shape.get(axis, 1) > 1 and size % math.prod(mesh.shape[a] for a in (*kept, axis)) == 0:
            kept.append(axis)
    return tuple(kept) or None


def sharded_experts(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                    dispatch: str, factor: float, native: bool, act: Activation,
                    mesh: Any, kernel: str = "ragged_dot") -> tuple[jax.Array, jax.Array]:
    """The experts on a device mesh, in shard_map: each device routes its own rows (the batch as
    the "batch" rule splits it), the "expert" axis holds an equal share of the experts each
    (tokens travel to them and back), the "tensor" axis splits each expert's hidden width (the
    down projection's partial sums added). GSPMD left alone would gather the whole batch onto
    every device for the sort and the grouped matmuls. x: (B, T, d); returns (y, dropped)."""
    P = jax.sharding.PartitionSpec
    batch_axes = nn.logical_to_mesh_axes(("batch",))[0]
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    rows = P(_fitted(batch_axes, x.shape[0], mesh), _fitted(("context",), x.shape[1], mesh), None)
    ways = mesh.shape.get("expert", 1)
    tensor = "tensor" if mesh.shape.get("tensor", 1) > 1 and w_gate.shape[2] % mesh.shape["tensor"] == 0 else None
    expert = "expert" if ways > 1 else None
    w_in, w_out = P(expert, None, tensor), P(expert, tensor, None)
    axis = ("expert", ways) if ways > 1 else None

    def local(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
              w_down: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        r = Routing(experts.reshape(b * t, -1), weights.reshape(b * t, -1), None, None)  # type: ignore[arg-type]
        dropped = jnp.zeros((), jnp.float32)
        if dispatch == "capacity":
            y, dropped = capacity_experts(tokens, r, w_gate, w_up, w_down, factor, act, expert_axis=axis)
        elif axis:
            y = exchanged_ragged_experts(tokens, r, w_gate, w_up, w_down, axis, native, act, kernel)
        else:
            y = ragged_experts(tokens, r, w_gate, w_up, w_down, act, kernel)
        if tensor:
            y = jax.lax.psum(y, tensor)
        return y.reshape(b, t, d), jax.lax.pmean(dropped, tuple(mesh.axis_names))

    shape = x.shape[:2] + (-1,)
    return jax.shard_map(local, in_specs=(rows, rows, rows, w_in, w_in, w_out), out_specs=(rows, P()),
                         check_vma=False)(x, routing.experts.reshape(shape), routing.weights.reshape(shape),
                                          w_gate, w_up, w_down)


class MoEMLP(nn.Module):
    """The MoE feed-forward of one layer, (B, T, d) -> (B, T, d): a float32 router (embed, expert),
    SwiGLU experts stacked on a leading "expert" axis, optional shared experts every token uses."""

    # the family's config: d_model, n_layers, dtype, params_dtype, activation and the moe_* fields; the
    # optional moe_n_group, moe_topk_group, moe_routed_scaling (`route`) and moe_score_bias (a fixed
    # selection bias parameter, DeepSeek-V3's e_score_correction_bias as imported) default to off
    cfg: Any
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
        bias = self.variable(MODEL_STATE, "router_bias", jnp.zeros, (n,), jnp.float32) if cfg.moe_bias_rate else None
        chooser = None if bias is None else bias.value
        if getattr(cfg, "moe_score_bias", False):  # a fixed selection bias (imported), the moving one added
            fixed = jax.lax.stop_gradient(self.param("score_bias", zeros_init(("expert",)), (n,), jnp.float32))
            chooser = fixed if chooser is None else fixed + chooser
        routing = route(tokens.astype(jnp.float32) @ router, cfg.moe_top_k, cfg.moe_score, cfg.moe_normalize,
                        bias=chooser, n_group=getattr(cfg, "moe_n_group", 1),
                        topk_group=getattr(cfg, "moe_topk_group", 1), scaling=getattr(cfg, "moe_routed_scaling", 1.0))
        weights = [w.astype(cfg.dtype) for w in (w_gate, w_up, w_down)]
        dropped = jnp.zeros((), jnp.float32)
        mesh = jax.sharding.get_abstract_mesh()
        if cfg.moe_dispatch != "dense" and not mesh.empty and mesh.size > 1:
            if n % mesh.shape.get("expert", 1):
                raise ConfigError("mesh.expert", mesh.shape["expert"], f"it must divide the {n} experts "
                                  "(job.model.moe.n_experts).", f"use a divisor of {n}.")
            y, dropped = sharded_experts(x, routing, *weights, cfg.moe_dispatch, cfg.moe_capacity_factor,
                                         cfg.moe_native_exchange, self.act, mesh, cfg.moe_kernel)
        elif cfg.moe_dispatch in ("auto", "ragged", "gmm"):  # auto: the platform's pick, ragged until it is known
            y = ragged_experts(tokens, routing, *weights, act=self.act, kernel=cfg.moe_kernel)
        elif cfg.moe_dispatch == "capacity":
            y, dropped = capacity_experts(tokens, routing, *weights, factor=cfg.moe_capacity_factor, act=self.act)
        elif cfg.moe_dispatch == "dense":
            y = dense_experts(tokens, routing, *weights, act=self.act)
        else:
            raise ValueError(f"moe_dispatch={cfg.moe_dispatch!r} is none of {DISPATCHES}")
        sums = routing_sums(routing, n, dropped)
        if self.is_mutable_collection(LAYER_SUMS):  # one microbatch of a pipeline: it settles the batch's sums
            self.sow(LAYER_SUMS, "routing", sums)
        else:
            loss, reports, moved = settle(cfg, sums, None if bias is None else bias.value)
            if moved is not None and self.is_mutable_collection(MODEL_STATE) and not self.is_initializing():
                bias.value = moved
            self.sow(LOSSES, "moe_balancing", loss)
            for name, value in reports.items():
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


def for_platform(config: Any, platform: str) -> Any:
    """A family config's moe_* settings `platform` (tpu, gpu, cpu; auto: not known yet) decides:
    dispatch auto is gmm on TPU (megablox's grouped matmul) and ragged elsewhere; gmm is refused off
    TPU; expert parallelism moves tokens by the ragged all-to-all where the platform has one."""
    dispatch = config.moe_dispatch
    if dispatch == "auto":
        dispatch = "gmm" if platform == "tpu" else "ragged"
    if config.moe_experts and dispatch == "gmm" and platform not in ("tpu", "auto"):
        raise ConfigError("job.model.moe.dispatch", "gmm", f"megablox's grouped matmul is a TPU kernel, and "
                          f"this run's platform is {platform}.", "use auto (gmm on TPU, ragged elsewhere) or ragged.")
    kernel = "gmm" if dispatch == "gmm" else "blocked" if platform == "cpu" else "ragged_dot"
    return dataclasses.replace(config, moe_dispatch=dispatch, moe_kernel=kernel,
                               moe_native_exchange=platform in ("tpu", "gpu"))


def describe(config: Any, mesh_shape: Any) -> str:
    """How a family config's experts run on a mesh (mode=compile's report); empty without experts."""
    if not config.moe_experts:
        return ""
    ways = int(dict(mesh_shape).get("expert", 1))
    kernel = {"ragged_dot": "jax.lax.ragged_dot", "gmm": "megablox gmm", "blocked": "blocked matmuls"}.get(
        config.moe_kernel, config.moe_kernel)
    how = {"capacity": f"capacity dispatch (factor {config.moe_capacity_factor:g})",
           "dense": "dense dispatch (every expert on every token)"}.get(
        config.moe_dispatch, f"{config.moe_dispatch} dispatch ({kernel})")
    moved = "" if ways == 1 or config.moe_dispatch == "dense" else ", tokens to them and back by " + (
        "all-to-all" if config.moe_dispatch == "capacity" else
        "ragged all-to-all" if config.moe_native_exchange else "padded all-to-all")
    groups = getattr(config, "moe_n_group", 1)
    limited = f", from {config.moe_topk_group} of {groups} groups" if groups > 1 else ""
    return (f"experts: {config.moe_experts} per layer, {config.moe_top_k} per token{limited}, "
            f"{config.moe_experts // ways} on each of mesh.expert={ways} shards{moved}; {how}")
