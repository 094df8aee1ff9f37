"""mode=plan (runner.main.plan): the search space, the refusals, and a plan whose printed commands
compile to the same verdict and memory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from runner.main import plan_space
from runner.parallel.topology import CHIPS, parse_topology
from tests.conftest import TINY, refused_in_process, run_runner
from tests.parallel.test_compile import needs_libtpu


def _facts(**changes: int) -> plan_space.ModelFacts:
    base = dict(parameters=70_553_706_496, flops_per_token=6 * 70e9, d_model=8192, d_ff=28672, n_layers=80,
                n_heads=64, n_kv_heads=8, vocab_size=128256, n_experts=0, batch_size=256, seq_len=8192,
                param_bytes=4, state_bytes=4)
    return plan_space.ModelFacts(**{**base, **changes})


def test_the_search_space_holds_what_the_user_gave_and_splits_data_across_slices() -> None:
    topology = parse_topology("2xv5p-128")
    found = plan_space.layouts(topology, _facts(), {}, "full")
    meshes = {tuple(c.mesh.values()) for c in found}
    assert (1, 2, 64, 1, 1, 1) in meshes  # data across the slices, fsdp within
    assert any(c.mesh["stage"] == 2 and c.schedule == "circular" for c in found)  # stages across the slices
    assert all(c.mesh["data"] % 2 == 0 for c in found if c.mesh["stage"] == 1)
    assert all(64 % c.mesh["tensor"] == 0 for c in found)  # the tensor axis divides the heads
    held = plan_space.layouts(topology, _facts(), {"mesh.tensor": "1", "train.accumulate_steps": "2"}, "full")
    assert held and all(c.mesh["tensor"] == 1 and c.accumulate_steps == 2 for c in held)
    # the optimizer goes to the host only where the device cannot hold it
    small = plan_space.layouts(parse_topology("v5p-128"), _facts(parameters=10**9, n_layers=16), {}, "dots")
    limit = CHIPS["v5p"].hbm_bytes_per_device
    on_host = [c for c in small if c.offload == "host"]
    assert 0 < len(on_host) < len(small) / 2
    for layout in on_host:  # only after the same layout with its state on the device, tiled or not, did not fit
        kept = [c for c in small if c.offload == "none" and dataclasses.replace(c, offload="host", mlp_tiles=1)
                == dataclasses.replace(layout, mlp_tiles=1)]
        assert len(kept) == 2 and all(c.memory_bytes > limit for c in kept)
    tiled = [c for c in small if c.mlp_tiles > 1]
    assert tiled and all(c.overrides()[-1] == "job.model.mlp_tiles=4" for c in tiled if c.offload == "none")
    piped = next(c for c in found if c.mesh["stage"] == 2 and c.schedule == "gpipe" and c.microbatches == 4)
    assert piped.notes["bubble"] == pytest.approx(1 / 5)  # (S-1)/(M+S-1), as the compiled estimate takes it
    ordered = plan_space.promising(found, CHIPS["v5p"].hbm_bytes_per_device)
    assert all(c.memory_bytes <= plan_space.PRUNE_ABOVE * CHIPS["v5p"].hbm_bytes_per_device for c in ordered)
    firsts = [tuple(c.mesh.values()) for c in ordered[:len({tuple(c.mesh.values()) for c in ordered})]]
    assert len(set(firsts)) == len(firsts)  # every mesh once before any mesh twice


def test_a_plan_it_cannot_honour_is_refused(capsys: pytest.CaptureFixture) -> None:
    from runner.errors import ConfigError, UserError
    from runner.main.plan import run_plan
    from runner.spec import ExecutionSpec

    with pytest.raises(ConfigError, match="cpu-4.*names no chip"):
        run_plan(ExecutionSpec(topology="cpu-4", mode="plan"), [])
    with pytest.raises(UserError, match="topology=h100-8 needs those GPUs"):  # this machine has none
        run_plan(ExecutionSpec(topology="h100-8", mode="plan"), [])
    with pytest.raises(ConfigError, match="no published bandwidths for v3"):
        run_plan(ExecutionSpec(topology="v3-8", mode="plan"), [])
    with pytest.raises(UserError, match=r"held settings \{'mesh.tensor': '3'\} allow"):
        run_plan(ExecutionSpec(topology="v5p-8", mode="plan"), ["mesh.tensor=3"])
    # the job's own mesh need not fit the topology: the plan chooses the mesh (mode=compile refuses it)
    from runner.main.cli import precheck, prepare

    prepare()
    llama_on_two_slices = ["job=llama3_70b", "topology=2xv5p-128", "data.strategy=synthetic"]
    precheck(["mode=plan", *llama_on_two_slices], build=True)
    assert "mesh.data" in refused_in_process(["mode=compile", *llama_on_two_slices], capsys, build=True)
    line = refused_in_process(["plan.compiles=4"], capsys, build=True)
    assert "plan.compiles" in line and "mode=plan" in line
    line = refused_in_process(["mode=plan", "plan.compiles=0"], capsys, build=True)
    assert "plan.compiles" in line


def test_a_plan_whose_every_compile_fails_says_why_and_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """No layout compiled (each crashed, say): not "nothing fits" (exit 3) but the first failure's
    paragraph, with the layout it came from (exit 2); the progress line says each one failed."""
    from runner.errors import UserError
    from runner.main import plan
    from runner.spec import ExecutionSpec, PlanSpec

    monkeypatch.setattr(plan, "_valid", lambda layout, base: "")
    fell = (1, None, "RuntimeError: the compiler fell", False)
    monkeypatch.setattr(plan, "compile_layout", lambda args, cache: fell)
    said: list[str] = []
    with pytest.raises(UserError, match=r"could not compile any of the 2 layouts .* was failed: RuntimeError: the "
                                        r"compiler fell"):
        plan.run_plan(ExecutionSpec(topology="v5p-8", mode="plan", plan=PlanSpec(compiles=2, workers=1)), [],
                      say=said.append)
    assert sum(": failed" in line for line in said) == 2


@needs_libtpu
@pytest.mark.e2e
def test_a_plan_ranks_compiled_layouts_and_its_commands_compile_to_the_same_verdict(tmp_path: Path) -> None:
    """mode=plan on a v5p-8 compiles two layouts in two processes and ranks those that fit; the best
    row's command, run with mode=compile, fits with the very memory the plan printed; asked again,
    the plan takes both reports from its cache."""
    args = [*TINY, "topology=v5p-8", "data.strategy=synthetic", "train.batch_size=32", "eval.batch_size=16"]
    proc = run_runner(["mode=plan", *args, "plan.compiles=2", "plan.workers=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["report"] == "plan" and plan["candidates"] > 2
    compiled = [r for r in plan["rows"] if r["status"] != "not compiled"]
    assert len(compiled) == 2 and all(r["status"] == "fits" for r in compiled)
    best = plan["best"]
    assert best == compiled[0] and best["estimate"]["step_s"] <= compiled[1]["estimate"]["step_s"]
    assert "mode=plan: 2/2 compiled" in proc.stdout and best["command"] in proc.stdout
    command = best["command"].split()
    assert command[:3] == ["python", "-m", "runner"]
    again = run_runner(["mode=compile", *command[3:]], tmp_path)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout.strip().splitlines()[-1])
    assert report["fits"] and report["memory"]["total"] == best["memory_bytes"]
    assert report["estimate"]["step_s"] == pytest.approx(best["estimate"]["step_s"])
    cached = run_runner(["mode=plan", *args, "plan.compiles=2", "plan.workers=2"], tmp_path)
    assert cached.returncode == 0 and json.loads(cached.stdout.strip().splitlines()[-1])["best"]["cached"]


@needs_libtpu
@pytest.mark.deep
def test_a_plan_where_nothing_fits_exits_3_with_the_advice_and_across_slices_counts_the_network(
        tmp_path: Path) -> None:
    """GPT-2's vocabulary over 16,384 rows of 1,024 tokens in one micro-batch, the whole logits at once,
    fits no layout of a v4-8: exit 3, no best row, mode=compile's advice for the smallest (with more
    micro-batches, which the plan may choose unless they are held, it fits). On two v5p-8 slices the data axis spans the slices
    and its gradient crosses them: the estimate has a network term."""
    from tests.parallel.test_compile import OVERSIZED

    proc = run_runner(["mode=plan", "topology=v4-8", *OVERSIZED, "plan.compiles=2", "plan.workers=2",
                       "job.model.remat=full", "optimizer.offload=host", "train.accumulate_steps=1"], tmp_path)
    assert proc.returncode == 3, proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["best"] is None and {r["status"] for r in plan["rows"] if r["status"] != "not compiled"} == \
        {"does not fit"}
    assert "fits: NO, none of the 2 compiled layouts fits on v4-8 (exit 3)" in proc.stdout
    assert plan["held"] == {"job.model.remat": "full", "optimizer.offload": "host", "train.accumulate_steps": "1"}
    args = [*TINY, "topology=2xv5p-8", "data.strategy=synthetic", "train.batch_size=32", "eval.batch_size=16",
            "mesh.tensor=1"]
    proc = run_runner(["mode=plan", *args, "plan.compiles=2", "plan.workers=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    compiled = [r for r in plan["rows"] if r["status"] == "fits"]
    assert compiled and all(r["estimate"]["dcn_bytes"] > 0 for r in compiled)
    assert all("mesh.tensor=1" in r["overrides"] for r in compiled)
