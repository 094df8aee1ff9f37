"""Rotary position embeddings as transformers computes them (rotate-half layout, so weights move
between the two): the inverse frequencies (plain, linear, Llama 3's and YaRN's scalings), YaRN's
attention factor, and the rotation. A config names its rotary settings as `rope_*` fields and the
rotated width as `head_dim`."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(cfg: Any) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, (head_dim / 2,), as transformers computes them:
    linear (every frequency divided by `rope_factor`); Llama 3's (long wavelengths slowed by
    `rope_factor`, short ones kept, the band between interpolated); YaRN's (interpolated below
    `beta_slow` rotations over the original context, extrapolated above `beta_fast`, a linear ramp
    between)."""
    dim = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_scaling == "yarn":
        def correction_dim(rotations: float) -> float:
            turns = cfg.rope_original_context / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(cfg.rope_theta))

        low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
        if cfg.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv / cfg.rope_factor) * (1 - extrapolation) + inv * extrapolation
    elif cfg.rope_scaling == "llama3":
        low_wavelen = cfg.rope_original_context / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_context / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (cfg.rope_original_context / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_attention_scale(cfg: Any) -> float:
    """The factor YaRN multiplies cos and sin by (so attention logits by its square); 1 otherwise."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return float(cfg.rope_attention_factor)
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotate (B, T, N, H) by positions (B, T), rotate-half layout (Hugging Face's); cos and sin
    multiplied by `scale` (YaRN's attention factor)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # (B, T, H/2)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
