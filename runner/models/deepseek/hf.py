"""The deepseek family in Hugging Face terms: transformers' DeepseekV3ForCausalLM (model_type
deepseek_v3), every config.json field read into job.model settings or refused, and the tensor
layout both ways.

- Rotary rows: DeepSeek's files lay each rotary part out in interleaved pairs (rope_interleave, true
  in DeepSeek's release and transformers' default); runner rotates halves. The pairs are
  de-interleaved on import (a permutation of the rotary rows of q_b_proj / q_proj and
  kv_a_proj_with_mqa: attention scores are unchanged) and interleaved again on export, as the files
  came (job.model.hf.rope_interleave).
- e_score_correction_bias: the router's fixed selection bias (a parameter, `moe/score_bias`); a run
  that moves a bias of its own (job.model.moe.bias_update_rate) exports the sum of the two.
- MTP: DeepSeek's release stores module k as layer num_hidden_layers + k - 1 (enorm, hnorm, eh_proj,
  shared_head.norm, a decoder layer, and copies of embed_tokens and shared_head.head); transformers'
  model ignores those tensors (it loads the main model and reports them as unexpected keys beyond
  DeepSeek's own layer 61), and its save_pretrained drops them. The export writes them as DeepSeek does
  (num_nextn_predict_layers = job.model.mtp.depth); an import takes them when the files hold them
  (job.model.mtp.depth = num_nextn_predict_layers), and imports without MTP (depth 0) files that
  hold none of them, such as transformers' own.

Everything here works on the family's config by its fields, so this module does not import the model.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from runner.errors import ConfigError
from runner.models.hf.adapter import HFAdapter
from runner.models.hf.mapping import (HF_PREFIX, STATE_SOURCE, HFTensor, HFTensors, Refused, Rule, activation_rule,
                                      hf_dir, inert, into, one, only, read_hf_config, same, zeros_of)
from runner.models.hf.rope import read_rope
from runner.models.hf.rope import rope_parameters as common_rope_parameters

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"

# transformers' DeepseekV3Config defaults (tests/models/test_deepseek.py holds them against the class)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_parameters": None,
    "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
}


def _architectures(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    if value not in (None, [], [ARCHITECTURE]):
        raise Refused(f"runner imports the causal language model {ARCHITECTURE}, and this is a {value}.",
                      f"architectures [{ARCHITECTURE}] for model_type {MODEL_TYPE}",
                      f"save the model as {ARCHITECTURE} in transformers and import that.")
    return {}


def _kv_heads(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """MLA gives every query head its own key and value: transformers groups them only when
    num_key_value_heads equals the heads (or is unset)."""
    if value not in (None, config["num_attention_heads"]):
        raise Refused(f"multi-head latent attention expands the latent into one key and value per query head, and "
                      f"{value} key/value heads for {config['num_attention_heads']} query heads would group them.",
                      "num_key_value_heads equal to num_attention_heads (or null)",
                      "set num_key_value_heads to num_attention_heads in config.json.")
    return {}


def _or(default: Any, convert: Callable[[Any], Any], key: str) -> Rule:
    """A field read into job.model.`key`, None meaning `default` (as DeepseekV3Config's code reads None)."""
    return lambda value, config, model: {key: convert(default if value is None else value)}


def _rope(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """The llama family's reading of the rotary settings (default, linear, llama3, yarn), plus
    DeepSeek's softmax scale: yarn's mscale_all_dim (transformers' yarn_apply_mscale)."""
    settings = dict(read_rope(value, config, model))
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if settings["rope.scaling"] == "yarn":
        settings["rope.mscale_all_dim"] = float(params.get("mscale_all_dim") or 0.0)
    return settings


def _first_dense(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    """The leading dense layers; every layer dense (MTP's too) is a model without experts."""
    dense = int(value or 0)
    if dense >= int(config["num_hidden_layers"]) + _declared_mtp(config):
        return {"moe.first_dense_layers": 0, "moe.n_experts": 0}
    return {"moe.first_dense_layers": dense}


def _experts(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    if not isinstance(value, int) or value < 1:
        raise Refused("DeepSeek-V3's layers past the dense ones have experts.", "n_routed_experts of 1 or more",
                      "import a model with experts (first_k_dense_replace = num_hidden_layers for a dense one).")
    dense = int(config.get("first_k_dense_replace") or 0)
    return {} if dense >= int(config["num_hidden_layers"]) + _declared_mtp(config) else {"moe.n_experts": value}


def _declared_mtp(config: Mapping[str, Any]) -> int:
    value = config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0))
    return int(value or 0)


def mtp_rule(present: int | None) -> Rule:
    """num_nextn_predict_layers -> job.model.mtp.depth: the MTP modules the files hold (`present`:
    how many of the declared layers past the last decoder layer have tensors; None: unknown, none)."""

    def rule(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
        declared = int(value or 0)
        held = present or 0
        if held not in (0, declared):
            raise Refused(f"it declares {declared} MTP module(s) and the files hold tensors for {held} of them.",
                          "all of them (job.model.mtp.depth = num_nextn_predict_layers) or none (imported without "
                          "MTP, as transformers' save_pretrained writes)",
                          "import files holding every MTP layer, or none of them.")
        return {"mtp.depth": held}

    return rule


_DROPOUT = inert("dropout is a training choice, not the model's function; the deepseek family has none")
RULES: dict[str, Rule] = {
    "model_type": inert("chooses these rules"),
    "architectures": _architectures,
    "vocab_size": into("vocab_size", int), "hidden_size": into("d_model", int),
    "intermediate_size": into("d_ff", int), "moe_intermediate_size": into("moe.d_ff_expert", int),
    "num_hidden_layers": into("n_layers", int), "num_attention_heads": into("n_heads", int),
    "num_key_value_heads": _kv_heads,
    "n_shared_experts": _or(0, int, "moe.n_shared_experts"), "n_routed_experts": _experts,
    "num_local_experts": inert("transformers' alias of n_routed_experts (attribute_map), read as that"),
    "routed_scaling_factor": into("moe.routed_scaling", float),
    "kv_lora_rank": into("mla.kv_lora_rank", int), "q_lora_rank": _or(0, int, "mla.q_lora_rank"),
    "qk_rope_head_dim": into("mla.qk_rope_head_dim", int), "v_head_dim": into("mla.v_head_dim", int),
    "qk_nope_head_dim": into("mla.qk_nope_head_dim", int),
    "n_group": _or(1, int, "moe.n_group"), "topk_group": _or(1, int, "moe.topk_group"),
    "num_experts_per_tok": into("moe.top_k", int), "first_k_dense_replace": _first_dense,
    "norm_topk_prob": into("moe.normalize_top_k", bool), "hidden_act": activation_rule("hidden_act"),
    "max_position_embeddings": inert("the longest sequence it was trained on; runner's is job.model.context_length "
                                     "(read here only as YaRN's default original context)"),
    "rms_norm_eps": into("norm_eps", float), "tie_word_embeddings": into("tie_embeddings", bool),
    "rope_parameters": _rope, "rope_scaling": inert("read with rope_parameters"),
    "rope_theta": inert("read with rope_parameters"),
    "rope_interleave": into("hf.rope_interleave", bool),
    "attention_bias": only(False, supported="MLA without biases (DeepSeek-V3's)",
                           fix="import a model without attention biases."),
    "attention_dropout": _DROPOUT,
    "pretraining_tp": inert("transformers' tensor-parallel matmul split computes the same products"),
    "head_dim": inert("DeepseekV3Config recomputes it: qk_rope_head_dim"),
    "qk_head_dim": inert("DeepseekV3Config recomputes it: qk_nope_head_dim + qk_rope_head_dim"),
    "num_nextn_predict_layers": mtp_rule(None),  # `settings` reads it with what the files hold
    "num_mtp_layers": inert("transformers' alias of num_nextn_predict_layers, read as that"),
    # DeepSeek's own config.json (its trust_remote_code class) names the routing it computes
    "topk_method": only("noaux_tc", supported="DeepSeek-V3's group-limited top-k with the selection bias (noaux_tc)",
                        fix="import a model routed by noaux_tc (DeepSeek-V3)."),
    "scoring_func": only("sigmoid", supported="sigmoid expert scores (DeepSeek-V3's)",
                         fix="import a model that scores experts by a sigmoid."),
    "moe_layer_freq": only(1, supported="experts in every layer past the leading dense ones",
                           fix="import a model with moe_layer_freq 1."),
    "ep_size": inert("how DeepSeek's code split experts over devices: not the model's function"),
    "aux_loss_alpha": into("moe.aux_loss", float),
    "seq_aux": inert("whether DeepSeek's balancing loss is per sequence: a training setting (runner's is per batch)"),
}


def settings(init_from: str, config: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """job.model settings of the model config.json describes (dotted keys below job.model)."""
    if "num_local_experts" in config and "n_routed_experts" not in config:  # as transformers' attribute_map
        config = {**config, "n_routed_experts": config["num_local_experts"]}
    if "num_mtp_layers" in config and "num_nextn_predict_layers" not in config:
        config = {**config, "num_nextn_predict_layers": config["num_mtp_layers"]}
    full = {**DEFAULTS, **config}
    present = _mtp_layers_held(init_from, int(full["num_hidden_layers"]), _declared_mtp(full))
    out = {"family": "deepseek", "hf.architecture": ARCHITECTURE, "hf.bos_token_id": None, "hf.eos_token_id": [],
           "moe.score": "sigmoid", "moe.bias_update_rate": 0.0}
    out.update(read_hf_config(init_from, config, {**RULES, "num_nextn_predict_layers": mtp_rule(present)},
                              DEFAULTS, model))
    if not out.get("moe.n_experts", True):
        out = {k: v for k, v in out.items() if not k.startswith("moe.") or k == "moe.n_experts"}
    return out


def _mtp_layers_held(init_from: str, layers: int, declared: int) -> int | None:
    """How many of the `declared` MTP layers (numbered from `layers`) have tensors in the files; None
    when the directory cannot be read (config.json alone)."""
    try:
        names = HFTensors(hf_dir(init_from)).file_of if init_from.startswith(HF_PREFIX) else None
    except (ConfigError, OSError):
        names = None
    if names is None:
        return None
    return sum(any(name.startswith(f"model.layers.{layers + k}.") for name in names) for k in range(declared))


# ----------------------------------------------------------------------------- export


def architecture(cfg: Any, exporting: bool = False) -> tuple[str, str]:
    """Every deepseek-family model is a DeepseekV3ForCausalLM; exported, with at most one MTP module
    (DeepSeek-V3's): transformers' own MTP layer passes each depth's normed output on, runner's module
    its hidden state, so deeper chains would draft differently there (refused when `exporting`)."""
    if exporting and cfg.mtp_depth > 1:
        raise ConfigError("job.model.mtp.depth", cfg.mtp_depth, "a chain of MTP modules feeds each depth runner's "
                          "hidden state, where transformers' MTP layer passes its normed output on, so the export "
                          "would predict other drafts.", "train with job.model.mtp.depth=1 (DeepSeek-V3's) to "
                          "exchange the model with transformers; evaluate this one with mode=eval.")
    return ARCHITECTURE, MODEL_TYPE


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """The common rope_parameters (runner.models.hf.rope) plus DeepSeek's mscale_all_dim (and mscale equal to it
    where that is what the cos/sin factor of 1 means, as DeepSeek-V3's file says it)."""
    rope = common_rope_parameters(cfg)
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        rope["mscale_all_dim"] = cfg.rope_mscale_all_dim
        if rope.get("attention_factor") == 1.0:
            rope["mscale"] = cfg.rope_mscale_all_dim
    return rope


def hf_config(cfg: Any) -> dict[str, Any]:
    experts = cfg.moe_experts
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": cfg.activation,
        "rope_parameters": rope_parameters(cfg), "rope_interleave": cfg.hf_rope_interleave,
        "attention_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
        # without experts every layer, MTP's too, is dense: first_k_dense_replace past them all
        "n_routed_experts": experts or 1, "num_experts_per_tok": cfg.moe_top_k if experts else 1,
        "moe_intermediate_size": cfg.moe_d_ff if experts else cfg.d_ff,
        "n_shared_experts": cfg.moe_shared if experts else 0,
        "first_k_dense_replace": cfg.moe_first_dense if experts else cfg.n_layers + cfg.mtp_depth,
        "n_group": cfg.moe_n_group if experts else 1, "topk_group": cfg.moe_topk_group if experts else 1,
        "norm_topk_prob": cfg.moe_normalize, "routed_scaling_factor": cfg.moe_routed_scaling if experts else 1.0,
        "num_nextn_predict_layers": cfg.mtp_depth, "output_router_logits": False,
    }


Template = tuple[str, tuple[str, ...], Callable[..., np.ndarray], Callable[..., tuple[np.ndarray, ...]], tuple]


def _t(w: np.ndarray) -> np.ndarray:
    return w.T


def rope_order(cfg: Any) -> np.ndarray:
    """runner's rotary row j is the files' row rope_order[j]: the interleaved pairs' first members,
    then their second ones (identity when the files rotate halves)."""
    rope = cfg.qk_rope_head_dim
    return np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)]) if cfg.hf_rope_interleave \
        else np.arange(rope)


def _query(cfg: Any, rows_in: int) -> tuple[Callable[..., np.ndarray], Callable[..., tuple[np.ndarray, ...]]]:
    """(N * qk, in) files <-> (in, N, qk) runner, each head's rotary rows reordered."""
    n, nope, qk = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_head_dim
    order = np.concatenate([np.arange(nope), nope + rope_order(cfg)])
    back = np.argsort(order)

    def to_hf(k: np.ndarray) -> np.ndarray:
        return k.transpose(1, 2, 0)[:, back].reshape(n * qk, rows_in)

    return to_hf, one(lambda w: w.reshape(n, qk, rows_in)[:, order].transpose(2, 0, 1))


def _kv_down(cfg: Any) -> tuple[Callable[..., np.ndarray], Callable[..., tuple[np.ndarray, ...]]]:
    """(kv_lora + rope, d) files <-> (d, kv_lora + rope) runner, the shared key's rotary rows reordered."""
    order = np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + rope_order(cfg)])
    back = np.argsort(order)
    return (lambda k: k.T[back]), one(lambda w: w[order].T)


def _attention_templates(cfg: Any) -> list[Template]:
    """A block's norms and attention: (name below the layer, sources below the block, to_hf, from_hf, part)."""
    d, n, kv, v = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.v_head_dim
    out: list[Template] = [
        ("input_layernorm.weight", ("attn_norm/scale",), same, one(same), ()),
        ("post_attention_layernorm.weight", ("mlp_norm/scale",), same, one(same), ()),
        ("self_attn.kv_a_proj_with_mqa.weight", ("attn/kv_down/kernel",), *_kv_down(cfg), ()),
        ("self_attn.kv_a_layernorm.weight", ("attn/kv_norm/scale",), same, one(same), ()),
        ("self_attn.kv_b_proj.weight", ("attn/kv_up/kernel",),
         lambda k: k.transpose(1, 2, 0).reshape(-1, kv),
         one(lambda w: w.reshape(n, cfg.qk_nope_head_dim + v, kv).transpose(2, 0, 1)), ()),
        ("self_attn.o_proj.weight", ("attn/out/kernel",), lambda k: k.reshape(n * v, d).T,
         one(lambda w: w.T.reshape(n, v, d)), ()),
    ]
    if cfg.q_lora_rank:
        out += [("self_attn.q_a_proj.weight", ("attn/query_down/kernel",), _t, one(_t), ()),
                ("self_attn.q_a_layernorm.weight", ("attn/query_norm/scale",), same, one(same), ()),
                ("self_attn.q_b_proj.weight", ("attn/query_up/kernel",), *_query(cfg, cfg.q_lora_rank), ())]
    else:
        out.append(("self_attn.q_proj.weight", ("attn/query/kernel",), *_query(cfg, d), ()))
    return out


def _mlp_templates(cfg: Any) -> list[Template]:
    return [(f"mlp.{proj}_proj.weight", (f"mlp/{proj}/kernel",), _t, one(_t), ()) for proj in ("gate", "up", "down")]


def _moe_templates(cfg: Any) -> list[Template]:
    """The router, its selection bias (with the moving one of a run that moves it), every expert's
    matrices and the shared experts'."""
    bias: Template = ("mlp.gate.e_score_correction_bias", ("moe/score_bias",), same, one(same), ())
    if cfg.moe_bias_rate:
        bias = ("mlp.gate.e_score_correction_bias", ("moe/score_bias", f"{STATE_SOURCE}moe/router_bias"),
                lambda fixed, moving: fixed + moving, one(same), ())
    out: list[Template] = [("mlp.gate.weight", ("moe/router",), _t, one(_t), ()), bias]
    for name, source in (("gate_proj", "moe/gate"), ("up_proj", "moe/up"), ("down_proj", "moe/down")):
        out += [(f"mlp.experts.{j}.{name}.weight", (source,), _t, one(_t), (j,)) for j in range(cfg.moe_experts)]
    if cfg.moe_shared:
        out += [(f"mlp.shared_experts.{proj}_proj.weight", (f"moe/shared_{proj}/kernel",), _t, one(_t), ())
                for proj in ("gate", "up", "down")]
    else:  # transformers builds them zero wide
        d = cfg.d_model
        for proj, shape in (("gate", (0, d)), ("up", (0, d)), ("down", (d, 0))):
            name, sources, to_hf, from_hf = zeros_of(f"mlp.shared_experts.{proj}_proj.weight", shape)
            out.append((name, sources, to_hf, from_hf, ()))
    return out


def _block_templates(cfg: Any, layer: int) -> list[Template]:
    return _attention_templates(cfg) + (_moe_templates(cfg) if cfg.sparse(layer) else _mlp_templates(cfg))


def _below(prefix: str, source: str) -> str:
    """`source` below the module `prefix` (a model-state source keeps its mark in front)."""
    if source.startswith(STATE_SOURCE):
        return STATE_SOURCE + prefix + source[len(STATE_SOURCE):]
    return prefix + source


def layout(cfg: Any) -> list[HFTensor]:
    embed = HFTensor("model.embed_tokens.weight", ("embed/embedding",), None, same, one(same))
    head = HFTensor("lm_head.weight", ("lm_head/kernel",), None, _t, one(_t))
    out = [embed, HFTensor("model.norm.weight", ("norm/scale",), None, same, one(same))]
    if not cfg.tie_embeddings:
        out.append(head)
    dense = cfg.dense_layers  # the leading layers with a dense MLP; scanned apart when some have experts
    split = dense if 0 < dense < cfg.n_layers else 0
    for layers in (range(dense), range(dense, cfg.n_layers)):  # a source's layers together: each leaf read once
        if layers:
            for name, sources, to_hf, from_hf, part in _block_templates(cfg, layers.start):
                out += [HFTensor(f"model.layers.{i}.{name}", sources, i, to_hf, from_hf, split, part) for i in layers]
    for k in range(cfg.mtp_depth):  # DeepSeek's MTP layers, after the decoder's
        at, module = f"model.layers.{cfg.n_layers + k}.", f"mtp_{k}/"
        out += [HFTensor(at + name, tuple(_below(f"{module}block/", s) for s in sources), None, to_hf, from_hf, 0, part)
                for name, sources, to_hf, from_hf, part in _block_templates(cfg, cfg.n_layers + k)]
        out += [HFTensor(at + "enorm.weight", (module + "token_norm/scale",), None, same, one(same)),
                HFTensor(at + "hnorm.weight", (module + "hidden_norm/scale",), None, same, one(same)),
                HFTensor(at + "eh_proj.weight", (module + "project/kernel",), None, _t, one(_t)),
                HFTensor(at + "shared_head.norm.weight", (module + "head_norm/scale",), None, same, one(same)),
                HFTensor(at + "embed_tokens.weight", embed.sources, None, same, one(same)),
                HFTensor(at + "shared_head.head.weight", *((embed.sources, None, same, one(same)) if cfg.tie_embeddings
                                                           else (head.sources, None, _t, one(_t))))]
    return out


def buffers(cfg: Any) -> dict[str, Any]:
    """With tied embeddings, a copy of the embedding as lm_head (accepted when equal)."""
    if cfg.tie_embeddings:
        return {"lm_head.weight": lambda x, read: bool(np.array_equal(x, read("model.embed_tokens.weight")))}
    return {}


class DeepSeekHF(HFAdapter):
    """DeepSeek-V3 both ways."""

    model_types = (MODEL_TYPE,)
    settings = staticmethod(settings)
    architecture = staticmethod(architecture)
    config = staticmethod(hf_config)
    layout = staticmethod(layout)
    buffers = staticmethod(buffers)


__all__ = ["ARCHITECTURE", "DEFAULTS", "DeepSeekHF", "MODEL_TYPE", "RULES", "layout", "rope_order", "settings"]
