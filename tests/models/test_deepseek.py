"""DeepSeek-V3 (the deepseek family) against transformers' DeepseekV3ForCausalLM (PyTorch on CPU, models
built from configs with random weights large enough that the routing matters, random selection
biases, no downloads): import -> runner's logits equal transformers' (multi-head latent attention with
and without a query latent, values wider and narrower than queries, interleaved and rotate-half
rotary files, YaRN with mscale_all_dim, group-limited routing, routed scaling, shared experts, leading
dense layers), on plain and packed rows; a runner checkpoint -> export -> transformers gives runner's
logits; export -> import is bitwise; greedy decoding through the latent cache equals transformers';
the MTP module exports as DeepSeek stores it and imports back; the router's group-limited choice is
transformers' gate's; every config field has a rule, and refused ones are named; the published
671B's counts. Deep tier: expert, context and stage meshes equal one device (MTP loss included); the
tiny job learns, reports its MTP loss and resumes bit-exact after SIGKILL."""

from __future__ import annotations

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

from runner.errors import ConfigError, UserError
from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.main.export import export
from runner.models import family_for, import_hf_params
from runner.models.common.layers import LOSSES, REPORTS
from runner.models.common.moe import route
from runner.models.deepseek import hf as deepseek_hf
from runner.models.deepseek.model import DeepSeek, DeepSeekConfig, DeepSeekFamily
from runner.models.hf import mapping as hf
from runner.spec import register_schema
from runner.train.job import JOBS, load_job_modules
from tests.conftest import TINY as TINY_WITH_DIMS
from tests.conftest import read_metrics, run_runner
from tests.models.test_hf import assert_greedy_as_transformers
from tests.parallel.equivalence import run_script

register_schema()
load_job_modules()
TOL = 1e-4
# TINY's run settings without its model dims (an imported model's come from config.json)
TINY = [k for k in TINY_WITH_DIMS if not k.startswith("job.model.")]
JOB = ["job=deepseek_v3_tiny", "job.model.context_length=64"]
BASE = dict(vocab_size=320, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64)

VARIANTS: dict[str, Callable[[], Any]] = {
    # DeepSeek-V3's shape: a query latent, interleaved rotary files, 8 experts in 2 groups (a token
    # picks 1), routed weights x 2.5, a shared expert, a leading dense layer; values wider than q/k
    "v3": lambda: transformers.DeepseekV3Config(
        **BASE, num_hidden_layers=3, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=16),
    # V2-Lite's shape: queries projected directly, values narrower than q/k, rotate-half files, YaRN
    # with mscale and mscale_all_dim, tied embeddings, 2 shared experts, unnormalised weights
    "lite_yarn": lambda: transformers.DeepseekV3Config(
        **BASE, num_hidden_layers=2, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_interleave=False,
        tie_word_embeddings=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 16, "mscale": 0.7,
                                                   "mscale_all_dim": 1.0}),
}
CASES = [("v3", True), ("lite_yarn", False)]  # each once (scanned and unrolled agree: the cache test)
TOKENS = np.random.default_rng(0).integers(0, 320, (2, 24))


def spec_for(*overrides: str) -> Any:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return build_spec(compose(CONFIG_NAME, overrides=list(overrides)), list(overrides))


def save(model_dir: Path, name: str, edit: Callable[[Any], None] | None = None) -> Any:
    """transformers' model of variant `name` (std 0.3: router logits that route apart), its selection
    biases random (transformers starts them at zero), saved by save_pretrained."""
    config = VARIANTS[name]()
    config.initializer_range = 0.3
    if edit is not None:
        edit(config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for key, buffer in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    model.save_pretrained(model_dir)
    return model


def hf_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def import_job(tmp_path: Path, where: Path, scan: bool, *extra: str) -> Any:
    return JOBS.get("lm")(spec_for(*TINY, *JOB, f"run.init_from=hf:{where}",
                                   f"job.model.scan_layers={str(scan).lower()}", f"run.dir={tmp_path / 'run'}", *extra))


def packed_logits(job: Any) -> np.ndarray:
    """Runner's logits for one row packing TOKENS[0, :10] and TOKENS[1, :14]."""
    row = np.concatenate([TOKENS[0, :10], TOKENS[1, :14]])[None]
    segments = np.array([[1] * 10 + [2] * 14])
    positions = np.array([list(range(10)) + list(range(14))])
    return np.asarray(job.model.apply({"params": job.state.params}, jnp.asarray(row),
                                      segment_ids=jnp.asarray(segments), positions=jnp.asarray(positions)))


@pytest.mark.parametrize("name,scan", CASES)
def test_import_gives_transformers_logits_and_export_round_trips(tmp_path: Path, name: str, scan: bool) -> None:
    model = save(tmp_path / "hf", name)
    job = import_job(tmp_path, tmp_path / "hf", scan)
    job.load()
    assert job.spec.job.model.mtp.depth == 0  # transformers' save_pretrained writes no MTP layer
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
    assert type(loaded).__name__ == report["architecture"] == "DeepseekV3ForCausalLM"
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace", "norm_topk_prob",
                "rope_interleave", "tie_word_embeddings"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    for key in ("rope_type", "rope_theta", "factor", "mscale_all_dim"):  # the rest written out explicitly
        assert loaded.config.rope_parameters.get(key) == model.config.rope_parameters.get(key), key
    assert np.abs(hf_logits(loaded.eval(), TOKENS) - ours).max() < TOL

    again = import_job(tmp_path / "again", tmp_path / "out", scan)  # export -> import: bitwise
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


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_generation_through_the_latent_cache_equals_transformers(tmp_path: Path, name: str) -> None:
    model = save(tmp_path / "hf", name)
    module, params = imported(spec_for(*TINY, *JOB, f"run.init_from=hf:{tmp_path / 'hf'}"))
    assert_greedy_as_transformers(module, params, model)


def test_mtp_exports_as_deepseek_stores_it_and_imports_back(tmp_path: Path) -> None:
    """A runner model with an MTP module and a moving selection bias: the export holds the MTP layer as
    DeepSeek's release does (layer n_layers: enorm, hnorm, eh_proj, shared_head, copies of the
    embedding and head), which transformers leaves unused while its logits are runner's; the
    exported e_score_correction_bias is the fixed bias plus the moved one; importing the export
    brings the MTP module back (mtp.depth 1), every parameter bitwise; a copy that differs from the
    embedding is refused."""
    dims = ["job.model.d_model=32", "job.model.n_layers=2", "job.model.d_ff=48", "job.model.moe.d_ff_expert=16"]
    job = JOBS.get("lm")(spec_for(*TINY, *JOB, *dims, "job.model.scan_layers=true", f"run.dir={tmp_path / 'run'}"))
    job.load()
    noise = lambda tree, key: jax.tree.map(  # noqa: E731
        lambda p: p + 0.3 * jax.random.normal(jax.random.key(key), p.shape, p.dtype), tree)
    job.state = job.state.replace(params=noise(job.state.params, 1), model_state=noise(job.state.model_state, 2))
    job.save()
    ours = np.asarray(job.model.apply(job.state.variables(), jnp.asarray(TOKENS)))
    params, state = job.state.params, job.state.model_state
    job.close()
    export(tmp_path / "run", tmp_path / "out")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and loaded.config.num_nextn_predict_layers == 1
    mtp = {k for k in info["unexpected_keys"] if k.startswith("model.layers.2.")}
    assert mtp == set(info["unexpected_keys"]) and {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
                                                    "model.layers.2.eh_proj.weight",
                                                    "model.layers.2.shared_head.head.weight",
                                                    "model.layers.2.embed_tokens.weight"} <= mtp
    assert np.abs(hf_logits(loaded.eval(), TOKENS) - ours).max() < TOL

    again = import_job(tmp_path / "again", tmp_path / "out", True)
    again.load()
    assert again.spec.job.model.mtp.depth == 1
    moved = {("blocks", "moe", "score_bias"): state["blocks"]["moe"]["router_bias"],
             ("mtp_0", "block", "moe", "score_bias"): state["mtp_0"]["block"]["moe"]["router_bias"]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(str(k.key) for k in path)
        got = again.state.params
        for key in keys:
            got = got[key]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf + moved[keys] if keys in moved else leaf))
    again.close()
    # the file's copy of the embedding in the MTP layer must be the embedding: else refused by name
    from safetensors.numpy import load_file, save_file

    tensors = load_file(tmp_path / "out" / "model.safetensors")
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.layers.2.embed_tokens.weight"] + 1.0
    save_file(tensors, tmp_path / "out" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="model.layers.2.embed_tokens.weight, a copy of what fills embed/embedding"):
        imported(spec_for(*TINY, *JOB, f"run.init_from=hf:{tmp_path / 'out'}"))


def test_group_limited_routing_is_transformers_gate() -> None:
    """16 sigmoid-scored experts in 4 groups, a token choosing 2 groups (by each group's two best
    biased scores) and 4 experts there, the weights normalised and scaled by 2.5: the experts and
    weights transformers' DeepseekV3TopkRouter picks; n_group 1 routes over every expert, as before."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, n_group=4, topk_group=2,
                                           num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True)
    gate = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_(0, 0.5)
        gate.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 16)
    with torch.no_grad():
        logits, weights, experts = gate(x)
    routing = route(jnp.asarray(logits.numpy()), 4, "sigmoid", True, bias=jnp.asarray(gate.e_score_correction_bias),
                    n_group=4, topk_group=2, scaling=2.5)
    order, theirs = np.argsort(np.asarray(routing.experts), 1), np.argsort(experts.numpy(), 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(routing.experts), order, 1),
                                  np.take_along_axis(experts.numpy(), theirs, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(routing.weights), order, 1),
                               np.take_along_axis(weights.numpy(), theirs, 1), rtol=1e-6)
    groups = np.asarray(routing.experts) // 4  # each token's experts lie in at most 2 groups
    assert max(len(set(row)) for row in groups) == 2
    free = route(jnp.asarray(logits.numpy()), 4, "sigmoid", True, bias=jnp.asarray(gate.e_score_correction_bias))
    assert max(len(set(row)) for row in np.asarray(free.experts) // 4) > 2  # without groups it would stray
    same = route(jnp.asarray(logits.numpy()), 4, "sigmoid", True, n_group=1, topk_group=1, scaling=1.0)
    plain = route(jnp.asarray(logits.numpy()), 4, "sigmoid", True)
    np.testing.assert_array_equal(np.asarray(same.weights), np.asarray(plain.weights))


def test_every_field_of_the_config_class_has_a_rule_and_the_defaults_are_transformers() -> None:
    fields = transformers.DeepseekV3Config().to_dict()
    undeclared = sorted(k for k in fields if k not in deepseek_hf.RULES and k not in hf.GENERIC_RULES)
    assert not undeclared, undeclared
    reference = transformers.DeepseekV3Config()
    for key, value in deepseek_hf.DEFAULTS.items():  # None: derived, as transformers derives it (rope)
        assert value is None or getattr(reference, key) == value, key
    # a near-empty config.json sets every structural setting, as transformers' class defaults would
    settings = deepseek_hf.settings("hf:x", {"model_type": "deepseek_v3"}, spec_for(*TINY, *JOB).job.model)
    assert settings["mla.q_lora_rank"] == 1536 and settings["moe.n_group"] == 8 and settings["moe.topk_group"] == 4
    assert settings["moe.first_dense_layers"] == 3 and settings["hf.rope_interleave"] is True
    assert settings["mtp.depth"] == 0  # no files to hold its layer


# config.json values runner does not implement (written into a saved model's file: transformers
# cannot build a model of grouped MLA heads at all)
REFUSED = {"attention_bias": True, "num_key_value_heads": 2, "scoring_func": "softmax", "moe_layer_freq": 2}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_field_runner_does_not_implement_is_refused_naming_it(tmp_path: Path, field: str) -> None:
    save(tmp_path / "hf", "lite_yarn")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, field: REFUSED[field]}))
    with pytest.raises(hf.HFConfigError) as err:
        spec_for(*TINY, *JOB, f"run.init_from=hf:{tmp_path / 'hf'}")
    assert err.value.field == field and f"{field}={REFUSED[field]!r}" in str(err.value)


def test_other_families_refuse_the_deepseek_keys_and_it_refuses_theirs() -> None:
    from runner.models.llama.model import LlamaFamily

    with pytest.raises(ConfigError) as err:
        LlamaFamily.config(spec_for(*TINY_WITH_DIMS, "job=llama_tiny", "job.model.rope.mscale_all_dim=1.0").job.model)
    assert err.value.key == "job.model.rope.mscale_all_dim"
    for key, value in (("n_kv_heads", 2), ("qk_norm", True), ("head_dim", 16), ("moe.score", "softmax")):
        with pytest.raises(ConfigError) as err:
            DeepSeekFamily.config(spec_for(*TINY_WITH_DIMS, *JOB, f"job.model.{key}={value}").job.model)
        assert err.value.key == f"job.model.{key}"


# ----------------------------------------------------------------------------- MTP


def mtp_config(**kw: Any) -> DeepSeekConfig:
    base = dict(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, d_ff=48, q_lora_rank=24,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, moe_experts=4, moe_top_k=2,
                moe_d_ff=16, moe_shared=1, moe_first_dense=1, moe_n_group=2, moe_topk_group=1, moe_routed_scaling=2.5,
                moe_dispatch="dense", mtp_depth=2, scan_layers=False)
    return DeepSeekConfig(**{**base, **kw})


def test_mtp_loss_is_sown_packed_documents_equal_each_alone_and_the_trunk_is_untouched() -> None:
    """Two MTP depths on one row packing two documents (segments, positions restarting): each
    depth's per-token losses, and which count, are each document's alone (a target counts only in
    its own document, never the row's last); the sown loss is the weight times the depths' mean;
    the main loss and the logits are the trunk's whatever the MTP modules do."""
    model = DeepSeek(mtp_config())
    stream = jax.random.randint(jax.random.key(1), (1, 25), 0, 64)
    tokens, targets = stream[:, :24], stream[:, 1:]
    variables = model.init(jax.random.key(0), tokens)
    params = nn.unbox(variables["params"])
    assert "mtp_1" in params and "moe" in params["mtp_0"]["block"]  # DeepSeek's layer 2: past the dense one

    def run(x: jax.Array, y: jax.Array, seg: jax.Array, pos: jax.Array) -> tuple[Any, dict]:
        return model.apply({"params": params}, x, targets=y, segment_ids=seg, positions=pos,
                           mutable=[LOSSES, REPORTS, "intermediates"])

    seg = jnp.asarray([[0] * 10 + [1] * 14])
    pos = jnp.asarray([list(range(10)) + list(range(14))])
    (losses, _), sown = run(tokens, targets, seg, pos)
    for part in (slice(0, 10), slice(10, 24)):
        n = part.stop - part.start
        (_, _), alone = run(tokens[:, part], targets[:, part], jnp.zeros((1, n), jnp.int32), jnp.arange(n)[None])
        for depth in (1, 2):
            packed_losses, packed_valid = sown["intermediates"][f"mtp_losses_{depth}"][0]
            alone_losses, alone_valid = alone["intermediates"][f"mtp_losses_{depth}"][0]
            np.testing.assert_array_equal(packed_valid[:, part], alone_valid)
            assert int(alone_valid.sum()) == n - depth - 1  # inside its document; not the row's last target
            np.testing.assert_allclose(np.where(alone_valid, packed_losses[:, part], 0),
                                       np.where(alone_valid, alone_losses, 0), atol=1e-5)
    means = [float(jnp.sum(l * v) / jnp.sum(v)) for l, v in (sown["intermediates"][f"mtp_losses_{d}"][0]
                                                           for d in (1, 2))]
    assert float(sown[LOSSES]["mtp"][0]) == pytest.approx(0.3 * sum(means) / 2, rel=1e-6)
    assert float(sown[REPORTS]["mtp_loss"][0]) == pytest.approx(sum(means) / 2, rel=1e-6)
    # the trunk alone: evaluation (nothing mutable) gives the same losses, and the logits are
    # those of a model without MTP modules
    plain, _ = model.apply({"params": params}, tokens, targets=targets, segment_ids=seg, positions=pos)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(losses))
    trunk = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    np.testing.assert_array_equal(np.asarray(DeepSeek(mtp_config(mtp_depth=0)).apply({"params": trunk}, tokens)),
                                  np.asarray(model.apply({"params": params}, tokens)))


def test_scanned_and_unrolled_agree_and_the_latent_cache_decodes_the_same_logits() -> None:
    scanned, unrolled = DeepSeek(mtp_config(scan_layers=True)), DeepSeek(mtp_config())
    shapes = nn.unbox(jax.eval_shape(unrolled.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.2, s.shape), s.dtype), shapes)
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, 64)
    full = unrolled.apply({"params": params}, tokens)
    stacked = {k: v for k, v in params.items() if not k.startswith("block_")}
    stacked["dense_blocks"] = jax.tree.map(lambda x: x[None], params["block_0"])
    stacked["blocks"] = jax.tree.map(lambda x: x[None], params["block_1"])
    np.testing.assert_allclose(scanned.apply({"params": stacked}, tokens), full, atol=1e-5)
    logits, cache = unrolled.apply({"params": params}, tokens[:, :5], cache=unrolled.init_cache(3, 24),
                                   index=jnp.zeros(3, jnp.int32))
    parts = [logits]
    for t in range(5, 12):
        logits, cache = unrolled.apply({"params": params}, tokens[:, t:t + 1], cache=cache, index=jnp.full(3, t))
        parts.append(logits)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, atol=1e-5)
    assert cache["key"].shape == (2, 3, 24, 1, 16) and cache["value"].shape == (2, 3, 24, 1, 4)  # the latents


# ----------------------------------------------------------------------------- counts


@pytest.mark.parametrize("job", ["deepseek_v3_tiny", "deepseek_v3_671b"])
def test_analytic_parameter_count_equals_the_models_shapes(job: str) -> None:
    spec = spec_for(f"job={job}")
    config = DeepSeekFamily.config(spec.job.model)
    shapes = jax.eval_shape(DeepSeek(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes)["params"]))
    assert DeepSeekFamily.param_count(config) == counted
    assert DeepSeekFamily.flops_per_token(config, spec.train.seq_len) > 6 * DeepSeekFamily.active_param_count(config)


def test_the_published_671b_counts_are_transformers_model_plus_its_mtp_module() -> None:
    """conf/job/deepseek_v3_671b.yaml: the main model is transformers' DeepseekV3ForCausalLM of the
    default (published) config, counted on the meta device: 671,026,404,352 parameters (DeepSeek's
    "671B"), plus the 58 routers' selection biases runner holds as parameters (transformers' are
    buffers); the MTP module is one more of its MoE decoder layers with its bias, enorm, hnorm,
    eh_proj and shared_head.norm (DeepSeek's file adds copies of the embedding and head: its "14B",
    "685B" in all); activated: the main model less the 248 experts per MoE layer a token skips
    (DeepSeek's "37B")."""
    config = DeepSeekFamily.config(spec_for("job=deepseek_v3_671b").job.model)
    reference = transformers.DeepseekV3Config()
    with torch.device("meta"):
        main = transformers.DeepseekV3ForCausalLM(reference)
    weights = sum(p.numel() for p in main.parameters())
    biases = sum(b.numel() for k, b in main.named_buffers() if k.endswith("e_score_correction_bias"))
    assert (weights, biases) == (671_026_404_352, 58 * 256)
    layer = main.model.layers[3]  # an MoE layer, as the MTP layer 61 is
    d = reference.hidden_size
    mtp = sum(p.numel() for p in layer.parameters()) + reference.n_routed_experts + 3 * d + 2 * d * d
    assert DeepSeekFamily.param_count(config) == weights + biases + mtp == 682_636_487_424
    assert mtp + 2 * reference.vocab_size * d == 13_463_426_304  # with the file's copies: 671B + 13.5B
    skipped = sum(p.numel() for p in layer.mlp.experts.parameters()) * (256 - 8) // 256
    active = weights + biases - (61 - 3) * skipped
    assert DeepSeekFamily.active_param_count(config) == active
    assert 37.5e9 < active - biases < 37.6e9


# ----------------------------------------------------------------------------- deep tier

EQUIVALENCE = """
import json, dataclasses, jax, jax.numpy as jnp, numpy as np, flax.linen as nn
from runner.parallel.mesh import make_mesh
from runner.models.common.layers import LOSSES, REPORTS, MODEL_STATE
from runner.models.deepseek.model import DeepSeek, DeepSeekConfig, DeepSeekFamily
from runner.train.steps import reports
from tests.parallel.equivalence import relative_error

tokens = jax.random.randint(jax.random.PRNGKey(3), (8, 32), 0, 64)
targets = jnp.roll(tokens, -1, axis=1)
seg = np.tile(np.array([[1] * 5 + [2] * 3 + [3] * 5 + [4] * 11 + [5] * 8, [1] * 32, [1] * 16 + [2] * 16,
                        [1] * 7 + [2] * 25]), (2, 1))
starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1) != 0, np.arange(32), 0), axis=1)
positions, seg = jnp.asarray(np.arange(32) - starts), jnp.asarray(seg)
base = DeepSeekConfig(vocab_size=64, context_length=32, d_model=32, n_layers=4, n_heads=4, d_ff=48, q_lora_rank=24,
                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, moe_experts=4,
                      moe_top_k=2, moe_d_ff=16, moe_shared=1, moe_first_dense=2, moe_n_group=2, moe_topk_group=1,
                      moe_routed_scaling=2.5, moe_bias_rate=0.01, moe_dispatch="dense", mtp_depth=1)


def step(model, variables):
    def loss(p):
        (losses, _), sown = model.apply({"params": p, MODEL_STATE: variables[MODEL_STATE]}, tokens, targets=targets,
                                        segment_ids=seg, positions=positions, mutable=[LOSSES, REPORTS, MODEL_STATE])
        extra = sum(jnp.sum(leaf) for leaf in jax.tree.leaves(sown[LOSSES]))
        return jnp.sum(losses) + 100 * extra, (losses, reports(sown[REPORTS]), sown[MODEL_STATE])
    executable = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(variables["params"]).compile()
    return executable(variables["params"]), executable.as_text()


variables = nn.unbox(DeepSeek(base).init(jax.random.PRNGKey(0), tokens))
variables = {"params": variables["params"], MODEL_STATE: variables[MODEL_STATE]}
want, _ = step(DeepSeek(base), variables)
out = {}
for axes, change in [({"data": 2, "expert": 2}, {"moe_dispatch": "ragged"}),
                     ({"expert": 2, "fsdp": 2}, {"moe_dispatch": "capacity", "moe_capacity_factor": 8.0}),
                     ({"expert": 2, "tensor": 2}, {"moe_dispatch": "ragged"}),
                     ({"expert": 2, "context": 2}, {"moe_dispatch": "ragged", "context_parallel": "allgather"}),
                     ({"context": 4}, {"context_parallel": "ring"}),
                     ({"fsdp": 2, "context": 2}, {"moe_dispatch": "ragged", "context_parallel": "ulysses"}),
                     ({"stage": 2, "expert": 2, "fsdp": 2}, {"moe_dispatch": "ragged", "pipeline_stages": 2,
                                                            "pipeline_microbatches": 4})]:
    c = dataclasses.replace(base, **change)
    shape = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, **axes}
    with jax.set_mesh(make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])), \\
            nn.logical_axis_rules(DeepSeekFamily.axis_rules(c, shape)):
        got, text = step(DeepSeek(c), variables)
    out["/".join(f"{k}{v}" for k, v in axes.items()) + "/" + change.get("context_parallel", "")] = relative_error(
        got, want)
print(json.dumps(out))
"""


@pytest.mark.deep
def test_expert_context_and_stage_meshes_give_the_one_device_loss_and_gradients(tmp_path: Path) -> None:
    """8 CPU devices: experts over mesh.expert (dropless and by capacity) beside data, fsdp and
    tensor; rows over mesh.context (allgather, ring, ulysses: MLA's padded heads through the kernels
    unchanged, the MTP targets in context order); the layers in 2 pipeline stages beside fsdp and
    expert. Against one device with the dense dispatch, packed documents, MTP and the moving
    selection bias: the loss (main and MTP), every gradient, the reports and the bias's update
    within float32 rounding."""
    out = run_script(EQUIVALENCE, tmp_path, devices=8)
    assert len(out) == 7
    for name, error in out.items():
        assert error < 1e-5, (name, error)


RUN = [*TINY_WITH_DIMS, "job=deepseek_v3_tiny", "job.model.d_model=64", "job.model.d_ff=96",
       "job.model.moe.d_ff_expert=32", "data.document_mask=true", "train.steps=24", "checkpoint.every_steps=8",
       "eval.every=0", "optimizer.lr=1e-2"]


def trained(run_dir: Path, step: int = 24) -> list[np.ndarray]:
    """A checkpoint's parameters and model state (the router biases), by plain orbax."""
    import orbax.checkpoint as ocp

    path = (run_dir / "checkpoints" / str(step) / "state").absolute()
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        state = checkpointer.restore(path, args=ocp.args.StandardRestore(
            fallback_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    assert jax.tree.leaves(state["model_state"])
    return [np.asarray(x) for x in jax.tree.leaves((state["params"], state["model_state"]))]


def losses_of(run_dir: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


@pytest.mark.deep
def test_the_tiny_job_learns_reports_its_mtp_loss_and_resumes_bit_exact_after_sigkill(tmp_path: Path) -> None:
    """deepseek_v3_tiny (narrowed), packed documents: the loss falls over 24 steps and the MTP loss is
    logged every step; a run killed at step 13 resumes from its step-8 checkpoint and ends with the
    uninterrupted run's parameters and router biases bit for bit, every step's losses equal."""
    straight = run_runner([*RUN, "run.dir=straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    loss, mtp = losses_of(tmp_path / "straight"), losses_of(tmp_path / "straight", "mtp_loss")
    assert sorted(mtp) == list(range(1, 25)) and loss[24] < loss[1] - 0.5 and mtp[24] < mtp[1]
    killed = run_runner([*RUN, "run.dir=run"], tmp_path, RUNNER_FAULT="kill_at_step:13")
    assert killed.returncode == -signal.SIGKILL
    again = run_runner([*RUN, "run.dir=run"], tmp_path)
    assert again.returncode == 0 and "resumed from step 8 " in again.stdout, again.stderr[-3000:]
    for a, b in zip(trained(tmp_path / "run"), trained(tmp_path / "straight"), strict=True):
        np.testing.assert_array_equal(a, b)
    assert losses_of(tmp_path / "run") == loss and losses_of(tmp_path / "run", "mtp_loss") == mtp
