"""The gpt family in Hugging Face terms: GPT2LMHeadModel, every config.json field read into
job.model settings or refused, and the tensor layout both ways. Works on the family's config
(runner.models.gpt.model.GPTConfig) by its fields, so this module does not import the model."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from runner.models.hf.adapter import HFAdapter
from runner.models.hf.mapping import (HFTensor, Refused, activation_rule, inert, into, one, only, read_hf_config, same,
    zeros_of)

ARCHITECTURE = "GPT2LMHeadModel"
BASE_PREFIX = "transformer."  # the hub's own gpt2 files name tensors without it (saved from GPT2Model)

# transformers' GPT2Config defaults for the fields whose absence matters (tests/models/test_hf_config.py)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
}


def _architectures(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    if value not in (None, [], [ARCHITECTURE], ["GPT2Model"]):
        raise Refused(f"runner imports the causal language model {ARCHITECTURE}, and this is a {value}.",
                      f"architectures [{ARCHITECTURE}] for model_type gpt2",
                      f"save the model as {ARCHITECTURE} in transformers and import that.")
    return {}


def _n_ctx(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
    if value not in (None, config["n_positions"]):
        raise Refused(f"an attention span other than n_positions={config['n_positions']}.",
                      "n_ctx equal to n_positions (older GPT-2 configs carry both)", "import a standard GPT-2.")
    return {}


_DROPOUT = inert("dropout is a training choice, not the model's function: runner's is job.model.dropout")
_HEAD = inert("the sequence-classification head's settings: runner imports the language-model head")
RULES = {
    "model_type": inert("chooses these rules"), "architectures": _architectures,
    "vocab_size": into("vocab_size", int), "n_positions": into("context_length", int), "n_embd": into("d_model", int),
    "n_layer": into("n_layers", int), "n_head": into("n_heads", int),
    "n_inner": lambda value, config, model: {"d_ff": int(value or 4 * config["n_embd"])},
    "activation_function": activation_rule("activation_function"), "layer_norm_epsilon": into("norm_eps", float),
    "tie_word_embeddings": into("tie_embeddings", bool), "n_ctx": _n_ctx,
    "resid_pdrop": _DROPOUT, "embd_pdrop": _DROPOUT, "attn_pdrop": _DROPOUT,
    **{name: _HEAD for name in ("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                                "summary_first_dropout")},
    "scale_attn_weights": only(True, supported="attention scores scaled by 1/sqrt(head_dim) (scale_attn_weights "
                               "true)", fix="import a GPT-2 with scale_attn_weights true."),
    "scale_attn_by_inverse_layer_idx": only(False, supported="the same attention scale in every layer "
                                            "(scale_attn_by_inverse_layer_idx false)",
                                            fix="import a GPT-2 trained without it."),
    "reorder_and_upcast_attn": inert("computes the attention scores in float32 in another order: the same "
                                     "values up to rounding"),
}


def settings(init_from: str, config: Mapping[str, Any], model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"family": "gpt", "use_bias": True, "hf.architecture": ARCHITECTURE,
                           "hf.bos_token_id": None, "hf.eos_token_id": []}
    out.update(read_hf_config(init_from, config, RULES, DEFAULTS, model))
    return out


def hf_config(cfg: Any) -> dict[str, Any]:
    return {"architectures": [ARCHITECTURE], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.context_length, "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_inner": cfg.d_ff, "activation_function": cfg.activation,
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True}


def layout(cfg: Any) -> list[HFTensor]:
    """GPT2LMHeadModel's tensors; a model trained without biases (job.model.use_bias=false) has
    them exported as zeros, the same function."""
    d, f = cfg.d_model, cfg.d_ff

    def split3(w: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        return tuple(part.reshape(shape) for part in np.split(w, 3, axis=-1))

    def bias(name: str, sources: tuple[str, ...], size: int, to_hf: Any = same, from_hf: Any = one(same)) -> tuple:
        return (name, sources, to_hf, from_hf) if cfg.use_bias else zeros_of(name, (size,))

    top = [HFTensor("transformer.wte.weight", ("wte/embedding",), None, same, one(same)),
           HFTensor("transformer.wpe.weight", ("wpe/embedding",), None, same, one(same)),
           HFTensor("transformer.ln_f.weight", ("ln_f/scale",), None, same, one(same))]
    name, sources, to_hf, from_hf = bias("transformer.ln_f.bias", ("ln_f/bias",), d)
    top.append(HFTensor(name, sources, None, to_hf, from_hf))
    if not cfg.tie_embeddings:
        top.append(HFTensor("lm_head.weight", ("lm_head/kernel",), None, lambda w: w.T, one(lambda w: w.T)))
    qkv = tuple(f"attn/{p}/kernel" for p in ("query", "key", "value"))
    qkv_bias = tuple(f"attn/{p}/bias" for p in ("query", "key", "value"))
    shape = (d, cfg.n_heads, cfg.head_dim)
    templates: list[tuple[str, tuple[str, ...], Any, Any]] = [
        ("ln_1.weight", ("ln_1/scale",), same, one(same)), bias("ln_1.bias", ("ln_1/bias",), d),
        ("ln_2.weight", ("ln_2/scale",), same, one(same)), bias("ln_2.bias", ("ln_2/bias",), d),
        ("attn.c_attn.weight", qkv, lambda *w: np.concatenate([x.reshape(d, d) for x in w], -1),
         lambda w: split3(w, shape)),
        bias("attn.c_attn.bias", qkv_bias, 3 * d, lambda *b: np.concatenate([x.reshape(d) for x in b]),
             lambda b: split3(b, shape[1:])),
        ("attn.c_proj.weight", ("attn/out/kernel",), lambda w: w.reshape(d, d), one(lambda w: w.reshape(
            cfg.n_heads, cfg.head_dim, d))),
        bias("attn.c_proj.bias", ("attn/out/bias",), d),
        ("mlp.c_fc.weight", ("mlp/fc/kernel",), same, one(same)), bias("mlp.c_fc.bias", ("mlp/fc/bias",), f),
        ("mlp.c_proj.weight", ("mlp/proj/kernel",), same, one(same)), bias("mlp.c_proj.bias", ("mlp/proj/bias",), d),
    ]
    return top + [HFTensor(f"transformer.h.{i}.{name}", sources, i, to_hf, from_hf)
                  for name, sources, to_hf, from_hf in templates for i in range(cfg.n_layers)]


def buffers(cfg: Any) -> dict[str, Any]:
    """Tensors older GPT-2 files carry that are computed, not learned: each layer's causal mask
    (accepted when it is lower-triangular ones), the fill value for masked scores, and with tied
    embeddings a copy of the embedding as lm_head (accepted when equal)."""

    def causal(x: np.ndarray, read: Any) -> bool:
        square = x.reshape(x.shape[-2:]) if x.ndim >= 2 else x
        return square.ndim == 2 and bool(np.array_equal(square != 0, np.tril(np.ones(square.shape, bool))))

    out: dict[str, Any] = {}
    for i in range(cfg.n_layers):
        out[f"transformer.h.{i}.attn.bias"] = causal
        out[f"transformer.h.{i}.attn.masked_bias"] = lambda x, read: x.size == 1
    if cfg.tie_embeddings:
        out["lm_head.weight"] = lambda x, read: bool(np.array_equal(x, read("transformer.wte.weight")))
    return out


class GPTHF(HFAdapter):
    """GPT-2 (GPT2LMHeadModel) both ways."""

    model_types = ("gpt2",)
    base_prefix = BASE_PREFIX
    settings = staticmethod(settings)
    config = staticmethod(hf_config)
    layout = staticmethod(layout)
    buffers = staticmethod(buffers)

    @staticmethod
    def architecture(cfg: Any, exporting: bool = False) -> tuple[str, str]:
        return ARCHITECTURE, "gpt2"
