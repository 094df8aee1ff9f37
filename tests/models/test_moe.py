"""The mixture-of-experts block's dispatches against the plain reference (every expert on every
token, masked by the routing), forward and gradients, in float32; the balancing terms' values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models.moe import (balance_loss, capacity, capacity_experts, dense_experts, expert_load, ragged_experts,
                               route, updated_bias, z_loss)
from tests.conftest import TINY, read_metrics, run_runner

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
    from runner.models.llama import LlamaFamily
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

    from runner.models.llama import Llama

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


def test_parameter_count_and_flops_count_every_expert_and_the_active_ones() -> None:
    from runner.models.llama import Llama, LlamaFamily

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

    from runner.models.llama import Llama
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
    assert set(reported) == {"moe/aux_loss", "moe/z_loss", "moe/load_max", "moe/load_min", "moe/dropped"}
    assert float(reported["moe/load_max"]) >= 1.0 >= float(reported["moe/load_min"])


def test_moe_settings_the_model_cannot_honour_are_refused() -> None:
    from runner.errors import ConfigError, UserError
    from runner.models import gpt, llama_hf
    from runner.spec import ModelSpec, MoESpec

    with pytest.raises(ConfigError, match="job.model.moe.n_experts=4.*gpt family has no mixture-of-experts"):
        gpt.GPTFamily.config(ModelSpec(moe=MoESpec(n_experts=4)))
    with pytest.raises(UserError, match="does not map expert tensors"):
        llama_hf.hf_config(moe_config())
    with pytest.raises(UserError, match="does not map expert tensors"):
        llama_hf.layout(moe_config())


MOE_RUN = [*TINY, "job=llama_tiny", "job.model.n_kv_heads=2", "job.model.head_dim=16", "job.model.moe.n_experts=4",
           "job.model.moe.d_ff_expert=32", "job.model.moe.n_shared_experts=1", "train.steps=6",
           "checkpoint.every_steps=2", "eval.every=3"]


@pytest.mark.e2e
def test_an_moe_run_resumes_bit_exact_after_sigkill_and_a_mesh_gives_the_same_numbers(tmp_path) -> None:
    """Through `python -m runner`: the router and every expert are saved and restored exactly; a
    (data 1, fsdp 2, tensor 2) mesh trains the same model as one device, within float32 rounding."""
    import signal

    from tests.train.test_restore import params_of

    whole = run_runner([*MOE_RUN, "run.dir=whole"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    reports = [r for r in read_metrics(tmp_path / "whole") if "moe/aux_loss" in r]
    assert [r["step"] for r in reports] == list(range(1, 7))
    assert all(r["moe/load_max"] >= 1.0 >= r["moe/load_min"] and r["moe/dropped"] == 0.0 for r in reports)
    card = (tmp_path / "whole" / "RUN_CARD.md").read_text()
    assert "active per token" in card  # 4 experts, 2 chosen: fewer parameters per token than in all

    killed = run_runner([*MOE_RUN, "run.dir=killed"], tmp_path, RUNNER_FAULT="kill_at_step:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    again = run_runner([*MOE_RUN, "run.dir=killed"], tmp_path)
    assert again.returncode == 0 and "resumed from step 2 " in again.stdout, again.stderr[-3000:]
    for a, b in zip(params_of(tmp_path / "killed", 6), params_of(tmp_path / "whole", 6), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: routing included

    mesh = run_runner([*MOE_RUN, "run.dir=mesh", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], tmp_path, devices=4)
    assert mesh.returncode == 0, mesh.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "whole") if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "mesh") if "loss" in r}
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-4, abs=2e-4), step


@pytest.mark.e2e
def test_exporting_an_moe_run_is_refused_with_one_paragraph(tmp_path) -> None:
    import subprocess
    import sys

    from tests.conftest import runner_env

    done = run_runner([*MOE_RUN, "run.dir=run", "train.steps=2"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = subprocess.run([sys.executable, "-m", "runner.export", "run", "hf"], cwd=tmp_path,
                              env=runner_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert exported.returncode == 2 and "Traceback" not in exported.stderr, exported.stderr[-3000:]
    assert "job.model.moe.n_experts=4" in exported.stderr and "Fix:" in exported.stderr
    assert not (tmp_path / "hf").exists()


def test_muon_orthogonalises_each_expert_s_matrices_apart() -> None:
    import flax.linen as nn

    from runner.models.llama import Llama
    from runner.optim.optimizers import muon_dimension_numbers, param_axis_names

    variables = jax.eval_shape(Llama(moe_config()).init, jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
    params = nn.meta.unbox(variables)["params"]
    dims = muon_dimension_numbers(params, param_axis_names(params, nn.get_partition_spec(variables)["params"]))
    moe = dims["blocks"]["moe"]  # scanned: (layers, expert, ...) leaves
    assert (moe["gate"].reduction_axis, moe["gate"].output_axis) == (2, (3,))  # embed in, mlp out, per expert
    assert (moe["up"].reduction_axis, moe["up"].output_axis) == (2, (3,))
    assert (moe["down"].reduction_axis, moe["down"].output_axis) == ((2,), 3)  # mlp in, embed out
    assert (moe["router"].reduction_axis, moe["router"].output_axis) == (1, (2,))  # a (embed, expert) matrix


# Mixtral-8x7B (46.7B, 12.9B active per token) and Qwen3-30B-A3B (30.5B, 3.3B activated), as
# transformers' configs give them: the totals are the published models' to the parameter.
PUBLISHED_MOE = {
    "mixtral_8x7b": (dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                          d_ff=14336, tie_embeddings=False), dict(n_experts=8, top_k=2),
                     46_702_792_704, 12_879_925_248),
    "qwen3_30b_a3b": (dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                           d_ff=6144, qk_norm=True, tie_embeddings=False), dict(n_experts=128, top_k=8, d_ff_expert=768),
                      30_532_122_624, 3_353_032_704),
}


@pytest.mark.parametrize("name", PUBLISHED_MOE)
def test_published_moe_shapes_count_every_parameter_and_the_active_ones(name: str) -> None:
    import flax.linen as nn

    from runner.models.llama import Llama, LlamaFamily
    from runner.spec import ModelSpec, MoESpec

    model, moe, total, active = PUBLISHED_MOE[name]
    cfg = LlamaFamily.config(ModelSpec(family="llama", context_length=4096, **model, moe=MoESpec(**moe)))
    shapes = nn.unbox(jax.eval_shape(Llama(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    counted = sum(int(np.prod(x.shape)) for _, x in leaves)
    experts = sum(int(np.prod(x.shape)) for path, x in leaves
                  if jax.tree_util.keystr(path).endswith(("'moe']['gate']", "'moe']['up']", "'moe']['down']")))
    unchosen = experts * (cfg.moe_experts - cfg.moe_top_k) // cfg.moe_experts
    assert LlamaFamily.param_count(cfg) == counted == total
    assert LlamaFamily.active_param_count(cfg) == counted - unchosen == active
