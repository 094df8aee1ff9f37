"""The llama family in Hugging Face terms: which transformers architectures it is (Llama, Mistral,
Qwen2, Qwen3, and the mixtures of experts Mixtral and Qwen3-MoE), how each reads every config.json
field into job.model settings or refuses it, and the tensor layout both ways.

Everything here works on the family's config (runner.models.llama.model.LlamaConfig) by its fields, so
this module does not import the model.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from runner.errors import ConfigError
from runner.models.common.rope import rope_frequencies
from runner.models.hf.adapter import HFAdapter
from runner.models.hf.rope import read_rope, rope_parameters
from runner.models.hf.mapping import (HFTensor, Refused, Rule, activation_rule, inert, into, one, only, read_hf_config,
    same, zeros_of)

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
ARCHITECTURES = {arch: model_type for model_type, arch in MODEL_TYPES.items()}
MOE_TYPES = ("mixtral", "qwen3_moe")  # (Qwen2-MoE's shared expert has a sigmoid gate runner's lack: not imported)
# the rotary theta of a config.json that names none (transformers' config classes' default_theta)
_DEFAULT_THETA = {"mixtral": 1e6}

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
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "head_dim": None, "sliding_window": 4096},
    "qwen2": {**_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 32768,
              "head_dim": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
              "layer_types": None},
    "qwen3": {**_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 32768,
              "head_dim": None, "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "layer_types": None},
    "mixtral": {**_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": None,
                "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
                "router_jitter_noise": 0.0},
    # Qwen3MoeConfig has no head_dim field (its attention reads one config.json gives, else
    # hidden_size // num_attention_heads), and writes num_experts as num_local_experts (attribute_map)
    "qwen3_moe": {**_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None,
                  "max_position_embeddings": 32768, "attention_bias": False, "use_sliding_window": False,
                  "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                  "num_experts_per_tok": 8, "num_local_experts": 128, "norm_topk_prob": False,
                  "router_aux_loss_coef": 0.001, "mlp_only_layers": None},
}



def _rope(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """The rope fields (runner.models.hf.rope), Mixtral's theta when the file names none."""
    return read_rope(value, config, model, _DEFAULT_THETA.get(config["model_type"], 10000.0))


def _sliding_window(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """A sliding window in every layer (Mistral v0.1, Mixtral, Qwen2/3 with max_window_layers 0) is
    job.model.window.size; a window in some layers only is accepted where it cannot cut (at least
    job.model.context_length: no query then reaches a key it would hide), else refused."""
    model_type = config["model_type"]
    window = value if model_type in ("mistral", "mixtral") or config.get("use_sliding_window") else None
    if window is None:
        return {}
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or (  # Mistral's, Mixtral's and Qwen3-MoE's window is every layer's
        ["sliding_attention" if i >= config.get("max_window_layers", 0) else "full_attention" for i in range(layers)]
        if model_type in ("qwen2", "qwen3") else ["sliding_attention"] * layers)
    if "sliding_attention" not in types:
        return {}
    if set(types) == {"sliding_attention"}:
        return {"window.size": int(window)}
    if int(window) < model.context_length:
        raise Refused(f"attention over the last {window} positions in {types.count('sliding_attention')} of "
                      f"{layers} layers and over every earlier one in the rest differs from one window in every "
                      f"layer on sequences longer than the window, and job.model.context_length="
                      f"{model.context_length} allows them.",
                      "a sliding window in every layer or in none (and a window in some layers at least "
                      "job.model.context_length long, which never cuts); interleaved local and global layers are "
                      "the gemma family's",
                      f"set job.model.context_length={window} (train.seq_len no longer), where the window never "
                      "cuts; or import a model whose window is in every layer.")
    return {}


def _layer_types(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    unknown = sorted(set(value or ()) - {"full_attention", "sliding_attention"})
    if unknown:
        raise Refused(f"layer type(s) {unknown} are not attention runner implements.",
                      "full_attention and sliding_attention layers (a window in every layer, or one that never cuts)",
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
_MOE_SUPPORTED = ("experts chosen by a softmax router's top-k in every layer past a leading block of dense ones "
                  "(job.model.moe)")


def _experts(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    if not isinstance(value, int) or value < 1:
        raise Refused("a mixture-of-experts architecture without experts is a dense model.", _MOE_SUPPORTED,
                      "import it as the dense architecture (Qwen3ForCausalLM for a Qwen3-MoE without experts).")
    return {"moe.n_experts": value}


def _mixtral_ff(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """Mixtral's intermediate_size is its experts' width (it has no dense MLP)."""
    return {"d_ff": int(value), "moe.d_ff_expert": int(value)}


def _aux_loss(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """The balancing loss's coefficient, a training setting kept for fine-tuning and the export.
    transformers adds coef * E * sum_e f_e * P_e with f and P pooled over the layers (only with
    output_router_logits; f sums to top_k); runner adds coef * E * sum_e f_e * P_e in every layer
    with experts (f sums to 1). At even routing transformers' term is coef * top_k, runner's coef
    times the number of layers with experts."""
    return {"moe.aux_loss": float(value)}


def _mlp_only_layers(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """Qwen3-MoE's dense layers: runner's are a leading block (job.model.moe.first_dense_layers)."""
    layers = int(config["num_hidden_layers"])
    dense = sorted({int(i) for i in value or () if 0 <= int(i) < layers})
    if dense != list(range(len(dense))) or len(dense) == layers:
        raise Refused(f"dense layers {dense} of {layers} are not a leading block with experts after it.",
                      f"{_MOE_SUPPORTED}: mlp_only_layers [0, 1, ..., F-1] with F < num_hidden_layers",
                      "import a model whose dense layers come first.")
    return {"moe.first_dense_layers": len(dense)}


_MOE: dict[str, Rule] = {
    "num_local_experts": _experts,
    "num_experts": inert("transformers reads it as num_local_experts (attribute_map), which wins when both are given"),
    "num_experts_per_tok": into("moe.top_k", int),
    "router_aux_loss_coef": _aux_loss,
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
    "mixtral": {**_DIMS, **_MOE, "sliding_window": _sliding_window, "intermediate_size": _mixtral_ff,
                "router_jitter_noise": only(0, 0.0, supported="routing without noise (runner's router has none)",
                                            fix="set router_jitter_noise to 0 in config.json (it acts in training "
                                                "only), or import a model without it.")},
    "qwen3_moe": {**_DIMS, **_MOE, "sliding_window": _sliding_window,
                  "use_sliding_window": inert("read with sliding_window"),
                  "max_window_layers": inert("Qwen3-MoE's class does not read it: with use_sliding_window every layer "
                                             "slides (read with sliding_window)"),
                  "attention_bias": _attention_bias, "moe_intermediate_size": into("moe.d_ff_expert", int),
                  "norm_topk_prob": into("moe.normalize_top_k", bool),
                  "decoder_sparse_step": only(1, supported=f"{_MOE_SUPPORTED}: decoder_sparse_step 1",
                                              fix="import a model with experts in every layer past its leading "
                                                  "dense ones."),
                  "mlp_only_layers": _mlp_only_layers},
}
# What each architecture fixes that config.json does not say.
_SOFTMAX_EXPERTS = {"moe.score": "softmax", "moe.n_shared_experts": 0}
IMPLIED: dict[str, dict[str, Any]] = {
    "llama": {"qk_norm": False, "moe.n_experts": 0},
    "mistral": {"qk_norm": False, "qkv_bias": False, "out_bias": False, "mlp_bias": False, "moe.n_experts": 0},
    "qwen2": {"qk_norm": False, "qkv_bias": True, "out_bias": False, "mlp_bias": False, "moe.n_experts": 0},
    "qwen3": {"qk_norm": True, "mlp_bias": False, "moe.n_experts": 0},
    "mixtral": {"qk_norm": False, "qkv_bias": False, "out_bias": False, "mlp_bias": False, **_SOFTMAX_EXPERTS,
                "moe.normalize_top_k": True, "moe.first_dense_layers": 0},
    "qwen3_moe": {"qk_norm": True, "mlp_bias": False, **_SOFTMAX_EXPERTS},
}


def settings(init_from: str, config: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """job.model settings of the model config.json describes (dotted keys below job.model)."""
    model_type = config["model_type"]
    if model_type in MOE_TYPES and "num_experts" in config:  # as transformers' attribute_map reads it
        config = {**config, "num_local_experts": config.get("num_local_experts", config["num_experts"])}
    out = {"family": "llama", "hf.architecture": MODEL_TYPES[model_type], "hf.bos_token_id": None,
           "hf.eos_token_id": [], **IMPLIED[model_type]}
    out.update(read_hf_config(init_from, config, RULES[model_type], DEFAULTS[model_type], model))
    return out


# ----------------------------------------------------------------------------- export


class _Misfit(NamedTuple):
    """Why an architecture cannot hold a model: the job.model key, its value, why, the fix; and
    whether the refusal waits for the export (`deferred`): the expert settings runner trains for
    models it does not export (DeepSeek-V3's shared experts, sigmoid scores, leading dense layers)
    are refused when exporting, not when the run starts."""

    key: str
    value: Any
    why: str
    fix: str
    deferred: bool = False


def _misfit(cfg: Any, model_type: str) -> _Misfit | None:
    """Why `model_type` cannot hold this model (None when it can). Missing biases are exported as
    zeros (the same function); an MLP bias matters only where there is a dense MLP."""
    moe = model_type in MOE_TYPES
    if bool(cfg.moe_experts) != moe:
        return _Misfit("job.model.moe.n_experts", cfg.moe_experts, f"{MODEL_TYPES[model_type]} has "
                       f"{'' if moe else 'no '}mixture-of-experts layers", "export a model with experts as Mixtral "
                       "or Qwen3-MoE, and a dense one as Llama, Mistral, Qwen2 or Qwen3.")
    if cfg.window and model_type == "llama":
        return _Misfit("job.model.window.size", cfg.window, "LlamaForCausalLM has no sliding window",
                       "export as Mistral (the default for a window without QK-norm or biases), or drop the window.")
    if cfg.qk_norm != (model_type in ("qwen3", "qwen3_moe")):
        return _Misfit("job.model.qk_norm", cfg.qk_norm, "QK-norm (job.model.qk_norm) is Qwen3's and Qwen3-MoE's "
                       "alone", "drop QK-norm, or export as Qwen3 (Qwen3-MoE with experts).")
    biases = [key for key in ("qkv_bias", "out_bias", "mlp_bias") if getattr(cfg, key)
              and (key != "mlp_bias" or cfg.dense_layers)]
    unheld = {"qwen2": {"out_bias", "mlp_bias"}, "mistral": set(biases), "mixtral": set(biases),
              "qwen3": {"mlp_bias"}, "qwen3_moe": {"mlp_bias"}}.get(model_type, set())
    for key in biases:
        if key in unheld:
            what = {"qwen2": "attention-output or MLP", "qwen3": "MLP", "qwen3_moe": "MLP"}.get(model_type, "")
            return _Misfit(f"job.model.{key}", True, f"{MODEL_TYPES[model_type]} has no {what + ' ' if what else ''}"
                           "biases", f"train without job.model.{key}, or export as an architecture with it.")
    return _expert_misfit(cfg, model_type) if moe else None


def _expert_misfit(cfg: Any, model_type: str) -> _Misfit | None:
    """What Mixtral's or Qwen3-MoE's experts cannot hold (refused at the export)."""
    exchange = ("to exchange the model with transformers; evaluate this one with mode=eval or lm-eval's "
                "`--model runner`.")
    if cfg.moe_shared:
        return _Misfit("job.model.moe.n_shared_experts", cfg.moe_shared, "neither Mixtral nor Qwen3-MoE has shared "
                       "experts (Qwen2-MoE's is scaled by a sigmoid gate, which runner's shared experts lack)",
                       f"train with job.model.moe.n_shared_experts=0 {exchange}", True)
    if cfg.moe_score != "softmax":
        return _Misfit("job.model.moe.score", cfg.moe_score, "Mixtral and Qwen3-MoE score experts by a softmax",
                       f"train with job.model.moe.score=softmax {exchange}", True)
    if getattr(cfg, "moe_bias_rate", 0.0):  # the bias is model state, moved each step: not a weight either has
        return _Misfit("job.model.moe.bias_update_rate", cfg.moe_bias_rate, "Mixtral and Qwen3-MoE choose experts "
                       "without DeepSeek-V3's selection bias", f"train with job.model.moe.bias_update_rate=0 "
                       f"{exchange}", True)
    if model_type == "mixtral" and cfg.moe_first_dense:
        return _Misfit("job.model.moe.first_dense_layers", cfg.moe_first_dense, "Mixtral has experts in every "
                       "layer", "use 0, or QK-norm (job.model.qk_norm=true) to export as Qwen3-MoE, which keeps "
                       "leading dense layers (mlp_only_layers).", True)
    if model_type == "mixtral" and not cfg.moe_normalize:
        return _Misfit("job.model.moe.normalize_top_k", cfg.moe_normalize, "Mixtral always renormalises the chosen "
                       "experts' weights", "use true, or QK-norm (job.model.qk_norm=true) to export as Qwen3-MoE "
                       "(norm_topk_prob).", True)
    return None


def architecture(cfg: Any, exporting: bool = False) -> tuple[str, str]:
    """(architecture, model_type) to export as: job.model.hf.architecture when set (an imported
    model's), else the one the settings call for (with experts: Qwen3-MoE with QK-norm, else
    Mixtral). A model no transformers architecture holds is a ConfigError, raised when the run
    starts (runner.models.check_spec), not after training; but expert settings runner trains for
    architectures it does not export (`_Misfit.deferred`) are refused only when `exporting`."""
    if cfg.hf_architecture:
        model_type = ARCHITECTURES.get(cfg.hf_architecture)
        if model_type is None:
            raise ConfigError("job.model.hf.architecture", cfg.hf_architecture, "the llama family exports as "
                              f"{', '.join(ARCHITECTURES)}.", "use one of them, or leave it empty.")
        misfit = _misfit(cfg, model_type)
        if misfit:
            raise ConfigError("job.model.hf.architecture", cfg.hf_architecture, f"{misfit.why}, and these model "
                              f"settings need it ({misfit.key}={misfit.value!r}).",
                              "change the model settings, or leave job.model.hf.architecture empty.")
        return cfg.hf_architecture, model_type
    if cfg.moe_experts:
        model_type = "qwen3_moe" if cfg.qk_norm else "mixtral"
    elif cfg.qk_norm:
        model_type = "qwen3"
    elif cfg.qkv_bias and not (cfg.out_bias or cfg.mlp_bias):
        model_type = "qwen2"
    else:
        model_type = "mistral" if cfg.window else "llama"
    misfit = _misfit(cfg, model_type)
    if misfit and model_type == "qwen3":
        raise ConfigError("job.model.mlp_bias", cfg.mlp_bias, "no transformers architecture has both QK-norm "
                          "(job.model.qk_norm) and MLP biases, so this model could not be exported to Hugging Face.",
                          "drop one of them.")
    if misfit and (exporting or not misfit.deferred):
        raise ConfigError(misfit.key, misfit.value, f"{misfit.why}, so this model could not be exported to Hugging "
                          f"Face as {MODEL_TYPES[model_type]} (the architecture its settings call for).", misfit.fix)
    return MODEL_TYPES[model_type], model_type


def hf_config(cfg: Any) -> dict[str, Any]:
    arch, model_type = architecture(cfg, exporting=True)
    config: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": cfg.activation,
        "rope_parameters": rope_parameters(cfg),
        "attention_dropout": 0.0,
    }
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = bool(cfg.qkv_bias or cfg.out_bias)
    if model_type == "llama":
        config["mlp_bias"] = cfg.mlp_bias
    window = cfg.window or None
    if model_type in ("mistral", "mixtral"):
        config["sliding_window"] = window
    if model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=bool(window), sliding_window=window,
                      max_window_layers=0 if window else cfg.n_layers)
    if model_type in MOE_TYPES:
        config.update(num_experts_per_tok=cfg.moe_top_k, router_aux_loss_coef=cfg.moe_aux_loss,
                      output_router_logits=False)
    if model_type == "mixtral":  # its intermediate_size is the experts' width
        config.update(intermediate_size=cfg.moe_d_ff, num_local_experts=cfg.moe_experts, router_jitter_noise=0.0)
    if model_type == "qwen3_moe":
        config.update(num_experts=cfg.moe_experts, moe_intermediate_size=cfg.moe_d_ff,
                      norm_topk_prob=cfg.moe_normalize, decoder_sparse_step=1,
                      mlp_only_layers=list(range(cfg.moe_first_dense)), use_sliding_window=bool(window),
                      sliding_window=window)
    return config


def _attention_templates(cfg: Any, model_type: str) -> list[tuple[str, tuple[str, ...], Any, Any]]:
    """Every layer's norms and attention: (Hugging Face name below the layer, sources, to_hf, from_hf)."""
    d, h, n, k = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads

    def heads_in(heads: int) -> tuple[Callable[..., np.ndarray], Callable[..., tuple[np.ndarray, ...]]]:
        return (lambda w: w.reshape(d, heads * h).T), one(lambda w: w.T.reshape(d, heads, h))

    templates: list[tuple[str, tuple[str, ...], Any, Any]] = [
        ("input_layernorm.weight", ("attn_norm/scale",), same, one(same)),
        ("post_attention_layernorm.weight", ("mlp_norm/scale",), same, one(same)),
        ("self_attn.q_proj.weight", ("attn/query/kernel",), *heads_in(n)),
        ("self_attn.k_proj.weight", ("attn/key/kernel",), *heads_in(k)),
        ("self_attn.v_proj.weight", ("attn/value/kernel",), *heads_in(k)),
        ("self_attn.o_proj.weight", ("attn/out/kernel",), lambda w: w.reshape(n * h, d).T,
         one(lambda w: w.T.reshape(n, h, d))),
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
    if cfg.qk_norm:
        templates += [("self_attn.q_norm.weight", ("attn/query_norm/scale",), same, one(same)),
                      ("self_attn.k_norm.weight", ("attn/key_norm/scale",), same, one(same))]
    return templates


def _mlp_templates(cfg: Any) -> list[tuple[str, tuple[str, ...], Any, Any]]:
    """A dense layer's MLP (every layer of a dense model; an MoE model's leading ones)."""
    templates: list[tuple[str, tuple[str, ...], Any, Any]] = [
        (f"mlp.{proj}_proj.weight", (f"mlp/{proj}/kernel",), lambda w: w.T, one(lambda w: w.T))
        for proj in ("gate", "up", "down")]
    if cfg.mlp_bias:
        templates += [(f"mlp.{proj}_proj.bias", (f"mlp/{proj}/bias",), same, one(same))
                      for proj in ("gate", "up", "down")]
    return templates


# Where each MoE architecture keeps a layer's experts in its files (what save_pretrained writes and the
# hub's checkpoints hold; transformers fuses them into experts.gate_up_proj in memory when loading):
# (block, the gate's, the up projection's and the down projection's names), each an nn.Linear (out, in).
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                 "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def _expert_tensors(cfg: Any, model_type: str, layers: range, split: int) -> list[HFTensor]:
    """The router and every expert's three matrices of the layers with experts. runner's router is
    (d_model, n_experts), its experts stacked: gate and up (n_experts, d_model, d_ff_expert), down
    (n_experts, d_ff_expert, d_model)."""
    block, *names = _EXPERT_NAMES[model_type]
    out = [HFTensor(f"model.layers.{i}.{block}.gate.weight", ("moe/router",), i, _t, one(_t), split) for i in layers]
    for name, source in zip(names, ("moe/gate", "moe/up", "moe/down")):  # each leaf's layers and experts together
        out += [HFTensor(f"model.layers.{i}.{block}.experts.{j}.{name}.weight", (source,), i, _t, one(_t), split, (j,))
                for i in layers for j in range(cfg.moe_experts)]
    return out


def _t(w: np.ndarray) -> np.ndarray:
    return w.T


def layout(cfg: Any) -> list[HFTensor]:
    _, model_type = architecture(cfg, exporting=True)
    out = [HFTensor("model.embed_tokens.weight", ("embed/embedding",), None, same, one(same)),
           HFTensor("model.norm.weight", ("norm/scale",), None, same, one(same))]
    if not cfg.tie_embeddings:
        out.append(HFTensor("lm_head.weight", ("lm_head/kernel",), None, _t, one(_t)))
    dense = cfg.dense_layers  # the leading layers with a dense MLP; scanned apart when some have experts
    split = dense if 0 < dense < cfg.n_layers else 0
    for templates, layers in ((_attention_templates(cfg, model_type), range(cfg.n_layers)),
                              (_mlp_templates(cfg), range(dense))):
        for hf_name, sources, to_hf, from_hf in templates:  # a source's layers together: each leaf read once
            out += [HFTensor(f"model.layers.{i}.{hf_name}", sources, i, to_hf, from_hf, split) for i in layers]
    if cfg.moe_experts:
        out += _expert_tensors(cfg, model_type, range(dense, cfg.n_layers), split)
    return out


def buffers(cfg: Any) -> dict[str, Any]:
    """Tensors some checkpoints carry that are computed, not learned: the rotary inverse
    frequencies (accepted when they are the ones this model computes) and, with tied embeddings,
    a copy of the embedding as lm_head (accepted when equal)."""
    inv = rope_frequencies(cfg)
    out: dict[str, Any] = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": (
        lambda x, read: x.shape == inv.shape and bool(np.allclose(x, inv, rtol=1e-5, atol=0)))
        for i in range(cfg.n_layers)}
    if cfg.tie_embeddings:
        out["lm_head.weight"] = lambda x, read: bool(np.array_equal(x, read("model.embed_tokens.weight")))
    return out


class LlamaHF(HFAdapter):
    """Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE both ways."""

    model_types = tuple(MODEL_TYPES)
    settings = staticmethod(settings)
    architecture = staticmethod(architecture)
    config = staticmethod(hf_config)
    layout = staticmethod(layout)
    buffers = staticmethod(buffers)
