"""optimizer.offload=host: the optimizer state kept in host memory between steps (runner.optim
.offload). In this process, on the CPU (whose runtime places arrays in its pinned host memory
kind): the state lives there from its creation on, the compiled step takes and returns it there,
the numbers are bit for bit those of a run without it, and checkpoints restore either way. The
copies to and from the host that a TPU's step makes: tests/parallel/test_offload.py."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import pytest

from runner.errors import ConfigError
from runner.observability.runcard import RUN_CARD
from runner.optim.offload import check_devices
from tests.conftest import TINY, refused_in_process

HOST = ["optimizer.offload=host"]


def train(run_dir: Path, steps: int, extra: list[str]) -> Any:
    """A tiny run in this process (RestoreableJob.run: restore, train, final checkpoint)."""
    from hydra import compose, initialize_config_dir

    from runner.main.cli import CONF_DIR, CONFIG_NAME, prepare
    from runner.main.config import build_spec
    from runner.train.job import JOBS

    prepare()
    overrides = [*TINY, f"run.dir={run_dir}", f"train.steps={steps}", "eval.every=0", "checkpoint.every_steps=100",
                 "logging.progress=none", *extra]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        spec = build_spec(compose(CONFIG_NAME, overrides=overrides), overrides)
    job = JOBS.get(spec.job.trainer)(spec)
    job.run()
    return job


def memory_kinds(tree: Any) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def assert_same_state(a: Any, b: Any) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_state_lives_in_host_memory_trains_the_same_numbers_and_resumes_either_way(tmp_path) -> None:
    """Saved with the state in host memory, resumed without it, and the other way round: both end
    bit for bit where the uninterrupted run without it ends; the compiled step's entry takes and
    returns every optimizer state leaf in host memory (XLA's memory space 5), and nothing else."""
    train(tmp_path / "to_device", 3, HOST)
    train(tmp_path / "to_host", 3, [])
    back_on_device = train(tmp_path / "to_device", 6, [])
    offloaded = train(tmp_path / "to_host", 6, HOST)
    reference = train(tmp_path / "reference", 6, [])
    assert back_on_device.restored_step == offloaded.restored_step == 3
    assert memory_kinds(offloaded.state.opt_state) == {"pinned_host"}
    assert memory_kinds(offloaded.state.params) == memory_kinds(back_on_device.state.opt_state) == {"device"}
    assert_same_state(offloaded.state, reference.state)
    assert_same_state(back_on_device.state, reference.state)

    entry = re.search(r"entry_computation_layout=\{\((.*)\)->(.*)\}",
                      offloaded.program.train_executable().as_text()).groups()
    leaves = len(jax.tree.leaves(offloaded.state.opt_state))
    assert [side.count("S(5)") for side in entry] == [leaves, leaves], entry
    plain = reference.program.train_executable().as_text().split("\n", 1)[0]
    assert "S(5)" not in plain
    card = (tmp_path / "to_host" / RUN_CARD).read_text()
    state_mib = sum(x.nbytes for x in jax.tree.leaves(offloaded.state.opt_state)) / 2**20
    assert f"in host memory: {state_mib:,.1f} MiB a device (the optimizer state" in card, card[:2000]
    assert "in host memory" not in (tmp_path / "reference" / RUN_CARD).read_text()


def test_devices_without_host_memory_are_refused_naming_the_platform() -> None:
    class NoMemoryKinds:
        platform = "metal"

        def addressable_memories(self) -> list:
            raise NotImplementedError("no memory kinds")

    check_devices("none", [NoMemoryKinds()])  # nothing asked of them
    with pytest.raises(ConfigError) as err:
        check_devices("host", [NoMemoryKinds()])
    text = str(err.value)
    assert "`optimizer.offload='host'`" in text and "metal devices" in text and "optimizer.offload=none" in text
    device_only = SimpleNamespace(platform="other", addressable_memories=lambda: [SimpleNamespace(kind="device")])
    with pytest.raises(ConfigError, match=r"memory kinds: \['device'\]"):
        check_devices("host", [device_only])
    check_devices("host", jax.devices())  # the CPU has it
    # a pod's compile-only devices of other hosts list no memory: the listed ones decide
    host = SimpleNamespace(platform="tpu", addressable_memories=lambda: [SimpleNamespace(kind="pinned_host")])
    elsewhere = SimpleNamespace(platform="tpu", addressable_memories=lambda: [])
    check_devices("host", [host, elsewhere])
    with pytest.raises(ConfigError, match="tpu devices offer no such memory"):
        check_devices("host", [elsewhere, elsewhere])


def test_an_unknown_offload_target_is_refused(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = refused_in_process([*TINY, "optimizer.offload=disk"], capsys, build=True)
    assert "optimizer.offload" in line and "disk" in line and "host" in line
    assert not any(tmp_path.iterdir())
