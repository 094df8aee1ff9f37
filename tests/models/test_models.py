"""Model families: every job's analytic parameter count against the model's own shapes (and the
published figures), the llama family's variants (grouped-query attention, QK-norm, biases, tied
and untied, scanned and unrolled, Llama 3 rotary scaling), decoding with a cache, key/value heads
on a tensor axis they don't divide, and a user's family by import path."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from runner.errors import ConfigError
from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.models import family_for
from runner.models.llama.model import Llama, LlamaConfig, axis_rules, rope_frequencies
from runner.spec import register_schema
from runner.train.job import load_job_modules
from tests.conftest import TINY, read_metrics, run_runner

register_schema()
load_job_modules()

# What the model cards say (Llama 3.2 1B: 1.24B; Llama 3 8B: 8.03B; Llama 3 70B: 70.6B; Qwen3-0.6B:
# 0.6B, 0.44B without embeddings), to the parameter.
PUBLISHED = {"llama3_1b": 1_235_814_400, "llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496,
             "qwen3_0_6b": 596_049_920}
JOBS = ["gpt_tiny", "gpt_10m", "gpt_small", "gpt_medium", "llama_tiny", "llama_150m", *PUBLISHED]


def spec_for(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return build_spec(compose(CONFIG_NAME, overrides=list(overrides)), list(overrides))


@pytest.mark.parametrize("job", JOBS)
def test_analytic_parameter_count_equals_the_models_shapes(job: str) -> None:
    spec = spec_for(f"job={job}")
    family = family_for(spec)
    config = family.config(spec.job.model)
    shapes = jax.eval_shape(family.module(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes)["params"]))
    assert family.param_count(config) == counted
    if job in PUBLISHED:
        assert counted == PUBLISHED[job]
    assert family.flops_per_token(config, spec.train.seq_len) > 6 * counted * 0.5


VARIANTS = {
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mqa_qk_norm": dict(n_heads=4, n_kv_heads=1, qk_norm=True),
    "bias_untied": dict(n_heads=4, n_kv_heads=4, qkv_bias=True, tie_embeddings=False),
    "llama3_rope": dict(n_heads=4, n_kv_heads=2, rope_scaling="llama3", rope_factor=4.0, rope_original_context=16),
    "all_biases_gelu_linear_rope": dict(n_heads=4, n_kv_heads=2, qkv_bias=True, out_bias=True, mlp_bias=True,
                                        activation="gelu", rope_scaling="linear", rope_factor=2.0),
    "yarn_rope": dict(n_heads=4, n_kv_heads=2, rope_scaling="yarn", rope_factor=4.0, rope_original_context=8),
    "sliding_window": dict(n_heads=4, n_kv_heads=2, window=4),  # Mistral v0.1's: the cache masks by it too
}


def tiny(scan: bool, **kw) -> LlamaConfig:
    base = dict(vocab_size=61, context_length=24, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=40,
                scan_layers=scan)
    return LlamaConfig(**{**base, **kw})


def random_params(model: Llama, seed: int = 0) -> dict:
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.2, s.shape), s.dtype), shapes)


def unstack(params: dict, layers: int) -> dict:
    """Scanned parameters (blocks, stacked on axis 0) as unrolled ones (block_i)."""
    out = {k: v for k, v in params.items() if k != "blocks"}
    for i in range(layers):
        out[f"block_{i}"] = jax.tree.map(lambda x: x[i], params["blocks"])
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_scanned_and_unrolled_agree_and_a_cache_decodes_the_same_logits(variant: str) -> None:
    scanned, unrolled = Llama(tiny(True, **VARIANTS[variant])), Llama(tiny(False, **VARIANTS[variant]))
    params = random_params(scanned)
    from runner.models.llama.model import param_count

    assert param_count(scanned.cfg) == sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, 61)
    full = scanned.apply({"params": params}, tokens)
    np.testing.assert_allclose(unrolled.apply({"params": unstack(params, 2)}, tokens), full, atol=1e-5)
    # the prompt at once, then one token at a time, through the cache
    logits, cache = scanned.apply({"params": params}, tokens[:, :5], cache=scanned.init_cache(3, 24),
                                  index=jnp.zeros(3, jnp.int32))
    parts = [logits]
    for t in range(5, 12):
        logits, cache = scanned.apply({"params": params}, tokens[:, t:t + 1], cache=cache, index=jnp.full(3, t))
        parts.append(logits)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, atol=1e-5)
    assert cache["key"].shape == (2, 3, 24, VARIANTS[variant]["n_kv_heads"], 12)


def test_rotary_positions_are_relative() -> None:
    """Query-key products depend on the distance between positions, not on where they are."""
    from runner.models.llama.model import apply_rope

    inv = rope_frequencies(tiny(True, rope_scaling="llama3", rope_factor=4.0, rope_original_context=16))
    q, k = jax.random.normal(jax.random.key(3), (2, 1, 5, 1, 12))
    pos = jnp.arange(5)[None]

    def scores(shift: int) -> jax.Array:
        return jnp.einsum("btnh,bsnh->bts", apply_rope(q, pos + shift, inv), apply_rope(k, pos + shift, inv))

    np.testing.assert_allclose(scores(0), scores(37), atol=1e-4)
    assert not np.allclose(scores(0), jnp.einsum("btnh,bsnh->bts", q, k), atol=1e-3)  # it does rotate


def test_llama3_scaling_slows_long_wavelengths_and_keeps_short_ones() -> None:
    plain = rope_frequencies(tiny(True, head_dim=64, rope_theta=500000.0))
    scaled = rope_frequencies(tiny(True, head_dim=64, rope_theta=500000.0, rope_scaling="llama3", rope_factor=32.0,
                                   rope_original_context=8192))
    wavelen = 2 * np.pi / plain
    np.testing.assert_allclose(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # short: unchanged
    np.testing.assert_allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 32, rtol=1e-6)  # long: / factor
    assert np.all(np.diff(scaled) <= 0)  # still ordered from fast to slow


def test_key_value_heads_shard_on_the_tensor_axis_only_when_it_divides_them() -> None:
    rules = dict(axis_rules(tiny(True, n_heads=4, n_kv_heads=2), tensor=2))
    assert rules["kv_heads"] == "tensor" and rules["heads"] == "tensor"
    assert dict(axis_rules(tiny(True, n_heads=4, n_kv_heads=1), tensor=2))["kv_heads"] is None  # replicated
    assert dict(axis_rules(tiny(True, n_heads=8, n_kv_heads=2), tensor=4))["kv_heads"] is None


def test_bad_llama_settings_name_their_key() -> None:
    with pytest.raises(ConfigError) as info:
        spec_for("job=llama_tiny", "job.model.n_kv_heads=3")
    assert info.value.key == "job.model.n_kv_heads"
    with pytest.raises(ConfigError) as info:
        spec_for("job=llama_tiny", "job.model.family=nope")
    assert info.value.key == "job.model.family" and "gpt" in str(info.value) and "llama" in str(info.value)
    with pytest.raises(ConfigError) as info:
        spec_for("job=llama_tiny", "job.model.rope.scaling=dynamic")
    assert info.value.key == "job.model.rope.scaling"
    # a key only the other family reads is refused, not ignored
    for job, key, value in (("gpt_tiny", "mlp_bias", "true"), ("gpt_tiny", "rope.theta", "5000"),
                            ("gpt_tiny", "n_kv_heads", "2"), ("llama_tiny", "dropout", "0.1"),
                            ("llama_tiny", "use_bias", "false"), ("gpt_tiny", "window.size", "16"),
                            ("llama_tiny", "mla.kv_lora_rank", "64"), ("llama_tiny", "mtp.depth", "1"),
                            ("llama_tiny", "softcap.final", "30"), ("gpt_tiny", "query_pre_attn_scalar", "64")):
        with pytest.raises(ConfigError) as info:
            spec_for(f"job={job}", f"job.model.{key}={value}")
        assert info.value.key == f"job.model.{key.split('.')[0]}" and "does not read it" in str(info.value)
    with pytest.raises(ConfigError) as info:
        spec_for("job=llama_tiny", "job.model.activation=tanh")
    assert info.value.key == "job.model.activation"
    # the window's interleaving and DeepSeek-V3's routing are other families': refused with the family that has them
    for key, value, family in (("window.global_every", "2", "gemma"), ("moe.n_group", "2", "deepseek"),
                               ("moe.routed_scaling", "2.5", "deepseek")):
        with pytest.raises(ConfigError) as info:
            spec_for("job=moe_tiny", "job.model.window.size=16", f"job.model.{key}={value}")
        assert info.value.key == f"job.model.{key}" and f"family={family}" in str(info.value)
    # a context-parallel setting with no context axis would change nothing: refused, not ignored
    for overrides in (["job.model.context_parallel=usp", "job.model.ulysses_ways=3"],
                      ["job.model.context_parallel=ring"]):
        with pytest.raises(ConfigError) as info:
            spec_for("job=llama_tiny", "mesh.context=1", *overrides)
        assert info.value.key == overrides[-1].split("=")[0] and "mesh.context=1 splits no row" in str(info.value)


@pytest.mark.deep
def test_llama_with_one_kv_head_trains_on_a_tensor_axis_and_a_users_family_trains(tmp_path) -> None:
    small = [*TINY, "train.steps=3", "eval.every=0", "checkpoint.every_steps=0"]
    mqa = run_runner([*small, "job=llama_tiny", "job.model.n_kv_heads=1", "job.model.head_dim=16",
                      "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "run.dir=mqa"], tmp_path, devices=4)
    assert mqa.returncode == 0, mqa.stderr[-3000:]
    assert all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "mqa") if "loss" in r)
    own = run_runner([*small, "job.model.family=tests.family_fixture:UnigramFamily", "run.dir=own"], tmp_path)
    assert own.returncode == 0, own.stderr[-3000:]
    assert "parameters: 320 " in own.stdout  # the family's own model (a vocabulary-sized bias)


def test_the_family_key_is_part_of_the_spec() -> None:
    spec = spec_for("job=qwen3_0_6b")
    assert spec.job.model.family == "llama" and spec.job.model.qk_norm and spec.job.model.rope.theta == 1e6
    config = family_for(spec).config(spec.job.model)
    assert dataclasses.asdict(config)["n_kv_heads"] == 8


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_remat_auto_saves_only_the_weight_matmuls_when_scanned_and_nothing_is_recomputed_unrolled(family) -> None:
    """job.model.remat=auto (the default): a scanned stack is rematerialised with the dots policy
    (its forward's jaxpr has a checkpoint whose policy is checkpoint_dots_with_no_batch_dims), an unrolled
    one not at all; gradients are those of remat=none either way."""
    from runner.models.common.decoder import REMAT_POLICIES, remat_of

    def checkpoints(jaxpr, found):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("checkpoint", "remat", "remat2"):  # jax.checkpoint, by version
                found.append(eqn.params.get("policy"))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        checkpoints(inner, found)
        return found

    for scan in (True, False):
        spec = spec_for(*TINY, f"job.model.family={family}", f"job.model.scan_layers={str(scan).lower()}")
        assert spec.job.model.remat == "auto"
        fam = family_for(spec)
        cfg = fam.config(spec.job.model)
        assert remat_of(cfg) == ("dots" if scan else "none")
        tokens = jnp.arange(32).reshape(2, 16) % 64
        model = fam.module(cfg)
        params = model.init(jax.random.PRNGKey(0), tokens)["params"]

        def loss(p, model=model):
            return jnp.mean(jnp.sin(model.apply({"params": p}, tokens)))

        found = checkpoints(jax.make_jaxpr(loss)(params).jaxpr, [])
        assert found == ([REMAT_POLICIES["dots"]] if scan else []), found
        plain = fam.module(dataclasses.replace(cfg, remat="none"))
        want = jax.grad(lambda p: jnp.mean(jnp.sin(plain.apply({"params": p}, tokens))))(params)
        for a, b in zip(jax.tree.leaves(jax.grad(loss)(params)), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
