"""Host offload (job.model.remat=offload): each block's input kept in the host's pinned memory
between the forward and the backward pass (and optimizer.offload=host's TPU program: the state
itself is tested in tests/optim/test_offload.py). Proven on the program: an ahead-of-time compile for a
TPU holds host memory and copies to and from it; the gradients are the full remat's; the CPU,
whose runtime has no host memory apart, refuses it. (On a GPU: tools/bench/offload_check.py, figures in
docs/performance.md.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import pytest
from flax import linen as nn

from tests.conftest import TINY, refused_in_process, run_runner
from tests.models.test_tiling import MODELS
from tests.parallel.equivalence import relative_error
from tests.parallel.test_compile import _summary, needs_libtpu


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_the_offload_policy_gives_the_full_remat_gradients(name: str) -> None:
    """The layers tagged and rematerialised by the offload policy (scanned and unrolled) give the
    loss and every gradient of remat=full (here on the CPU, which ignores the placement)."""
    scope: dict = {}
    exec(MODELS, scope)  # noqa: S102
    Model, _, cfg = scope["MODELS"][name]
    params = nn.unbox(Model(cfg).init(jax.random.PRNGKey(0), scope["tokens"])["params"])
    for scan in (True, False):
        base = dataclasses.replace(cfg, scan_layers=scan)
        unboxed = params if scan else nn.unbox(Model(base).init(jax.random.PRNGKey(0), scope["tokens"])["params"])
        (want, _), _ = scope["loss_and_grads"](Model(dataclasses.replace(base, remat="full")), unboxed)
        (got, _), _ = scope["loss_and_grads"](Model(dataclasses.replace(base, remat="offload")), unboxed)
        assert relative_error(got, want) < 1e-6, scan


def test_offload_on_a_cpu_is_refused_naming_the_platform(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = refused_in_process([*TINY, "job=llama_tiny", "topology=cpu-2", "job.model.remat=offload"], capsys,
                              build=True)
    assert "job.model.remat='offload'" in line and "this run's platform is cpu" in line and "remat=full" in line
    assert not any(tmp_path.iterdir())


@needs_libtpu
@pytest.mark.parametrize("setting", ["job.model.remat=offload", "optimizer.offload=host"])
@pytest.mark.deep
def test_a_tpu_compile_of_the_offloaded_step_copies_to_host_memory_and_back(tmp_path: Path, setting: str) -> None:
    """mode=compile for a v5p-8 with remat=offload (each layer's input) or optimizer.offload=host (the
    optimizer state between steps): the compiled step holds host memory (reported apart from the
    device's) and copies there and back; the same step with neither in tests/parallel/test_compile.py
    holds none and copies nothing. The optimizer's host memory is its whole state (AdamW: two float32
    moments a parameter, replicated over mesh.data=4), one copy each way per leaf, and the device's
    arguments hold no more of it."""
    proc = run_runner(["topology=v5p-8", "mode=compile", "job=llama_tiny", "data.strategy=synthetic",
                       "train.batch_size=8", "eval.batch_size=8", setting, "logging.wandb=disabled"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _summary(proc.stdout)
    assert report["memory"]["host"] > 0
    assert report["host_transfers"]["to_host"] > 0 and report["host_transfers"]["from_host"] > 0
    assert "host memory (apart)" in proc.stdout and "copies to host and" in proc.stdout
    if setting.startswith("optimizer"):
        state = 2 * 4 * report["parameters"]
        assert state <= report["memory"]["host"] < state + 2**16  # the moments, the counters
        assert report["memory"]["argument"] < 4 * report["parameters"] + 2**16  # the parameters and the batch
        assert report["host_transfers"]["to_host"] == report["host_transfers"]["from_host"]
        assert "optimizer state in float32, kept in host memory between steps" in proc.stdout
