"""The llama family in Hugging Face terms: which transformers architectures it is (Llama, Mistral,
Qwen2, Qwen3), how each reads every config.json field into job.model settings or refuses it, and
the tensor layout both ways.

Everything here works on the family's config (runner.models.llama.LlamaConfig) by its fields, so
this module does not import the model.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from runner.errors import ConfigError, UserError
from runner.models.hf import (
    HFTensor,
    Refused,
    Rule,
    activation_rule,
    inert,
    into,
    one,
    only,
    read_hf_config,
    same,
    zeros_of,
)

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
ARCHITECTURES = {arch: model_type for model_type, arch in MODEL_TYPES.items()}

# transformers' config-class defaults for the fields whose absence from config.json matters
# (tests/models/test_hf_config.py holds them against transformers' own classes).
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_key_value_heads": None,
    "rope_parameters": None, "attention_dropout": 0.0,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
              "attention_bias": False, "mlp_bias": False, "head_dim": None, "pretraining_tp": 1},
    "mistral": {**_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 131072,
                "head_dim": None, "sliding_window": 4096},
    "qwen2": {**_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 32768,
              "head_dim": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
              "layer_types": None},
    "qwen3": {**_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 32768,
              "head_dim": None, "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "layer_types": None},
}

# rope_parameters keys each rope type reads (transformers' modeling_rope_utils)
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
}
_ROPE_SUPPORTED = "rope types default, linear, llama3 and yarn, over the whole head (partial_rotary_factor 1)"


def _rope(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """rope_parameters (transformers 5), or rope_scaling and rope_theta (older configs), as
    transformers' standardize_rope_params reads them -> job.model.rope.*."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise Refused("rope parameters per layer type are for models with alternating attention.", _ROPE_SUPPORTED,
                      "import a model with one rotary embedding for every layer.")
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
    if kind not in _ROPE_KEYS:
        raise Refused(f"rope type {kind!r} is not implemented (dynamic NTK and longrope change the frequencies "
                      "with the sequence length).", _ROPE_SUPPORTED, "import a model with one of those rope types.")
    if partial != 1.0:
        raise Refused(f"partial_rotary_factor={partial} rotates only part of each head.", _ROPE_SUPPORTED,
                      "import a model whose rotary embedding covers the whole head.")
    unknown = sorted(set(params) - _ROPE_KEYS[kind])
    if unknown:
        raise Refused(f"rope type {kind!r} does not take {', '.join(unknown)}.", _ROPE_SUPPORTED,
                      f"import a model whose {kind} rope parameters are {sorted(_ROPE_KEYS[kind]) or 'none'}.")
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


def _sliding_window(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """A sliding window is accepted where it cannot cut: no layer slides, or the window is at
    least job.model.context_length (no query then reaches a key it would hide)."""
    model_type = config["model_type"]
    window = value if model_type == "mistral" or config.get("use_sliding_window") else None
    if window is None:
        return {}
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or (
        ["sliding_attention" if i >= config.get("max_window_layers", 0) else "full_attention" for i in range(layers)]
        if model_type != "mistral" else ["sliding_attention"] * layers)
    if "sliding_attention" in types and int(window) < model.context_length:
        raise Refused(f"attention over the last {window} positions only (in {types.count('sliding_attention')} of "
                      f"{layers} layers) differs from full attention on sequences longer than the window, and "
                      f"job.model.context_length={model.context_length} allows them.",
                      "full causal attention (a window at least job.model.context_length long never cuts)",
                      f"set job.model.context_length={window} (train.seq_len no longer), where the window never "
                      "cuts; or import a model without a sliding window.")
    return {}


def _layer_types(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    unknown = sorted(set(value or ()) - {"full_attention", "sliding_attention"})
    if unknown:
        raise Refused(f"layer type(s) {unknown} are not attention runner implements.",
                      "full_attention and sliding_attention layers (the latter where the window never cuts)",
                      "import a model whose layers are full or sliding attention.")
    return {}  # read with sliding_window


def _architectures(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    expected = MODEL_TYPES[config["model_type"]]
    if value not in (None, [], [expected]):
        raise Refused(f"runner imports the causal language model {expected}, and this is a {value}.",
                      f"architectures [{expected}] for model_type {config['model_type']}",
                      f"save the model as {expected} in transformers and import that.")
    return {}


def _attention_bias(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    return {"qkv_bias": bool(value), "out_bias": bool(value)}


def _heads(key: str) -> Rule:
    return lambda value, config, model: {key: int(value or config["num_attention_heads"])}


def _head_dim(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    return {"head_dim": int(value or config["hidden_size"] // config["num_attention_heads"])}


_DROPOUT = inert("dropout is a training choice, not the model's function; runner's llama family has none")
_DIMS: dict[str, Rule] = {
    "model_type": inert("chooses these rules"),
    "architectures": _architectures,
    "vocab_size": into("vocab_size", int), "hidden_size": into("d_model", int),
    "intermediate_size": into("d_ff", int), "num_hidden_layers": into("n_layers", int),
    "num_attention_heads": into("n_heads", int), "num_key_value_heads": _heads("n_kv_heads"),
    "head_dim": _head_dim, "rms_norm_eps": into("norm_eps", float),
    "tie_word_embeddings": into("tie_embeddings", bool), "hidden_act": activation_rule("hidden_act"),
    "max_position_embeddings": inert("the longest sequence it was trained on; runner's is job.model.context_length "
                                     "(read here only as YaRN's and Llama 3's default original context)"),
    "rope_parameters": _rope,
    "rope_scaling": inert("read with rope_parameters"), "rope_theta": inert("read with rope_parameters"),
    "partial_rotary_factor": inert("read with rope_parameters"),
    "original_max_position_embeddings": inert("read with rope_parameters"),
    "attention_dropout": _DROPOUT,
}
_SLIDING: dict[str, Rule] = {"sliding_window": _sliding_window, "use_sliding_window": inert("read with sliding_window"),
                             "max_window_layers": inert("read with sliding_window"), "layer_types": _layer_types}
RULES: dict[str, dict[str, Rule]] = {
    "llama": {**_DIMS, "attention_bias": _attention_bias, "mlp_bias": into("mlp_bias", bool),
              "pretraining_tp": inert("transformers' tensor-parallel matmul split computes the same products")},
    "mistral": {**_DIMS, "sliding_window": _sliding_window},
    "qwen2": {**_DIMS, **_SLIDING, "use_mrope": only(False, supported="one-dimensional rotary positions",
                                                     fix="import a text-only Qwen2.")},
    "qwen3": {**_DIMS, **_SLIDING, "attention_bias": _attention_bias},
}
# What each architecture fixes that config.json does not say.
IMPLIED: dict[str, dict[str, Any]] = {
    "llama": {"qk_norm": False},
    "mistral": {"qk_norm": False, "qkv_bias": False, "out_bias": False, "mlp_bias": False},
    "qwen2": {"qk_norm": False, "qkv_bias": True, "out_bias": False, "mlp_bias": False},
    "qwen3": {"qk_norm": True, "mlp_bias": False},
}


def settings(init_from: str, config: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """job.model settings of the model config.json describes (dotted keys below job.model)."""
    model_type = config["model_type"]
    out = {"family": "llama", "hf.architecture": MODEL_TYPES[model_type], "hf.bos_token_id": None,
           "hf.eos_token_id": [], **IMPLIED[model_type]}
    out.update(read_hf_config(init_from, config, RULES[model_type], DEFAULTS[model_type], model))
    return out


# ----------------------------------------------------------------------------- export


def architecture(cfg: Any) -> tuple[str, str]:
    """(architecture, model_type) to export as: job.model.hf.architecture when set (an imported
    model's), else the one the settings call for. A model no transformers architecture holds is a
    ConfigError, raised when the run starts (runner.models.check_spec), not after training."""
    biases = cfg.qkv_bias or cfg.out_bias

    def fits(model_type: str) -> str:
        """Why `model_type` cannot hold this model ('' when it can). Missing biases are exported
        as zeros (the same function)."""
        if cfg.qk_norm != (model_type == "qwen3"):
            return "QK-norm (job.model.qk_norm) is Qwen3's alone"
        if model_type == "qwen2" and (cfg.out_bias or cfg.mlp_bias):
            return "Qwen2 has no attention-output or MLP biases"
        if model_type == "mistral" and (biases or cfg.mlp_bias):
            return "Mistral has no biases"
        if model_type == "qwen3" and cfg.mlp_bias:
            return "Qwen3 has no MLP biases"
        return ""

    if cfg.hf_architecture:
        model_type = ARCHITECTURES.get(cfg.hf_architecture)
        if model_type is None:
            raise ConfigError("job.model.hf.architecture", cfg.hf_architecture, "the llama family exports as "
                              f"{', '.join(ARCHITECTURES)}.", "use one of them, or leave it empty.")
        why = fits(model_type)
        if why:
            raise ConfigError("job.model.hf.architecture", cfg.hf_architecture, f"{why}, and these model settings "
                              "need it.", "change the model settings, or leave job.model.hf.architecture empty.")
        return cfg.hf_architecture, model_type
    if cfg.qk_norm:
        order = ["qwen3"]
    elif cfg.qkv_bias and not (cfg.out_bias or cfg.mlp_bias):
        order = ["qwen2"]
    else:
        order = ["llama"]
    for model_type in order:
        if not fits(model_type):
            return MODEL_TYPES[model_type], model_type
    raise ConfigError("job.model.mlp_bias", cfg.mlp_bias, "no transformers architecture has both QK-norm "
                      "(job.model.qk_norm) and MLP biases, so this model could not be exported to Hugging Face.",
                      "drop one of them.")


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


def refuse_experts(cfg: Any) -> None:
    """Mixtral's and Qwen3-MoE's expert tensors are not mapped yet: an MoE model is neither
    exported nor warm-started from Hugging Face (refused, not half-converted)."""
    if getattr(cfg, "moe_experts", 0):
        raise UserError(f"This model has mixture-of-experts layers (job.model.moe.n_experts={cfg.moe_experts}), and "
                        "runner does not map expert tensors to or from Hugging Face yet (Mixtral, Qwen3-MoE). Fix: "
                        "evaluate it with mode=eval or lm-eval's `--model runner`, or train a dense model "
                        "(job.model.moe.n_experts=0) to exchange it with transformers.")


def hf_config(cfg: Any) -> dict[str, Any]:
    refuse_experts(cfg)
    arch, model_type = architecture(cfg)
    config: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": cfg.activation,
        "rope_parameters": rope_parameters(cfg),
        "attention_dropout": 0.0,
    }
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = bool(cfg.qkv_bias or cfg.out_bias)
    if model_type == "llama":
        config["mlp_bias"] = cfg.mlp_bias
    if model_type == "mistral":
        config["sliding_window"] = None
    if model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    return config


def layout(cfg: Any) -> list[HFTensor]:
    refuse_experts(cfg)
    d, h, n, k = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    _, model_type = architecture(cfg)

    def heads_in(heads: int) -> tuple[Callable[..., np.ndarray], Callable[..., tuple[np.ndarray, ...]]]:
        return (lambda w: w.reshape(d, heads * h).T), one(lambda w: w.T.reshape(d, heads, h))

    out = [HFTensor("model.embed_tokens.weight", ("embed/embedding",), None, same, one(same)),
           HFTensor("model.norm.weight", ("norm/scale",), None, same, one(same))]
    if not cfg.tie_embeddings:
        out.append(HFTensor("lm_head.weight", ("lm_head/kernel",), None, lambda w: w.T, one(lambda w: w.T)))
    templates: list[tuple[str, tuple[str, ...], Any, Any]] = [
        ("input_layernorm.weight", ("attn_norm/scale",), same, one(same)),
        ("post_attention_layernorm.weight", ("mlp_norm/scale",), same, one(same)),
        ("self_attn.q_proj.weight", ("attn/query/kernel",), *heads_in(n)),
        ("self_attn.k_proj.weight", ("attn/key/kernel",), *heads_in(k)),
        ("self_attn.v_proj.weight", ("attn/value/kernel",), *heads_in(k)),
        ("self_attn.o_proj.weight", ("attn/out/kernel",), lambda w: w.reshape(n * h, d).T,
         one(lambda w: w.T.reshape(n, h, d))),
        ("mlp.gate_proj.weight", ("mlp/gate/kernel",), lambda w: w.T, one(lambda w: w.T)),
        ("mlp.up_proj.weight", ("mlp/up/kernel",), lambda w: w.T, one(lambda w: w.T)),
        ("mlp.down_proj.weight", ("mlp/down/kernel",), lambda w: w.T, one(lambda w: w.T)),
    ]
    attention_bias = cfg.qkv_bias or cfg.out_bias or model_type == "qwen2"
    if attention_bias:  # a bias the architecture has and this model lacks is exported as zeros
        for proj, name, heads in (("q", "query", n), ("k", "key", k), ("v", "value", k)):
            templates.append((f"self_attn.{proj}_proj.bias", (f"attn/{name}/bias",), lambda b: b.reshape(-1),
                              one(lambda b, heads=heads: b.reshape(heads, h))) if cfg.qkv_bias
                             else zeros_of(f"self_attn.{proj}_proj.bias", (heads * h,)))
    if attention_bias and model_type != "qwen2":
        templates.append(("self_attn.o_proj.bias", ("attn/out/bias",), same, one(same)) if cfg.out_bias
                         else zeros_of("self_attn.o_proj.bias", (d,)))
    if cfg.mlp_bias:
        templates += [("mlp.gate_proj.bias", ("mlp/gate/bias",), same, one(same)),
                      ("mlp.up_proj.bias", ("mlp/up/bias",), same, one(same)),
                      ("mlp.down_proj.bias", ("mlp/down/bias",), same, one(same))]
    if cfg.qk_norm:
        templates += [("self_attn.q_norm.weight", ("attn/query_norm/scale",), same, one(same)),
                      ("self_attn.k_norm.weight", ("attn/key_norm/scale",), same, one(same))]
    for hf_name, sources, to_hf, from_hf in templates:  # a source's layers together: each leaf read once
        out += [HFTensor(f"model.layers.{i}.{hf_name}", sources, i, to_hf, from_hf) for i in range(cfg.n_layers)]
    return out
