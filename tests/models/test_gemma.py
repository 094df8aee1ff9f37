"""The gemma family (Gemma 3's text decoder) against transformers' Gemma3ForCausalLM itself
(PyTorch on CPU, tiny models built from Gemma3TextConfig with random weights, no downloads):

- import (run.init_from=hf:DIR) gives transformers' logits, scanned and unrolled; the export loads
  in transformers as Gemma3ForCausalLM with the same logits, and imports back bitwise; greedy
  decoding (KV cache, windowed layers) equals transformers' generate(do_sample=False);
- every field of Gemma3TextConfig has a rule; what runner cannot honour is refused naming it;
- packed documents (segment ids, restarted positions) give each document's logits alone, through
  the window; Gemma 2's soft-capping on runner's own XLA path and in the tiled loss;
- the jobs: gemma3_4b's count is Gemma 3 4B's (transformers' own, on the meta device), FLOPs count
  a windowed layer's keys; gemma3_tiny learns and resumes bit-exact after SIGKILL (deep).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import signal
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

from runner.errors import ConfigError
from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.main.export import export
from runner.models import family_for, import_hf_params, model_config
from runner.models.gemma import hf as gemma_hf
from runner.models.gemma.model import Gemma, GemmaConfig, GemmaFamily, attended_keys
from runner.models.hf import mapping as hf
from runner.spec import register_schema
from runner.train.job import JOBS, load_job_modules
from tests.conftest import TINY as TINY_WITH_DIMS
from tests.conftest import run_runner
from tests.models.test_hf import assert_greedy_as_transformers

register_schema()
load_job_modules()
TOL = 1e-4
# TINY's run settings without its model dims (an imported model's come from config.json); the
# context long enough for 32 generated tokens
TINY = [k for k in TINY_WITH_DIMS if not k.startswith("job.model.")]
JOB = ["job=gemma3_tiny", "job.model.context_length=64"]
SMALL = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=64)
# transformers config arguments of each variant: windows of 4 keys cut the 24-token rows
VARIANTS: dict[str, Callable[[], Any]] = {
    # Gemma 3 4B's shape in small: every third layer global (a fifth layer after the last period),
    # linear rope scaling on the global layers, query_pre_attn_scalar apart from head_dim, tied
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=5, sliding_window=4, sliding_window_pattern=3, query_pre_attn_scalar=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}),
    # Gemma 2's final soft-capping, alternating layers, attention biases, untied, the older rope fields
    "final_softcap_biases_untied": lambda: transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=4, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=3.0, attention_bias=True, tie_word_embeddings=False, rope_theta=20000.0,
        rope_local_base_freq=5000.0),
}
TOKENS = np.random.default_rng(0).integers(0, 320, (2, 24))


def spec_for(*overrides: str) -> Any:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return build_spec(compose(CONFIG_NAME, overrides=list(overrides)), list(overrides))


def save(model_dir: Path, config: Any, std: float = 0.3) -> Any:
    """A transformers model of `config` with every weight random, the norms' and biases' too
    (transformers starts them at zero), saved to `model_dir`."""
    config.initializer_range = std
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(model_dir)
    return model


def hf_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def close(ours: np.ndarray, theirs: np.ndarray) -> bool:
    return float(np.abs(ours - theirs).max()) < TOL * max(1.0, float(np.abs(theirs).max()) / 10)


# --------------------------------------------------------------------------------------------- transformers parity


# each variant once, one scanned and one unrolled (scanned and unrolled agree: the cache test below)
@pytest.mark.parametrize("name,scan", [("gemma3", True), ("final_softcap_biases_untied", False)])
def test_import_gives_transformers_logits_and_export_round_trips(tmp_path: Path, name: str, scan: bool) -> None:
    model = save(tmp_path / "hf", VARIANTS[name]())
    spec = spec_for(*TINY, *JOB, f"job.model.scan_layers={str(scan).lower()}", f"run.init_from=hf:{tmp_path / 'hf'}",
                    f"run.dir={tmp_path / 'run'}")
    assert spec.job.model.family == "gemma" and spec.job.model.hf.architecture == "Gemma3ForCausalLM"
    job = JOBS.get("lm")(spec)
    job.load()  # a fresh run, initialised from the Hugging Face model
    ours = np.asarray(job.model.apply({"params": job.state.params}, jnp.asarray(TOKENS)))
    theirs = hf_logits(model, TOKENS)
    assert close(ours, theirs), np.abs(ours - theirs).max()

    job.save()  # a runner checkpoint of those parameters -> export -> transformers
    report = export(tmp_path / "run", tmp_path / "out")
    job.close()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                                     attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(loaded).__name__ == report["architecture"] == "Gemma3ForCausalLM"
    assert close(hf_logits(loaded.eval(), TOKENS), ours)
    original = model.config.to_dict()
    again = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters", "attention_bias",
                "final_logit_softcapping", "attn_logit_softcapping", "tie_word_embeddings", "hidden_activation"):
        assert again[key] == original[key], key

    # export -> import: bitwise the same parameters
    again_spec = spec_for(*TINY, *JOB, f"job.model.scan_layers={str(scan).lower()}",
                          f"run.init_from=hf:{tmp_path / 'out'}", f"run.dir={tmp_path / 'again'}")
    reimported = JOBS.get("lm")(again_spec)
    reimported.load()
    for a, b in zip(jax.tree.leaves(reimported.state.params), jax.tree.leaves(job.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reimported.close()


def imported(spec: Any) -> tuple[GemmaConfig, Any, dict]:
    family = family_for(spec)
    config = family.config(spec.job.model)
    module = family.module(config)
    abstract = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    return config, module, import_hf_params(spec, config, abstract)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_generation_equals_transformers(tmp_path: Path, name: str) -> None:
    """32 greedy tokens through the KV cache, past the 4-key window: transformers' generate's."""
    model = save(tmp_path / "hf", VARIANTS[name]())
    _, module, params = imported(spec_for(*TINY, *JOB, f"run.init_from=hf:{tmp_path / 'hf'}"))
    assert_greedy_as_transformers(module, params, model)


# --------------------------------------------------------------------------------------------- config.json fields


def test_every_field_of_gemma3_text_config_has_a_rule_and_its_defaults_are_transformers() -> None:
    fields = transformers.Gemma3TextConfig().to_dict()
    undeclared = sorted(k for k in fields if k not in gemma_hf.RULES and k not in hf.GENERIC_RULES)
    assert not undeclared, f"config fields without a rule: {undeclared}"
    reference = transformers.Gemma3TextConfig
    for key, value in gemma_hf.DEFAULTS.items():
        if value is not None:
            assert getattr(reference, key) == value, (key, getattr(reference, key), value)
    assert gemma_hf.DEFAULT_THETA == {"full_attention": reference.default_theta["global"],
                                      "sliding_attention": reference.default_theta["local"]}


def test_a_near_empty_config_json_reads_as_transformers_reads_it() -> None:
    """transformers' defaults for what config.json leaves out: 26 layers, every sixth global, a
    4096-key window, rotary bases 1e6 and 1e4, query_pre_attn_scalar 256, tied."""
    spec = spec_for(*TINY, *JOB)
    got = gemma_hf.settings("hf:x", {"model_type": "gemma3_text"}, spec.job.model)
    reference = transformers.Gemma3TextConfig()
    assert got["window.global_every"] == 6 and got["window.size"] == reference.sliding_window
    assert got["n_layers"] == reference.num_hidden_layers and got["head_dim"] == reference.head_dim
    assert (got["rope.theta"], got["window.local_rope_theta"], got["rope.scaling"]) == (1e6, 1e4, "none")
    assert got["query_pre_attn_scalar"] == 256 and got["tie_embeddings"] and got["qk_norm"]
    assert (got["softcap.attention"], got["softcap.final"]) == (0.0, 0.0)
    # the hub's Gemma 3 1B config.json: the older rope fields and sliding_window_pattern, read as transformers does
    hub = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 26,
           "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000,
           "rope_scaling": None, "cache_implementation": "hybrid", "eos_token_id": [1, 106], "torch_dtype": "bfloat16"}
    got = gemma_hf.settings("hf:x", hub, spec.job.model)
    assert (got["window.size"], got["window.global_every"], got["hf.eos_token_id"]) == (512, 6, [1, 106])
    types = transformers.Gemma3TextConfig(**{k: v for k, v in hub.items() if k not in ("model_type", "torch_dtype")})
    assert gemma_hf.layer_types(hub) == types.layer_types


@pytest.mark.parametrize("window, every", [(0, 0), (4, 0), (4, 3), (4, 2)])
def test_every_layer_pattern_exports_to_a_config_transformers_takes_and_reads_back(window: int, every: int) -> None:
    """No window, every layer windowed, a period with a tail, every layer global: the exported
    config.json is one transformers' Gemma3TextConfig accepts, with the same layer types, and it
    reads back as the same job.model.window."""
    overrides = [f"job.model.window.size={window}", f"job.model.window.global_every={every}"]
    if not window:
        overrides.append("job.model.window.local_rope_theta=0")
    if window and not every:  # every layer windowed: the global base (the job's 1e6) would reach none
        overrides.append("job.model.rope.theta=10000")
    spec = spec_for("job=gemma3_tiny", "job.model.n_layers=5", *overrides)
    config = GemmaFamily.config(spec.job.model)
    exported = gemma_hf.hf_config(config)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in exported.items() if k not in ("architectures",
                                                                                           "model_type")})
    assert theirs.layer_types == exported["layer_types"]
    assert [t == "full_attention" for t in theirs.layer_types] == [config.is_global(i) for i in range(5)]
    back = gemma_hf.settings("hf:x", json.loads(json.dumps(theirs.to_dict())), spec.job.model)
    same_layers = dataclasses.replace(config, global_every=back["window.global_every"])
    assert back["window.size"] == window and [same_layers.is_global(i) for i in range(5)] == \
        [config.is_global(i) for i in range(5)]


def _config_dir(where: Path, edit: Callable[[dict], None]) -> Path:
    """A model directory whose config.json is a small Gemma3TextConfig's, edited (the weights are
    not read: a refusal comes first)."""
    data = transformers.Gemma3TextConfig(**SMALL, num_hidden_layers=4, sliding_window=4,
                                         sliding_window_pattern=2).to_dict()
    data["architectures"] = ["Gemma3ForCausalLM"]
    edit(data)
    where.mkdir()
    (where / "config.json").write_text(json.dumps(data))
    (where / hf.SINGLE_FILE).write_bytes(b"")
    return where


REFUSED: dict[str, tuple[Callable[[dict], None], str]] = {
    "irregular_layer_types": (lambda c: c.update(layer_types=["sliding_attention", "full_attention",
                                                              "full_attention", "sliding_attention"]), "layer_types"),
    "unknown_layer_type": (lambda c: c.update(layer_types=["chunked_attention"] * 4), "layer_types"),
    "windowed_layers_without_window": (lambda c: c.update(sliding_window=None), "sliding_window"),
    "scaled_local_rope": (lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
                          "rope_parameters"),
    "yarn_global_rope": (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn", factor=4.0),
                         "rope_parameters"),
    "partial_rotary": (lambda c: c["rope_parameters"]["full_attention"].update(partial_rotary_factor=0.5),
                       "rope_parameters"),
    "bidirectional": (lambda c: c.update(use_bidirectional_attention=True), "use_bidirectional_attention"),
    # transformers' Gemma3ForCausalLM carries it and does not apply it: neither reading is safe
    "attention_softcapping": (lambda c: c.update(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    "multimodal_architecture": (lambda c: c.update(architectures=["Gemma3ForConditionalGeneration"]),
                                "architectures"),
    "unknown_field": (lambda c: c.update(altup_num_inputs=4), "altup_num_inputs"),
    "unknown_activation": (lambda c: c.update(hidden_activation="mish"), "hidden_activation"),
    "quantized": (lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_field_runner_cannot_honour_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    edit, field = REFUSED[name]
    where = _config_dir(tmp_path / "hf", edit)
    with pytest.raises(hf.HFConfigError) as info:
        spec_for(*TINY, *JOB, f"run.init_from=hf:{where}")
    assert info.value.field == field
    message = str(info.value)
    assert f"{field}=" in message and "runner supports" in message and "Fix:" in message


def test_model_settings_the_family_cannot_honour_are_refused_naming_the_key() -> None:
    for override, key in (("job.model.qk_norm=false", "job.model.qk_norm"),
                          ("job.model.rope.scaling=yarn", "job.model.rope.scaling"),
                          ("job.model.mlp_bias=true", "job.model.mlp_bias"),
                          ("job.model.dropout=0.1", "job.model.dropout"),
                          ("job.model.moe.n_experts=4", "job.model.moe.n_experts"),
                          ("job.model.mtp.depth=1", "job.model.mtp.depth"),
                          ("job.model.hf.architecture=LlamaForCausalLM", "job.model.hf.architecture"),
                          ("job.model.query_pre_attn_scalar=12.5", "job.model.query_pre_attn_scalar"),
                          ("job.model.window.global_every=1", "job.model.window.global_every")):
        with pytest.raises(ConfigError) as info:
            spec_for("job=gemma3_tiny", override)
        assert info.value.key == key, (override, info.value.key)
    spec = spec_for("job=gemma3_tiny", "job.model.softcap.attention=50")
    config = GemmaFamily.config(spec.job.model)
    for attention in ("cudnn", "splash"):
        with pytest.raises(ConfigError) as info:
            GemmaFamily.for_platform(dataclasses.replace(config, attention=attention), "gpu")
        assert info.value.key == "job.model.softcap.attention" and attention in str(info.value)
    with pytest.raises(ConfigError) as info:  # auto on a GPU in bfloat16 is cuDNN
        GemmaFamily.for_platform(dataclasses.replace(config, compute_dtype="bfloat16"), "gpu")
    assert info.value.key == "job.model.softcap.attention"
    with pytest.raises(ConfigError) as info:
        GemmaFamily.for_platform(dataclasses.replace(config, attention="xla", context_parallel="ring"), "gpu")
    assert info.value.key == "job.model.softcap.attention"
    assert model_config(spec).attention == "xla"  # on this CPU: honoured by runner's own XLA path
    with pytest.raises(ConfigError) as info:  # trained, but not exported: transformers' class does not compute it
        gemma_hf.GemmaHF.config(config)
    assert info.value.key == "job.model.softcap.attention" and "mode=eval" in str(info.value)
    with pytest.raises(ConfigError) as info:
        GemmaFamily.for_platform(dataclasses.replace(config, pipeline_stages=2), "cpu")
    assert info.value.key == "mesh.stage"


# --------------------------------------------------------------------------------------------- the model itself


def tiny(scan: bool, **kw: Any) -> GemmaConfig:
    base = dict(vocab_size=61, context_length=64, d_model=32, n_layers=5, n_heads=4, n_kv_heads=2, head_dim=8,
                d_ff=40, window_size=6, global_every=3, query_pre_attn_scalar=16, scan_layers=scan)
    return GemmaConfig(**{**base, **kw})


def random_params(model: Gemma, seed: int = 0) -> dict:
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.2, s.shape), s.dtype), shapes)


@pytest.mark.parametrize("scan,softcap", [(True, 0.0), (False, 2.0)])
def test_packed_documents_give_each_documents_logits_alone_through_the_window(scan: bool, softcap: float) -> None:
    """Three documents longer than the 6-key window in one row (segment ids, positions restarting
    at each): each document's logits are its own alone; without the segments they are not."""
    model = Gemma(tiny(scan, attn_softcap=softcap, final_softcap=softcap and 4.0))
    params = random_params(model)
    lengths = [17, 9, 22]
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 61, n) for n in lengths]
    row = jnp.asarray(np.concatenate(docs))[None]
    segments = jnp.asarray(np.repeat(np.arange(1, 4), lengths))[None]
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]))[None]
    packed = model.apply({"params": params}, row, segment_ids=segments, positions=positions)
    start = 0
    for doc in docs:
        alone = model.apply({"params": params}, jnp.asarray(doc)[None])
        np.testing.assert_allclose(packed[:, start:start + len(doc)], alone, atol=1e-5)
        start += len(doc)
    unpacked = model.apply({"params": params}, row)
    assert np.abs(unpacked[:, lengths[0]:] - packed[:, lengths[0]:]).max() > 1e-2


@pytest.mark.parametrize("window", [0, 5])
def test_soft_capped_attention_is_transformers_eager_attention(window: int) -> None:
    """runner's own XLA path (soft-capping needs the raw scores) against transformers' eager
    attention with softcap (what Gemma 2 calls), grouped heads, causal, through a window."""
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    from runner.models.gemma.model import causal_mask, scores_attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(0, 1.5, (2, 12, heads, 8)).astype(np.float32) for heads in (4, 2, 2))
    ours = scores_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal_mask(12, window, None), 0.25, 3.0)
    allowed = np.asarray(causal_mask(12, window, None))[:, None]  # (1, 1, T, T)
    additive = torch.tensor(np.where(allowed, 0.0, -np.inf), dtype=torch.float32)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    theirs, _ = eager_attention_forward(module, *(torch.tensor(a).transpose(1, 2) for a in (q, k, v)), additive,
                                        scaling=0.25, softcap=3.0)
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-5)
    uncapped = scores_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal_mask(12, window, None), 0.25,
                                0.0)
    assert np.abs(np.asarray(uncapped) - theirs.numpy()).max() > 1e-3  # the cap changes these scores


@pytest.mark.parametrize("softcap, every", [(2.0, 3), (0.0, 7)])
def test_scanned_and_unrolled_agree_and_a_cache_decodes_the_same_logits(softcap: float, every: int) -> None:
    """Periods and a tail scanned (or, global_every past n_layers, the tail alone), or every layer
    unrolled: the same logits; a prompt then one token at a time through the cache (windowed layers
    masking what fell out of reach): the same again."""
    from runner.models.gemma.hf import block_path

    scanned = Gemma(tiny(True, attn_softcap=softcap, global_every=every))
    params = random_params(scanned)
    unrolled = {k: v for k, v in params.items() if k not in ("blocks", "tail_blocks")}
    for i in range(scanned.cfg.n_layers):
        path, part = block_path(scanned.cfg, i)
        node = params
        for key in path.split("/"):
            node = node[key]
        unrolled[f"block_{i}"] = jax.tree.map(lambda x, part=part: x[part], node)
    tokens = jax.random.randint(jax.random.key(1), (3, 16), 0, 61)
    full = scanned.apply({"params": params}, tokens)
    unrolled_model = Gemma(tiny(False, attn_softcap=softcap, global_every=every))
    np.testing.assert_allclose(unrolled_model.apply({"params": unrolled}, tokens), full, atol=1e-5)
    logits, cache = scanned.apply({"params": params}, tokens[:, :5], cache=scanned.init_cache(3, 64),
                                  index=jnp.zeros(3, jnp.int32))
    parts = [logits]
    for t in range(5, 16):
        logits, cache = scanned.apply({"params": params}, tokens[:, t:t + 1], cache=cache, index=jnp.full(3, t))
        parts.append(logits)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, atol=1e-5)
    assert cache["key"].shape == (5, 3, 64, 2, 8)


@pytest.mark.parametrize("remat", ["full"])  # each layer of a period on its own; auto (dots) saves more
def test_a_scanned_stack_rematerialised_layer_by_layer_gives_the_unrolled_gradients(remat: str) -> None:
    """Each layer of a period rematerialised on its own (auto: dots when scanned): the loss's
    gradients are the unrolled, unrematerialised model's, leaf for leaf."""
    from runner.models.gemma.hf import block_path

    scanned = Gemma(tiny(True, remat=remat))
    params = random_params(scanned)
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 61)
    targets = jnp.roll(tokens, -1, axis=1)

    def loss(model: Gemma, p: dict) -> jax.Array:
        return jnp.mean(model.apply({"params": p}, tokens, targets=targets)[0])

    grads = jax.grad(functools.partial(loss, scanned))(params)
    unrolled = {k: v for k, v in params.items() if k not in ("blocks", "tail_blocks")}
    for i in range(scanned.cfg.n_layers):
        path, part = block_path(scanned.cfg, i)
        node = params
        for key in path.split("/"):
            node = node[key]
        unrolled[f"block_{i}"] = jax.tree.map(lambda x, part=part: x[part], node)
    want = jax.grad(functools.partial(loss, Gemma(tiny(False, remat="none"))))(unrolled)
    for i in range(scanned.cfg.n_layers):
        path, part = block_path(scanned.cfg, i)
        node = grads
        for key in path.split("/"):
            node = node[key]
        for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x, part=part: x[part], node)),
                        jax.tree.leaves(want[f"block_{i}"]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads["embed"]["embedding"], want["embed"]["embedding"], rtol=1e-4, atol=1e-6)


def test_the_window_and_the_layer_kinds_change_what_a_layer_sees() -> None:
    """A key further back than the window moves a global layer's output but not a windowed one's;
    the two kinds rotate by their own bases."""
    from runner.models.gemma.model import Block, layer_frequencies

    cfg = tiny(False, n_layers=1, local_rope_theta=100.0)
    x = jax.random.normal(jax.random.key(0), (1, 12, 32))
    moved = x.at[0, 0].add(5.0)  # the first token: 11 positions before the last, beyond the 6-key window
    positions = jnp.arange(12)[None]
    for is_global in (True, False):
        block = Block(cfg, is_global)
        params = block.init(jax.random.key(1), x, positions)
        last = [block.apply(params, h, positions)[0][0, -1] for h in (x, moved)]
        assert (float(jnp.abs(last[0] - last[1]).max()) > 1e-4) == is_global
    assert not np.allclose(layer_frequencies(cfg, True), layer_frequencies(cfg, False))
    scaled = dataclasses.replace(cfg, rope_scaling="linear", rope_factor=8.0)
    np.testing.assert_allclose(layer_frequencies(scaled, True), layer_frequencies(cfg, True) / 8, rtol=1e-6)
    np.testing.assert_array_equal(layer_frequencies(scaled, False), layer_frequencies(cfg, False))


def test_final_soft_capping_caps_the_logits_and_the_tiled_loss_equals_the_whole() -> None:
    capped = Gemma(tiny(True, final_softcap=2.0))
    params = random_params(capped)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 61)
    raw = Gemma(tiny(True)).apply({"params": params}, tokens)
    logits = capped.apply({"params": params}, tokens)
    np.testing.assert_allclose(logits, 2.0 * np.tanh(np.asarray(raw) / 2.0), atol=1e-6)
    assert float(jnp.abs(logits).max()) <= 2.0 < float(jnp.abs(raw).max())
    targets = jnp.roll(tokens, -1, axis=1)
    whole = capped.apply({"params": params}, tokens, targets=targets)
    tiled = Gemma(tiny(True, final_softcap=2.0, loss_tiles=4)).apply({"params": params}, tokens, targets=targets)
    np.testing.assert_allclose(tiled[0], whole[0], rtol=1e-6)
    np.testing.assert_array_equal(tiled[1], whole[1])
    import optax

    np.testing.assert_allclose(whole[0], optax.softmax_cross_entropy_with_integer_labels(logits, targets), rtol=1e-6)


# --------------------------------------------------------------------------------------------- the jobs

GEMMA3_4B = 3_880_263_168  # Gemma 3 4B's text model (the 4.3B total has the SigLIP vision tower besides)


def test_parameter_counts_are_the_modules_and_gemma3_4b_is_the_published_one() -> None:
    for job in ("gemma3_tiny", "gemma3_4b"):
        spec = spec_for(f"job={job}")
        family = family_for(spec)
        config = family.config(spec.job.model)
        shapes = jax.eval_shape(family.module(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        counted = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes)["params"]))
        assert family.param_count(config) == counted, job
    # transformers' own Gemma3ForCausalLM of the same config, on the meta device (no memory)
    exported = gemma_hf.hf_config(config)
    text = transformers.Gemma3TextConfig(**{k: v for k, v in exported.items() if k not in ("architectures",
                                                                                          "model_type")})
    with torch.device("meta"):
        theirs = transformers.Gemma3ForCausalLM(text)
    assert sum(p.numel() for p in theirs.parameters()) == counted == GEMMA3_4B  # tied: the head counted once
    assert text.layer_types.count("full_attention") == 5 and text.layer_types[5] == "full_attention"
    assert text.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}


def test_flops_count_a_windowed_layers_keys_not_the_whole_row() -> None:
    config = family_for(spec_for("job=gemma3_4b")).config(spec_for("job=gemma3_4b").job.model)
    family = family_for(spec_for("job=gemma3_4b"))
    assert attended_keys(config, 8192) == 5 * 8192 + 29 * 1024  # 5 global layers, 29 windowed
    assert attended_keys(config, 512) == 34 * 512  # a row shorter than the window: every key
    everything = dataclasses.replace(config, window_size=0)
    attention = 12 * 8 * 256 * (34 * 8192 - attended_keys(config, 8192))
    assert family.flops_per_token(everything, 8192) - family.flops_per_token(config, 8192) == attention


@pytest.mark.deep
def test_gemma3_tiny_learns_and_resumes_bit_exact_after_sigkill(tmp_path: Path) -> None:
    """docs/models.md's tiny job on the embedded corpus through `python -m runner`: the loss falls
    over its first 24 steps; killed at step 13 (checkpoints every 8) and rerun, the run is the
    uninterrupted one's, parameters bitwise and every step's loss exactly."""
    from tests.train.test_restore import losses, params_of

    base = ["job=gemma3_tiny", "train.steps=24", "checkpoint.every_steps=8", "eval.every=0", "logging.wandb=disabled",
            "train.log_every=1"]
    reference = run_runner([*base, "run.dir=ref"], tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    learned = losses(tmp_path / "ref")
    assert np.mean([learned[s] for s in range(20, 25)]) < learned[1] - 1.0, learned
    killed = run_runner([*base, "run.dir=run"], tmp_path, RUNNER_FAULT="kill_at_step:13")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    again = run_runner([*base, "run.dir=run"], tmp_path)
    assert again.returncode == 0 and "resumed from step 8 " in again.stdout, again.stderr[-3000:]
    for a, b in zip(params_of(tmp_path / "run", 24), params_of(tmp_path / "ref", 24), strict=True):
        np.testing.assert_array_equal(a, b)
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    assert sorted(losses(tmp_path / "run")) == list(range(1, 25))
