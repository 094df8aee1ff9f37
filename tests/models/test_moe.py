"""The mixture-of-experts block's dispatches against the plain reference (every expert on every
token, masked by the routing), forward and gradients, in float32; the balancing terms' values."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models.common.moe import (balance_loss, capacity, capacity_experts, dense_experts, expert_load,
    ragged_experts, route, routing_sums, settle, updated_bias, z_loss)
from tests.conftest import LEARNING, TINY, read_metrics, run_runner, xla_flags
from tests.parallel.equivalence import LOSS_RTOL

T, D, F, E = 24, 8, 12, 6


def weights(seed: int = 0) -> tuple[jax.Array, ...]:
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(k[0], (T, D))
    router = jax.random.normal(k[1], (D, E))
    w_gate, w_up = (jax.random.normal(k[i], (E, D, F)) / np.sqrt(D) for i in (2, 3))
    w_down = jax.random.normal(k[4], (E, F, D)) / np.sqrt(F)
    return x, router, w_gate, w_up, w_down


@pytest.mark.parametrize("score,top_k", [("softmax", 2), ("sigmoid", 3), ("softmax", 1)])
def test_ragged_equals_the_reference_forward_and_gradients(score: str, top_k: int) -> None:
    x, router, w_gate, w_up, w_down = weights()

    def loss(fn, x, router, w_gate, w_up, w_down):
        routing = route(x @ router, top_k, score)
        return jnp.sum(jnp.sin(fn(x, routing, w_gate, w_up, w_down)))

    args = (x, router, w_gate, w_up, w_down)
    want, want_grads = jax.value_and_grad(lambda *a: loss(dense_experts, *a), argnums=tuple(range(5)))(*args)
    got, got_grads = jax.jit(jax.value_and_grad(lambda *a: loss(ragged_experts, *a), argnums=tuple(range(5))))(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(got_grads[1]).sum()) > 0  # the router learns through the weights


@pytest.mark.parametrize("skew", [0.0, 8.0])
def test_the_blocked_kernel_equals_the_reference_balanced_or_not(skew: float) -> None:
    """XLA:CPU's ragged kernel: whole blocks per expert, even when one expert takes every token
    (skew 8) and the others none."""
    x, router, w_gate, w_up, w_down = weights(4)
    bias = jnp.zeros(E).at[0].set(skew)

    def loss(kernel, x, router, w_gate, w_up, w_down):
        routing = route(x @ router + bias, 2)
        fn = dense_experts if kernel == "reference" else lambda *a: ragged_experts(*a, kernel=kernel)
        return jnp.sum(jnp.sin(fn(x, routing, w_gate, w_up, w_down)))

    args = (x, router, w_gate, w_up, w_down)
    want = jax.value_and_grad(lambda *a: loss("reference", *a), argnums=tuple(range(5)))(*args)
    got = jax.jit(jax.value_and_grad(lambda *a: loss("blocked", *a), argnums=tuple(range(5))))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    counts = np.bincount(np.asarray(route(x @ router + bias, 2).experts).ravel(), minlength=E)
    assert (counts.max() == T) == (skew > 0)


def test_capacity_with_room_for_all_equals_the_reference() -> None:
    x, router, w_gate, w_up, w_down = weights(1)
    routing = route(x @ router, 2)
    got, dropped = capacity_experts(x, routing, w_gate, w_up, w_down, factor=float(E))
    np.testing.assert_allclose(got, dense_experts(x, routing, w_gate, w_up, w_down), rtol=1e-5, atol=1e-6)
    assert float(dropped) == 0.0


def test_capacity_drops_the_slots_past_it_and_counts_them() -> None:
    x, router, w_gate, w_up, w_down = weights(2)
    routing = route(x @ router + jnp.array([4.0, 0, 0, 0, 0, 0]), 2)  # expert 0 is everyone's favourite
    cap = capacity(T, E, 2, 1.0)
    got, dropped = capacity_experts(x, routing, w_gate, w_up, w_down, factor=1.0)
    # by hand: first choices in token order, then second choices; each expert keeps `cap` slots
    experts = np.asarray(routing.experts)
    seen, kept = np.zeros(E, int), np.zeros_like(experts, bool)
    for choice in range(2):
        for t in range(T):
            e = experts[t, choice]
            kept[t, choice] = seen[e] < cap
            seen[e] += 1
    assert not kept.all()
    masked = type(routing)(experts=routing.experts, weights=routing.weights * kept, probs=routing.probs,
                           logits=routing.logits)
    np.testing.assert_allclose(got, dense_experts(x, masked, w_gate, w_up, w_down), rtol=1e-5, atol=1e-6)
    assert float(dropped) == pytest.approx(1 - kept.mean())


def test_the_terms_made_from_routing_sums_add_up_over_microbatches() -> None:
    """`settle` of one call's sums gives the balancing loss, z-loss and load of the functions
    above; the sums of two halves of the tokens, added, give the whole's terms (what a pipeline
    does), where the mean of the halves' balancing losses would not."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(moe_aux_loss=0.01, moe_z_loss=0.001, moe_bias_rate=1e-3)
    logits = jax.random.normal(jax.random.PRNGKey(4), (T, E)) * 2
    whole, halves = route(logits, 2), [route(logits[:T // 2], 2), route(logits[T // 2:], 2)]
    no_drop = jnp.zeros(())
    loss, reports, bias = settle(cfg, routing_sums(whole, E, no_drop), jnp.zeros(E))
    assert float(reports["aux_loss"]) == pytest.approx(float(balance_loss(whole, E)), rel=1e-6)
    assert float(reports["z_loss"]) == pytest.approx(float(z_loss(whole)), rel=1e-6)
    assert float(reports["load_max"]) == float(jnp.max(expert_load(whole, E)))
    assert float(loss) == pytest.approx(0.01 * float(balance_loss(whole, E)) + 0.001 * float(z_loss(whole)), rel=1e-6)
    np.testing.assert_array_equal(bias, updated_bias(jnp.zeros(E), expert_load(whole, E), 1e-3))
    added = jax.tree.map(lambda a, b: a + b, *(routing_sums(h, E, no_drop) for h in halves))
    loss_added, reports_added, bias_added = settle(cfg, added, jnp.zeros(E))
    assert float(loss_added) == pytest.approx(float(loss), rel=1e-6)
    np.testing.assert_array_equal(bias_added, bias)
    assert reports_added["load_min"] == reports["load_min"]
    mean_of_halves = np.mean([float(balance_loss(h, E)) for h in halves])
    assert abs(mean_of_halves - float(reports["aux_loss"])) > 1e-3  # why the sums, not the halves' terms


def test_balance_terms() -> None:
    even = route(jnp.zeros((T, E)), 2)  # ties: top_k picks the lowest indices, so this collapses
    load = expert_load(even, E)
    assert float(load[0]) == pytest.approx(E / 2) and float(load[-1]) == 0.0
    spread = route(jnp.tile(jnp.eye(E) * 10.0, (T // E, 1)), 1)  # token t prefers expert t mod E
    np.testing.assert_allclose(expert_load(spread, E), np.ones(E))
    assert float(balance_loss(spread, E)) == pytest.approx(1.0, rel=1e-3)
    collapsed = route(jnp.tile(jnp.array([10.0] + [0.0] * (E - 1)), (T, 1)), 1)
    assert float(balance_loss(collapsed, E)) > 5.0
    mask = jnp.zeros(T).at[:E].set(1.0)  # padding rows count for nothing
    np.testing.assert_allclose(expert_load(spread, E, mask), np.ones(E))
    assert float(z_loss(route(jnp.zeros((T, E)), 1))) == pytest.approx(np.log(E) ** 2, rel=1e-5)
    bias = updated_bias(jnp.zeros(E), load, 1e-3)
    assert float(bias[0]) < 0 < float(bias[-1])  # the busy expert is chosen less, the idle one more
    chosen = route(jnp.zeros((T, E)), 2, bias=jnp.array([0, 0, 0, 0, 1.0, 1.0])).experts
    assert set(np.asarray(chosen).ravel()) == {4, 5}  # the bias chooses ...
    assert float(route(jnp.zeros((T, E)), 2, bias=jnp.array([0, 0, 0, 0, 1.0, 1.0])).weights[0, 0]) == 0.5  # ... weights don't move


# --------------------------------------------------------------------------- the llama family's MoE layers

def moe_config(**moe: object):
    from runner.models.llama.model import LlamaFamily
    from runner.spec import ModelSpec, MoESpec

    settings = {"n_experts": 4, "top_k": 2, "d_ff_expert": 24, **moe}
    model = ModelSpec(family="llama", vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, d_ff=48, scan_layers=True, moe=MoESpec(**settings))
    return LlamaFamily.config(model)


def packed_inputs() -> dict[str, jax.Array]:
    """Two rows of packed documents (a boundary mid-row, and one padded tail)."""
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 16), 0, 64)
    segment_ids = jnp.array([[1] * 6 + [2] * 10, [1] * 12 + [0] * 4])
    positions = jnp.array([list(range(6)) + list(range(10)), list(range(12)) + [0] * 4])
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}


@pytest.mark.parametrize("scan", [True, False])
def test_the_family_s_dispatches_give_the_reference_logits_and_gradients(scan: bool) -> None:
    import dataclasses

    from runner.models.llama.model import Llama

    inputs = packed_inputs()
    base = dataclasses.replace(moe_config(n_shared_experts=1), scan_layers=scan)
    params = Llama(base).init(jax.random.PRNGKey(0), inputs["tokens"])["params"]

    def run(dispatch: str, **extra: object):
        cfg = dataclasses.replace(base, moe_dispatch=dispatch, **extra)

        def loss(p):
            logits = Llama(cfg).apply({"params": p}, inputs["tokens"], segment_ids=inputs["segment_ids"],
                                      positions=inputs["positions"])
            return jnp.sum(jnp.sin(logits)), logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, grads

    want_logits, want_grads = run("dense")
    for dispatch, extra in (("ragged", {}), ("capacity", {"moe_capacity_factor": 4.0})):
        logits, grads = run(dispatch, **extra)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=f"{dispatch} {jax.tree_util.keystr(path)}")
    router = [g for path, g in jax.tree_util.tree_flatten_with_path(want_grads)[0] if "router" in jax.tree_util.keystr(path)]
    assert router and all(float(jnp.abs(g).sum()) > 0 for g in router)


@pytest.mark.parametrize("scan", [True, False])
def test_leading_dense_layers_keep_a_dense_mlp_and_decode_with_their_cache(scan: bool) -> None:
    import dataclasses

    import flax.linen as nn

    from runner.models.llama.model import Llama, LlamaFamily

    cfg = dataclasses.replace(moe_config(first_dense_layers=1), n_layers=3, scan_layers=scan)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, 64)
    params = nn.unbox(Llama(cfg).init(jax.random.PRNGKey(0), tokens)["params"])
    if scan:
        assert "mlp" in params["dense_blocks"] and "moe" in params["blocks"]
        assert params["dense_blocks"]["mlp"]["gate"]["kernel"].shape[0] == 1
        assert params["blocks"]["moe"]["gate"].shape[0] == 2
    else:
        assert "mlp" in params["block_0"] and "moe" in params["block_1"] and "moe" in params["block_2"]
    assert LlamaFamily.param_count(cfg) == sum(x.size for x in jax.tree.leaves(params))
    assert LlamaFamily.active_param_count(cfg) == LlamaFamily.param_count(cfg) - 2 * 2 * 3 * 32 * 24
    full = Llama(cfg).apply({"params": params}, tokens)
    model = Llama(cfg)
    cache = model.apply({"params": params}, 1, 8, method=model.init_cache)
    logits, _ = model.apply({"params": params}, tokens, cache=cache, index=jnp.zeros((1,), jnp.int32))
    np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)


def test_parameter_count_and_flops_count_every_expert_and_the_active_ones() -> None:
    from runner.models.llama.model import Llama, LlamaFamily

    cfg = moe_config(n_shared_experts=1)
    params = Llama(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))["params"]
    assert LlamaFamily.param_count(cfg) == sum(x.size for x in jax.tree.leaves(params))
    dense_mlp, d = 3 * 32 * 24, 32
    one_more_expert = LlamaFamily.flops_per_token(moe_config(n_shared_experts=1, top_k=3), 16) - \
        LlamaFamily.flops_per_token(cfg, 16)
    assert one_more_expert == 6 * 2 * dense_mlp  # a token's FLOPs grow with top_k, not with n_experts
    assert LlamaFamily.flops_per_token(moe_config(n_experts=8), 16) - LlamaFamily.flops_per_token(
        moe_config(n_experts=4), 16) == 6 * 2 * d * 4  # only the router's width


def test_the_train_step_adds_the_weighted_balancing_terms_and_reports_them() -> None:
    import optax

    from runner.models.llama.model import Llama
    from runner.train.state import create_state
    from runner.train.steps import token_loss

    cfg = moe_config(aux_loss=0.5, z_loss=0.25)
    model = Llama(cfg)
    state = create_state(model, optax.sgd(0.1), jax.random.PRNGKey(0), (jnp.zeros((1, 16), jnp.int32),))
    inputs = packed_inputs()
    micro = {"x": inputs["tokens"], "y": jnp.roll(inputs["tokens"], -1, axis=1), "mask": jnp.ones((2, 16))}
    total, count, reported = token_loss(state, state.params, micro, jax.random.PRNGKey(1))
    logits = model.apply({"params": state.params}, micro["x"])
    ce = float(jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, micro["y"])))
    penalty = (0.5 * reported["moe/aux_loss"] + 0.25 * reported["moe/z_loss"]) * 2  # mean over 2 layers, x2 layers
    assert float(total) == pytest.approx(ce + float(penalty) * float(count), rel=1e-5)
    per_layer = {f"moe/load_{end}/{i}" for end in ("max", "min") for i in (0, 1)}
    assert set(reported) == {"moe/aux_loss", "moe/z_loss", "moe/load_max", "moe/load_min", "moe/dropped", *per_layer}
    assert float(reported["moe/load_max"]) >= 1.0 >= float(reported["moe/load_min"])
    assert float(reported["moe/load_max"]) == max(float(reported[f"moe/load_max/{i}"]) for i in (0, 1))
    assert float(reported["moe/load_min"]) == min(float(reported[f"moe/load_min/{i}"]) for i in (0, 1))


def test_per_layer_reports_come_in_layer_order_scanned_or_not() -> None:
    from runner.train.steps import reports

    unrolled = {f"block_{i}": {"moe": {"moe/load_max": jnp.array([float(i)])}} for i in (0, 1, 2, 10, 11)}
    out = reports(unrolled)
    assert [float(out[f"moe/load_max/{i}"]) for i in range(5)] == [0, 1, 2, 10, 11]  # block_10 after block_2
    scanned = reports({"blocks": {"moe": {"moe/load_max": jnp.array([3.0, 1.0, 2.0]),
                                          "moe/aux_loss": jnp.array([1.0, 2.0, 3.0])}}})
    assert [float(scanned[f"moe/load_max/{i}"]) for i in range(3)] == [3, 1, 2] and float(scanned["moe/load_max"]) == 3
    assert float(scanned["moe/aux_loss"]) == 2.0 and "moe/aux_loss/0" not in scanned


def test_the_progress_line_summarises_the_experts_load() -> None:
    from runner.observability.metrics import Progress

    line = Progress("none", 10, 1).line(3, {"loss": 2.0, "moe/load_max": 1.7, "moe/load_min": 0.4,
                                            "moe/dropped": 0.031}, 5.0)
    assert "experts 0.40-1.70x, dropped 3.1%" in line
    assert "dropped" not in Progress("none", 10, 1).line(3, {"moe/load_max": 1.2, "moe/load_min": 0.8,
                                                               "moe/dropped": 0.0}, 5.0)


def test_moe_settings_the_model_cannot_honour_are_refused() -> None:
    from runner.errors import ConfigError, UserError
    from runner.models.gpt import model as gpt
    from runner.models.llama import hf as llama_hf
    from runner.spec import ModelSpec, MoESpec

    with pytest.raises(ConfigError, match="job.model.moe.n_experts=4.*gpt family has no mixture-of-experts"):
        gpt.GPTFamily.config(ModelSpec(moe=MoESpec(n_experts=4)))
    with pytest.raises(UserError, match="job.model.moe.n_shared_experts"):  # no exported architecture has them
        llama_hf.hf_config(moe_config(n_shared_experts=1))
    with pytest.raises(UserError, match="job.model.moe.n_shared_experts"):
        llama_hf.layout(moe_config(n_shared_experts=1))


MOE_RUN = [*TINY, "job=llama_tiny", "job.model.n_kv_heads=2", "job.model.head_dim=16", "job.model.moe.n_experts=4",
           "job.model.moe.d_ff_expert=32", "job.model.moe.n_shared_experts=1", "train.steps=6",
           "checkpoint.every_steps=2", "eval.every=3"]


MOE_BIAS_RUN = [*MOE_RUN, "job.model.moe.bias_update_rate=0.001"]


@pytest.fixture(scope="module")
def moe_whole(tmp_path_factory) -> tuple[Path, str]:
    """MOE_BIAS_RUN uninterrupted on one device: its directory and output."""
    tmp = tmp_path_factory.mktemp("moe")
    whole = run_runner([*MOE_BIAS_RUN, "run.dir=whole"], tmp)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return tmp / "whole", whole.stdout


@pytest.mark.deep
def test_an_moe_run_resumes_bit_exact_after_sigkill_and_a_mesh_gives_the_same_numbers(tmp_path, moe_whole) -> None:
    """Through `python -m runner`: the router, every expert and the router's selection bias are
    saved and restored exactly, after a kill during the save of step 4 and then one at step 5 in
    the same run; a (data 1, fsdp 2, tensor 2) mesh trains the same model as one device, within
    float32 rounding."""
    import signal

    from tests.train.test_restore import params_of

    def state_of(run_dir, step: int) -> list[np.ndarray]:
        import orbax.checkpoint as ocp

        path = (run_dir / "checkpoints" / str(step) / "state").absolute()
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            state = checkpointer.restore(path, args=ocp.args.StandardRestore(
                fallback_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])))
        return [np.asarray(x) for x in jax.tree.leaves(state["model_state"])]

    whole, out = moe_whole
    reports = [r for r in read_metrics(whole) if "moe/aux_loss" in r]
    assert [r["step"] for r in reports] == list(range(1, 7))
    assert all(r["moe/load_max"] >= 1.0 >= r["moe/load_min"] and r["moe/dropped"] == 0.0 for r in reports)
    assert all(r["moe/load_max"] == max(r["moe/load_max/0"], r["moe/load_max/1"]) for r in reports)  # per layer
    assert "experts " in out  # the progress line's summary
    card = (whole / "RUN_CARD.md").read_text()
    assert "active per token" in card  # 4 experts, 2 chosen: fewer parameters per token than in all

    run = [*MOE_BIAS_RUN, "run.dir=killed"]
    mid_save = run_runner(run, tmp_path, RUNNER_FAULT="kill_after_save:4")
    assert mid_save.returncode == -signal.SIGKILL, mid_save.stderr[-3000:]
    killed = run_runner(run, tmp_path, RUNNER_FAULT="kill_at_step:5")  # from 4 if its save committed, else 2
    assert killed.returncode == -signal.SIGKILL and "resumed from step " in killed.stdout, killed.stderr[-3000:]
    again = run_runner(run, tmp_path)
    assert again.returncode == 0 and "resumed from step 4 " in again.stdout, again.stderr[-3000:]
    for a, b in zip(params_of(tmp_path / "killed", 6), params_of(whole, 6), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: routing included
    bias = state_of(whole, 6)
    assert [b.shape for b in bias] == [(4,), (4,)] and np.abs(bias[0]).max() > 0  # per layer and expert, moved
    for a, b in zip(state_of(tmp_path / "killed", 6), bias, strict=True):
        np.testing.assert_array_equal(a, b)

    mesh = run_runner([*MOE_BIAS_RUN, "run.dir=mesh", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], tmp_path,
                      devices=4)
    assert mesh.returncode == 0, mesh.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in read_metrics(whole) if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "mesh") if "loss" in r}
    assert got.keys() == want.keys()
    for step in want:  # measured 4.3e-7 relative (2026-11-28): LOSS_RTOL's 1e-5 (tests/parallel/equivalence.py)
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), step


@pytest.mark.deep
def test_exporting_an_moe_run_is_refused_with_one_paragraph(tmp_path, moe_whole) -> None:
    """MOE_RUN's shared expert: no architecture runner exports (Mixtral, Qwen3-MoE) has one. It
    trains (the run above), and its export is refused naming the key (tests/models/test_moe_hf.py:
    the rest)."""
    from tests.conftest import fork_server, runner_env
    from tests.forked import run

    exported = run(fork_server(), "module", "runner.export", [str(moe_whole[0]), "hf"], tmp_path,
                   runner_env(tmp_path), 300)
    assert exported.returncode == 2 and "Traceback" not in exported.stderr, exported.stderr[-3000:]
    assert "job.model.moe.n_shared_experts=1" in exported.stderr and "Fix:" in exported.stderr  # (MOE_RUN's)
    assert not (tmp_path / "hf").exists()


def test_muon_orthogonalises_each_expert_s_matrices_apart() -> None:
    import flax.linen as nn

    from runner.models.llama.model import Llama
    from runner.optim.optimizers import muon_dimension_numbers, param_axis_names

    variables = jax.eval_shape(Llama(moe_config()).init, jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
    params = nn.meta.unbox(variables)["params"]
    dims = muon_dimension_numbers(params, param_axis_names(params, nn.get_partition_spec(variables)["params"]))
    moe = dims["blocks"]["moe"]  # scanned: (layers, expert, ...) leaves
    assert (moe["gate"].reduction_axis, moe["gate"].output_axis) == (2, (3,))  # embed in, mlp out, per expert
    assert (moe["up"].reduction_axis, moe["up"].output_axis) == (2, (3,))
    assert (moe["down"].reduction_axis, moe["down"].output_axis) == ((2,), 3)  # mlp in, embed out
    assert (moe["router"].reduction_axis, moe["router"].output_axis) == (1, (2,))  # a (embed, expert) matrix


# Mixtral-8x7B (46.7B, 12.9B active per token) and Qwen3-30B-A3B (30.5B, 3.3B activated): the
# jobs conf/job/mixtral_8x7b.yaml and qwen3_30b_a3b.yaml give the published totals to the parameter.
PUBLISHED_MOE = {"mixtral_8x7b": (46_702_792_704, 12_879_925_248), "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
                 "moe_tiny": (None, None)}


@pytest.mark.parametrize("name", PUBLISHED_MOE)
def test_published_moe_shapes_count_every_parameter_and_the_active_ones(name: str) -> None:
    import flax.linen as nn

    from runner.models.llama.model import Llama, LlamaFamily
    from tests.models.test_models import spec_for

    total, active = PUBLISHED_MOE[name]
    cfg = LlamaFamily.config(spec_for(f"job={name}").job.model)
    shapes = nn.unbox(jax.eval_shape(Llama(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    counted = sum(int(np.prod(x.shape)) for _, x in leaves)
    experts = sum(int(np.prod(x.shape)) for path, x in leaves
                  if jax.tree_util.keystr(path).endswith(("'moe']['gate']", "'moe']['up']", "'moe']['down']")))
    unchosen = experts * (cfg.moe_experts - cfg.moe_top_k) // cfg.moe_experts
    assert LlamaFamily.param_count(cfg) == counted == (total or counted)
    assert LlamaFamily.active_param_count(cfg) == counted - unchosen == (active or counted - unchosen)


def test_the_selection_bias_is_state_that_moves_toward_even_load_and_never_gets_a_gradient() -> None:
    """bias_update_rate: the bias lives in TrainState.model_state (not in the parameters, no
    optimizer touches it), shifts which experts are chosen, and after each step moves by the rate
    toward even load: up for the idle experts, down for the busy ones."""
    import optax

    from runner.models.llama.model import Llama
    from runner.train.state import create_state, state_tree
    from runner.train.steps import train_step

    cfg = moe_config(bias_update_rate=0.01)
    inputs = packed_inputs()
    model = Llama(cfg)
    state = create_state(model, optax.adam(1e-2), jax.random.PRNGKey(0), (inputs["tokens"],))
    assert "router_bias" not in str(jax.tree_util.tree_structure(state.params))
    bias = state.model_state["blocks"]["moe"]["router_bias"]
    assert bias.shape == (2, 4) and not np.any(np.asarray(bias))
    assert "model_state" in state_tree(state)
    batch = {"x": inputs["tokens"][None], "y": inputs["tokens"][None], "mask": (inputs["segment_ids"] > 0)[None],
             "segment_ids": inputs["segment_ids"][None], "positions": inputs["positions"][None]}
    step = jax.jit(train_step, static_argnums=3)
    new, _, meta = step(state, batch, jax.random.PRNGKey(1), 1)
    moved = np.asarray(new.model_state["blocks"]["moe"]["router_bias"])
    np.testing.assert_allclose(np.abs(moved), 0.01)  # every expert moved by the rate, one way or the other
    assert (moved > 0).any() and (moved < 0).any() and "model_state" not in meta
    # routing follows the bias: a large bias on expert 3 puts it among every token's two choices
    forced = new.replace(model_state=jax.tree.map(lambda b: b.at[..., 3].set(10.0), new.model_state))
    _, sown = model.apply(forced.variables(), inputs["tokens"], mutable=["reports"])
    np.testing.assert_allclose(sown["reports"]["blocks"]["moe"]["moe/load_max"][0], [2.0, 2.0])  # its share x 2
    after, _, _ = step(forced, batch, jax.random.PRNGKey(1), 1)
    bias = np.asarray(after.model_state["blocks"]["moe"]["router_bias"])
    np.testing.assert_allclose(bias[:, 3], 10.0 - 0.01, rtol=1e-7)  # the busy expert is pushed down
    change = bias[:, :3] - np.asarray(new.model_state["blocks"]["moe"]["router_bias"])[:, :3]
    np.testing.assert_allclose(np.abs(change), 0.01, rtol=1e-5)
    assert ((change > 0).sum(axis=1) >= 2).all()  # the other three share the other half: two at least are idle


def test_under_accumulation_the_bias_moves_by_the_mean_of_the_micro_batches_updates() -> None:
    """train.accumulate_steps=2: the router bias after the step is the mean of what each
    micro-batch's own step would have made it (so an expert busy in one half and idle in the other
    keeps its bias), not the last micro-batch's."""
    import optax

    from runner.models.llama.model import Llama
    from runner.train.state import create_state
    from runner.train.steps import train_step

    cfg = moe_config(bias_update_rate=0.01)
    inputs = packed_inputs()
    state = create_state(Llama(cfg), optax.adam(1e-2), jax.random.PRNGKey(0), (inputs["tokens"],))
    halves = [{"x": tokens[None], "y": tokens[None], "mask": (inputs["segment_ids"] > 0)[None],
               "segment_ids": inputs["segment_ids"][None], "positions": inputs["positions"][None]}
              for tokens in (inputs["tokens"], (inputs["tokens"] * 7 + 5) % 64)]
    step = jax.jit(train_step, static_argnums=3)

    def bias(new: object) -> np.ndarray:
        return np.asarray(new.model_state["blocks"]["moe"]["router_bias"])

    alone = [bias(step(state, half, jax.random.PRNGKey(1), 1)[0]) for half in halves]
    assert not np.array_equal(alone[0], alone[1])  # the halves load the experts differently
    both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *halves)
    np.testing.assert_allclose(bias(step(state, both, jax.random.PRNGKey(1), 2)[0]), (alone[0] + alone[1]) / 2,
                               atol=1e-7)


def test_megablox_s_grouped_matmul_equals_ragged_dot_forward_and_gradients() -> None:
    """dispatch gmm (auto on TPU): megablox's kernel, run here by its interpreter, against
    ragged_dot, rows past the groups' sum included (they come out zero and take no gradient)."""
    from runner.models.common.moe import grouped_matmul

    rows = jax.random.normal(jax.random.PRNGKey(0), (40, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 12))
    sizes = jnp.array([10, 0, 20, 6], jnp.int32)  # 36 of 40 rows
    for kernel in ("ragged_dot", "gmm_interpret"):
        out = grouped_matmul(rows, w, sizes, kernel)
        assert not np.any(np.asarray(out[36:]))
    want = jax.grad(lambda r, w: jnp.sum(jnp.sin(grouped_matmul(r, w, sizes))), argnums=(0, 1))(rows, w)
    got = jax.grad(lambda r, w: jnp.sum(jnp.sin(grouped_matmul(r, w, sizes, "gmm_interpret"))), argnums=(0, 1))(rows, w)
    np.testing.assert_allclose(grouped_matmul(rows, w, sizes, "gmm_interpret"), grouped_matmul(rows, w, sizes),
                               rtol=1e-5, atol=1e-5)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[0][36:]))


def test_dispatch_auto_is_the_platform_s_and_gmm_is_refused_off_tpu() -> None:
    import dataclasses

    from runner.errors import ConfigError
    from runner.models.llama.model import LlamaFamily

    cfg = moe_config(dispatch="auto")
    assert (LlamaFamily.for_platform(cfg, "tpu").moe_dispatch, LlamaFamily.for_platform(cfg, "tpu").moe_kernel) == \
        ("gmm", "gmm")
    assert LlamaFamily.for_platform(cfg, "cpu").moe_dispatch == "ragged"
    assert LlamaFamily.for_platform(cfg, "gpu").moe_native_exchange and not \
        LlamaFamily.for_platform(cfg, "cpu").moe_native_exchange
    with pytest.raises(ConfigError, match=r"job.model.moe.dispatch='gmm'.*TPU kernel.*platform is cpu"):
        LlamaFamily.for_platform(moe_config(dispatch="gmm"), "cpu")
    # the family's dispatches through the model: gmm (interpreted here) gives the reference's logits
    from runner.models.llama.model import Llama

    inputs = packed_inputs()
    base = dataclasses.replace(moe_config(), moe_dispatch="dense")
    params = Llama(base).init(jax.random.PRNGKey(0), inputs["tokens"])["params"]
    want = Llama(base).apply({"params": params}, inputs["tokens"])
    got = Llama(dataclasses.replace(base, moe_dispatch="gmm", moe_kernel="gmm_interpret")).apply(
        {"params": params}, inputs["tokens"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.deep
def test_moe_tiny_learns_with_balanced_experts(tmp_path) -> None:
    """docs/moe.md's tiny job on the embedded corpus: the eval loss falls by more than 2.5 in 160
    steps, and at steps 150 and 160 no expert of any layer takes more than twice its even share of
    the token-slots (measured: 5.77 -> 2.49, the busiest 1.49x)."""
    done = run_runner(["job=moe_tiny", "train.steps=160", "eval.every=160", "checkpoint.every_steps=0",
                       "logging.wandb=disabled", "run.dir=run"], tmp_path, XLA_FLAGS=xla_flags(1, LEARNING))
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    evals = [r["eval/stdlib/loss"] for r in records if "eval/stdlib/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] - 2.5, evals
    late = [r for r in records if "moe/load_max" in r and r["step"] >= 150]
    assert [r["step"] for r in late] == [150, 160]
    assert all(r[f"moe/load_max/{i}"] <= 2.0 for r in late for i in range(4)), late


@pytest.mark.deep
def test_an_moe_run_with_accumulation_document_masks_and_splash_evaluates_the_same_in_mode_eval(tmp_path) -> None:
    """Gradient accumulation, document masking and splash attention (interpreted on a CPU) in one
    MoE run with a selection bias, through `python -m runner`; mode=eval restores the router's
    bias with the parameters and gives the run's own final evaluation. (The bias's update under
    accumulation: the in-process test above.)"""
    import json

    args = [*MOE_RUN, "job.model.moe.bias_update_rate=0.01", "train.accumulate_steps=2", "data.document_mask=true",
            "job.model.attention=splash", "job.model.context_length=128", "train.seq_len=128", "train.steps=4",
            "eval.every=4", "checkpoint.every_steps=4", "run.dir=run"]
    done = run_runner(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attention: splash_interpret" in done.stdout
    final = [r for r in read_metrics(tmp_path / "run") if "eval/stdlib/loss" in r][-1]
    evaluate = ["mode=eval", "eval.checkpoint=run", "logging.wandb=disabled", "eval.rows=16", "eval.batch_size=8"]
    evaluated = run_runner(evaluate, tmp_path)  # the run's evaluation settings (mode=eval takes them from here)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "checkpoints" / "4" / "eval_results.json").read_text())
    assert record["metrics"]["eval/stdlib/loss"] == pytest.approx(final["eval/stdlib/loss"], rel=1e-6)
