"""Quantized training (job.model.quantization, runner.models.common.quantization): every matmul the
scope names runs quantized forward and backward (counted in the step's jaxpr, so a layer left
in bf16 fails), every parameter still learns, refusals, the run card and MFU, mode=compile's
count, the CPU training bound against bf16, SIGKILL resume and the export's parity."""

from __future__ import annotations

import dataclasses
import json
import signal
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from runner.errors import ConfigError
from runner.models.common import quantization
from runner.models.gpt.model import GPTConfig, GPTFamily
from runner.models.llama.model import LlamaConfig, LlamaFamily
from tests.conftest import LEARNING, TINY, read_metrics, run_runner, xla_flags

FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
TOKENS = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, 64)


def matmul_operand_types(jaxpr: Any, counts: dict | None = None) -> dict[tuple[str, str], int]:
    """(lhs dtype, rhs dtype) -> how many matmuls (dot_general, ragged_dot) take them, nested
    jaxprs (scan, remat, custom_vjp) included."""
    counts = {} if counts is None else counts
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot", "ragged_dot_general"):
            key = tuple(str(v.aval.dtype) for v in eqn.invars[:2])
            counts[key] = counts.get(key, 0) + 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    matmul_operand_types(sub.jaxpr, counts)
                elif isinstance(sub, jcore.Jaxpr):
                    matmul_operand_types(sub, counts)
    return counts


def llama(**kw: Any) -> LlamaConfig:
    """Three layers: one dense, two with four experts and a shared expert; nothing recomputed (a
    recomputed forward would run its matmuls twice)."""
    return LlamaConfig(**{**dict(vocab_size=64, context_length=32, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                 head_dim=8, d_ff=64, compute_dtype="bfloat16", moe_experts=4, moe_top_k=2,
                                 moe_d_ff=16, moe_shared=1, moe_first_dense=1, moe_dispatch="ragged",
                                 moe_kernel="ragged_dot", remat="none"), **kw})


def gpt(**kw: Any) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4,
                               compute_dtype="bfloat16", remat="none"), **kw})


def forward_matmuls(family: Any, cfg: Any, scope: tuple[str, ...]) -> int:
    """The quantized matmul calls one forward pass should make, counted from the config alone (a
    scanned stack's body is traced once): 4 attention projections a layer, 3 dense MLP matmuls
    (gpt: 2), 3 grouped expert matmuls and 3 shared-expert ones, 1 output head."""
    if family is GPTFamily:
        layers = dense = 1 if cfg.scan_layers else cfg.n_layers
        moe, mlp = 0, 2
    else:
        dense_layers, moe_layers = cfg.moe_first_dense, cfg.n_layers - cfg.moe_first_dense
        if cfg.scan_layers:
            dense_layers, moe_layers = min(dense_layers, 1), min(moe_layers, 1)
        layers, dense, moe, mlp = dense_layers + moe_layers, dense_layers, moe_layers, 3
    return (4 * layers * ("attention" in scope) + mlp * dense * ("mlp" in scope)
            + 6 * moe * ("experts" in scope) + ("head" in scope))


CASES = [(LlamaFamily, llama, scan, fmt) for scan in (True, False) for fmt in ("int8", "fp8")] + [
    (GPTFamily, gpt, False, "fp8")]


@pytest.mark.parametrize("family,make,scan,fmt", CASES)
def test_every_matmul_in_scope_runs_quantized_both_ways_and_every_parameter_learns(family, make, scan, fmt) -> None:
    """The step's jaxpr: each in-scope matmul takes quantized operands forward (e4m3 or int8) and
    both of its gradient matmuls do too (e5m2 gradients for fp8), no more and no fewer; the
    router, the attention scores and out-of-scope matmuls stay in bf16/float32."""
    scope = ("attention", "mlp", "experts", "head") if family is LlamaFamily else ("attention", "mlp", "head")
    cfg = make(scan_layers=scan)
    plain = family.module(cfg)
    variables = plain.init(jax.random.PRNGKey(1), TOKENS)
    model = family.module(dataclasses.replace(cfg, quantization=fmt, quantization_scope=scope))

    def loss(params: Any) -> jax.Array:
        return jnp.mean(jnp.sin(model.apply({**variables, "params": params}, TOKENS)))

    counts = matmul_operand_types(jax.make_jaxpr(jax.grad(loss))(variables["params"]).jaxpr)
    calls = forward_matmuls(family, cfg, scope)
    if fmt == "fp8":
        assert counts.pop(("float8_e4m3fn", "float8_e4m3fn")) == calls  # forward
        assert counts.pop(("float8_e5m2", "float8_e4m3fn"), 0) + counts.pop(("float8_e4m3fn", "float8_e5m2"), 0) \
            == 2 * calls  # each matmul's two gradients, the incoming gradient in e5m2
    else:
        assert counts.pop(("int8", "int8")) == 3 * calls
    assert not [k for k in counts if set(k) - {"bfloat16", "float32"}], counts  # the rest unquantized
    grads = jax.jit(jax.grad(loss))(variables["params"])
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        g = np.asarray(jax.tree.leaves(g)[0], np.float32)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, jax.tree_util.keystr(path)  # nothing frozen
    recorded = quantization.provider_of(model).quantized
    assert not [p for p, op in recorded if p.endswith("moe") and op == "dot_general"]  # never the router


@pytest.mark.parametrize("scope", ["attention", "mlp", "experts", "head"])
def test_each_scope_alone_changes_the_output_and_none_changes_nothing(scope: str) -> None:
    cfg = llama()
    plain = LlamaFamily.module(cfg)
    variables = plain.init(jax.random.PRNGKey(1), TOKENS)
    want = np.asarray(plain.apply(variables, TOKENS))
    none = LlamaFamily.module(dataclasses.replace(cfg, quantization="none", quantization_scope=(scope,)))
    np.testing.assert_array_equal(np.asarray(none.apply(variables, TOKENS)), want)
    model = LlamaFamily.module(dataclasses.replace(cfg, quantization="fp8", quantization_scope=(scope,)))
    got = np.asarray(model.apply(variables, TOKENS))
    assert 0 < np.abs(got - want).max() < 0.1 * np.abs(want).max()  # quantized, and still the same model
    kinds = {p.split("/")[-1] if "/" in p else p for p, _ in quantization.provider_of(model).quantized}
    assert kinds == {"attention": {"query", "key", "value", "out"}, "mlp": {"gate", "up", "down"},
                     "experts": {"moe", "shared_gate", "shared_up", "shared_down"}, "head": {"lm_head"}}[scope]


def spec_for(*overrides: str) -> Any:
    from tests.test_spec import spec_for as compose

    return compose(*overrides)


@pytest.mark.parametrize("overrides,key,needle", [
    (["job.model.quantization=fp8", "topology=v5litepod-4"], "job.model.quantization", "v5e chips"),
    (["job.model.quantization=fp8", "topology=v6e-8"], "job.model.quantization", "no fp8 matrix units"),
    (["job.model.quantization=fp8", "topology=a100-8"], "job.model.quantization", "use job.model.quantization=int8"),
    (["job.model.quantization=int8", "topology=v3-8"], "job.model.quantization", "use job.model.quantization=none"),
    (["job.model.quantization=int4"], "job.model.quantization", "fp8, int8, none"),
    (["job.model.quantization=int8", "job.model.quantization_scope=[attention,embeddings]"],
     "job.model.quantization_scope", "'embeddings'"),
    (["job.model.quantization=int8", "job.model.quantization_scope=[]"], "job.model.quantization_scope",
     "would change nothing"),
    (["job.model.quantization=int8", "job.model.quantization_scope=[experts]"], "job.model.quantization_scope",
     "no experts matmuls"),
    (["job=moe_tiny", "job.model.quantization=fp8", "job.model.quantization_scope=[mlp]"],
     "job.model.quantization_scope", "every layer has experts"),
    (["job=moe_tiny", "job.model.quantization=fp8", "job.model.moe.dispatch=gmm"], "job.model.moe.dispatch",
     "train unquantized"),
    (["job.model.quantization=fp8", "job.model.family=tests.family_fixture:UnigramFamily"], "job.model.quantization",
     "does not quantize"),
    (["job.model.quantization_scaling=row"], "job.model.quantization_scaling", "auto, channel, tensor"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_key(overrides, key, needle) -> None:
    with pytest.raises(ConfigError) as err:
        spec_for("job=llama_tiny", *overrides)
    assert err.value.key == key and needle in str(err.value), str(err.value)


def test_the_platform_s_slow_cases_are_warned_and_fast_ones_are_not() -> None:
    from runner.parallel.topology import CHIPS

    model = spec_for("job=llama_tiny", "job.model.quantization=int8").job.model
    assert any("for testing only" in w for w in quantization.check(model, "cpu"))
    assert any("slower than bf16" in w for w in quantization.check(model, "gpu", CHIPS["h100"]))
    assert any("no faster" in w for w in quantization.check(model, "tpu", CHIPS["v4"]))
    assert quantization.check(model, "tpu", CHIPS["v6e"]) == []
    fp8 = dataclasses.replace(model, quantization="fp8")
    assert quantization.check(fp8, "gpu", CHIPS["h100"]) == []
    assert any("not published" in w for w in quantization.check(model, "tpu", CHIPS["tpu7x"]))


def test_mfu_stays_against_bf16_and_the_format_s_own_is_reported_beside_it() -> None:
    from runner.observability.throughput import Throughput
    from runner.parallel.topology import parse_topology

    devices = jax.devices()[:1]
    fp8 = Throughput.for_run(1e9, parse_topology("h100-1"), devices, "fp8")
    rates = fp8.rates(400_000.0)
    assert rates["mfu"] == pytest.approx(400e12 / 989e12) and rates["mfu_fp8"] == pytest.approx(400e12 / 1979e12)
    assert "bf16 peak" in fp8.describe() and "mfu_fp8 against its peak, 1.98e+03 TFLOP/s" in fp8.describe()
    int8 = Throughput.for_run(1e9, parse_topology("v5p-8"), devices, "int8").rates(100_000.0)
    assert int8["mfu_int8"] == pytest.approx(int8["mfu"] / 2)  # v5p: 918 int8 TOPS against 459 bf16 TFLOP/s
    assert "mfu_fp8" not in Throughput.for_run(1e9, parse_topology("h100-1"), devices).rates(1.0)


def test_the_compile_report_counts_matmuls_by_their_operands() -> None:
    from runner.parallel.compile import quantized_matmuls

    hlo = "\n".join([
        "  %p0 = s8[8,4]{1,0} parameter(0)", "  %fusion.1 = s8[4,16]{1,0} fusion(%x), kind=kLoop",
        "  %c = f32[8,4]{1,0} parameter(1)", "  %d = f32[4,16]{1,0} parameter(2)",
        "  %e = f8e4m3fn[8,4]{1,0} bitcast(%y)", "  %f = f8e4m3fn[16,4]{1,0} bitcast(%z)",
        "  %conv.1 = bf16[8,16]{1,0} convolution(%p0, %fusion.1), dim_labels=bf_io->bf",  # int8 in, bf16 out
        "  %dot.2 = f32[8,16]{1,0} dot(%c, %d), lhs_contracting_dims={1}",
        "  %dot.3 = f32[8,16]{1,0} dot(%p0, %d), lhs_contracting_dims={1}",  # one int8 operand: not int8
        '  %g = (bf16[8,16]{1,0}, s8[1024]{0}) custom-call(%e, %f), custom_call_target="__cublas$lt$matmul$f8"',
        '  %h = (bf16[8,16]{1,0}, s8[1024]{0}) custom-call(%c, %d), custom_call_target="__cublas$lt$matmul"',
        '  %s = f32[8] custom-call(%c), custom_call_target="Sharding"'])
    assert quantized_matmuls(hlo) == {"int8": 1, "fp8": 1, "all": 5}


QUANT_RUN = [*TINY, "job=llama_tiny", "job.model.n_kv_heads=2", "job.model.head_dim=16", "train.steps=6",
             "checkpoint.every_steps=2", "eval.every=3", "job.model.compute_dtype=bfloat16"]


@pytest.mark.deep
def test_llama_tiny_in_int8_and_fp8_learns_within_0_05_of_bf16_in_100_steps(tmp_path) -> None:
    """docs/speed.md's bound, on the embedded corpus: after 100 steps the eval loss of the int8 and
    fp8 runs is within 0.05 of the bf16 run's (measured: bf16 2.6991, int8 2.7006, fp8 2.6944,
    from 5.78 at step 0; after 150 steps 2.4642, 2.4734, 2.4862; after 300 as small: 2.1225, 2.1001,
    2.1338). The three runs are one sweep: one process."""
    done = run_runner(["-m", "job=llama_tiny", "job.model.compute_dtype=bfloat16",
                       "job.model.quantization=none,int8,fp8", "train.steps=100", "eval.every=100",
                       "checkpoint.every_steps=0", "logging.wandb=disabled", "run.sweep=q"], tmp_path,
                      XLA_FLAGS=xla_flags(1, LEARNING))
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = tmp_path / "runs" / "sweeps" / "q"
    members = json.loads((sweep / "summary.json").read_text())["members"]
    assert [m["status"] for m in members] == ["finished"] * 3, members
    finals = {}
    for member in members:
        run = tmp_path / member["run_dir"]
        fmt = next(o.split("=")[1] for o in member["overrides"] if o.startswith("job.model.quantization="))
        finals[fmt] = [r["eval/stdlib/loss"] for r in read_metrics(run) if "eval/stdlib/loss" in r]
        if fmt != "none":
            card = (run / "RUN_CARD.md").read_text()
            assert f"quantization: {fmt} via Qwix" in card and "28 modules" in card, card  # 4 layers x 7
    assert sorted(finals) == ["fp8", "int8", "none"]
    assert done.stdout.count("for testing only") >= 2  # the CPU emulates the quantized matmuls
    assert finals["none"][0] - finals["none"][1] > 3.0, finals  # it learned
    for fmt in ("int8", "fp8"):  # close, and not the unquantized run's (the formats train another model)
        assert abs(finals[fmt][1] - finals["none"][1]) < 0.05 and finals[fmt][1] != finals["none"][1], finals


@pytest.mark.deep
def test_an_fp8_run_resumes_bit_exact_after_sigkill_and_exports_plain_weights(tmp_path) -> None:
    """Dynamic scaling keeps no state, so the checkpoint is the plain one and a killed fp8 run
    ends bitwise where an uninterrupted one does; its export is float32 weights with no
    quantization in config.json, which transformers runs as runner's unquantized forward does.
    (That fp8 trains another model than the plain run: the 100-step test above.)"""
    import safetensors.numpy
    import torch
    import transformers

    from tests.conftest import fork_server, runner_env
    from tests.forked import run as forked
    from tests.train.test_restore import params_of

    run = [*QUANT_RUN, "job.model.quantization=fp8"]
    whole = run_runner([*run, "run.dir=whole"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run_runner([*run, "run.dir=killed"], tmp_path, RUNNER_FAULT="kill_at_step:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    again = run_runner([*run, "run.dir=killed"], tmp_path)
    assert again.returncode == 0 and "resumed from step 2 " in again.stdout, again.stderr[-3000:]
    final = params_of(tmp_path / "whole", 6)
    for a, b in zip(params_of(tmp_path / "killed", 6), final, strict=True):
        np.testing.assert_array_equal(a, b)

    exported = forked(fork_server(), "module", "runner.export", ["whole", "hf"], tmp_path, runner_env(tmp_path), 600)
    assert exported.returncode == 0, exported.stderr[-3000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config
    weights = safetensors.numpy.load_file(next((tmp_path / "hf").glob("*.safetensors")))
    assert {str(w.dtype) for w in weights.values()} == {"float32"}  # the parameters, dequantized by nature

    spec = spec_for(*run, f"run.dir={tmp_path / 'whole'}")
    from runner.train.job import JOBS

    job = JOBS.get("lm")(spec)
    job.load()
    tokens = np.random.default_rng(0).integers(0, 320, (2, 16))
    # the exported weights are the trained parameters: runner's plain forward in float32 is
    # transformers' float32 forward of the export, to float32 rounding
    unquantized = LlamaFamily.module(dataclasses.replace(job.model_config, quantization="none",
                                                         compute_dtype="float32"))
    ours = np.asarray(unquantized.apply({"params": job.state.params}, jnp.asarray(tokens)), np.float32)
    quantized = np.asarray(job.model.apply({"params": job.state.params}, jnp.asarray(tokens)), np.float32)
    job.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    scale = np.abs(ours).max()
    assert np.abs(theirs - ours).max() < 1e-4 * scale, np.abs(theirs - ours).max() / scale
    assert np.abs(quantized - ours).max() > 100 * np.abs(theirs - ours).max()  # the fp8 forward is another


def test_a_refused_format_is_one_paragraph_and_leaves_nothing(tmp_path, monkeypatch, capsys) -> None:
    """The command's own check (refused_in_process: exit 2, one line; tests/test_spec.py shows a
    refusal of the built spec end to end), in an empty directory that stays empty."""
    from tests.conftest import refused_in_process

    monkeypatch.chdir(tmp_path)
    line = refused_in_process([*QUANT_RUN, "job.model.quantization=fp8", "topology=v5litepod-4", "mode=compile",
                               "run.dir=run"], capsys, build=True)
    assert "job.model.quantization" in line and "Fix:" in line and "int8" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.deep
def test_an_int8_program_compiles_for_a_v5e_topology(tmp_path) -> None:
    compiled = run_runner([*QUANT_RUN, "job.model.quantization=int8", "topology=v5litepod-4", "mode=compile",
                           "run.dir=run"], tmp_path)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    report = json.loads([line for line in compiled.stdout.splitlines() if line.startswith("{")][-1])
    # 2 layers x 7 modules, forward and both gradients, all int8; the rest (attention scores, head) not
    assert report["quantized_matmuls"]["int8"] == 2 * 7 * 3 < report["quantized_matmuls"]["all"], report
    assert "quantization: int8 via Qwix" in compiled.stdout
