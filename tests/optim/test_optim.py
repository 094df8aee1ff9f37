"""Schedules hit hand-computed values; optimizers build, descend, mask decay and clip."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from runner.errors import ConfigError
from runner.optim import OPTIMIZERS, SCHEDULES, OptimizerSettings, build_optimizer, build_schedule, decay_mask

PEAK, TOTAL, WARMUP, FINAL = 1.0, 100, 10, 0.1


def values(schedule: optax.Schedule, steps: list[int]) -> list[float]:
    return [float(schedule(jnp.asarray(s))) for s in steps]


# --- schedules -------------------------------------------------------------------------------

# name, extra, {step: expected} beyond the warmup checks shared by all schedules.
SCHEDULE_CASES = [
    ("constant", {}, {55: 1.0, 100: 1.0, 1000: 1.0}),
    ("cosine", {}, {55: 0.1 + 0.9 * 0.5, 100: 0.1, 200: 0.1}),
    ("linear", {}, {55: 0.55, 100: 0.1, 200: 0.1}),
    ("wsd", {}, {30: 1.0, 80: 1.0, 90: 0.55, 100: 0.1}),
    ("wsd", {"decay_shape": "cosine"}, {80: 1.0, 90: 0.55, 100: 0.1}),
    ("wsd", {"decay_shape": "sqrt"}, {80: 1.0, 90: 0.1 + 0.9 * (1 - math.sqrt(0.5)), 100: 0.1}),
    ("wsd", {"decay_fraction": 0.5}, {50: 1.0, 75: 0.55, 100: 0.1}),
    ("inverse_sqrt", {}, {40: 0.5, 100: math.sqrt(0.1), 1000: 0.1, 10_000: 0.1}),
]


@pytest.mark.parametrize("name,extra,expected", SCHEDULE_CASES)
def test_schedule_values(name: str, extra: dict, expected: dict[int, float]) -> None:
    schedule = build_schedule(name, PEAK, TOTAL, WARMUP, FINAL, extra)
    # Linear warmup 0 -> peak: step 0, mid-warmup, end of warmup.
    np.testing.assert_allclose(values(schedule, [0, 5, 10]), [0.0, 0.5, 1.0], atol=1e-6)
    np.testing.assert_allclose(values(schedule, list(expected)), list(expected.values()), atol=1e-6)


def test_every_registered_schedule_is_covered() -> None:
    assert {case[0] for case in SCHEDULE_CASES} == set(SCHEDULES.names())


def test_wsd_stable_phase_is_flat() -> None:
    schedule = build_schedule("wsd", PEAK, TOTAL, WARMUP, FINAL)
    np.testing.assert_allclose(values(schedule, list(range(10, 81))), [1.0] * 71, atol=1e-7)
    assert float(schedule(81)) < 1.0


@pytest.mark.parametrize("name", ["constant", "cosine", "linear", "wsd"])
def test_no_warmup_starts_at_peak(name: str) -> None:
    assert float(build_schedule(name, PEAK, TOTAL, 0, FINAL)(0)) == pytest.approx(1.0)


def test_inverse_sqrt_without_warmup_uses_timescale() -> None:
    default = build_schedule("inverse_sqrt", PEAK, TOTAL, 0, 0.0)
    np.testing.assert_allclose(values(default, [0, 1000, 4000]), [1.0, 1.0, 0.5], atol=1e-6)
    custom = build_schedule("inverse_sqrt", PEAK, TOTAL, 0, 0.0, {"timescale": 100})
    np.testing.assert_allclose(values(custom, [100, 400]), [1.0, 0.5], atol=1e-6)


def test_warmup_equal_to_total_is_allowed() -> None:
    """No steps are left to decay in, so every schedule ends its warmup at the peak."""
    for name in SCHEDULES:
        extra = {"decay_fraction": 0.0} if name == "wsd" else {}  # wsd's default decay would overlap
        schedule = build_schedule(name, PEAK, TOTAL, TOTAL, FINAL, extra)
        np.testing.assert_allclose(values(schedule, [50, 100]), [0.5, 1.0], atol=1e-6)


def test_unknown_schedule_lists_names() -> None:
    with pytest.raises(ConfigError) as err:
        build_schedule("cosin", PEAK, TOTAL, WARMUP, FINAL)
    assert err.value.key == "schedule.name"
    for name in SCHEDULES:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"warmup_steps": 101}, "schedule.warmup_steps"),
        ({"warmup_steps": -1}, "schedule.warmup_steps"),
        ({"peak_lr": 0.0}, "schedule.peak_lr"),
        ({"peak_lr": -1e-3}, "schedule.peak_lr"),
        ({"final_lr": -0.1}, "schedule.final_lr"),
        ({"final_lr": 2.0}, "schedule.final_lr"),
        ({"total_steps": 0}, "schedule.total_steps"),
    ],
)
def test_bad_common_settings(kwargs: dict, key: str) -> None:
    args = dict(name="cosine", peak_lr=PEAK, total_steps=TOTAL, warmup_steps=WARMUP, final_lr=FINAL) | kwargs
    with pytest.raises(ConfigError) as err:
        build_schedule(**args)
    assert err.value.key == key


def test_unknown_extra_lists_accepted_keys() -> None:
    with pytest.raises(ConfigError) as err:
        build_schedule("wsd", PEAK, TOTAL, WARMUP, FINAL, {"decay_frac": 0.1})
    assert err.value.key == "schedule.decay_frac"
    assert "decay_fraction" in str(err.value) and "decay_shape" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_schedule("cosine", PEAK, TOTAL, WARMUP, FINAL, {"timescale": 5})
    assert err.value.key == "schedule.timescale"


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"decay_shape": "exp"}, "schedule.decay_shape"),
        ({"decay_fraction": 1.5}, "schedule.decay_fraction"),
        ({"decay_fraction": 0.95}, "schedule.decay_fraction"),  # overlaps the 10-step warmup
    ],
)
def test_bad_wsd_extras(extra: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_schedule("wsd", PEAK, TOTAL, WARMUP, FINAL, extra)
    assert err.value.key == key


# --- lengths as values: one program for runs of any length (issue 59) -----------------------


def optax_schedule(name: str, peak: float, total: int, warmup: int, final: float, extra: dict) -> optax.Schedule:
    """The schedules as runner built them from optax with their lengths as constants (before
    issue 59): what the value-reading ones must equal bit for bit."""
    def decay(shape: str, steps: int) -> optax.Schedule:
        if steps <= 0:
            return optax.constant_schedule(peak)
        if shape == "linear":
            return optax.linear_schedule(peak, final, steps)
        if shape == "cosine":
            return optax.cosine_decay_schedule(peak, steps, alpha=final / peak)
        return lambda step: final + (peak - final) * (1.0 - jnp.sqrt(jnp.clip(jnp.asarray(step, jnp.float32) / steps,
                                                                              0.0, 1.0)))

    if name == "constant":
        after = optax.constant_schedule(peak)
    elif name in ("cosine", "linear"):
        after = decay(name, total - warmup)
    elif name == "wsd":
        decay_steps = int(round(extra.get("decay_fraction", 0.2) * total))
        after = optax.join_schedules([optax.constant_schedule(peak), decay(extra.get("decay_shape", "linear"),
                                                                           decay_steps)],
                                     [total - warmup - decay_steps])
    else:
        timescale = extra.get("timescale", warmup if warmup > 0 else 1000)
        after = lambda step: jnp.maximum(peak * jnp.sqrt(  # noqa: E731
            timescale / jnp.maximum(jnp.asarray(step, jnp.float32) + warmup, timescale)), final)
    if warmup <= 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


# (train.steps, warmup, peak, final / peak): long and short runs, no warmup, all warmup.
LENGTHS = [(100, 10, 3e-4, 0.1), (1000, 100, 1.0, 0.0), (10, 0, 3e-4, 0.1), (37, 37, 1.0, 0.1), (7, 3, 6e-4, 0.0)]


def test_schedules_reading_their_lengths_equal_optax_bit_for_bit() -> None:
    """The train step takes a schedule's lengths as (weakly typed) arguments: under jit, for every
    schedule and many lengths, that gives the very bits (and types) the constants gave."""
    cases = [(name, peak, total, warmup, peak * fraction, extra)
             for name, extra, *_ in SCHEDULE_CASES + [("wsd", {"decay_fraction": 0.0}, {}),
                                                      ("inverse_sqrt", {"timescale": 3}, {})]
             for total, warmup, peak, fraction in LENGTHS
             if name != "wsd" or round(extra.get("decay_fraction", 0.2) * total) <= total - warmup]
    built = [build_schedule(*case) for case in cases]
    old = [optax_schedule(*case) for case in cases]
    steps = jnp.arange(1100, dtype=jnp.int32)  # past the end of every run above

    def bits(outputs: list[jax.Array]) -> np.ndarray:
        return np.stack([np.broadcast_to(np.asarray(out, np.float32), steps.shape) for out in outputs]).view(np.uint32)

    expected = bits(jax.jit(lambda s: [schedule(s) for schedule in old])(steps))
    as_values = jax.jit(lambda s, values: [schedule.at(v)(s) for schedule, v in zip(built, values)])
    np.testing.assert_array_equal(bits(as_values(steps, [schedule.values for schedule in built])), expected)
    np.testing.assert_array_equal(bits(jax.jit(lambda s: [schedule(s) for schedule in built])(steps)), expected)
    one = jnp.int32(5)  # weakly typed or not decides how a learning rate promotes against bfloat16
    assert [jax.eval_shape(lambda s, v: schedule.at(v)(s), one, schedule.values) for schedule in built] == \
        [jax.eval_shape(schedule, one) for schedule in old]
    # One program for every length: the values differ, the program does not.
    longer, shorter = (build_schedule("cosine", PEAK, total, WARMUP, FINAL) for total in (2 * TOTAL, TOTAL))
    assert set(longer.values) == set(shorter.values) and longer.values != shorter.values
    lowered = [jax.jit(lambda s, v: schedule.at(v)(s)).lower(one, schedule.values).as_text()  # noqa: B023
               for schedule in (longer, shorter)]
    assert lowered[0] == lowered[1]


# --- optimizers ------------------------------------------------------------------------------


def small_params() -> dict:
    keys = jax.random.split(jax.random.key(0), 4)
    return {
        "wte": {"embedding": jax.random.normal(keys[0], (10, 4))},
        "block": {"kernel": jax.random.normal(keys[1], (4, 4)), "bias": jax.random.normal(keys[2], (4,))},
        "ln": {"scale": jax.random.normal(keys[3], (4,))},
    }


def quadratic(params: dict) -> jax.Array:
    return sum(jnp.sum((p - 1.0) ** 2) for p in jax.tree.leaves(params))


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_optimizer_reduces_quadratic(name: str) -> None:
    params = small_params()
    tx = build_optimizer(name, 1e-2, OptimizerSettings(), clip_norm=1.0)
    state = tx.init(params)
    loss, grads = jax.value_and_grad(quadratic)(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    assert float(quadratic(new_params)) < float(loss)
    assert jax.tree.structure(new_params) == jax.tree.structure(params)


def test_optimizer_accepts_a_schedule() -> None:
    schedule = build_schedule("cosine", 1e-2, 100, 10, 0.0)
    params = small_params()
    for name in OPTIMIZERS:
        tx = build_optimizer(name, schedule, OptimizerSettings(), None)
        state = tx.init(params)
        for _ in range(2):  # step 0 has lr 0; step 1 moves
            updates, state = tx.update(jax.grad(quadratic)(params), state, params)
        assert any(float(jnp.abs(u).max()) > 0 for u in jax.tree.leaves(updates)), name


def test_decay_mask() -> None:
    mask = decay_mask(small_params() | {"stack": jnp.ones((2, 4, 4)), "wpe": jnp.ones((8, 4)),
                                        "moe": {"score_bias": jnp.ones((2, 8))}})
    assert mask == {
        "wte": {"embedding": False}, "wpe": False, "stack": True,
        "block": {"kernel": True, "bias": False}, "ln": {"scale": False},
        "moe": {"score_bias": False},  # DeepSeek-V3's fixed selection bias, stacked over layers: never decayed
    }


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_weight_decay_only_shrinks_kernels(name: str) -> None:
    """With zero gradients only decay moves parameters: kernel by lr * wd, the rest not at all."""
    params = jax.tree.map(jnp.ones_like, small_params())
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = build_optimizer(name, 0.1, OptimizerSettings(weight_decay=0.1), None)
    updates, _ = tx.update(zeros, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["block"]["kernel"], 0.99, rtol=1e-6)
    for path in (("block", "bias"), ("ln", "scale"), ("wte", "embedding")):
        np.testing.assert_array_equal(new[path[0]][path[1]], 1.0)


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_decay_embeddings_and_norms_decays_everything(name: str) -> None:
    params = jax.tree.map(jnp.ones_like, small_params())
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = build_optimizer(name, 0.1, OptimizerSettings(weight_decay=0.1, decay_embeddings_and_norms=True), None)
    updates, _ = tx.update(zeros, tx.init(params), params)
    for leaf in jax.tree.leaves(optax.apply_updates(params, updates)):
        np.testing.assert_allclose(leaf, 0.99, rtol=1e-6)


def test_muon_handles_1d_2d_and_3d_leaves() -> None:
    params = small_params() | {"stack": jnp.ones((2, 4, 4))}
    tx = build_optimizer("muon", 1e-2, OptimizerSettings(), 1.0)
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(jax.grad(quadratic)(params), state, params)
    assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_clipping_limits_global_norm() -> None:
    tx = build_optimizer(optax.sgd(1.0), learning_rate=123.0, settings=OptimizerSettings(), clip_norm=1.0)
    params = {"a": jnp.zeros(2)}
    updates, _ = tx.update({"a": jnp.array([300.0, 400.0])}, tx.init(params), params)
    np.testing.assert_allclose(updates["a"], [-0.6, -0.8], rtol=1e-6)


def test_optax_object_without_clipping_is_returned_as_is() -> None:
    sgd = optax.sgd(1.0)
    assert build_optimizer(sgd, 1.0, OptimizerSettings(), None) is sgd


def test_unknown_optimizer_lists_names() -> None:
    with pytest.raises(ConfigError) as err:
        build_optimizer("adam_w", 1e-3, OptimizerSettings(), None)
    assert err.value.key == "optimizer.name"
    for name in OPTIMIZERS:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "settings,clip_norm,key",
    [
        (OptimizerSettings(b1=1.0), None, "optimizer.b1"),
        (OptimizerSettings(b2=1.0), None, "optimizer.b2"),
        (OptimizerSettings(b2=-0.1), None, "optimizer.b2"),
        (OptimizerSettings(momentum=1.5), None, "optimizer.momentum"),
        (OptimizerSettings(eps=0.0), None, "optimizer.eps"),
        (OptimizerSettings(weight_decay=-0.1), None, "optimizer.weight_decay"),
        (OptimizerSettings(nesterov="yes"), None, "optimizer.nesterov"),  # type: ignore[arg-type]
        (OptimizerSettings(), 0.0, "optimizer.clip_norm"),
        (OptimizerSettings(), -1.0, "optimizer.clip_norm"),
    ],
)
def test_bad_optimizer_settings(settings: OptimizerSettings, clip_norm: float | None, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_optimizer("adamw", 1e-3, settings, clip_norm)
    assert err.value.key == key


# --- optimizer state on a mesh ---------------------------------------------------------------

def _scanned_gpt_params() -> tuple[dict, dict]:
    """(abstract params, logical partition specs) of a small scanned GPT."""
    import flax.linen as nn

    from runner.models.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=2, scan_layers=True)
    boxed = jax.eval_shape(GPT(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
    return nn.meta.unbox(boxed)["params"], nn.get_partition_spec(boxed)["params"]


@pytest.mark.parametrize("leaf, param, spec, expected", [
    ((4, 8), (4, 8), ("fsdp", "tensor"), ("fsdp", "tensor")),  # a moment: the parameter's own
    ((4,), (4, 8), ("fsdp", "tensor"), ("fsdp",)),  # factored: the last axis reduced
    ((8,), (4, 8), ("fsdp", "tensor"), ("tensor",)),  # factored: the first axis reduced
    ((2, 8), (2, 4, 8), (None, "fsdp", "tensor"), (None, "tensor")),  # stacked layers, factored
    ((1,), (4, 8), ("fsdp", "tensor"), ()),  # Adafactor's placeholder
    ((4, 8), (4, 8), (), ()),  # a replicated parameter
    ((8,), (4, 8), (), (None,)),  # ... and its factored moment
])
def test_restricted_spec_keeps_the_axes_a_state_leaf_keeps(leaf, param, spec, expected) -> None:
    from jax.sharding import PartitionSpec as P

    from runner.optim.sharding import restricted_spec

    assert restricted_spec(leaf, param, P(*spec)) == P(*expected)


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_every_optimizer_state_gets_a_sharding_that_fits_it(name: str) -> None:
    """Factored, masked, scalar and per-parameter states alike: one valid sharding per leaf, the
    state's own tree structure, and moments sharded like their parameters."""
    import dataclasses

    import flax.linen as nn
    from jax.sharding import Mesh

    from runner.models.gpt.model import LOGICAL_AXIS_RULES
    from runner.optim.optimizers import param_axis_names
    from runner.optim.sharding import opt_state_sharding

    params, specs = _scanned_gpt_params()
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("stage", "data", "fsdp", "tensor"))
    param_sharding = nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)
    settings = dataclasses.replace(OptimizerSettings(), param_axes=param_axis_names(params, specs))
    tx = build_optimizer(name, 1e-3, settings, 1.0)
    state = jax.eval_shape(tx.init, params)
    sharding = opt_state_sharding(state, params, param_sharding, mesh)
    assert jax.tree.structure(sharding) == jax.tree.structure(state)
    by_param = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(param_sharding)}
    sharded_like_a_param = 0
    for (path, leaf), s in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(sharding)):
        assert len(s.spec) <= len(leaf.shape), (jax.tree_util.keystr(path), leaf.shape, s.spec)
        s.shard_shape(leaf.shape)  # raises if the spec does not fit the leaf
        key = jax.tree_util.keystr(path)
        owner = [p for p in by_param if key.endswith(p)]
        if owner and leaf.shape == params_shape(params, owner[0]):
            assert s.spec == by_param[owner[0]], key
            sharded_like_a_param += 1
    assert sharded_like_a_param > 0


def params_shape(params: dict, keystr: str) -> tuple[int, ...]:
    return {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}[keystr]


def test_muon_orthogonalises_every_weight_matrix_of_a_scanned_model() -> None:
    """Stacked layers are batch axes; projections read or write the residual stream (embed);
    biases, norms and embeddings go to Adam."""
    from runner.optim.optimizers import muon_dimension_numbers, param_axis_names

    params, specs = _scanned_gpt_params()
    dims = muon_dimension_numbers(params, param_axis_names(params, specs))
    blocks = dims["blocks"]
    assert tuple(blocks["attn"]["query"]["kernel"]) == (1, (2, 3))  # (layers, embed, heads, kv)
    assert tuple(blocks["attn"]["out"]["kernel"]) == ((1, 2), 3)  # (layers, heads, kv, embed)
    assert tuple(blocks["mlp"]["fc"]["kernel"]) == (1, (2,))  # (layers, embed, mlp)
    assert tuple(blocks["mlp"]["proj"]["kernel"]) == ((1,), 2)  # (layers, mlp, embed)
    for vector in (blocks["attn"]["query"]["bias"], blocks["mlp"]["fc"]["bias"], blocks["ln_1"]["scale"],
                   dims["wte"]["embedding"], dims["wpe"]["embedding"], dims["ln_f"]["scale"]):
        assert vector is None
    # Without names only 2-D leaves are matrices (a stacked kernel is 3-D: it goes to Adam).
    by_rank = muon_dimension_numbers(params)
    assert by_rank["blocks"]["attn"]["query"]["kernel"] is None
    assert by_rank["blocks"]["mlp"]["fc"]["bias"] is None  # a bias by name, whatever its rank
    flat = {"w": jnp.zeros((4, 8)), "b": {"bias": jnp.zeros((4, 8))}, "v": jnp.zeros((8,))}
    is_dims = lambda d: d is None or isinstance(d, optax.contrib.MuonDimensionNumbers)  # noqa: E731
    assert jax.tree.map(lambda d: d is not None, muon_dimension_numbers(flat), is_leaf=is_dims) == \
        {"w": True, "b": {"bias": False}, "v": False}


def test_muon_refuses_a_model_without_weight_matrices() -> None:
    import dataclasses

    from jax.sharding import PartitionSpec as P

    params = {"bias": jnp.zeros((8,)), "wte": {"embedding": jnp.zeros((8, 4))}}
    axes = {"bias": P("vocab"), "wte": {"embedding": P("vocab", "embed")}}
    with pytest.raises(ConfigError) as info:
        build_optimizer("muon", 1e-2, dataclasses.replace(OptimizerSettings(), param_axes=axes), 1.0)
    assert info.value.key == "optimizer.name" and "matrices" in str(info.value)
    del params
