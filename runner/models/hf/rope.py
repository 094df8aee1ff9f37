"""Rotary embeddings in Hugging Face terms, for every family with transformers' rope fields:
`rope_parameters` (or the older `rope_scaling` and `rope_theta`) read into job.model.rope.*, and
the config's rope fields -> the exported `rope_parameters`."""

from __future__ import annotations

import math
from typing import Any, Mapping

from runner.models.hf.mapping import Refused

# rope_parameters keys each rope type reads (transformers' modeling_rope_utils)
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
}
ROPE_SUPPORTED = "rope types default, linear, llama3 and yarn, over the whole head (partial_rotary_factor 1)"


def read_rope(value: Any, config: Mapping[str, Any], model: Any, default_theta: float = 10000.0) -> Mapping[str, Any]:
    """rope_parameters (transformers 5), or rope_scaling and rope_theta (older configs), as
    transformers' standardize_rope_params reads them -> job.model.rope.* (a family's Rule, with the
    theta its architecture assumes when the file names none)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise Refused("rope parameters per layer type are for models with alternating attention.", ROPE_SUPPORTED,
                      "import a model with one rotary embedding for every layer.")
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = (params.pop("rope_theta", None) or config.get("rope_theta")
             or default_theta)
    partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
    if kind not in ROPE_KEYS:
        raise Refused(f"rope type {kind!r} is not implemented (dynamic NTK and longrope change the frequencies "
                      "with the sequence length).", ROPE_SUPPORTED, "import a model with one of those rope types.")
    if partial != 1.0:
        raise Refused(f"partial_rotary_factor={partial} rotates only part of each head.", ROPE_SUPPORTED,
                      "import a model whose rotary embedding covers the whole head.")
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise Refused(f"rope type {kind!r} does not take {', '.join(unknown)}.", ROPE_SUPPORTED,
                      f"import a model whose {kind} rope parameters are {sorted(ROPE_KEYS[kind]) or 'none'}.")
    settings: dict[str, Any] = {"rope.theta": float(theta), "rope.scaling": "none" if kind == "default" else kind}
    original = int(params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                   or config["max_position_embeddings"])
    if kind == "linear":
        settings["rope.factor"] = float(params["factor"])
    elif kind == "llama3":
        settings.update({"rope.factor": float(params["factor"]), "rope.original_context": original,
                         "rope.low_freq_factor": float(params.get("low_freq_factor", 1.0)),
                         "rope.high_freq_factor": float(params.get("high_freq_factor", 4.0))})
    elif kind == "yarn":
        factor = params.get("factor") or config["max_position_embeddings"] / original
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = params.get("attention_factor")
        if attention is None:  # as transformers' _compute_yarn_parameters infers it

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                         else get_mscale(factor))
        settings.update({"rope.factor": float(factor), "rope.original_context": original,
                         "rope.beta_fast": float(params.get("beta_fast") or 32), "rope.beta_slow":
                         float(params.get("beta_slow") or 1), "rope.attention_factor": float(attention),
                         "rope.truncate": bool(params.get("truncate", True))})
    return settings


def rope_parameters(cfg: Any) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
                            "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        rope["factor"] = cfg.rope_factor
    elif cfg.rope_scaling == "llama3":
        rope.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_context)
    elif cfg.rope_scaling == "yarn":
        attention = cfg.rope_attention_factor or (1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1)
        rope.update(factor=cfg.rope_factor, original_max_position_embeddings=cfg.rope_original_context,
                    beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, attention_factor=attention,
                    truncate=cfg.rope_truncate)
    return rope
