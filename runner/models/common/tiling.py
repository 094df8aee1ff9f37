"""Tiles of a row's tokens: the output head with its loss, and the feed-forward block, computed one
tile at a time and recomputed tile by tile in the backward pass (ALST's TiledMLP and tiled loss).

At long context the per-token work that does not attend is what fills a device: the logits of a
128k-token row of a 128k-word vocabulary are 62 GiB in float32, and a feed-forward block holds
its d_ff-wide activations for every token. Each is a function of one token at a time, so it can
run over `tiles` pieces of the row in a `scan` whose body is rematerialised: the forward keeps
each tile's output, the backward recomputes one tile's intermediates at a time, and the scan's
transpose sums the weights' gradients over the tiles. The gradient is JAX's own (no hand-written
VJP), so an outer scale of the loss reaches every gradient, the hidden states' included.

A tile is every `tiles`-th token, not a contiguous run of them: the row's sequence axis may be
split over `mesh.context`, and a strided tile keeps that split (each device holds its share of
every tile), where a contiguous one would sit on one device. The modules are flax's own, lifted
(`nn.scan` of `nn.remat` over a function of the module), so their parameters, their names and
their quantization are the untiled ones: a checkpoint does not know whether a run tiled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from runner.errors import ConfigError
from runner.models.common import quantization
from runner.parallel.mesh import mesh_shape
from runner.parallel.topology import parse_topology


def split_tiles(x: jax.Array, tiles: int) -> jax.Array:
    """(B, T, ...) -> (tiles, B, T / tiles, ...): tile j holds the tokens t with t % tiles == j."""
    batch, length = x.shape[:2]
    return jnp.moveaxis(x.reshape(batch, length // tiles, tiles, *x.shape[2:]), 2, 0)


def merge_tiles(y: jax.Array) -> jax.Array:
    """The inverse of `split_tiles`: (tiles, B, T / tiles, ...) -> (B, T, ...)."""
    tiles, batch, part = y.shape[:3]
    return jnp.moveaxis(y, 0, 2).reshape(batch, part * tiles, *y.shape[3:])


def over_tiles(fn: Callable[..., Any], module: nn.Module, tiles: int, *arrays: jax.Array) -> Any:
    """`fn(module, *arrays)` for (B, T, ...) arrays, one tile of their tokens at a time, each tile
    recomputed in the backward pass; with `tiles` 1, one call on the whole arrays. Call inside a
    compact method, `module` a child of it."""
    if tiles <= 1:
        return fn(module, *arrays)

    def body(mdl: nn.Module, carry: None, pieces: tuple[jax.Array, ...]) -> tuple[None, Any]:
        return carry, fn(mdl, *pieces)

    scan = nn.scan(nn.remat(body, prevent_cse=False), variable_broadcast="params",
                   split_rngs={"params": False}, length=tiles)
    _, out = scan(module, None, tuple(split_tiles(a, tiles) for a in arrays))
    return jax.tree.map(merge_tiles, out)


def feed_forward(module: nn.Module, x: jax.Array, tiles: int) -> jax.Array:
    """`module(x)` for a per-token block (the dense MLP), over `tiles` tiles of x's tokens."""
    return over_tiles(lambda mdl, piece: mdl(piece), module, tiles, x)


def head_losses(project: Callable[[nn.Module, jax.Array], jax.Array], head: nn.Module, x: jax.Array,
                targets: jax.Array, tiles: int) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy of the float32 logits `project(head, x)` against `targets` (B, T),
    and whether each target is the logits' argmax, over `tiles` tiles: only one tile's logits
    exist at a time, forward and backward."""
    def losses(mdl: nn.Module, hidden: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = project(mdl, hidden)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels), jnp.argmax(logits, -1) == labels

    return over_tiles(losses, head, tiles, x, targets)


def tokens_per_device(spec: Any) -> int:
    """The tokens of one micro-batch that each device computes the head over: its rows (the batch
    over data x fsdp x expert, an axis left to fill, -1, filled from the topology's devices, or with
    topology=auto the ones JAX sees) times its share of each row (over context)."""
    mesh = spec.mesh
    ways = mesh.data * mesh.fsdp * mesh.expert
    if ways < 0:
        devices = (parse_topology(spec.topology).num_devices if spec.topology else 0) or jax.device_count()
        ways = math.prod(v for k, v in mesh_shape(spec, devices).items() if k in ("data", "fsdp", "expert"))
    rows = max(1, spec.train.batch_size // spec.train.accumulate_steps // ways)
    return rows * spec.train.seq_len // mesh.context


AUTO_LOGITS_BYTES = 1 << 30  # loss_tiles=0 tiles the head once one device's float32 logits would pass 1 GiB
AUTO_TILE_BYTES = 256 << 20  # and then into tiles of at most 256 MiB of logits each


def auto_loss_tiles(spec: Any, vocab_size: int) -> int:
    """job.model.loss_tiles=0: 1 (the whole logits) while one device's float32 logits stay under
    AUTO_LOGITS_BYTES; else the fewest tiles, a power of two dividing each device's share of a
    row, whose logits each fit AUTO_TILE_BYTES (or as many as divide)."""
    share = spec.train.seq_len // spec.mesh.context
    logits = tokens_per_device(spec) * vocab_size * 4 // spec.mesh.tensor
    if logits <= AUTO_LOGITS_BYTES:
        return 1
    tiles = 1
    while logits // tiles > AUTO_TILE_BYTES and share % (tiles * 2) == 0:
        tiles *= 2
    return tiles


def resolve(spec: Any, config: Any) -> Any:
    """`config` with its loss_tiles resolved for this run (0: `auto_loss_tiles`, or 1 where a tiled
    head would not equal the whole one, see `check`); unchanged for a family without tiles."""
    if not hasattr(config, "loss_tiles"):
        return config
    tiles = config.loss_tiles or (1 if _quantized(config, "head") else auto_loss_tiles(spec, config.vocab_size))
    return dataclasses.replace(config, loss_tiles=tiles)


def _quantized(config: Any, scope: str) -> bool:
    """Whether `scope`'s matmuls are quantized: their scales are maxima over the operands, and the
    weight's gradient takes one over the tokens it sums, so a tile's scale would be its own, not
    the whole row's, and a tiled matmul would not equal the untiled one."""
    return getattr(config, "quantization", "none") != "none" and scope in config.quantization_scope


def _refuse(key: str, value: Any, reason: str, fix: str) -> None:
    raise ConfigError(f"job.model.{key}", value, reason, fix)


def check(spec: Any, config: Any) -> None:
    """The tiles the spec asks for are ones this model and mesh can run exactly as the untiled model."""
    model, share = spec.job.model, spec.train.seq_len // max(1, spec.mesh.context)
    for key, tiles in (("loss_tiles", model.loss_tiles), ("mlp_tiles", model.mlp_tiles)):
        if tiles > 1 and not hasattr(config, key):
            _refuse(key, tiles, f"the {model.family} family does not tile it (its config has no {key}).",
                    f"drop job.model.{key}, or use a family that tiles (gpt, llama, gemma, deepseek).")
        if tiles > 1 and share % tiles:
            _refuse(key, tiles, f"a tile takes one token in {tiles} of each device's share of a row, and that share "
                    f"(train.seq_len={spec.train.seq_len} / mesh.context={spec.mesh.context} = {share} tokens) does "
                    f"not divide by {tiles}.", f"use a divisor of {share}, e.g. {_divisor_below(share, tiles)}.")
    for key, scope in (("loss_tiles", "head"), ("mlp_tiles", "mlp")):
        if getattr(model, key) > 1 and _quantized(config, scope):
            _refuse(key, getattr(model, key), f"quantization_scope has {scope}, quantized to {model.quantization}: "
                    "its scales are maxima over the tokens (the weight's gradient sums over them), so each tile "
                    "would be scaled by its own and the run would not equal the untiled one.",
                    f"drop {scope} from job.model.quantization_scope, or drop job.model.{key}.")
    if model.mlp_tiles > 1 and model.moe.n_experts:
        _refuse("mlp_tiles", model.mlp_tiles, "the mixture of experts routes all of a micro-batch's tokens at once "
                "(its balancing loss and each expert's capacity are counted over them), so over tiles it would "
                "route and balance differently from the untiled model.",
                "drop job.model.mlp_tiles (tile the loss instead: job.model.loss_tiles).")
    if model.mlp_tiles > 1 and model.dropout:
        _refuse("mlp_tiles", model.mlp_tiles, f"dropout={model.dropout} would draw each tile's mask on its own, "
                "so the run would not equal the untiled one.", "set job.model.dropout=0, or drop job.model.mlp_tiles.")


def _divisor_below(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe(config: Any, spec: Any) -> str:
    """The launch's line on tiling; empty when nothing is tiled."""
    loss, mlp = getattr(config, "loss_tiles", 1), getattr(config, "mlp_tiles", 1)
    if loss <= 1 and mlp <= 1:
        return ""
    whole = tokens_per_device(spec) * config.vocab_size * 4 // spec.mesh.tensor
    how = "job.model.loss_tiles=0 (auto)" if spec.job.model.loss_tiles == 0 else f"loss_tiles={loss}"
    parts = [f"output head and loss over {loss} tiles of each row's tokens, by {how}: {_size(whole // loss)} of "
             f"float32 logits at a time on a device, not {_size(whole)}"] if loss > 1 else []
    parts += [f"feed-forward over {mlp} tiles, each recomputed in the backward pass"] if mlp > 1 else []
    return "tiles: " + "; ".join(parts)
