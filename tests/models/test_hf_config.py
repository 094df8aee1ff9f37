"""Hugging Face import reads every config.json field or refuses it (issue 26), against transformers
itself (PyTorch on CPU, models built from config classes with random weights, no downloads).

- every field of transformers' Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE and GPT-2 config
  classes has a rule, and runner's defaults for absent fields are transformers' (the mixtures of
  experts' parity: tests/models/test_moe_hf.py);
- each newly supported field (rope linear and yarn, Llama 3 rope parameters from the file,
  attention and MLP biases, activations, GPT-2's epsilon and activation, Mistral, hub-style
  tensor names and buffers) imports with logit parity within 1e-4, greedy generation equal for 32
  tokens, and exports back as the same architecture with the same fields;
- each field runner does not implement is refused before device work, naming it (and one
  refusal end to end: exit 2, no traceback, no run directory);
- the model's dims come from config.json: one launch from any job; a contradicting command-line
  key is refused naming both; tensors the model does not use are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir

from runner.errors import ConfigError, UserError
from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.main.export import export
from runner.models import family_for, import_hf_params
from runner.models.gpt import hf as gpt_hf
from runner.models.hf import mapping as hf
from runner.models.llama import hf as llama_hf
from runner.spec import register_schema
from runner.train.job import JOBS, load_job_modules
from tests.conftest import TINY as TINY_WITH_DIMS
from tests.conftest import run_runner
from tests.models.test_hf import assert_greedy_as_transformers, perturbed_export

register_schema()
load_job_modules()
TOL = 1e-4
CONFIGS = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "gpt2": transformers.GPT2Config, "mixtral": transformers.MixtralConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig}
DECODER = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
GPT2 = dict(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
# TINY's run settings without its model dims (an imported model's come from config.json)
TINY = [k for k in TINY_WITH_DIMS if not k.startswith("job.model.")]
# the job's own files set other dims (llama_tiny, gpt_tiny): config.json's win; only the context
# length (not a dim of the llama family) is chosen here, long enough for 32 generated tokens
JOB = {"llama": ["job=llama_tiny", "job.model.context_length=64"], "gpt": ["job=gpt_tiny"]}


def spec_for(*overrides: str) -> Any:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return build_spec(compose(CONFIG_NAME, overrides=list(overrides)), list(overrides))


def save(model_dir: Path, config: Any, std: float = 0.02, edit: Callable[[dict], None] | None = None) -> Any:
    config.initializer_range = std
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases start at zero in transformers: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") and "ln" not in name and "norm" not in name:
                p.normal_(0, 0.5)
    model.save_pretrained(model_dir)
    if edit is not None:
        data = json.loads((model_dir / "config.json").read_text())
        edit(data)
        (model_dir / "config.json").write_text(json.dumps(data))
    return model


def hf_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def imported(spec: Any) -> tuple[Any, Any, dict]:
    family = family_for(spec)
    config = family.config(spec.job.model)
    module = family.module(config)
    abstract = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    return config, module, import_hf_params(spec, config, abstract)


TOKENS = np.random.default_rng(0).integers(0, 320, (2, 24))


# --------------------------------------------------------------------------------------------- every field


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_every_field_of_transformers_config_class_has_a_rule(model_type: str) -> None:
    rules = gpt_hf.RULES if model_type == "gpt2" else llama_hf.RULES[model_type]
    defaults = gpt_hf.DEFAULTS if model_type == "gpt2" else llama_hf.DEFAULTS[model_type]
    fields = CONFIGS[model_type]().to_dict()
    undeclared = sorted(k for k in fields if k not in rules and k not in hf.GENERIC_RULES)
    assert not undeclared, f"{model_type}: config fields without a rule: {undeclared}"
    # runner's defaults for fields config.json may leave out are transformers' (None: derived,
    # as transformers derives it: head_dim, num_key_value_heads, n_inner, layer_types, rope)
    reference = CONFIGS[model_type]
    for key, value in defaults.items():
        if value is None:
            continue
        theirs = getattr(reference, key, None)
        theirs = theirs if theirs is not None and not isinstance(theirs, property) else fields.get(key)
        assert theirs == value, (model_type, key, theirs, value)


# Every job.model setting that shapes the computation: an import must set each of them (else the
# job file's value leaks into the imported model).
STRUCTURAL = {
    "llama": {"family", "vocab_size", "d_model", "d_ff", "n_layers", "n_heads", "n_kv_heads", "head_dim", "norm_eps",
              "tie_embeddings", "activation", "qk_norm", "qkv_bias", "out_bias", "mlp_bias", "rope.theta",
              "rope.scaling", "hf.architecture", "hf.bos_token_id", "hf.eos_token_id", "moe.n_experts"},
    "gpt2": {"family", "vocab_size", "context_length", "d_model", "d_ff", "n_layers", "n_heads", "norm_eps",
             "tie_embeddings", "activation", "use_bias", "hf.architecture", "hf.bos_token_id", "hf.eos_token_id"},
}
STRUCTURAL["moe"] = STRUCTURAL["llama"] | {"moe.top_k", "moe.d_ff_expert", "moe.n_shared_experts", "moe.score",
                                          "moe.normalize_top_k", "moe.first_dense_layers"}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_near_empty_config_json_still_sets_every_structural_setting(model_type: str) -> None:
    """transformers fills a field config.json leaves out with its class default; so does runner,
    for every setting that shapes the model."""
    spec = spec_for(*TINY, *JOB["llama"])
    module = gpt_hf if model_type == "gpt2" else llama_hf
    settings = module.settings("hf:x", {"model_type": model_type}, spec.job.model)
    kind = "gpt2" if model_type == "gpt2" else "moe" if model_type in llama_hf.MOE_TYPES else "llama"
    assert STRUCTURAL[kind] <= set(settings)
    reference = CONFIGS[model_type]()
    if model_type != "gpt2":
        head_dim = getattr(reference, "head_dim", None) or reference.hidden_size // reference.num_attention_heads
        assert settings["head_dim"] == head_dim
        assert settings["d_ff"] == reference.intermediate_size and settings["norm_eps"] == reference.rms_norm_eps
        assert settings["n_kv_heads"] == (reference.num_key_value_heads or reference.num_attention_heads)
    if kind == "moe":
        assert (settings["moe.n_experts"], settings["moe.top_k"]) == (reference.num_experts,
                                                                      reference.num_experts_per_tok)
        assert settings["moe.d_ff_expert"] == getattr(reference, "moe_intermediate_size", reference.intermediate_size)
        assert settings["moe.normalize_top_k"] == getattr(reference, "norm_topk_prob", True)


# --------------------------------------------------------------------------------------------- supported, with parity

SUPPORTED: dict[str, tuple[str, Callable[[], Any], Callable[[dict], None] | None]] = {
    "llama_rope_linear": ("llama", lambda: transformers.LlamaConfig(
        **DECODER, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), None),
    "llama_rope_yarn": ("llama", lambda: transformers.LlamaConfig(
        **DECODER, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 16}), None),
    "llama_rope_yarn_mscale_betas": ("llama", lambda: transformers.LlamaConfig(
        **DECODER, head_dim=16, rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 8, "beta_fast": 16.0,
                                                 "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5}), None),
    "llama3_rope_from_the_file": ("llama", lambda: transformers.LlamaConfig(
        **DECODER, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                    "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                    "original_max_position_embeddings": 16}), None),
    "legacy_rope_scaling_and_theta": ("llama", lambda: transformers.LlamaConfig(**DECODER),
                                      lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0},
                                                         rope_theta=20000.0, rope_parameters=None)),
    "llama_attention_and_mlp_bias": ("llama", lambda: transformers.LlamaConfig(
        **DECODER, attention_bias=True, mlp_bias=True), None),
    "llama_gelu": ("llama", lambda: transformers.LlamaConfig(**DECODER, hidden_act="gelu"), None),
    "llama_gelu_tanh_bf16_file": ("llama", lambda: transformers.LlamaConfig(**DECODER, hidden_act="gelu_pytorch_tanh",
                                                                            dtype="bfloat16"), None),
    "mistral_window_never_cuts": ("mistral", lambda: transformers.MistralConfig(**DECODER, sliding_window=64,
                                                                                bos_token_id=7, eos_token_id=9),
                                  None),
    "qwen3_attention_bias": ("qwen3", lambda: transformers.Qwen3Config(**DECODER, head_dim=8, attention_bias=True,
                                                                       tie_word_embeddings=True), None),
    "qwen2_sliding_flag_without_window_layers": ("qwen2", lambda: transformers.Qwen2Config(
        **DECODER, use_sliding_window=True, sliding_window=8, max_window_layers=2), None),
    # a window in every layer, shorter than the tokens: job.model.window.size (Mistral v0.1's, Qwen2's)
    "mistral_sliding_window": ("mistral", lambda: transformers.MistralConfig(**DECODER, sliding_window=5), None),
    "qwen2_window_in_every_layer": ("qwen2", lambda: transformers.Qwen2Config(
        **DECODER, use_sliding_window=True, sliding_window=6, max_window_layers=0), None),
    "gpt2_relu_eps": ("gpt2", lambda: transformers.GPT2Config(**GPT2, activation_function="relu",
                                                              layer_norm_epsilon=0.1), None),
    "gpt2_quick_gelu_untied": ("gpt2", lambda: transformers.GPT2Config(**GPT2, activation_function="quick_gelu",
                                                                       tie_word_embeddings=False), None),
}


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_field_imports_with_parity_and_exports_as_it_came(tmp_path: Path, name: str) -> None:
    model_type, make, edit = SUPPORTED[name]
    save(tmp_path / "hf", make(), std=0.3 if model_type != "gpt2" else 0.2, edit=edit)
    # transformers reads the (edited, bf16) file as runner does, in float32
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    family = "gpt" if model_type == "gpt2" else "llama"
    spec = spec_for(*TINY, *JOB[family], f"run.init_from=hf:{tmp_path / 'hf'}", f"run.dir={tmp_path / 'run'}")
    assert spec.job.model.family == family and spec.job.model.hf.architecture == type(model).__name__
    config, module, params = imported(spec)
    ours = np.asarray(module.apply({"params": params}, jnp.asarray(TOKENS)))
    theirs = hf_logits(model, TOKENS)
    assert np.abs(ours - theirs).max() < TOL * max(1.0, float(np.abs(theirs).max()) / 10)

    assert_greedy_as_transformers(module, params, model)

    # a run's checkpoint of these parameters exports as the same architecture, same fields
    job = JOBS.get("lm")(spec)
    job.load()
    job.save()
    job.close()
    report = export(tmp_path / "run", tmp_path / "out")
    assert report["architecture"] == type(model).__name__
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    assert np.abs(hf_logits(loaded, TOKENS) - ours).max() < TOL * max(1.0, float(np.abs(theirs).max()) / 10)
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    again = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("hidden_act", "activation_function", "layer_norm_epsilon", "rms_norm_eps", "attention_bias",
                "mlp_bias", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if original.get(key) is not None:
            assert again[key] == original[key], key
    if spec.job.model.window.size:  # a window in every layer goes out as it came
        assert again["sliding_window"] == original["sliding_window"] == spec.job.model.window.size
    rope = original.get("rope_parameters") or original.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    assert again.get("rope_parameters", {"rope_type": "default"})["rope_type"] == kind
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "beta_fast", "beta_slow"):
        if key in rope:
            assert again["rope_parameters"][key] == pytest.approx(rope[key]), key


def test_hub_style_gpt2_file_without_prefix_and_with_mask_buffers(tmp_path: Path) -> None:
    """The hub's own gpt2 files: tensors named without `transformer.`, each layer's causal mask
    and masked_bias stored; accepted (the mask checked), a damaged mask refused by name."""
    from safetensors.numpy import save_file

    model = save(tmp_path / "hf", transformers.GPT2Config(**GPT2), std=0.2)
    tensors = {k.removeprefix("transformer."): v.numpy() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.uint8))
        tensors[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    (tmp_path / "hf" / hf.SINGLE_FILE).unlink()
    save_file(tensors, str(tmp_path / "hf" / hf.SINGLE_FILE))
    spec = spec_for(*TINY, *JOB["gpt"], f"run.init_from=hf:{tmp_path / 'hf'}")
    _, module, params = imported(spec)
    assert np.abs(np.asarray(module.apply({"params": params}, jnp.asarray(TOKENS))) -
                  hf_logits(model, TOKENS)).max() < TOL
    tensors["h.1.attn.bias"] = np.ones((1, 1, 64, 64), np.uint8)  # not causal
    save_file(tensors, str(tmp_path / "hf" / hf.SINGLE_FILE))
    with pytest.raises(UserError, match=r"h\.1\.attn\.bias"):
        imported(spec)


def test_tensors_the_model_does_not_use_are_refused_by_name(tmp_path: Path) -> None:
    """Biases in the file that config.json does not declare (the failure that dropped them
    silently), an unknown extra tensor; a tied head's identical copy and a correct rotary table
    are accepted."""
    save(tmp_path / "hf", transformers.LlamaConfig(**DECODER, attention_bias=True),
         edit=lambda c: c.update(attention_bias=False))
    spec = spec_for(*TINY, *JOB["llama"], f"run.init_from=hf:{tmp_path / 'hf'}")
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn\.[a-z]_proj\.bias"):
        imported(spec)

    from safetensors.numpy import load_file, save_file

    save(tmp_path / "tied", transformers.LlamaConfig(**DECODER, tie_word_embeddings=True))
    file = tmp_path / "tied" / hf.SINGLE_FILE
    tensors = load_file(str(file))
    spec = spec_for(*TINY, *JOB["llama"], f"run.init_from=hf:{tmp_path / 'tied'}")
    config = family_for(spec).config(spec.job.model)
    from runner.models.llama.model import rope_frequencies

    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = rope_frequencies(config)
    save_file(tensors, str(file))
    imported(spec)  # accepted: a copy and a computed table
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(file))
    with pytest.raises(UserError, match="lm_head.weight"):
        imported(spec)
    del tensors["lm_head.weight"]
    tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(file))
    with pytest.raises(UserError, match=r"model\.layers\.0\.extra\.weight"):
        imported(spec)


# --------------------------------------------------------------------------------------------- refused

REFUSED: dict[str, tuple[Callable[[], Any], Callable[[dict], None] | None, str]] = {
    "qwen2_window_in_later_layers": (lambda: transformers.Qwen2Config(**DECODER, use_sliding_window=True,
                                                                      sliding_window=8, max_window_layers=1),
                                     None, "sliding_window"),
    "qwen3_sliding_layer_types": (lambda: transformers.Qwen3Config(**DECODER, use_sliding_window=True, sliding_window=4,
                                                                   layer_types=["full_attention", "sliding_attention"]),
                                  None, "sliding_window"),
    "rope_dynamic": (lambda: transformers.LlamaConfig(**DECODER), lambda c: c.update(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "rope_parameters"),
    "rope_longrope": (lambda: transformers.LlamaConfig(**DECODER), lambda c: c.update(
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                         "long_factor": [2.0] * 4}), "rope_parameters"),
    "rope_partial": (lambda: transformers.LlamaConfig(**DECODER), lambda c: c.update(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "rope_parameters"),
    "rope_unknown_parameter": (lambda: transformers.LlamaConfig(**DECODER), lambda c: c.update(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "low_freq_factor": 3.0}),
        "rope_parameters"),
    "activation_unknown": (lambda: transformers.LlamaConfig(**DECODER), lambda c: c.update(hidden_act="mish"),
                           "hidden_act"),
    "gpt2_inverse_layer_idx": (lambda: transformers.GPT2Config(**GPT2, scale_attn_by_inverse_layer_idx=True), None,
                               "scale_attn_by_inverse_layer_idx"),
    "gpt2_unscaled_attention": (lambda: transformers.GPT2Config(**GPT2, scale_attn_weights=False), None,
                                "scale_attn_weights"),
    "gpt2_cross_attention": (lambda: transformers.GPT2Config(**GPT2), lambda c: c.update(add_cross_attention=True),
                             "add_cross_attention"),
    "quantized": (lambda: transformers.LlamaConfig(**DECODER), lambda c: c.update(
        quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True}), "quantization_config"),
    "remote_code": (lambda: transformers.LlamaConfig(**DECODER), lambda c: c.update(
        auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}), "auto_map"),
    "unknown_field": (lambda: transformers.Qwen3Config(**DECODER), lambda c: c.update(attn_logit_softcapping=30.0),
                      "attn_logit_softcapping"),
    "not_a_causal_lm": (lambda: transformers.LlamaConfig(**DECODER), lambda c: c.update(
        architectures=["LlamaForSequenceClassification"]), "architectures"),
    "pruned": (lambda: transformers.GPT2Config(**GPT2), lambda c: c.update(pruned_heads={"0": [1]}), "pruned_heads"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_field_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    make, edit, field = REFUSED[name]
    save(tmp_path / "hf", make(), edit=edit)
    family = "gpt" if name.startswith("gpt2") or name == "pruned" else "llama"
    with pytest.raises(hf.HFConfigError) as info:
        spec_for(*TINY, *JOB[family], f"run.init_from=hf:{tmp_path / 'hf'}")
    assert info.value.field == field
    message = str(info.value)
    assert f"{field}=" in message and "runner supports" in message and "Fix:" in message


@pytest.mark.deep
def test_a_refusal_end_to_end_is_exit_2_without_a_run_directory(tmp_path: Path) -> None:
    save(tmp_path / "hf", transformers.Qwen2Config(**DECODER, use_sliding_window=True, sliding_window=8,
                                                   max_window_layers=1))  # full attention, then a window
    out = run_runner([*TINY, "job=llama_tiny", "run.init_from=hf:hf", "run.dir=run"], tmp_path)
    assert out.returncode == 2 and "sliding_window=8" in out.stderr and "context_length" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()
    # the fix it names works: a context the window never cuts
    ok = run_runner([*TINY, "job=llama_tiny", "run.init_from=hf:hf", "run.dir=run", "job.model.context_length=8",
                     "train.seq_len=8", "train.steps=1", "eval.every=0"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "Qwen2ForCausalLM" in ok.stdout


def test_unknown_architecture_names_the_init_from_value_and_the_model_type(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gemma", "hidden_size": 8}))
    (tmp_path / "hf" / hf.SINGLE_FILE).write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        spec_for(*TINY, f"run.init_from=hf:{tmp_path / 'hf'}")
    assert info.value.key == "run.init_from" and info.value.value == f"hf:{tmp_path / 'hf'}"
    assert "model_type='gemma'" in str(info.value) and "qwen3 (llama)" in str(info.value)


def test_weights_runner_cannot_read_are_refused_before_the_run(tmp_path: Path) -> None:
    save(tmp_path / "hf", transformers.LlamaConfig(**DECODER))
    (tmp_path / "hf" / hf.SINGLE_FILE).rename(tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="pytorch_model.bin"):
        spec_for(*TINY, f"run.init_from=hf:{tmp_path / 'hf'}")
    (tmp_path / "hf" / hf.INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match="model-00001-of-00002"):
        spec_for(*TINY, f"run.init_from=hf:{tmp_path / 'hf'}")


# --------------------------------------------------------------------------------------------- dims from config.json


def test_dims_come_from_config_json_and_a_contradicting_command_line_key_is_refused(tmp_path: Path) -> None:
    save(tmp_path / "hf", transformers.Qwen3Config(**DECODER, head_dim=16, tie_word_embeddings=True))
    where = f"run.init_from=hf:{tmp_path / 'hf'}"
    for job in ("job=gpt_tiny", "job=llama_tiny"):  # one launch from any job: the file's dims win
        m = spec_for(*TINY, job, where).job.model
        assert (m.family, m.d_model, m.d_ff, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.qk_norm,
                m.tie_embeddings, m.norm_eps) == ("llama", 32, 48, 2, 4, 2, 16, True, True, 1e-6)
    save(tmp_path / "gpt2", transformers.GPT2Config(**GPT2))  # and the other way: a GPT-2 from a llama job
    m = spec_for(*TINY, "job=llama_tiny", f"run.init_from=hf:{tmp_path / 'gpt2'}").job.model
    assert (m.family, m.d_model, m.context_length, m.n_kv_heads, m.rope.theta) == ("gpt", 32, 64, 0, 10000.0)
    agreeing = spec_for(*TINY, "job=llama_tiny", where, "job.model.d_ff=48", "job.model.qk_norm=true")
    assert agreeing.job.model.d_ff == 48
    for key, value, theirs in (("d_ff", "64", "48"), ("qk_norm", "false", "True"), ("family", "gpt", "'llama'"),
                               ("rope.theta", "500000", "10000.0")):
        with pytest.raises(ConfigError) as info:
            spec_for(*TINY, "job=llama_tiny", where, f"job.model.{key}={value}")
        assert info.value.key == f"job.model.{key}" and f"has {theirs}" in str(info.value)


def test_combinations_no_architecture_holds_are_refused_at_the_start_not_at_export() -> None:
    with pytest.raises(ConfigError, match="job.model.mlp_bias"):
        spec_for(*TINY, "job=llama_tiny", "job.model.qk_norm=true", "job.model.mlp_bias=true")
    with pytest.raises(ConfigError, match="job.model.hf.architecture"):
        spec_for(*TINY, "job=llama_tiny", "job.model.qkv_bias=true", "job.model.hf.architecture=MistralForCausalLM")
    with pytest.raises(ConfigError, match="job.model.hf.architecture"):
        spec_for(*TINY, "job.model.hf.architecture=LlamaForCausalLM")  # the gpt family


EXPORTED_WITH_ZERO_BIASES = {
    # models transformers' architectures hold with a zero bias in place of the one they lack
    "gpt_without_biases": (["job=gpt_tiny", "job.model.use_bias=false", "job.model.context_length=64"],
                           "GPT2LMHeadModel"),
    "qk_norm_with_qkv_bias": (["job=llama_tiny", "job.model.qk_norm=true", "job.model.qkv_bias=true"],
                              "Qwen3ForCausalLM"),
    "llama_out_bias_only": (["job=llama_tiny", "job.model.out_bias=true"], "LlamaForCausalLM"),
}


@pytest.mark.parametrize("name", sorted(EXPORTED_WITH_ZERO_BIASES))
def test_models_without_a_bias_their_architecture_has_export_with_zeros(tmp_path: Path, name: str) -> None:
    overrides, architecture = EXPORTED_WITH_ZERO_BIASES[name]
    spec = spec_for(*TINY, *overrides, f"run.dir={tmp_path / 'run'}")
    ours, loaded, info, report = perturbed_export(spec, tmp_path, 0.05, TOKENS)  # biases and norms moved
    assert report["architecture"] == type(loaded).__name__ == architecture
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert np.abs(hf_logits(loaded.eval(), TOKENS) - ours).max() < TOL


def test_bf16_parameters_export_as_bfloat16(tmp_path: Path) -> None:
    spec = spec_for(*TINY, "job=llama_tiny", "job.model.param_dtype=bfloat16", f"run.dir={tmp_path / 'run'}")
    job = JOBS.get("lm")(spec)
    job.load()
    job.save()
    job.close()
    report = export(tmp_path / "run", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert report["dtype"] == config["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch.bfloat16
    assert dataclasses.is_dataclass(spec)
