"""Pipeline parallelism (mesh.stage, the pipeline section, runner.models.common.pipeline): the gpipe and
circular schedules run every layer in the model's order on every microbatch; stage meshes beside
data, fsdp, tensor and context give the one-device logits, gradients and losses, for both
families, grouped-query attention, scanned and unrolled layers, with packed documents; a run
resumes bit-exact after SIGKILL, moves between meshes with and without stages, and exports to
Hugging Face; the stage axis spans slices; what cannot run in stages is refused at start."""

from __future__ import annotations

import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import TINY, read_metrics, refused_in_process, run_runner
from tests.parallel.equivalence import assert_close_losses, run_script


@pytest.mark.parametrize("stages, microbatches, repeats", [(2, 2, 1), (4, 3, 1), (2, 4, 2), (3, 3, 2), (2, 2, 3)])
def test_the_schedules_run_every_layer_in_order_on_every_microbatch(stages: int, microbatches: int,
                                                                    repeats: int) -> None:
    """A layer that does not commute with the others (h -> h * a + b, its own a and b), 12 layers,
    6 rows with a per-row shared input: the pipelined result is the sequential one for gpipe and
    circular, M below, at and above S, and so is what each layer sums over its rows, added up over
    the microbatches; the iteration count and bubble are the formula's."""
    from runner.models.common.pipeline import Schedule, run

    layers = 12 // (stages * repeats) * stages * repeats
    key_a, key_b, key_x = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"a": jax.random.uniform(key_a, (layers, 5), minval=0.5, maxval=1.5),
              "b": jax.random.normal(key_b, (layers, 5))}
    x = jax.random.normal(key_x, (6 * microbatches, 5))
    shared = (jnp.arange(6 * microbatches, dtype=jnp.float32)[:, None], None)

    def layer(w, h, sh):  # and each row's input summed: what an MoE layer sums over a microbatch
        return h * w["a"] + w["b"] + 0.01 * sh[0], {"sum": jnp.sum(h, axis=0)}

    want, want_sums = x, []
    for i in range(layers):
        want, sums = layer(jax.tree.map(lambda w: w[i], params), want, shared)
        want_sums.append(sums["sum"])
    schedule = Schedule(stages, microbatches, repeats)
    got, got_sums = jax.jit(lambda p, h, s: run(layer, p, h, s, schedule, names=("batch", "embed")))(params, x, shared)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_sums["sum"], np.stack(want_sums), rtol=1e-5, atol=1e-5)  # each layer's, all rows
    assert schedule.iterations == microbatches * repeats + stages - 1
    assert schedule.bubble == pytest.approx((stages - 1) / (microbatches * repeats + stages - 1))
    assert schedule.name == ("circular" if repeats > 1 else "gpipe")


EQUIVALENCE = """
import json, dataclasses, jax, jax.numpy as jnp, numpy as np, flax.linen as nn
from runner.parallel.mesh import make_mesh
from runner.models.llama.model import Llama, LlamaConfig, LlamaFamily
from runner.models.gpt.model import GPT, GPTConfig, GPTFamily
from tests.parallel.equivalence import logits_and_grads, relative_error

tokens = jax.random.randint(jax.random.PRNGKey(3), (8, 32), 0, 64)
seg = np.tile(np.array([[1] * 5 + [2] * 3 + [3] * 5 + [4] * 11 + [5] * 8, [1] * 32, [1] * 16 + [2] * 12 + [0] * 4,
                        [1] * 7 + [2] * 25]), (2, 1))
starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1) != 0, np.arange(32), 0), axis=1)
positions, seg = jnp.asarray(np.arange(32) - starts), jnp.asarray(seg)
llama = LlamaConfig(vocab_size=64, context_length=32, d_model=32, n_layers=8, n_heads=4, head_dim=8, d_ff=48,
                    n_kv_heads=2)
gpt = GPTConfig(vocab_size=64, context_length=32, d_model=32, n_layers=8, n_heads=4)
MODELS = {"llama": (Llama, LlamaFamily, llama), "gpt": (GPT, GPTFamily, gpt),
          "unrolled": (Llama, LlamaFamily, dataclasses.replace(llama, scan_layers=False))}
CASES = {"llama": [({"stage": 2, "data": 2}, 2, 1, ""), ({"stage": 2, "fsdp": 2}, 4, 2, ""),
                   ({"stage": 4, "fsdp": 2}, 4, 1, ""), ({"stage": 2, "fsdp": 2, "tensor": 2}, 2, 2, ""),
                   ({"stage": 2, "data": 2, "context": 2}, 2, 1, "allgather"),
                   ({"stage": 2, "fsdp": 2, "context": 2}, 2, 2, "ulysses")],
         "gpt": [({"stage": 2, "fsdp": 2}, 2, 1, ""), ({"stage": 4, "data": 2}, 4, 2, ""),
                 ({"stage": 2, "tensor": 2}, 4, 1, ""), ({"stage": 2, "data": 2, "context": 2}, 2, 2, "ring")],
         "unrolled": [({"stage": 2, "fsdp": 2}, 2, 2, "")]}
out = {}
for name, (Model, Family, cfg) in MODELS.items():
    params = nn.unbox(Model(cfg).init(jax.random.PRNGKey(0), tokens)["params"])
    want, _ = logits_and_grads(Model(cfg), params, tokens, seg, positions)
    for axes, microbatches, repeats, kind in CASES[name]:
        c = dataclasses.replace(cfg, pipeline_stages=axes["stage"], pipeline_microbatches=microbatches,
                                pipeline_repeats=repeats, context_parallel=kind or "auto")
        shape = {"data": 1, "fsdp": 1, "tensor": 1, **axes}
        size = int(np.prod(list(shape.values())))
        with jax.set_mesh(make_mesh(shape, jax.devices()[:size])), nn.logical_axis_rules(Family.axis_rules(c, shape)):
            got, text = logits_and_grads(Model(c), params, tokens, seg, positions, compiled=True)
        key = f"{name}/" + "/".join(f"{k}{v}" for k, v in axes.items()) + f"/m{microbatches}/r{repeats}/{kind}"
        out[key] = [relative_error(got, want), "collective-permute" in text]

# an MoE: the loss with its balancing terms, the reports and the router bias's update as well
from runner.models.common.layers import LOSSES, REPORTS, MODEL_STATE
from runner.train.steps import reports
moe = dataclasses.replace(llama, n_layers=4, moe_experts=4, moe_top_k=2, moe_d_ff=16, moe_shared=1, moe_bias_rate=0.01)


def moe_step(model, variables):
    def loss(p):
        out, sown = model.apply({"params": p, MODEL_STATE: variables[MODEL_STATE]}, tokens, segment_ids=seg,
                                positions=positions, mutable=[LOSSES, REPORTS, MODEL_STATE])
        balancing = sum(jnp.sum(leaf) for leaf in jax.tree.leaves(sown[LOSSES]))
        return jnp.sum(jnp.sin(out)) + 100 * balancing, (out, reports(sown[REPORTS]), sown[MODEL_STATE])
    executable = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(variables["params"]).compile()  # once
    return executable(variables["params"]), executable.as_text()


variables = nn.unbox(Llama(moe).init(jax.random.PRNGKey(0), tokens))
want, _ = moe_step(Llama(moe), variables)
for axes, microbatches, repeats in [({"stage": 2, "data": 2}, 2, 1), ({"stage": 2, "fsdp": 2}, 4, 2),
                                    ({"stage": 2, "expert": 2, "fsdp": 2}, 2, 1)]:
    c = dataclasses.replace(moe, pipeline_stages=2, pipeline_microbatches=microbatches, pipeline_repeats=repeats)
    shape = {"data": 1, "fsdp": 1, "tensor": 1, **axes}
    with jax.set_mesh(make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])), \
            nn.logical_axis_rules(LlamaFamily.axis_rules(c, shape)):
        got, text = moe_step(Llama(c), variables)
    key = "moe/" + "/".join(f"{k}{v}" for k, v in axes.items()) + f"/m{microbatches}/r{repeats}"
    out[key] = [relative_error(got, want), "collective-permute" in text]
print(json.dumps(out))
"""


@pytest.mark.deep
def test_stage_meshes_give_the_one_device_logits_and_gradients(tmp_path) -> None:
    """8 CPU devices, meshes of 4 and 8: stage 2 and 4 beside data, fsdp, tensor and context
    (allgather, ring, ulysses), gpipe and circular, microbatches at and above the stages, for llama
    (grouped-query, scanned and unrolled), gpt and an MoE llama (beside data, fsdp, and expert with
    fsdp), with packed documents: the logits and every gradient within float32 rounding of one
    device's, and for the MoE also its balancing losses, reports and router-bias update; each
    compiled program passes activations between stages (collective permutes)."""
    out = run_script(EQUIVALENCE, tmp_path, devices=8)
    assert len(out) == 14
    for name, (error, passed_on) in out.items():
        assert error < 1e-5, (name, error)
        assert passed_on, name


# scanned layers: the stacked parameters are the ones split over the stages in the checkpoints
RUN = [*TINY, "job=llama_tiny", "job.model.n_layers=4", "job.model.n_kv_heads=1", "job.model.scan_layers=true",
       "data.document_mask=true", "train.steps=20", "checkpoint.every_steps=10", "eval.every=10"]
GPIPE = ["mesh.stage=2", "mesh.data=2", "pipeline.microbatches=2"]
CIRCULAR = ["mesh.stage=2", "mesh.data=1", "mesh.fsdp=2", "pipeline.schedule=circular", "pipeline.repeats=2",
            "pipeline.microbatches=4"]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.e2e
def test_stages_train_the_one_device_curve_resume_bit_exact_move_meshes_and_export(tmp_path) -> None:
    """20 steps of packed documents through `python -m runner` on 4 devices, scanned layers: gpipe
    (stage 2 x data 2) and circular (stage 2 x fsdp 2, 2 rounds) match one device's losses and say their schedule
    and bubble at launch; a gpipe run killed at step 12 resumes bit-exact; a circular run killed at
    12 resumes without stages (data 4), and that run, killed in turn, resumes in gpipe stages, both
    onto the one-device curve (the saved layout is the same); the pipelined checkpoint exports
    to a Hugging Face model whose logits are the one-device model's on it."""
    from tests.train.test_restore import params_of

    one = run_runner([*RUN, "run.dir=one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    want = losses(tmp_path / "one")
    assert sorted(want) == list(range(1, 21)) and want[20] < want[1]
    for name, mesh in (("gpipe", GPIPE), ("circular", CIRCULAR)):
        done = run_runner([*RUN, *mesh, f"run.dir=whole/{name}"], tmp_path, devices=4)
        assert done.returncode == 0, done.stderr[-3000:]
        assert_close_losses(losses(tmp_path / "whole" / name), want, range(1, 21), name)
    assert ("pipeline: gpipe: 2 stages of 2 layers, 2 microbatches, 3 iterations, bubble 33.3%"
            in (tmp_path / "whole" / "gpipe" / "RUN_CARD.md").read_text())
    assert ("pipeline: circular: 2 stages of 1 layer, round them 2 times, 4 microbatches, 9 iterations, bubble 11.1%"
            in (tmp_path / "whole" / "circular" / "RUN_CARD.md").read_text())

    killed = run_runner([*RUN, *GPIPE, "run.dir=killed/gpipe"], tmp_path, devices=4, RUNNER_FAULT="kill_at_step:12")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    again = run_runner([*RUN, *GPIPE, "run.dir=killed/gpipe"], tmp_path, devices=4)
    assert again.returncode == 0 and "resumed from step 10 " in again.stdout, again.stdout[-3000:]
    for a, b in zip(params_of(tmp_path / "killed" / "gpipe", 20), params_of(tmp_path / "whole" / "gpipe", 20),
                    strict=True):
        np.testing.assert_array_equal(a, b)

    # the moves, chained in one run directory (saves every 5 steps: each leg resumes from the one
    # before it): circular killed at 12; relaunched without stages (data 4), it resumes from
    # circular's 10, saves 15 and is killed at 17; relaunched in gpipe stages, it resumes from that 15
    moved = [*RUN, "run.dir=moved", "checkpoint.every_steps=5"]
    legs = ((CIRCULAR, "kill_at_step:12", None), (["mesh.data=4"], "kill_at_step:17", 10), (GPIPE, "", 15))
    for mesh, fault, resumed in legs:
        leg = run_runner([*moved, *mesh], tmp_path, devices=4, **({"RUNNER_FAULT": fault} if fault else {}))
        assert leg.returncode == (-signal.SIGKILL if fault else 0), leg.stderr[-3000:]
        if resumed is not None:
            assert f"resumed from step {resumed} " in leg.stdout, leg.stdout[-3000:]
        if resumed == 10:  # the steps without stages, before the next leg logs over them
            assert_close_losses(losses(tmp_path / "moved"), want, range(11, 17), "circular -> flat")
    assert_close_losses(losses(tmp_path / "moved"), want, range(16, 21), "flat -> gpipe")
    assert_exports_as_one_device(tmp_path, tmp_path / "whole" / "gpipe")


GPT = [*TINY, "job=gpt_tiny", "job.model.n_layers=4", "job.model.scan_layers=true", "data.document_mask=true",
       "train.steps=20", "checkpoint.every_steps=20", "eval.every=0"]


@pytest.mark.deep
def test_gpt_in_circular_stages_trains_the_one_device_curve(tmp_path) -> None:
    """`python -m runner`, gpt_tiny (learned positions, tied head), 20 steps with packed documents:
    in 2 circular stages of 2 rounds beside data 2, each step's loss is one device's (llama's
    20-step runs are above; gpt's logits and gradients in the 8-device equivalence)."""
    one = run_runner([*GPT, "run.dir=one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    staged = run_runner([*GPT, "mesh.stage=2", "mesh.data=2", "pipeline.schedule=circular", "pipeline.repeats=2",
                         "pipeline.microbatches=2", "run.dir=staged"], tmp_path, devices=4)
    assert staged.returncode == 0, staged.stderr[-3000:]
    card = (tmp_path / "staged" / "RUN_CARD.md").read_text()
    assert "pipeline: circular: 2 stages of 1 layer, round them 2 times, 2 microbatches" in card
    want = losses(tmp_path / "one")
    assert sorted(want) == list(range(1, 21)) and want[20] < want[1]
    assert_close_losses(losses(tmp_path / "staged"), want, range(1, 21), "gpt circular")


MOE = [*TINY, "job=moe_tiny", "data.document_mask=true", "train.steps=20", "checkpoint.every_steps=10", "eval.every=0"]
MOE_STAGES = ["mesh.stage=2", "mesh.expert=2", "mesh.data=1", "pipeline.microbatches=2"]


@pytest.mark.deep
def test_an_moe_in_stages_trains_the_one_device_curve_and_resumes_bit_exact(tmp_path) -> None:
    """`python -m runner`, moe_tiny (2 unrolled layers of 8 experts, the balancing and z losses, the
    router's selection bias), 20 steps: in 2 gpipe stages beside 2 expert ways, each step's loss,
    balancing loss and largest expert load are one device's (a stage routes one microbatch at a
    time, and the sums of every microbatch make the batch's terms and bias update); killed at step
    12, it resumes bit-exact, parameters and router bias."""
    one = run_runner([*MOE, "run.dir=one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    whole = run_runner([*MOE, *MOE_STAGES, "run.dir=whole"], tmp_path, devices=4)
    assert whole.returncode == 0, whole.stderr[-3000:]
    want, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "whole")
    for name in ("loss", "moe/aux_loss", "moe/load_max"):
        assert_close_losses({r["step"]: r[name] for r in got if name in r},
                            {r["step"]: r[name] for r in want if name in r}, range(1, 21), name)
    bias_one, bias_staged = (state_of(tmp_path / run, 20, "model_state") for run in ("one", "whole"))
    assert all(np.any(b != 0) for b in bias_one)  # 20 updates of the selection bias, as one device made them
    for a, b in zip(bias_staged, bias_one, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    killed = run_runner([*MOE, *MOE_STAGES, "run.dir=killed"], tmp_path, devices=4, RUNNER_FAULT="kill_at_step:12")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    again = run_runner([*MOE, *MOE_STAGES, "run.dir=killed"], tmp_path, devices=4)
    assert again.returncode == 0 and "resumed from step 10 " in again.stdout, again.stderr[-3000:]
    for a, b in zip(state_of(tmp_path / "killed", 20), state_of(tmp_path / "whole", 20), strict=True):
        np.testing.assert_array_equal(a, b)


def state_of(run_dir: Path, step: int, *parts: str) -> list[np.ndarray]:
    """The checkpoint's `parts` (its parameters and model state, the router bias), as plain arrays."""
    import orbax.checkpoint as ocp

    path = (run_dir / "checkpoints" / str(step) / "state").absolute()
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        state = checkpointer.restore(path, args=ocp.args.StandardRestore(
            fallback_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    assert jax.tree.leaves(state["model_state"]), sorted(state)
    return [np.asarray(x) for x in jax.tree.leaves([state[p] for p in parts or ("params", "model_state")])]


def assert_exports_as_one_device(tmp_path: Path, run_dir: Path) -> None:
    """`python -m runner.export` of the run's newest checkpoint: transformers loads every weight,
    and its logits are runner's one-device model's on the checkpoint's parameters."""
    import torch
    import transformers
    from flax import linen as nn
    from flax import serialization

    from runner.models import model_config
    from runner.models.llama.model import Llama
    from tests.conftest import fork_server, runner_env
    from tests.forked import run
    from tests.test_spec import spec_for

    out = run(fork_server(), "module", "runner.export", [str(run_dir), "hf"], tmp_path, runner_env(tmp_path), 600)
    assert out.returncode == 0, out.stderr[-3000:]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    config = model_config(spec_for(*RUN))
    template = nn.unbox(Llama(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32))["params"])
    from tests.train.test_restore import params_of

    params = serialization.from_state_dict(template, jax.tree.unflatten(jax.tree.structure(template),
                                                                        params_of(run_dir, 20)))
    tokens = np.arange(64).reshape(2, 32) % 250
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(Llama(config).apply({"params": params}, jnp.asarray(tokens)))
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


REFUSED = [
    (["mesh.stage=3", "job.model.n_layers=4"], "mesh.stage=3", "does not divide them"),
    (["mesh.stage=2", "pipeline.schedule=circular", "pipeline.repeats=4", "job.model.n_layers=4"], "mesh.stage=2",
     "mesh.stage=2 x pipeline.repeats=4 = 8 does not divide them"),
    (["mesh.stage=2", "pipeline.schedule=circular"], "pipeline.repeats=1", "at least twice"),
    (["mesh.stage=2", "pipeline.repeats=2"], "pipeline.repeats=2", "gpipe schedule runs each stage's layers once"),
    (["mesh.stage=2", "pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.microbatches=1",
      "job.model.n_layers=4"], "pipeline.microbatches=1", "at least one microbatch per stage"),
    (["mesh.stage=2", "pipeline.microbatches=3"], "pipeline.microbatches=3", "cut into 3 microbatches"),
    (["topology=cpu-8", "mesh.stage=2", "mesh.data=4", "pipeline.microbatches=4"], "pipeline.microbatches=4",
     "of 4 rows each"),
    (["pipeline.microbatches=4"], "pipeline.microbatches=4", "mesh.stage=1: there is one stage"),
    (["pipeline.schedule=circular"], "pipeline.schedule='circular'", "mesh.stage=1"),
    (["mesh.stage=-1"], "mesh.stage=-1", "a positive count"),
    (["mesh.stage=0"], "mesh.stage=0", "a positive count"),
    (["job=moe_tiny", "mesh.stage=2", "job.model.moe.dispatch=capacity"], "job.model.moe.dispatch='capacity'",
     "other tokens than the one-stage run"),
    (["job=moe_tiny", "mesh.stage=2", "job.model.moe.first_dense_layers=1"], "job.model.moe.first_dense_layers=1",
     "two stacks"),
    (["topology=cpu-8", "mesh.stage=2", "mesh.context=4", "mesh.data=1", "job.model.context_parallel=usp"],
     "job.model.context_parallel='usp'", "no form inside the stages"),
    (["mesh.stage=2", "job.model.quantization=int8"], "job.model.quantization='int8'", "module paths"),
    (["job=gpt_tiny", "mesh.stage=2", "job.model.dropout=0.1"], "job.model.dropout=0.1", "dropout masks"),
    (["topology=3xv5p-8", "mode=compile", "mesh.stage=2", "mesh.data=-1", "train.batch_size=12",
      "eval.batch_size=12"], "mesh.stage=2",
     "multiple of the slice count"),
]


@pytest.mark.parametrize("overrides, key, reason", REFUSED, ids=[r[1] + "/" + r[0][-1] for r in REFUSED])
def test_what_cannot_run_in_stages_is_refused_at_start(overrides, key, reason, capsys, tmp_path, monkeypatch) -> None:
    """Each one line naming the key and value, exit 2, nothing written: layers that do not split
    into the stages (times the rounds), a schedule's repeats, microbatches that the batch (split
    over the batch's devices) does not divide or circular's fewer than the stages, pipeline
    settings without stages, a stage count that is not a count, and what is not proven in stages
    (an MoE's capacity dispatch, usp, quantization, dropout); MoE dense layers that do not split;
    stages across slices that do not divide."""
    monkeypatch.chdir(tmp_path)
    line = refused_in_process([*TINY, "job=llama_tiny", *overrides], capsys, build=True)
    assert key in line and reason in line, line
    assert not any(tmp_path.iterdir())
