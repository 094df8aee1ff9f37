"""Causal self-attention implementations, picked by `job.model.attention`.

    xla     jax.nn.dot_product_attention's plain XLA path: the full score matrix in memory. The
            reference every other implementation is tested against; runs everywhere.
    cudnn   cuDNN's fused flash attention on NVIDIA GPUs (jax.nn.dot_product_attention with
            implementation="cudnn"); needs bfloat16 compute.
    splash  the TPU Pallas splash-attention kernel (block-sparse causal and segment masks, no score
            matrix in memory). Asked for on a CPU it runs in Pallas interpret mode
            (`splash_interpret`): exact but slow, for tests.
    auto    the best one the platform has: splash on TPU (sequence lengths in multiples of 128),
            cudnn on GPU with bfloat16 compute, xla otherwise. The default.

Every implementation takes `segment_ids` (B, T) for document-masked packing: a query attends only
to earlier keys of its own segment. None of them may ignore it (MaxText #4476: a fused kernel that
dropped segment ids trained on the wrong loss without an error); tests compare each against xla
with segments, outputs and gradients. Each takes a sliding `window` too (the keys a query sees,
itself included, Hugging Face's `sliding_window`; 0: every earlier key): XLA and cuDNN by their
local window, splash by a windowed mask whose blocks out of reach it skips, each context-parallel
kind by its masks (runner.models.attention.context).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from runner.errors import ConfigError
from runner.models.attention import context, splash
from runner.models.common.layers import Q_AXES, fit_spec
from runner.registry import Registry

# (q (B, T, N, H), k and v (B, T, K, H), segment_ids (B, T) or None, logical axes) -> (B, T, N, H)
Attend = Callable[..., jax.Array]
ATTENTION: Registry[Attend] = Registry("attention implementation", "job.model.attention", allow_import_paths=False)
CHOICES = ("auto", "xla", "cudnn", "splash")


def segment_mask(segment_ids: Optional[jax.Array]) -> Optional[jax.Array]:
    """(B, 1, T, T) True where query and key are in the same segment (None: no segments)."""
    if segment_ids is None:
        return None
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


@ATTENTION.register("xla")
def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
                  kv_axes: tuple[str, ...] = Q_AXES, window: int = 0) -> jax.Array:
    """XLA's attention (jax.nn.dot_product_attention): runs on every platform, the score matrix in memory."""
    return jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segment_ids), is_causal=True,
                                        local_window_size=local_window(window), implementation="xla")


def local_window(window: int) -> Optional[tuple[int, int]]:
    """jax.nn.dot_product_attention's (left, right) for a causal `window` (itself and window - 1 before)."""
    return (window - 1, 0) if window else None


@ATTENTION.register("cudnn")
def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
                    kv_axes: tuple[str, ...] = Q_AXES, window: int = 0) -> jax.Array:
    """cuDNN flash attention; segments become a boolean mask that cuDNN turns into an additive
    bias (B, 1, T, T): correct, but it costs the score matrix's memory once per layer. A window is
    cuDNN's sliding window (its `local_window_size`)."""
    return jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segment_ids), is_causal=True,
                                        local_window_size=local_window(window), implementation="cudnn")


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array],
                  interpret: bool, window: int = 0) -> jax.Array:
    """Splash on one device's shard: q (B, T, N, H), k/v (B, T, K, H), N a multiple of K."""
    kernel = splash.causal_kernel(q.shape[2] // k.shape[2], q.shape[1], interpret, window)
    return splash.rows(kernel, q, k, v, segment_ids, segment_ids)


@ATTENTION.register("splash")
def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
                     kv_axes: tuple[str, ...] = Q_AXES, interpret: bool = False, window: int = 0) -> jax.Array:
    """Splash attention under the current mesh: a Pallas kernel cannot be partitioned by XLA, so it
    runs per device inside shard_map, rows split as the batch axis is and heads as the tensor axis
    is. Key/value heads that are replicated while query heads are split (fewer kv heads than
    tensor shards) are repeated to one per query head first. The kernel tiles the sequence in
    blocks of 128: other lengths (a short initialisation batch, an evaluator's odd length) take
    the xla path, which computes the same function (train.seq_len itself is checked, `check`)."""
    if q.shape[1] % 128:
        return xla_attention(q, k, v, segment_ids, window=window)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _splash_local(q, k, v, segment_ids, interpret, window)
    P = jax.sharding.PartitionSpec
    q_spec, kv_spec = fit_spec(Q_AXES, q.shape, mesh), fit_spec(kv_axes, k.shape, mesh)
    if kv_spec[2] != q_spec[2]:
        repeat = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        kv_spec = q_spec
    seg_spec = P(q_spec[0], None)
    local = functools.partial(_splash_local, interpret=interpret, window=window)
    if segment_ids is None:
        return jax.shard_map(lambda a, b, c: local(a, b, c, None), in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q, k, v)
    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v, segment_ids)


# The splash kernel run by the Pallas interpreter: what splash means on a CPU; exact but slow, for tests.
ATTENTION.register("splash_interpret")(functools.partial(splash_attention, interpret=True))


def platform_of(device: Any) -> str:
    """tpu, gpu or cpu."""
    platform = str(device.platform).lower()
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def resolve(name: str, platform: str, compute_dtype: str, seq_len: int = 128) -> str:
    """The implementation `name` means on `platform` (tpu, gpu, cpu): `auto` picks splash on TPU
    (when seq_len is a multiple of its 128-token tiles), cudnn on GPU with bfloat16 compute (cuDNN
    has no float32 kernel), xla otherwise; splash off a TPU is splash_interpret."""
    if name == "splash" and platform != "tpu":
        return "splash_interpret"
    if name != "auto":
        return name
    if platform == "tpu" and seq_len % 128 == 0:
        return "splash"
    if platform == "gpu" and compute_dtype == "bfloat16":
        return "cudnn"
    return "xla"


def check(name: str, platform: str, compute_dtype: str, seq_len: int) -> str:
    """The resolved implementation, or a ConfigError when this platform cannot run `name`."""
    if name not in CHOICES:
        raise ConfigError("job.model.attention", name, "there is no attention implementation of that name.",
                          f"use one of: {', '.join(CHOICES)}.")
    impl = resolve(name, platform, compute_dtype, seq_len)
    if impl == "cudnn" and platform not in ("gpu", "auto"):
        raise ConfigError("job.model.attention", name, f"cuDNN attention runs on NVIDIA GPUs, and this run's "
                          f"topology is {platform}.", "use auto (the best one the platform has) or xla.")
    if impl == "cudnn" and compute_dtype != "bfloat16":
        raise ConfigError("job.model.attention", name, "cuDNN's fused attention has no float32 kernel "
                          f"(job.model.compute_dtype={compute_dtype}).",
                          "set job.model.compute_dtype=bfloat16, or use attention=auto or xla.")
    if impl == "splash_interpret" and platform == "gpu":
        raise ConfigError("job.model.attention", name, "splash attention is a TPU kernel, and this run's "
                          "topology is a GPU.", "use auto, cudnn or xla.")
    if impl == "splash" and platform == "tpu" and seq_len % 128:
        raise ConfigError("train.seq_len", seq_len, "splash attention on TPU tiles the sequence in blocks of "
                          "128 tokens.", "use a multiple of 128, or job.model.attention=xla.")
    return impl


def attend(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None,
           kv_axes: tuple[str, ...] = Q_AXES, context_parallel: str = "auto", ulysses_ways: int = 0,
           initializing: bool = False, window: int = 0) -> jax.Array:
    """Causal attention by implementation `impl` (`auto` resolved for the running backend); rows
    split over a context axis (runner.models.attention.context, in its order) by `context_parallel` (usp:
    ulysses within groups of `ulysses_ways` shards). While the model is `initializing`, XLA's on
    whole rows: init's forward pass is traced and thrown away (no parameter depends on how attention
    runs), and a kernel's tables for whole rows are built in numpy while tracing (about 70 s for a
    1,048,576-token row, 16 times that for 4,194,304). `window`: the keys a query sees, itself
    included (0: every earlier one)."""
    if initializing:
        return xla_attention(q, k, v, segment_ids, kv_axes=kv_axes, window=window)
    if impl == "auto":  # a config that did not go through `check`: the default backend decides
        impl = resolve(impl, platform_of(jax.devices()[0]), "bfloat16" if q.dtype == jnp.bfloat16 else "float32",
                       q.shape[1])
    if context.active(q.shape[1]):
        return context.context_attention(context_parallel, q, k, v, segment_ids, kv_axes, impl=impl,
                                         whole_rows=whole_rows(impl, window), ulysses_ways=ulysses_ways, window=window)
    return ATTENTION.get(impl)(q, k, v, segment_ids, kv_axes=kv_axes, window=window)


def whole_rows(impl: str, window: int = 0) -> context.WholeRows:
    """`impl` on one device's whole rows (ulysses runs it inside shard_map): the splash kernel per
    device where its 128-token tiles fit the rows (else xla, the same function), cuDNN's or XLA's
    fused attention as they are."""
    def attend_rows(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array]) -> jax.Array:
        if impl in context.SPLASH and q.shape[1] % 128 == 0:
            return _splash_local(q, k, v, segment_ids, interpret=impl == "splash_interpret", window=window)
        return (cudnn_attention if impl == "cudnn" else xla_attention)(q, k, v, segment_ids, window=window)

    return attend_rows


__all__ = ["ATTENTION", "CHOICES", "attend", "check", "resolve", "segment_mask", "whole_rows"]
