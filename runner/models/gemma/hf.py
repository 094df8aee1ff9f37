"""The gemma family in Hugging Face terms: Gemma3ForCausalLM (model_type gemma3_text), every
config.json field of transformers' Gemma3TextConfig read into job.model settings or refused, and
the tensor layout both ways. Works on the family's config (runner.models.gemma.model.GemmaConfig)
by its fields, so this module does not import the model.

The multimodal Gemma 3 checkpoints (4B and up: Gemma3ForConditionalGeneration, model_type gemma3)
hold this text model under `language_model`; runner imports the text-only form (model_type
gemma3_text, what Gemma 3 1B ships as, and what transformers saves a Gemma3ForCausalLM as).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from runner.errors import ConfigError
from runner.models.hf.adapter import HFAdapter
from runner.models.hf.mapping import (HFTensor, Refused, Rule, activation_rule, inert, into, one, only,
                                      read_hf_config, same, zeros_of)

MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"
FULL, SLIDING = "full_attention", "sliding_attention"
# transformers' Gemma3TextConfig defaults for the fields whose absence from config.json matters
# (tests/models/test_gemma.py holds them against transformers' own class), and its default_theta
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "layer_types": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
DEFAULT_PATTERN = 6  # transformers' sliding_window_pattern when config.json gives neither it nor layer_types
_SUPPORTED_PATTERN = ("windowed (sliding_attention) and global (full_attention) layers in a period: every N-th layer "
                      "global (job.model.window.global_every), or every layer of one kind")
_SUPPORTED_ROPE = ("default rotary embeddings in the windowed layers, default or linear ones in the global layers, "
                   "over the whole head")


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's attention, as transformers' Gemma3TextConfig derives it: layer_types, else every
    sliding_window_pattern-th layer full."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = int(config.get("sliding_window_pattern") or DEFAULT_PATTERN)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(int(config["num_hidden_layers"]))]


def _period(types: list[str]) -> int | None:
    """N with layer i global exactly when (i + 1) % N == 0 (0: every layer windowed), or None."""
    if FULL not in types:
        return 0
    for n in range(1, len(types) + 1):
        if all((t == FULL) == ((i + 1) % n == 0) for i, t in enumerate(types)):
            return n
    return None


def _rope_of(kind: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """One layer kind's rotary parameters, as Gemma3TextConfig.convert_rope_params_to_dict reads
    rope_parameters (transformers 5) or rope_scaling, rope_theta and rope_local_base_freq (older)."""
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping) or not all(isinstance(v, Mapping) or v is None for v in params.values()):
            raise Refused("Gemma 3's rope_parameters are one set per layer type (sliding_attention, "
                          "full_attention), and these are not.", _SUPPORTED_ROPE,
                          "give rope_parameters as transformers saves a Gemma3TextConfig.")
        unknown = sorted(set(params) - {FULL, SLIDING})
        if unknown:
            raise Refused(f"rope parameters for layer types {unknown}, which Gemma 3 does not have.", _SUPPORTED_ROPE,
                          "give rope parameters for sliding_attention and full_attention only.")
        if config.get("rope_scaling"):  # transformers would fold it into the global layers' parameters
            raise Refused("both rope_parameters and the older rope_scaling are set, and transformers merges the "
                          "latter into the global layers' parameters.", _SUPPORTED_ROPE,
                          "keep one of them (transformers saves rope_parameters alone).")
        out = dict(params.get(kind) or {"rope_type": "default"})
    else:
        out = {"rope_type": "default", **(dict(config.get("rope_scaling") or {}) if kind == FULL else {})}
    theta = config.get("rope_theta") if kind == FULL else config.get("rope_local_base_freq")
    out.setdefault("rope_theta", theta if theta is not None else DEFAULT_THETA[kind])
    return out


def _windowed_types(config: Mapping[str, Any]) -> list[str]:
    """The layer types, checked to be one of the two kinds per layer."""
    types = layer_types(config)
    if len(types) != int(config["num_hidden_layers"]) or set(types) - {FULL, SLIDING}:
        raise Refused(f"layer types {types} are not one of sliding_attention or full_attention per layer.",
                      _SUPPORTED_PATTERN, "import a model whose layer_types name every layer's attention.")
    return types


def _layer_types(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """layer_types (or sliding_window_pattern) -> job.model.window.global_every."""
    types = _windowed_types(config)
    period = _period(types)
    if period is None:
        raise Refused(f"its global layers {[i for i, t in enumerate(types) if t == FULL]} are not every N-th layer.",
                      _SUPPORTED_PATTERN, "import a model whose full_attention layers are layers N-1, 2N-1, ...")
    return {"window.global_every": period if SLIDING in types else 0}


def _sliding_window(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """-> job.model.window.size: the window of the windowed layers (0 when there are none)."""
    if SLIDING not in layer_types(config):  # (the types themselves: checked by layer_types' rule)
        return {"window.size": 0}
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise Refused(f"windowed layers with sliding_window={value!r}.", "a window of at least one key",
                      "set sliding_window to the window the model was trained with.")
    return {"window.size": int(value)}


def _rope(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """Both layer kinds' rotary parameters (rope_parameters, or the older rope_scaling, rope_theta
    and rope_local_base_freq) -> job.model.rope.* (the global layers') and
    job.model.window.local_rope_theta (the windowed layers', when there are any)."""
    windowed = SLIDING in layer_types(config)
    settings: dict[str, Any] = {"window.local_rope_theta": 0.0}
    for kind in [FULL] + ([SLIDING] if windowed else []):
        rope = _rope_of(kind, config)
        kind_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        theta = float(rope.pop("rope_theta"))
        partial = rope.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
        allowed = {"factor"} if kind_type == "linear" and kind == FULL else set()
        if kind_type not in ("default", "linear") or (kind == SLIDING and kind_type != "default") or partial != 1.0 \
                or set(rope) != allowed:  # (linear needs its factor)
            raise Refused(f"its {kind} layers' rope parameters are {_rope_of(kind, config)}.", _SUPPORTED_ROPE,
                          "import a model with default rotary embeddings in its windowed layers and default or "
                          "linear ones in its global layers.")
        if kind == FULL:
            settings.update({"rope.theta": theta, "rope.scaling": "none" if kind_type == "default" else "linear"})
            if kind_type == "linear":
                settings["rope.factor"] = float(rope["factor"])
        else:
            settings["window.local_rope_theta"] = theta
    return settings


def _architectures(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    if value not in (None, [], [ARCHITECTURE]):
        raise Refused(f"runner imports the causal language model {ARCHITECTURE}, and this is a {value}.",
                      f"architectures [{ARCHITECTURE}] for model_type {MODEL_TYPE}",
                      f"save the text model as {ARCHITECTURE} in transformers and import that.")
    return {}


def _attention_bias(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    return {"qkv_bias": bool(value), "out_bias": bool(value)}


def _softcap(key: str) -> Rule:
    return lambda value, config, model: {key: float(value or 0.0)}


def _head_dim(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    return {"head_dim": int(value or config["hidden_size"] // config["num_attention_heads"])}


_WITH_TYPES = inert("read with layer_types (transformers derives the layer types from it when they are not given)")
_WITH_ROPE = inert("read with rope_parameters (transformers folds it into them)")
RULES: dict[str, Rule] = {
    "model_type": inert("chooses these rules"),
    "architectures": _architectures,
    "vocab_size": into("vocab_size", int), "hidden_size": into("d_model", int),
    "intermediate_size": into("d_ff", int), "num_hidden_layers": into("n_layers", int),
    "num_attention_heads": into("n_heads", int),
    "num_key_value_heads": lambda value, config, model: {"n_kv_heads": int(value or config["num_attention_heads"])},
    "head_dim": _head_dim, "rms_norm_eps": into("norm_eps", float),
    "tie_word_embeddings": into("tie_embeddings", bool), "hidden_activation": activation_rule("hidden_activation"),
    "max_position_embeddings": inert("the longest sequence it was trained on; runner's is job.model.context_length"),
    "attention_bias": _attention_bias,
    "attention_dropout": inert("dropout is a training choice, not the model's function; the gemma family has none"),
    "query_pre_attn_scalar": into("query_pre_attn_scalar", float),
    "sliding_window": _sliding_window, "layer_types": _layer_types,
    "sliding_window_pattern": _WITH_TYPES, "_sliding_window_pattern": _WITH_TYPES,
    "rope_parameters": _rope, "rope_scaling": _WITH_ROPE, "rope_theta": _WITH_ROPE, "rope_local_base_freq": _WITH_ROPE,
    "partial_rotary_factor": _WITH_ROPE,
    "final_logit_softcapping": _softcap("softcap.final"),
    "attn_logit_softcapping": only(None, supported="attention without soft-capping, as transformers' "
                                   "Gemma3ForCausalLM computes it (it carries attn_logit_softcapping but does not "
                                   "apply it)", fix="set attn_logit_softcapping to null in config.json to import "
                                   "the model transformers computes (Gemma 3's own checkpoints have null)."),
    "use_bidirectional_attention": only(False, None, supported="causal attention (a decoder language model)",
                                        fix="import a causal Gemma 3 (use_bidirectional_attention false)."),
    "cache_implementation": inert("how transformers caches keys and values while generating, not the model"),
}
# What Gemma3ForCausalLM fixes that config.json does not say.
IMPLIED: dict[str, Any] = {"qk_norm": True}


def settings(init_from: str, config: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """job.model settings of the model config.json describes (dotted keys below job.model)."""
    out = {"family": "gemma", "hf.architecture": ARCHITECTURE, "hf.bos_token_id": None, "hf.eos_token_id": [],
           "softcap.attention": 0.0, "softcap.final": 0.0, **IMPLIED}
    out.update(read_hf_config(init_from, config, RULES, DEFAULTS, model))
    if out.get("window.size") and not out.get("window.global_every"):
        # every layer windowed: the global layers' rotary fields (their defaults, say) reach no layer
        for key in ("rope.theta", "rope.scaling", "rope.factor"):
            out.pop(key, None)
    return out


# ----------------------------------------------------------------------------- export


def architecture(cfg: Any, exporting: bool = False) -> tuple[str, str]:
    """Gemma3ForCausalLM (its biases, when only some are set, exported with zeros for the rest); a
    ConfigError, raised when the run starts, for what its config cannot hold: a query_pre_attn_scalar
    that is not a whole number (Gemma3TextConfig's field is an int). Attention soft-capping, which
    runner trains and transformers' class does not compute, is refused when `exporting` only."""
    if exporting and cfg.attn_softcap:
        raise ConfigError("job.model.softcap.attention", cfg.attn_softcap, f"transformers' {ARCHITECTURE} does not "
                          "soft-cap the attention scores (it carries attn_logit_softcapping unused), so the export "
                          "would compute another model.", "train without job.model.softcap.attention to exchange the "
                          "model with transformers; evaluate this one with mode=eval.")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError("job.model.n_heads", cfg.n_heads, f"{ARCHITECTURE}'s config requires it to divide "
                          f"hidden_size (job.model.d_model={cfg.d_model}), though runner's head_dim is apart, so "
                          "this model could not be exported to Hugging Face.", "use a divisor of job.model.d_model.")
    scalar = cfg.query_pre_attn_scalar
    if scalar != int(scalar):
        raise ConfigError("job.model.query_pre_attn_scalar", scalar, f"{ARCHITECTURE}'s config holds a whole "
                          "number there, so this model could not be exported to Hugging Face.",
                          "use a whole number (Gemma 3: 256, or head_dim), or 0 for head_dim.")
    return ARCHITECTURE, MODEL_TYPE


def hf_layer_types(cfg: Any) -> list[str]:
    return [FULL if cfg.is_global(i) else SLIDING for i in range(cfg.n_layers)]


def hf_config(cfg: Any) -> dict[str, Any]:
    architecture(cfg, exporting=True)
    full: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none" else "linear",
                            "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        full["factor"] = cfg.rope_factor
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_activation": cfg.activation, "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": cfg.local_rope_theta}, FULL: full},
        "attention_bias": bool(cfg.qkv_bias or cfg.out_bias), "attention_dropout": 0.0,
        "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar or cfg.head_dim),
        "sliding_window": cfg.window_size or None, "layer_types": hf_layer_types(cfg),
        "final_logit_softcapping": cfg.final_softcap or None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


Template = tuple[str, str, Callable[..., Any], Callable[..., Any]]


def _templates(cfg: Any) -> list[Template]:
    """Every layer's tensors: (Hugging Face name below the layer, runner path below the block,
    to_hf, from_hf), or a zeros_of for a bias the model lacks."""
    d, h, n, k = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads

    def heads_in(heads: int) -> tuple[Callable[..., np.ndarray], Callable[..., tuple[np.ndarray, ...]]]:
        return (lambda w: w.reshape(d, heads * h).T), one(lambda w: w.T.reshape(d, heads, h))

    templates: list[Any] = [
        ("input_layernorm.weight", "attn_norm/scale", same, one(same)),
        ("post_attention_layernorm.weight", "post_attn_norm/scale", same, one(same)),
        ("pre_feedforward_layernorm.weight", "mlp_norm/scale", same, one(same)),
        ("post_feedforward_layernorm.weight", "post_mlp_norm/scale", same, one(same)),
        ("self_attn.q_proj.weight", "attn/query/kernel", *heads_in(n)),
        ("self_attn.k_proj.weight", "attn/key/kernel", *heads_in(k)),
        ("self_attn.v_proj.weight", "attn/value/kernel", *heads_in(k)),
        ("self_attn.o_proj.weight", "attn/out/kernel", lambda w: w.reshape(n * h, d).T,
         one(lambda w: w.T.reshape(n, h, d))),
        ("self_attn.q_norm.weight", "attn/query_norm/scale", same, one(same)),
        ("self_attn.k_norm.weight", "attn/key_norm/scale", same, one(same)),
        *((f"mlp.{proj}_proj.weight", f"mlp/{proj}/kernel", _t, one(_t)) for proj in ("gate", "up", "down")),
    ]
    if cfg.qkv_bias or cfg.out_bias:  # attention_bias: all four; one the model lacks is exported as zeros
        for proj, name, heads in (("q", "query", n), ("k", "key", k), ("v", "value", k)):
            templates.append((f"self_attn.{proj}_proj.bias", f"attn/{name}/bias", lambda b: b.reshape(-1),
                              one(lambda b, heads=heads: b.reshape(heads, h))) if cfg.qkv_bias
                             else ("zeros", f"self_attn.{proj}_proj.bias", (heads * h,)))
        templates.append(("self_attn.o_proj.bias", "attn/out/bias", same, one(same)) if cfg.out_bias
                         else ("zeros", "self_attn.o_proj.bias", (d,)))
    return templates


def _t(w: np.ndarray) -> np.ndarray:
    return w.T


def block_path(cfg: Any, layer: int) -> tuple[str, tuple[int, ...]]:
    """Where layer `layer`'s parameters live (runner.models.gemma.model.Gemma.layers): its block's
    path and its index into the stacked leaves: ``block_i`` unrolled; scanned, period i // N's
    ``blocks/layer_{i % N}``, or ``tail_blocks`` past the last whole period."""
    if not cfg.scan_layers:
        return f"block_{layer}", ()
    whole = cfg.n_layers // cfg.period * cfg.period
    if layer < whole:
        return f"blocks/layer_{layer % cfg.period}", (layer // cfg.period,)
    return "tail_blocks", (layer - whole,)


def layout(cfg: Any) -> list[HFTensor]:
    out = [HFTensor("model.embed_tokens.weight", ("embed/embedding",), None, same, one(same)),
           HFTensor("model.norm.weight", ("norm/scale",), None, same, one(same))]
    if not cfg.tie_embeddings:
        out.append(HFTensor("lm_head.weight", ("lm_head/kernel",), None, _t, one(_t)))
    # each stacked leaf's layers together (an export reads each leaf once): by block path, then layer
    order = sorted(range(cfg.n_layers), key=lambda i: (block_path(cfg, i)[0], i))
    for template in _templates(cfg):
        for i in order:
            if template[0] == "zeros":
                name, sources, to_hf, from_hf = zeros_of(f"model.layers.{i}.{template[1]}", template[2])
                out.append(HFTensor(name, sources, None, to_hf, from_hf))
                continue
            hf_name, source, to_hf, from_hf = template
            path, part = block_path(cfg, i)
            out.append(HFTensor(f"model.layers.{i}.{hf_name}", (f"{path}/{source}",), None, to_hf, from_hf,
                                part=part))
    return out


def buffers(cfg: Any) -> dict[str, Any]:
    """Tensors some checkpoints carry that are computed, not learned: with tied embeddings, a copy
    of the embedding as lm_head (accepted when equal)."""
    if not cfg.tie_embeddings:
        return {}
    return {"lm_head.weight": lambda x, read: bool(np.array_equal(x, read("model.embed_tokens.weight")))}


class GemmaHF(HFAdapter):
    """Gemma3ForCausalLM both ways."""

    model_types = (MODEL_TYPE,)
    settings = staticmethod(settings)
    architecture = staticmethod(architecture)
    config = staticmethod(hf_config)
    layout = staticmethod(layout)
    buffers = staticmethod(buffers)
