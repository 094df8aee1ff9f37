"""Mixtral and Qwen3-MoE in and out, against transformers itself (PyTorch on CPU, models built from
configs with random weights large enough that the routing matters, no downloads): import ->
runner's logits equal transformers', on plain and packed rows; a runner checkpoint -> export ->
transformers loads every tensor and gives runner's logits; export -> import is bitwise; greedy
decoding equals transformers'; what no architecture holds is refused, naming the key."""

from __future__ import annotations

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

from runner.errors import ConfigError
from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.main.export import export
from runner.models import family_for, import_hf_params
from runner.models.hf import mapping as hf
from runner.models.llama import hf as llama_hf
from runner.spec import register_schema
from runner.train.job import JOBS, load_job_modules
from tests.conftest import TINY as TINY_WITH_DIMS
from tests.models.test_hf import assert_greedy_as_transformers, perturbed_export

register_schema()
load_job_modules()
TOL = 1e-4
STD = 0.3  # the initializer's: router logits of std ~1.7, so tokens go to different experts
# TINY's run settings without its model dims (an imported model's come from config.json), and a
# llama job long enough for 32 generated tokens
TINY = [k for k in TINY_WITH_DIMS if not k.startswith("job.model.")]
JOB = ["job=llama_tiny", "job.model.context_length=64"]
MOE = dict(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)

VARIANTS: dict[str, Callable[[], Any]] = {
    "mixtral": lambda: transformers.MixtralConfig(**MOE, num_hidden_layers=2, intermediate_size=24,
                                                  num_local_experts=4, router_aux_loss_coef=0.02),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**MOE, num_hidden_layers=2, intermediate_size=48,
                                                     moe_intermediate_size=24, num_experts=4, norm_topk_prob=True),
    "qwen3_moe_dense_first": lambda: transformers.Qwen3MoeConfig(
        **MOE, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        norm_topk_prob=False, mlp_only_layers=[0]),
    # Mixtral's sliding window, in every layer, shorter than the tokens: job.model.window.size
    "mixtral_window": lambda: transformers.MixtralConfig(**MOE, num_hidden_layers=2, intermediate_size=24,
                                                         num_local_experts=4, sliding_window=5),
}
CASES = [(name, scan) for name in VARIANTS for scan in (True, False) if scan or name != "mixtral_window"]


def spec_for(*overrides: str) -> Any:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return build_spec(compose(CONFIG_NAME, overrides=list(overrides)), list(overrides))


def save(model_dir: Path, name: str) -> Any:
    config = VARIANTS[name]()
    config.initializer_range = STD
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(model_dir)
    return model


def hf_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def experts_chosen(model: Any, tokens: np.ndarray) -> set[int]:
    """The experts transformers' routers pick first, over every layer with experts and token."""
    with torch.no_grad():
        router_logits = model(torch.tensor(tokens), output_router_logits=True).router_logits
    return {int(e) for layer in router_logits for e in layer.argmax(-1).flatten()}


def import_job(tmp_path: Path, where: Path, scan: bool) -> Any:
    return JOBS.get("lm")(spec_for(*TINY, *JOB, f"run.init_from=hf:{where}",
                                   f"job.model.scan_layers={str(scan).lower()}", f"run.dir={tmp_path / 'run'}"))


TOKENS = np.random.default_rng(0).integers(0, 320, (2, 24))


def packed_logits(job: Any) -> np.ndarray:
    """Runner's logits for one row packing TOKENS[0, :10] and TOKENS[1, :14] (segment ids, positions
    restarting at the second document)."""
    row = np.concatenate([TOKENS[0, :10], TOKENS[1, :14]])[None]
    segments = np.array([[1] * 10 + [2] * 14])
    positions = np.array([list(range(10)) + list(range(14))])
    return np.asarray(job.model.apply({"params": job.state.params}, jnp.asarray(row), segment_ids=jnp.asarray(segments),
                                      positions=jnp.asarray(positions)))


@pytest.mark.parametrize("name,scan", CASES)
def test_import_gives_transformers_logits_and_export_round_trips(tmp_path: Path, name: str, scan: bool) -> None:
    model = save(tmp_path / "hf", name)
    assert len(experts_chosen(model, TOKENS)) >= 3  # the routing matters: most experts are someone's first
    job = import_job(tmp_path, tmp_path / "hf", scan)
    job.load()  # a fresh run, initialised from the Hugging Face model
    if scan and name.endswith("dense_first"):
        assert set(job.state.params) >= {"dense_blocks", "blocks"}
    ours = np.asarray(job.model.apply({"params": job.state.params}, jnp.asarray(TOKENS)))
    assert np.abs(ours - hf_logits(model, TOKENS)).max() < TOL
    packed = packed_logits(job)  # packed documents: each routed and attended as on its own
    assert np.abs(packed[0, :10] - hf_logits(model, TOKENS[:1, :10])[0]).max() < TOL
    assert np.abs(packed[0, 10:] - hf_logits(model, TOKENS[1:, :14])[0]).max() < TOL

    job.save()  # a runner checkpoint of those parameters -> export -> transformers
    report = export(tmp_path / "run", tmp_path / "out")
    job.close()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(loaded).__name__ == type(model).__name__ == report["architecture"]
    for key in ("num_experts_per_tok", "num_local_experts", "intermediate_size", "moe_intermediate_size",
                "norm_topk_prob", "mlp_only_layers", "router_aux_loss_coef", "head_dim"):
        assert getattr(loaded.config, key, None) == getattr(model.config, key, None), key
    assert np.abs(hf_logits(loaded.eval(), TOKENS) - ours).max() < TOL

    # export -> import: bitwise the same parameters
    again = import_job(tmp_path / "again", tmp_path / "out", scan)
    again.load()
    for a, b in zip(jax.tree.leaves(again.state.params), jax.tree.leaves(job.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again.close()


def imported(spec: Any) -> tuple[Any, Any]:
    family = family_for(spec)
    config = family.config(spec.job.model)
    module = family.module(config)
    abstract = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    return module, import_hf_params(spec, config, abstract)


@pytest.mark.parametrize("name,scan", CASES)
def test_greedy_generation_equals_transformers(tmp_path: Path, name: str, scan: bool) -> None:
    model = save(tmp_path / "hf", name)
    module, params = imported(spec_for(*TINY, *JOB, f"run.init_from=hf:{tmp_path / 'hf'}",
                                       f"job.model.scan_layers={str(scan).lower()}"))
    assert_greedy_as_transformers(module, params, model)


def test_config_json_reads_into_the_moe_settings_and_hub_spellings_agree(tmp_path: Path) -> None:
    save(tmp_path / "mixtral", "mixtral")
    save(tmp_path / "qwen", "qwen3_moe_dense_first")
    job_model = spec_for(*TINY, *JOB).job.model
    mixtral = json.loads((tmp_path / "mixtral" / "config.json").read_text())
    qwen = json.loads((tmp_path / "qwen" / "config.json").read_text())
    m = llama_hf.settings("hf:x", mixtral, job_model)
    assert (m["moe.n_experts"], m["moe.top_k"], m["moe.d_ff_expert"], m["d_ff"], m["moe.normalize_top_k"],
            m["moe.first_dense_layers"], m["moe.aux_loss"], m["qk_norm"], m["rope.theta"]) == \
        (4, 2, 24, 24, True, 0, 0.02, False, 1e6)
    q = llama_hf.settings("hf:x", qwen, job_model)
    assert (q["moe.n_experts"], q["moe.d_ff_expert"], q["d_ff"], q["moe.normalize_top_k"],
            q["moe.first_dense_layers"], q["qk_norm"], q["head_dim"]) == (4, 24, 48, False, 1, True, 16)
    # the hub's spellings: Qwen3-MoE's num_experts (save_pretrained writes num_local_experts), its
    # ignored max_window_layers; transformers v4's top-level rope_theta; Mixtral's theta by default
    hub = {k: v for k, v in qwen.items() if k not in ("num_local_experts", "rope_parameters")}
    hub.update(num_experts=4, max_window_layers=3, rope_theta=10000.0, rope_scaling=None, torch_dtype="bfloat16")
    assert llama_hf.settings("hf:x", hub, job_model) == q
    assert llama_hf.settings("hf:x", {k: v for k, v in mixtral.items() if k != "rope_parameters"},
                             job_model)["rope.theta"] == 1e6


REFUSED_FIELDS: dict[str, tuple[str, Callable[[dict], None], str]] = {
    "qwen3_moe_dense_layers_not_leading": ("qwen3_moe_dense_first", lambda c: c.update(mlp_only_layers=[1]),
                                          "mlp_only_layers"),
    "qwen3_moe_every_layer_dense": ("qwen3_moe_dense_first", lambda c: c.update(mlp_only_layers=[0, 1, 2]),
                                    "mlp_only_layers"),
    "qwen3_moe_sparse_step": ("qwen3_moe", lambda c: c.update(decoder_sparse_step=2), "decoder_sparse_step"),
    "qwen3_moe_window_in_some_layers": ("qwen3_moe", lambda c: c.update(
        use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
        "sliding_window"),
    "mixtral_jitter": ("mixtral", lambda c: c.update(router_jitter_noise=0.1), "router_jitter_noise"),
    "mixtral_no_experts": ("mixtral", lambda c: c.update(num_local_experts=0), "num_local_experts"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_FIELDS))
def test_a_config_field_runner_does_not_implement_is_refused_naming_it(tmp_path: Path, case: str) -> None:
    name, edit, field = REFUSED_FIELDS[case]
    config = VARIANTS[name]().to_dict()
    edit(config)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / hf.SINGLE_FILE).write_bytes(b"")  # refused before the weights are read
    with pytest.raises(hf.HFConfigError) as info:
        spec_for(*TINY, *JOB, f"run.init_from=hf:{tmp_path / 'hf'}")
    assert info.value.field == field and f"{field}=" in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize("config_class", [transformers.Qwen2MoeConfig])  # deepseek_v3: its own family
def test_moe_architectures_runner_does_not_implement_are_refused_naming_the_model_type(tmp_path: Path,
                                                                                      config_class: Any) -> None:
    config_class(hidden_size=32, num_hidden_layers=2, num_attention_heads=4).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / hf.SINGLE_FILE).write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        spec_for(*TINY, *JOB, f"run.init_from=hf:{tmp_path / 'hf'}")
    model_type = config_class.model_type
    assert info.value.key == "run.init_from" and f"model_type={model_type!r}" in str(info.value)
    assert "not implement" in str(info.value) and "mixtral (llama)" in str(info.value)
    assert "deepseek_v3 (deepseek)" in str(info.value) and "gemma3_text (gemma)" in str(info.value)


MOE_RUN = [*TINY, *JOB, "job.model.d_model=32", "job.model.n_heads=4", "job.model.n_kv_heads=2", "job.model.head_dim=8",
           "job.model.d_ff=48", "job.model.moe.n_experts=4", "job.model.moe.d_ff_expert=24"]


def test_export_refuses_what_mixtral_and_qwen3_moe_cannot_hold() -> None:
    """Expert settings runner trains for other architectures (shared experts, sigmoid scores, a
    selection bias, leading dense layers without QK-norm) train, and are refused at the export
    naming the key;
    attention settings no MoE architecture holds, or a named architecture that cannot hold the
    model, are refused when the run starts."""
    for extra, key in ((["job.model.moe.n_shared_experts=1"], "job.model.moe.n_shared_experts"),
                       (["job.model.moe.score=sigmoid"], "job.model.moe.score"),
                       (["job.model.moe.first_dense_layers=1"], "job.model.moe.first_dense_layers"),
                       (["job.model.moe.normalize_top_k=false"], "job.model.moe.normalize_top_k"),
                       (["job.model.moe.bias_update_rate=0.001"], "job.model.moe.bias_update_rate"),
                       (["job.model.qk_norm=true", "job.model.moe.n_shared_experts=2"],
                        "job.model.moe.n_shared_experts")):
        spec = spec_for(*MOE_RUN, *extra)  # the run starts
        config = family_for(spec).config(spec.job.model)
        for export_step in (llama_hf.hf_config, llama_hf.layout):
            with pytest.raises(ConfigError) as info:
                export_step(config)
            assert info.value.key == key and "Fix:" in str(info.value), str(info.value)
    for extra, key in ((["job.model.qkv_bias=true"], "job.model.qkv_bias"),
                       (["job.model.moe.n_shared_experts=1", "job.model.hf.architecture=MixtralForCausalLM"],
                        "job.model.hf.architecture"),
                       (["job.model.hf.architecture=Qwen3ForCausalLM", "job.model.qk_norm=true"],
                        "job.model.hf.architecture")):
        with pytest.raises(ConfigError) as info:
            spec_for(*MOE_RUN, *extra)
        assert info.value.key == key, str(info.value)
    with pytest.raises(ConfigError, match="job.model.hf.architecture"):  # a dense model as an MoE architecture
        spec_for(*TINY, *JOB, "job.model.hf.architecture=MixtralForCausalLM")


@pytest.mark.parametrize("extra,architecture", [
    (["job.model.n_layers=2"], "MixtralForCausalLM"),
    (["job.model.qk_norm=true", "job.model.moe.first_dense_layers=1", "job.model.n_layers=3",
      "job.model.moe.normalize_top_k=false", "job.model.qkv_bias=true", "job.model.scan_layers=true"],
     "Qwen3MoeForCausalLM")])
def test_a_runner_trained_moe_exports_as_the_architecture_its_settings_call_for(tmp_path: Path, extra: list[str],
                                                                                architecture: str) -> None:
    spec = spec_for(*MOE_RUN, *extra, f"run.dir={tmp_path / 'run'}")
    ours, loaded, info, report = perturbed_export(spec, tmp_path, 0.2, TOKENS)  # routers off their initial values
    assert report["architecture"] == type(loaded).__name__ == architecture
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert len(experts_chosen(loaded.eval(), TOKENS)) >= 3
    assert np.abs(hf_logits(loaded, TOKENS) - ours).max() < TOL
