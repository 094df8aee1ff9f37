"""mode=compile: the real train step compiled for a pod slice on this CPU machine.

The TPU cases need the libtpu wheel (`pip install -e '.[tpu]'`, which CI installs); they run
the TPU compiler for real, on compile-only devices, and never need a TPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.parallel.topology import CHIPS, aot_topology_args, parse_topology
from tests.conftest import TINY, run_runner, runner_env

LIBTPU = importlib.util.find_spec("libtpu") is not None
# .ci/run sets RUNNER_CI=1: there the test extra has installed libtpu, and a missing one fails these
# tests (and test_ci_has_libtpu) instead of skipping them. Elsewhere, without `bash tools/venv.sh
# tpu`, they skip.
IN_CI = os.environ.get("RUNNER_CI") == "1"
needs_libtpu = pytest.mark.skipif(
    not LIBTPU and not IN_CI,
    reason="libtpu is not installed; `bash tools/venv.sh tpu` installs it (CI does, and fails without it)",
)

# The tiny model on synthetic data: compiles in seconds and needs no corpus.
SMALL = [*TINY, "train.batch_size=32", "eval.batch_size=16", "data.strategy=synthetic"]
# One layer, but GPT-2's vocabulary at 16384 x 1024 tokens: the logits alone are ~200 GiB per
# v4 device, far past any HBM (and past this machine's RAM for cpu-4).
# the whole logits of 1,024 rows a device (job.model.loss_tiles=1: tiled, as auto would, they fit)
OVERSIZED = [*TINY, "job.model.n_layers=1", "job.model.vocab_size=50304", "job.model.context_length=1024",
             "train.seq_len=1024", "train.batch_size=16384", "eval.batch_size=16", "data.strategy=synthetic",
             "job.model.loss_tiles=1"]


def test_ci_has_libtpu() -> None:
    """CI compiles for TPU topologies: there a missing libtpu is a failure, not a row of skips."""
    if IN_CI:
        assert LIBTPU, "RUNNER_CI=1 but libtpu is not installed: the test extra's tpu pin (tools/venv.sh test) failed"


def _summary(stdout: str) -> dict:
    """The JSON line mode=compile ends with."""
    last = stdout.strip().splitlines()[-1]
    data = json.loads(last)
    assert data["report"] == "compile"
    return data


@needs_libtpu
@pytest.mark.e2e
def test_v4_32_small_model_fits_and_reports_per_device_memory(tmp_path: Path) -> None:
    proc = run_runner(["topology=v4-32", "mode=compile", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for row in ("arguments (state + batch)", "outputs (state + metrics)", "temporaries", "generated code",
                "total", "v4 HBM", "FLOPs per step", "fits: yes"):
        assert row in proc.stdout, row
    report = _summary(proc.stdout)
    assert (report["devices"], report["device_kind"], report["mesh"]) == (
        16, "TPU v4", {"stage": 1, "data": 16, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1})
    assert report["fits"] is True and report["limit_bytes"] == CHIPS["v4"].hbm_bytes
    memory = report["memory"]
    # The state is replicated over data=16: every device holds params plus AdamW's two moments.
    assert memory["argument"] >= 3 * 4 * report["parameters"]
    assert memory["alias"] > 0  # the state is donated and updated in place
    assert memory["total"] == (memory["argument"] + memory["output"] - memory["alias"]
                               + memory["temp"] + memory["generated_code"])
    assert 0.5 < report["flops_per_device"] * 16 / report["analytic_flops"] < 2.0
    assert not (tmp_path / "runs").exists(), "mode=compile must not create or clean the run directory"
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("topology", [pytest.param("v4-32", marks=needs_libtpu), "cpu-4"])
@pytest.mark.e2e
def test_an_oversized_batch_does_not_fit_and_exits_3(tmp_path: Path, topology: str) -> None:
    proc = run_runner([f"topology={topology}", "mode=compile", *OVERSIZED], tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "does not fit" in proc.stdout and "train.batch_size" in proc.stdout
    report = _summary(proc.stdout)
    assert report["fits"] is False
    if topology == "v4-32":  # the TPU compiler itself refuses: more than 30 GiB of HBM needed
        assert "RESOURCE_EXHAUSTED" in report["compiler_error"]
        assert report["required_bytes"] > CHIPS["v4"].hbm_bytes
    else:  # XLA:CPU compiles it; the report compares with this host's memory per device
        assert report["memory"]["total"] > report["limit_bytes"]


@needs_libtpu
@pytest.mark.deep
def test_mode_compile_uses_and_names_the_kernel_the_target_runs(tmp_path: Path) -> None:
    """attention=auto on a TPU is the splash kernel, lowered by Mosaic for the TPU (not interpreted)."""
    proc = run_runner(["topology=v4-8", "mode=compile", "job=llama_tiny", "data.strategy=synthetic",
                       "train.batch_size=8", "logging.wandb=disabled"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _summary(proc.stdout)
    assert report["attention"] == "splash" and "attention splash" in proc.stdout
    assert report["fits"] is True
    assert report["kernels"]["tpu_custom_call"] > 0 and "fused kernels: " in proc.stdout


@needs_libtpu
@pytest.mark.parametrize("kind, summary", [
    ("allgather", "splash kernel on each shard's rows"),
    ("ring", "splash kernel per block, key/value blocks passed around"),
    ("auto", "splash on whole rows, 1 head per device, heads and sequence exchanged by all-to-all over mesh.context=4 "
             "(ulysses); key/value heads repeated to one per query head (2 on a device do not split 4 ways); "
             "auto chose it: 4 heads a device split over mesh.context=4, and splash's tables for whole "
             "1,024-token rows fit scalar memory")])
@pytest.mark.deep
def test_context_parallel_rows_take_the_splash_kernel_per_shard(tmp_path: Path, kind: str, summary: str) -> None:
    """Rows split over mesh.context=4 on a v5p-8, attention=auto: allgather runs the splash kernel
    on each shard's rows, ring on each block it passes, and auto takes ulysses (the kernel on whole
    rows: the heads split and the tables fit) (Mosaic calls in the compiled step); the report says
    which, and why auto chose it, and counts each kind's own collective in the compiled step
    (all-gather, collective-permute, all-to-all: only ulysses moves heads)."""
    proc = run_runner(["topology=v5p-8", "mode=compile", "job=llama_tiny", "data.strategy=synthetic",
                       "train.seq_len=1024", "job.model.context_length=1024", "train.batch_size=4",
                       "eval.batch_size=4", "mesh.data=1", "mesh.context=4", f"job.model.context_parallel={kind}",
                       "logging.wandb=disabled"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _summary(proc.stdout)
    assert report["attention"].startswith(summary), report["attention"]
    assert report["kernels"]["tpu_custom_call"] > 0
    # no host offload asked: none in the program (tests/parallel/test_offload.py asks for it)
    assert report["memory"]["host"] == 0 and report["host_transfers"] == {"to_host": 0, "from_host": 0}
    moved = report["collective_bytes"]  # each kind's own collective, read from the compiled step
    assert moved.get({"allgather": "all-gather", "ring": "collective-permute", "auto": "all-to-all"}[kind], 0) > 0
    assert ("all-to-all" in moved) == (kind == "auto") and "collectives per step and device" in proc.stdout


@pytest.mark.deep
def test_cpu_4_compiles_for_four_local_devices(tmp_path: Path) -> None:
    # One device in XLA_FLAGS: mode=compile gives cpu-4 its four devices itself.
    proc = run_runner(["topology=cpu-4", "mode=compile", *SMALL], tmp_path, devices=1)
    assert proc.returncode == 0, proc.stderr
    report = _summary(proc.stdout)
    assert (report["devices"], report["mesh"]["data"], report["fits"], report["attention"]) == (4, 4, True, "xla")
    assert report["memory"]["total"] > 0 and "host RAM / 4 devices" in proc.stdout
    # each stage said as it starts (a long row's trace and XLA's compile each take minutes)
    assert "mode=compile: tracing the train step (32 x 32 tokens, 4 devices; attention xla) ..." in proc.stdout
    assert re.search(r"mode=compile: traced in [\d.]+ s; XLA is compiling it for cpu-4 \.\.\.", proc.stdout)


@pytest.mark.deep
def test_a_tpu_topology_without_libtpu_says_how_to_install_it(tmp_path: Path) -> None:
    # A libtpu package that fails to import stands in for one that is not installed.
    fake = tmp_path / "no_libtpu" / "libtpu"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libtpu is not installed (simulated)')\n")
    env = runner_env(tmp_path, PYTHONPATH=str(fake.parent))
    env.pop("TPU_LIBRARY_PATH", None)  # set by an imported libtpu; it would point at the real one
    proc = subprocess.run([sys.executable, "-m", "runner", "topology=v5p-8", "mode=compile", *SMALL],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "libtpu is not installed" in proc.stderr and "topology=v5p-8" in proc.stderr
    assert "bash tools/venv.sh tpu" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@needs_libtpu
@pytest.mark.parametrize("name", ["v4-8", "v4-32", "2xv4-32", "v5p-8", "v5p-128", "2xv5p-128",
                                  "v5litepod-8", "v5litepod-16", "v6e-8", "v6e-16", "v3-32",
                                  "tpu7x-8", "tpu7x-16", "2xtpu7x-16", "tpu7x-128"])
def test_aot_args_describe_the_named_slice_in_libtpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from jax.experimental import topologies

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as mode=compile does: another process may hold libtpu

    t = parse_topology(name)
    devices = topologies.get_topology_desc(**aot_topology_args(t)).devices
    assert len(devices) == t.num_devices
    assert len({d.process_index for d in devices}) == t.num_hosts
    kind = {"v3": "TPU v3", "v4": "TPU v4", "v5p": "TPU v5", "v5e": "TPU v5 lite", "v6e": "TPU v6 lite",
            "tpu7x": "TPU7x"}
    assert {d.device_kind for d in devices} == {kind[t.chip.name]}
    if t.num_slices > 1:
        assert sorted({d.slice_index for d in devices}) == list(range(t.num_slices))


def test_the_compile_report_in_process_sizes_the_step_training_runs(tmp_path: Path) -> None:
    """runner.parallel.compile on the local CPU device, in this process: the job class builds the
    program training would run, the compiler sizes it, and the analytic FLOPs are the family's."""
    from hydra import compose, initialize_config_dir

    from runner.main.cli import CONF_DIR, CONFIG_NAME, prepare
    from runner.main.config import build_spec
    from runner.parallel.compile import compile_report
    from runner.train.job import JOBS

    prepare()
    overrides = [*TINY, f"run.dir={tmp_path / 'run'}", "mode=compile", "topology=cpu-1"]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        spec = build_spec(compose(CONFIG_NAME, overrides=overrides), overrides)
    report = compile_report(spec, JOBS.get(spec.job.trainer))
    assert report.fits and report.devices == 1 and report.memory is not None and report.memory.total > 0
    assert report.parameters > 0 and report.analytic_flops and report.flops_per_device
    assert not (tmp_path / "run").exists()  # mode=compile touches no run directory


def test_the_advice_leaves_out_what_is_already_in_force() -> None:
    import dataclasses

    from runner.parallel.compile import _advice
    from runner.spec import ExecutionSpec, ModelSpec, TrainSpec

    spec = ExecutionSpec()
    loose = _advice(spec, {"data": 4, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1})
    assert "accumulate_steps" in loose and "mesh.fsdp" in loose and "remat=full (auto now)" in loose
    assert "optimizer.offload=host" in loose and loose.endswith(", or pick a larger slice")
    tight = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=ModelSpec(remat="full")),
                                train=TrainSpec(batch_size=8, accumulate_steps=1),
                                optimizer=dataclasses.replace(spec.optimizer, offload="host"))
    assert _advice(tight, {"data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}) == \
        "split each row over more devices with mesh.context (context parallelism; mesh.context=1 now), " \
        "or pick a larger slice"


def test_kernel_tables_past_the_scalar_memory_are_told_apart_from_hbm_with_their_own_fix() -> None:
    """A splash kernel whose block tables overflow the chip's scalar memory (llama3_8b's whole
    1,048,576-token rows under ulysses on v5p-256: 8 MiB of tables against 1 MiB of SMEM) is not
    an HBM shortfall: the report says which memory, and the fix is tables per device's share of
    the row (allgather or ring), not more devices or remat."""
    import dataclasses

    from runner.parallel.compile import CompileReport, _tables_advice, kernel_tables_overflow
    from runner.spec import ExecutionSpec, ModelSpec, TrainSpec

    error = ("RESOURCE_EXHAUSTED: Allocation (size=8388608) would exceed memory (size=1048576) :: #allocation6 "
             "[shape = 'u8[8388608]{0}', space=smem, size = 0x800000, scoped, tag = 'prefetched SMEM operand 0'] "
             ":: splash_mqa_fwd_residuals.3")
    assert kernel_tables_overflow(error) and not kernel_tables_overflow("RESOURCE_EXHAUSTED: Used 129G of 95G hbm")
    # allgather's tables for 2,097,152-token rows over 32 shards, as XLA:TPU words it then
    assert kernel_tables_overflow("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
                                  "space smem. Used 1.50M of 1.00M smem. Exceeded smem capacity by 513.1K.")
    spec = ExecutionSpec(topology="v5p-256")
    spec = dataclasses.replace(spec, train=TrainSpec(seq_len=1048576, batch_size=4), job=dataclasses.replace(
        spec.job, model=ModelSpec(context_parallel="ulysses")))
    advice = _tables_advice(spec, {"fsdp": 4, "context": 32})
    assert advice.startswith("the splash kernel's block tables for whole 1,048,576-token rows exceed the chip's "
                             "scalar memory; use job.model.context_parallel=allgather or ring"), advice
    report = CompileReport(job="llama3_8b", topology="v5p-256", devices=128, device_kind="TPU v5", mesh={},
                           batch_size=4, seq_len=1048576, accumulate_steps=1, parameters=8, limit_bytes=95 << 30,
                           limit_source="v5p HBM (nominal)", fits=False, compile_seconds=1.0, compiler_error=error,
                           advice=advice)
    text = report.text()
    assert "the attention kernel's block tables do not fit the chip's scalar memory (SMEM):" in text
    assert "ran out of device memory" not in text and "fits: NO" in text and "allgather or ring" in text
    split = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=ModelSpec(context_parallel="ring")))
    assert "split each row over more devices with mesh.context" in _tables_advice(split, {"context": 32})
    gathered = dataclasses.replace(spec, job=dataclasses.replace(spec.job,
                                                                 model=ModelSpec(context_parallel="allgather")))
    assert "context_parallel=ring (its tables cover one block" in _tables_advice(gathered, {"context": 32})


SYNTHETIC_HLO = """HloModule step

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %constant.1 = s32[]{:T(128)} constant(32)
  ROOT %lt = pred[] compare(%i, %constant.1), direction=LT
}

%layer (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %all-gather-start = (f32[8]{0}, f32[32]{0}) all-gather-start(%x), dimensions={0}
  %all-gather-done = f32[32]{0} all-gather-done(%all-gather-start)
  %a2a = (bf16[4,16]{1,0}, bf16[4,16]{1,0}) all-to-all(%x, %x), dimensions={0}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

%wrapped (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %permute = f32[1024]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%layer
  %start = ((f32[1024]{0}), f32[1024]{0}, u32[]) async-start(%b), calls=%wrapped
  %done = f32[1024]{0} async-done(%start), calls=%wrapped
  %sum = f32[2,8]{1,0} all-reduce(%a), to_apply=%add
  %fixed = (s32[], f32[8]{0}) while(%init), condition=%other, body=%layer, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[8]{0} copy(%a)
}
"""


def test_collective_bytes_count_each_loop_body_times_its_trips_and_each_async_collective_once() -> None:
    """The layer loop's body 32 times (the bound its condition compares with) and another 3 times
    (XLA's known trip count): a 128-byte all-gather counted at its -done, a two-array bf16
    all-to-all of 256 bytes; a collective-permute wrapped in an async computation once (not again
    at its async-done); a top-level all-reduce once."""
    from runner.parallel.compile import collective_bytes

    assert collective_bytes(SYNTHETIC_HLO) == {"all-gather": 35 * 128, "all-to-all": 35 * 256,
                                               "collective-permute": 4096, "all-reduce": 64}


SLICED_HLO = """HloModule step

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %within = f32[8]{0} all-reduce(%a), replica_groups={{0,1},{2,3}}, to_apply=%add
  %across = f32[16]{0} all-reduce(%a), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
  %listed = f32[4]{0} all-gather(%a), replica_groups=[1,4]<=[4], dimensions={0}
  %cp-start = (f32[32]{0}, f32[32]{0}) collective-permute-start(%a), source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %cp-done = f32[32]{0} collective-permute-done(%cp-start)
  %near = f32[64]{0} collective-permute(%a), source_target_pairs={{0,1},{1,0}}
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%hop, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[8]{0} copy(%a)
}

%hop (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %s1 = (f32[1,8]{1,0}, u32[], token[]) send(%x, %a), frontend_attributes={_xla_megascale_transfer_type="ONE_TO_ONE"}
  %s2 = (bf16[4]{0}, u32[], token[]) send(%y, %a), frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %send-done.1 = token[] send-done(%s1)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}
"""


def test_collectives_whose_device_groups_span_slices_are_counted_apart() -> None:
    """Devices 0-1 in slice 0, 2-3 in slice 1: an all-reduce within each slice and a permute between
    neighbours inside one do not cross; an all-reduce over {0,2},{1,3} (XLA's iota form, transposed),
    an all-gather over all four and an asynchronous permute between the slices (counted at its
    -done, by its start's pairs) do; so do the sends a multi-slice TPU program makes through its
    data-centre network runtime (a loop's, 5 times: each its data, not the token or the counter)."""
    from runner.parallel.hlo import collective_bytes, device_groups

    assert device_groups("x = all-reduce(%a), replica_groups=[2,2]<=[2,2]T(1,0)", 4) == [[0, 2], [1, 3]]
    assert device_groups("x = all-reduce(%a), replica_groups={}", 4) == [[0, 1, 2, 3]]
    assert collective_bytes(SLICED_HLO) == {"all-reduce": 96, "all-gather": 16, "collective-permute": 384}
    assert collective_bytes(SLICED_HLO, [0, 0, 1, 1]) == {"all-reduce": 64, "all-gather": 16,
                                                          "collective-permute": 128, "one-to-one by send": 5 * 32,
                                                          "all-reduce by send": 5 * 8}


@needs_libtpu
@pytest.mark.deep
def test_stages_across_two_slices_are_reported_with_the_bytes_between_slices(tmp_path: Path) -> None:
    """llama_tiny's 4 layers in 2 gpipe stages on 2xv5p-8, fsdp 4 in each slice: the stage axis spans
    the slices, so the activations' hops cross them (one-to-one sends of the data-centre network's
    runtime), counted apart from the collectives within a slice; the report says the schedule and
    its bubble. (What crosses for a 70B model, stages against data across slices: docs/pipeline.md.)"""
    proc = run_runner(["topology=2xv5p-8", "mode=compile", "job=llama_tiny", "job.model.n_layers=4", "mesh.stage=2",
                       "mesh.data=1", "mesh.fsdp=4", "data.strategy=synthetic", "logging.wandb=disabled"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _summary(proc.stdout)
    assert report["mesh"]["stage"] == 2 and "pipeline: gpipe: 2 stages of 2 layers" in report["model_notes"]
    across = report["cross_slice_bytes"]
    assert across["one-to-one by send"] > 0 and "between slices per step and device" in proc.stdout


@needs_libtpu
@pytest.mark.deep
def test_stages_take_their_microbatches_without_gathering_the_buffer(tmp_path: Path) -> None:
    """TPU's partitioner turned a dynamic slice of the microbatch buffer (stage 0's next input, the
    last stage's output put back) into a gather of the whole buffer over the batch's devices in
    every iteration: for Llama 3 70B in 4 stages, 104 GiB a chip instead of 29 (docs/pipeline.md).
    Here, llama_tiny in 2 gpipe stages x fsdp 2 on v5p-8, 64 rows of 512 tokens in 4 microbatches,
    the whole buffer is 64 x 512 x 128 float32 values (16 MiB) and the schedule 5 iterations: the
    step's gathers (the weights') stay under two buffers, where the dynamic slice's came to 95 MiB."""
    proc = run_runner(["topology=v5p-8", "mode=compile", "job=llama_tiny", "job.model.n_layers=4", "mesh.stage=2",
                       "mesh.data=1", "mesh.fsdp=2", "train.batch_size=64", "eval.batch_size=64", "train.seq_len=512",
                       "job.model.context_length=512", "pipeline.microbatches=4", "data.strategy=synthetic",
                       "logging.wandb=disabled"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _summary(proc.stdout)
    assert "4 microbatches, 5 iterations" in report["model_notes"]
    whole_buffer = 64 * 512 * 128 * 4
    assert report["collective_bytes"]["all-gather"] < 2 * whole_buffer, report["collective_bytes"]
