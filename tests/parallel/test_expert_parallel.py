"""Expert parallelism (mesh.expert): the mixture of experts on a 4-device CPU mesh gives the
one-device model's logits, gradients and losses, dropless (ragged all-to-all) and by capacity
(GShard's all-to-all), with packed documents; a run resumes onto another expert size."""

from __future__ import annotations

import signal

import pytest

from runner.errors import ConfigError
from tests.conftest import TINY, read_metrics, run_runner
from tests.parallel.equivalence import assert_close_losses, run_script

EQUIVALENCE = """
import json, dataclasses, jax, jax.numpy as jnp, flax.linen as nn
from tests.models.test_moe import moe_config
from runner.parallel.mesh import make_mesh
from runner.models.llama.model import Llama, LlamaFamily
from tests.parallel.equivalence import logits_and_grads, relative_error

tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 16), 0, 64)
segment_ids = jnp.array([[1] * 6 + [2] * 10, [1] * 12 + [0] * 4, [1] * 16, [1] * 3 + [2] * 3 + [3] * 10])
positions = jnp.array([[*range(6), *range(10)], [*range(12), 0, 0, 0, 0], [*range(16)], [*range(3)] * 2 + [*range(10)]])
base = moe_config(n_shared_experts=1)
params = nn.unbox(Llama(base).init(jax.random.PRNGKey(0), tokens)["params"])

def run(cfg):
    return logits_and_grads(Llama(cfg), params, tokens, segment_ids, positions)

(want, _) = run(dataclasses.replace(base, moe_dispatch="dense"))
out = {}
for shape in ({"data": 2, "fsdp": 1, "expert": 2, "tensor": 1}, {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1},
              {"data": 1, "fsdp": 2, "expert": 1, "tensor": 2}, {"data": 1, "fsdp": 1, "expert": 2, "tensor": 2},
              {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}, {"data": 1, "fsdp": 1, "expert": 2, "context": 2,
                                                                "tensor": 1}):
    for dispatch, extra in (("ragged", {}), ("capacity", {"moe_capacity_factor": 8.0})):
        cfg = dataclasses.replace(base, moe_dispatch=dispatch, **extra)
        with jax.set_mesh(make_mesh(shape)), nn.logical_axis_rules(LlamaFamily.axis_rules(cfg, shape)):
            got, text = run(cfg)
        name = "/".join(f"{k}{v}" for k, v in shape.items() if v > 1) + "/" + dispatch
        out[name] = {"error": relative_error(got, want),
                     "all_to_all": "all_to_all" in text or "all-to-all" in text}
# rows split over context by ulysses (heads exchanged by all-to-all) beside the expert axis
shape = {"data": 1, "fsdp": 1, "expert": 2, "context": 2, "tensor": 1}
cfg = dataclasses.replace(base, moe_dispatch="ragged", context_parallel="ulysses")
with jax.set_mesh(make_mesh(shape)), nn.logical_axis_rules(LlamaFamily.axis_rules(cfg, shape)):
    got, text = run(cfg)
out["expert2/context2/ragged/ulysses"] = {"error": relative_error(got, want), "all_to_all": "all_to_all" in text}
print(json.dumps(out))
"""


@pytest.mark.deep
def test_expert_meshes_give_the_one_device_logits_and_gradients(tmp_path) -> None:
    """(data 2, expert 2), (expert 4), (fsdp 2, tensor 2), (expert 2, tensor 2), (fsdp 2, expert 2),
    (expert 2, context 2: rows split as well, by allgather and by ulysses) against the dense
    reference on one device: forward and every gradient, the router's included."""
    out = run_script(EQUIVALENCE, tmp_path)
    assert len(out) == 13
    for name, result in out.items():
        assert result["error"] < 1e-5, (name, result)
        assert result["all_to_all"] == ("expert" in name), (name, result)  # tokens travel only over the expert axis


RUN = [*TINY, "job=llama_tiny", "job.model.n_kv_heads=2", "job.model.head_dim=16", "job.model.moe.n_experts=4",
       "job.model.moe.d_ff_expert=32", "train.steps=20", "checkpoint.every_steps=5", "eval.every=10"]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.deep
def test_expert_meshes_train_the_one_device_loss_curve_and_resume_onto_another_expert_size(tmp_path) -> None:
    """20 steps through `python -m runner`: (data 2, expert 2) and (expert 4) match one device
    within float32 rounding; a run killed at step 12 on (expert 2) resumes on (expert 4) from
    its step-10 checkpoint and ends on the same curve."""
    one = run_runner([*RUN, "run.dir=one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    want = losses(tmp_path / "one")
    assert sorted(want) == list(range(1, 21)) and want[20] < want[1]
    # (data 2, expert 2) and (expert 4): one sweep (mesh.data is the devices the other axes leave)
    split = run_runner(["-m", *RUN, "mesh.expert=2,4", "run.sweep=split", "run.dir=expert${mesh.expert}"], tmp_path,
                       devices=4)
    assert split.returncode == 0, split.stderr[-3000:]
    assert "over 4 devices" in split.stdout and "'data': 2, 'fsdp': 1, 'expert': 2" in split.stdout
    for name in ("expert2", "expert4"):
        got = losses(tmp_path / name)
        assert got.keys() == want.keys(), name
        assert_close_losses(got, want, want, name)

    killed = run_runner([*RUN, "run.dir=moved", "mesh.data=2", "mesh.expert=2"], tmp_path, devices=4,
                        RUNNER_FAULT="kill_at_step:12")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    again = run_runner([*RUN, "run.dir=moved", "mesh.data=1", "mesh.expert=4"], tmp_path, devices=4)
    assert again.returncode == 0 and "resumed from step 10 " in again.stdout, again.stderr[-3000:]
    assert_close_losses(losses(tmp_path / "moved"), want, range(11, 21), "moved")


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused() -> None:
    import dataclasses

    from runner.parallel.mesh import check_spec
    from runner.spec import ExecutionSpec, MeshSpec, ModelSpec, MoESpec

    spec = ExecutionSpec(topology="cpu-4")
    spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=ModelSpec(
        family="llama", moe=MoESpec(n_experts=6))))
    with pytest.raises(ConfigError, match=r"mesh.expert=4.*share of the 6 experts.*e.g. mesh.expert=3"):
        check_spec(dataclasses.replace(spec, mesh=MeshSpec(data=1, expert=4)))
    with pytest.raises(ConfigError, match=r"train.batch_size.*data x fsdp x expert = 4 ways"):
        check_spec(dataclasses.replace(spec, mesh=MeshSpec(data=1, expert=2, fsdp=2),
                                       train=dataclasses.replace(spec.train, batch_size=6)))
    check_spec(dataclasses.replace(spec, mesh=MeshSpec(data=2, expert=2)))  # 2 divides 6
