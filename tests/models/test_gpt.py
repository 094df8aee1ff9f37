"""Tests for the GPT model: sizes, FLOPs, numerics and sharding annotations."""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from runner.models.gpt.model import GPT, LOGICAL_AXIS_RULES, GPTConfig, flops_per_token, param_count
from tests.conftest import fork_server, runner_env
from tests.forked import run

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY = GPTConfig(vocab_size=61, context_length=16, d_model=32, n_layers=2, n_heads=4)


def _abstract_variables(cfg: GPTConfig, seq_len: int = 8):
    tokens = jax.ShapeDtypeStruct((2, seq_len), jnp.int32)
    return jax.eval_shape(GPT(cfg).init, jax.random.key(0), tokens)


def _real_count(cfg: GPTConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(_abstract_variables(cfg))))


def _tokens(cfg: GPTConfig, batch: int = 2, seq_len: int = 8, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, seq_len), 0, cfg.vocab_size, jnp.int32)


# --- sizes ------------------------------------------------------------------


def test_d_ff_defaults_to_four_d_model() -> None:
    assert TINY.d_ff == 4 * TINY.d_model
    assert dataclasses.replace(TINY, d_ff=48).d_ff == 48


@pytest.mark.parametrize(
    ("d_model", "n_layers", "n_heads", "expected"),
    [(768, 12, 12, 124_439_808), (1024, 24, 16, 354_823_168)],
    ids=["gpt2-small", "gpt2-medium"],
)
def test_gpt2_param_counts(d_model: int, n_layers: int, n_heads: int, expected: int) -> None:
    cfg = GPTConfig(vocab_size=50257, context_length=1024, d_model=d_model, n_layers=n_layers, n_heads=n_heads)
    assert param_count(cfg) == expected
    assert _real_count(cfg) == expected


@pytest.mark.parametrize("tie_embeddings", [True, False])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_param_count_matches_model(tie_embeddings: bool, use_bias: bool, scan_layers: bool) -> None:
    cfg = dataclasses.replace(
        TINY, d_ff=48, tie_embeddings=tie_embeddings, use_bias=use_bias, scan_layers=scan_layers
    )
    assert param_count(cfg) == _real_count(cfg)
    embeddings = (cfg.vocab_size + cfg.context_length) * cfg.d_model
    assert param_count(cfg, include_embeddings=False) == param_count(cfg) - embeddings


def test_scan_and_unrolled_have_same_params() -> None:
    scanned = _abstract_variables(TINY)["params"]
    unrolled = _abstract_variables(dataclasses.replace(TINY, scan_layers=False))["params"]
    assert set(scanned) == {"blocks", "ln_f", "wte", "wpe"}
    assert set(unrolled) == {"block_0", "block_1", "ln_f", "wte", "wpe"}
    assert _real_count(TINY) == _real_count(dataclasses.replace(TINY, scan_layers=False))
    # Each scanned leaf is the per-layer leaf stacked on a leading layers axis.
    stacked = jax.tree.map(lambda x: (TINY.n_layers, *x.shape), nn.unbox(unrolled["block_0"]))
    assert jax.tree.map(lambda x: x.shape, nn.unbox(scanned["blocks"])) == stacked


def test_flops_per_token_hand_count() -> None:
    d, f, V, L, T = 32, 48, 61, 2, 16
    cfg = GPTConfig(vocab_size=V, context_length=T, d_model=d, n_layers=L, n_heads=4, d_ff=f)
    # Multiply-accumulates per token, forward pass:
    qkv = 3 * d * d  # 3_072
    proj = d * d  # 1_024
    mlp = 2 * d * f  # 3_072
    head = d * V  # 1_952
    qk_scores = T * d  # 512: each query dotted with T keys of width d
    weighted_values = T * d  # 512: T value vectors of width d summed
    macs = L * (qkv + proj + mlp + qk_scores + weighted_values) + head  # 2 * 8_192 + 1_952 = 18_336
    forward = 2 * macs  # 2 FLOPs per MAC
    training = 3 * forward  # backward = 2x forward
    assert training == 110_016
    assert flops_per_token(cfg, seq_len=T) == training
    # The attention term grows linearly with the sequence length.
    assert flops_per_token(cfg, seq_len=2 * T) - flops_per_token(cfg, seq_len=T) == 12 * L * d * T


# --- numerics ---------------------------------------------------------------
# Initialisation dominates runtime here (XLA:CPU is slow to compile the RNG), so
# the tiny model is initialised once and re-laid-out for the unrolled variant.


def _unroll(variables):
    """Scanned ``blocks`` (stacked on axis 0) -> ``block_{i}`` entries."""
    params = dict(variables["params"])
    blocks = params.pop("blocks")
    for i in range(TINY.n_layers):
        params[f"block_{i}"] = jax.tree.map(lambda x, i=i: x[i], blocks)
    return {"params": params}


def _scan(variables):
    """Inverse of ``_unroll``."""
    params = dict(variables["params"])
    blocks = [params.pop(f"block_{i}") for i in range(TINY.n_layers)]
    return {"params": {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}}


@pytest.fixture(scope="module")
def tokens() -> jax.Array:
    return _tokens(TINY)


@pytest.fixture(scope="module")
def variables(tokens: jax.Array):
    """Unboxed float32 variables of ``TINY`` (scanned layout)."""
    return nn.unbox(jax.jit(GPT(TINY).init)(jax.random.key(0), tokens))


@pytest.fixture(scope="module")
def apply() -> Callable[..., jax.Array]:
    """One jitted ``TINY`` forward, shared so it compiles once."""
    return jax.jit(GPT(TINY).apply)


@pytest.fixture(scope="module")
def logits(apply, variables, tokens: jax.Array) -> jax.Array:
    return apply(variables, tokens)


def test_forward_shape_and_dtype_float32(variables, logits: jax.Array, tokens: jax.Array) -> None:
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables))
    assert logits.shape == (*tokens.shape, TINY.vocab_size)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_forward_shape_and_dtype_bfloat16(variables, logits: jax.Array, tokens: jax.Array) -> None:
    bf16 = jax.jit(GPT(dataclasses.replace(TINY, compute_dtype="bfloat16")).apply)(variables, tokens)
    assert bf16.shape == logits.shape
    assert bf16.dtype == jnp.float32  # params stay float32, logits are upcast
    np.testing.assert_allclose(bf16, logits, atol=0.05)
    assert not np.array_equal(bf16, logits)  # it really computed in bfloat16


def test_rejects_sequence_longer_than_context(variables) -> None:
    with pytest.raises(ValueError, match="context_length"):
        jax.eval_shape(GPT(TINY).apply, variables, jnp.zeros((1, TINY.context_length + 1), jnp.int32))


def test_causal(apply, variables, logits: jax.Array, tokens: jax.Array) -> None:
    t = 4
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 1) % TINY.vocab_size)
    before, after = logits, apply(variables, changed)
    np.testing.assert_allclose(before[:, : t + 1], after[:, : t + 1], rtol=1e-6, atol=1e-6)
    assert not np.allclose(before[:, t + 1 :], after[:, t + 1 :])


def test_scan_matches_unrolled_forward(variables, logits: jax.Array, tokens: jax.Array) -> None:
    unrolled = jax.jit(GPT(dataclasses.replace(TINY, scan_layers=False)).apply)(_unroll(variables), tokens)
    np.testing.assert_allclose(unrolled, logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def reference_grads(variables, tokens: jax.Array):
    return _grads(TINY, variables, tokens)


def _grads(cfg: GPTConfig, variables, tokens: jax.Array):
    model = GPT(cfg)
    return jax.jit(jax.grad(lambda v: jnp.mean(model.apply(v, tokens) ** 2)))(variables)


@pytest.mark.parametrize(
    ("remat", "scan_layers"), [("full", True), ("dots", True), ("dots", False)]
)
def test_remat_matches_under_grad(remat: str, scan_layers: bool, variables, tokens, reference_grads) -> None:
    cfg = dataclasses.replace(TINY, remat=remat, scan_layers=scan_layers)
    if scan_layers:
        grads = _grads(cfg, variables, tokens)
    else:
        grads = _scan(_grads(cfg, _unroll(variables), tokens))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, reference_grads)


def test_dropout_only_when_not_deterministic(variables, logits: jax.Array, tokens: jax.Array) -> None:
    apply = jax.jit(GPT(dataclasses.replace(TINY, dropout=0.5)).apply, static_argnames="deterministic")
    np.testing.assert_allclose(apply(variables, tokens), logits, rtol=1e-6, atol=1e-6)
    train = apply(variables, tokens, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert not np.allclose(train, logits)


def test_gpt2_init_scales(variables) -> None:
    params = variables["params"]
    blocks = params["blocks"]
    residual_std = 0.02 / math.sqrt(2 * TINY.n_layers)
    for kernel, std in [
        (params["wte"]["embedding"], 0.02),
        (params["wpe"]["embedding"], 0.02),
        (blocks["attn"]["query"]["kernel"], 0.02),
        (blocks["mlp"]["fc"]["kernel"], 0.02),
        (blocks["attn"]["out"]["kernel"], residual_std),
        (blocks["mlp"]["proj"]["kernel"], residual_std),
    ]:
        assert float(jnp.std(kernel)) == pytest.approx(std, rel=0.1)
    assert float(jnp.abs(blocks["mlp"]["fc"]["bias"]).max()) == 0.0
    np.testing.assert_array_equal(blocks["ln_1"]["scale"], 1.0)
    # Layers get independent initialisations under scan.
    assert not np.allclose(blocks["mlp"]["fc"]["kernel"][0], blocks["mlp"]["fc"]["kernel"][1])


# --- sharding ---------------------------------------------------------------


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_every_param_has_logical_axes(scan_layers: bool, tie_embeddings: bool) -> None:
    cfg = dataclasses.replace(TINY, scan_layers=scan_layers, tie_embeddings=tie_embeddings)
    leaves = jax.tree.leaves(_abstract_variables(cfg), is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    assert all(len(x.names) == len(x.value.shape) for x in leaves)


def test_logical_rules_map_params_to_mesh_axes() -> None:
    specs = nn.logical_to_mesh(nn.get_partition_spec(_abstract_variables(TINY)), LOGICAL_AXIS_RULES)["params"]
    assert specs["wte"]["embedding"] == P("tensor", "fsdp")
    assert specs["wpe"]["embedding"] == P(None, "fsdp")
    assert specs["blocks"]["attn"]["query"]["kernel"] == P("stage", "fsdp", "tensor", None)
    assert specs["blocks"]["attn"]["out"]["kernel"] == P("stage", "tensor", None, "fsdp")
    assert specs["blocks"]["mlp"]["fc"]["kernel"] == P("stage", "fsdp", "tensor")
    assert specs["blocks"]["mlp"]["proj"]["kernel"] == P("stage", "tensor", "fsdp")
    assert specs["blocks"]["ln_1"]["scale"] == P("stage", "fsdp")  # stacked layers: split over the stages


_MESH_SCRIPT = textwrap.dedent(
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from runner.models.gpt.model import GPT, LOGICAL_AXIS_RULES, GPTConfig
    from runner.parallel.mesh import make_mesh

    assert jax.device_count() == 4, jax.devices()
    cfg = GPTConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4, tie_embeddings=False)
    model = GPT(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 8), dtype=np.int32)
    # runner's mesh: every axis the rules name (expert and context of size 1), all Auto (linen's
    # logical constraints are with_sharding_constraint hints, which need Auto axes)
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2})
    assert set(mesh.axis_types) == {AxisType.Auto}

    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, LOGICAL_AXIS_RULES)
    variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), tokens)

    fc = variables["params"]["blocks"]["mlp"]["fc"]["kernel"].value
    assert fc.sharding == NamedSharding(mesh, P("stage", "fsdp", "tensor")), fc.sharding
    head = variables["params"]["lm_head"]["kernel"].value
    assert head.sharding == NamedSharding(mesh, P("fsdp", "tensor")), head.sharding

    apply = jax.jit(model.apply)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        batch = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
        assert "sharding_constraint" in apply.lower(variables, batch).as_text()
        sharded = apply(variables, batch)
    assert sharded.shape == (4, 8, cfg.vocab_size) and sharded.dtype == jnp.float32

    # Outside any mesh the constraints are no-ops and the numbers agree.
    reference = apply(jax.device_get(variables), tokens)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), rtol=1e-5, atol=1e-5)
    print("OK")
    """
)


@pytest.mark.deep
def test_forward_on_fake_cpu_mesh(tmp_path) -> None:
    # XLA reads the device count when jax's backend starts, hence a process of its own (forked:
    # tests/forked.py, before any backend started)
    proc = run(fork_server(), "code", _MESH_SCRIPT, [], REPO_ROOT, runner_env(tmp_path, 4), 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")
