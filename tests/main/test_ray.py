"""hydra/launcher=ray: runs on a local Ray cluster (two hosts of two CPU devices each; one cluster
this module starts and its runs join, where a test is not about starting one), restarted by Ray
Train when an attempt fails, resumed by runner's restore."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from runner.main.ray_launcher import RunnerExit, final_outcome
from tests.conftest import TINY, fork_server, read_metrics, refused_in_process, runner_env, xla_flags
from tests.forked import run
from tests.train.test_multiprocess import BASE, STEPS, two_processes  # noqa: F401 (a fixture)
from tests.train.test_multiprocess import assert_identical_runs as assert_bitwise

RAY = ["hydra/launcher=ray", "hydra.launcher.hosts=2", "hydra.launcher.object_store_mb=100"]
ARGS = [*BASE, "eval.every=0", "logging.progress=plain"]


def on_ray(args: list[str], tmp_path: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return run(fork_server(), "module", "runner", [*RAY, *args], tmp_path,
               runner_env(tmp_path, 2, RAY_AUTH_MODE="disabled", **env), timeout)


class SharedCluster:
    """One local Ray cluster (a head of 2 CPUs: two hosts of one) for the runs here that are not
    about starting one: each command joins it (hydra.launcher.address), where starting a cluster of
    its own (address=local) would cost one per command. Started when first asked for; stopped
    before any test here that does not ask for it (`_only_where_asked`), so that a test of no
    cluster (address=auto joins any on this machine) or of a cluster of its own runs without it.
    (A command that joins a cluster keeps Train's placement-group cleaner, which asks the dashboard
    this one lacks (ray[train] has no dashboard) and prints its failure: a test that asserts no
    traceback starts its own cluster.)"""

    def __init__(self) -> None:
        self.cluster: Any = None

    def address(self) -> str:
        if self.cluster is None:
            import ray
            from ray.cluster_utils import Cluster

            # its nodes start its workers, and so the hosts' runner processes, with this environment:
            # the tests' (the session's compile cache, two CPU devices), Ray's as address=local sets it
            env = runner_env(Path.cwd(), 2, RAY_AUTH_MODE="disabled", RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0",
                             RAY_TRAIN_ENABLE_PRINT_PATCH="0")
            with pytest.MonkeyPatch.context() as mp:
                for key, value in env.items():
                    mp.setenv(key, value)
                self.cluster = Cluster(initialize_head=True, head_node_args={
                    "num_cpus": 2, "object_store_memory": 100 * 2**20, "include_dashboard": False})
            # Cluster names itself the machine's current cluster, which a bare ray.init() (address=local
            # elsewhere in the session) would join: this one is reached by its address alone
            ray._common.utils.reset_ray_address()
        return self.cluster.address

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


SHARED = SharedCluster()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[SharedCluster]:
    yield SHARED
    SHARED.stop()


@pytest.fixture(autouse=True)
def _only_where_asked(request: pytest.FixtureRequest) -> None:
    """The shared cluster is down during every test that does not use it."""
    if "ray_cluster" not in request.fixturenames:
        SHARED.stop()


def on_cluster(cluster: SharedCluster, args: list[str], tmp_path: Path, devices: int = 2,
               **env: str) -> subprocess.CompletedProcess:
    """`python -m runner hydra/launcher=ray ARGS` on the shared cluster. Its hosts' runner processes
    have the cluster's environment: their devices and a test's fault reach them through
    hydra.launcher.env."""
    hosts_env = ", ".join(f'{key}: "{value}"' for key, value in {"XLA_FLAGS": xla_flags(devices), **env}.items())
    return run(fork_server(), "module", "runner",
               [*args, f"hydra.launcher.address={cluster.address()}", f"hydra.launcher.env={{{hosts_env}}}"],
               tmp_path, runner_env(tmp_path, devices, RAY_AUTH_MODE="disabled",
                                    RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0"), 600)


@pytest.mark.e2e
def test_killed_worker_processes_are_restarted_by_ray_and_the_run_ends_bitwise(tmp_path, two_processes,
                                                                              ray_cluster) -> None:
    """SIGKILL of one host's process mid-run (attempt 1), then of process 0 while the save of step 8
    is written (attempt 2): Ray restarts the group each time (fresh processes, a fresh
    coordinator), runner resumes, and the run ends as the uninterrupted one."""
    result = on_cluster(ray_cluster, [*RAY, *ARGS, "run.dir=run"], tmp_path,
                        RUNNER_FAULT="kill_at_step:6@1#1,kill_after_save:8@0#2")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "ray: attempt 1 started on 2 hosts" in out
    assert "ray: attempt 1 ended: process" in out and "killed by SIGKILL" in out
    assert "ray: attempt 2 started on 2 hosts" in out
    # where each attempt took the run up, and its costs: from launches.jsonl in the run directory
    cost = r"\(startup \d+\.\d s, restore \d+\.\d s, compile \d+\.\d s\)"
    assert re.search(rf"ray: attempt 1: training from the start {cost}", out), out[-4000:]
    assert re.search(r"ray: attempt 2: resumed from step 4 \(durable tier; startup", out), out[-4000:]
    assert "ray: attempt 2 ended: process" in out
    resumed = re.search(r"ray: attempt 3: resumed from step (4|8)\b", out)
    assert resumed, out[-4000:]
    assert "ray: finished after 3 attempts (2 restarts)" in out
    from runner.observability import launches

    lines = launches.read(tmp_path / "run")
    assert [(r["attempt"], r["launch"], r["restored_step"], r["processes"]) for r in lines] == [
        (1, 1, None, 2), (2, 2, 4, 2), (3, 3, int(resumed[1]), 2)]
    assert all(r["startup_s"] > 0 and r["compile_s"] >= 0 and r["restore_s"] >= 0 for r in lines)
    assert_bitwise(tmp_path / "run", two_processes)  # the same run, two processes launched by hand
    records = [r for r in read_metrics(tmp_path / "run") if "goodput/restarts" in r]
    assert records[-1]["goodput/restarts"] == 2.0 and records[-1]["goodput/launches"] == 3.0  # lost ones too
    # attempt 3 trains again the steps attempt 2 logged after the checkpoint it resumed from: 5-8
    # when the save of 8 was lost, none when it was not
    assert records[-1]["goodput/recomputed_steps"] == (4.0 if resumed[1] == "4" else 0.0)
    if resumed[1] == "8":  # attempt 2's records stand: it trained step 5 again (attempt 1 had logged it)
        second = [r for r in records if r["goodput/restarts"] == 1.0]
        assert [r["step"] for r in second] == [5, 6, 7, 8]
        assert {r["goodput/recomputed_steps"] for r in second} == {1.0}


@pytest.mark.deep
def test_every_sweep_member_is_a_ray_job_and_the_summary_is_todays(tmp_path, ray_cluster) -> None:
    sweep = on_cluster(ray_cluster, ["-m", "hydra/launcher=ray", "hydra.launcher.object_store_mb=100", *TINY,
                                     "train.steps=3", "eval.every=0", "optimizer.lr=1e-2,2e-2", "run.root=runs"],
                       tmp_path, devices=1)
    assert sweep.returncode == 0, (sweep.stdout + sweep.stderr)[-3000:]
    assert sweep.stdout.count("ray: finished after 1 attempt (0 restarts)") == 2
    assert ": 2 members, 0 failed" in sweep.stdout
    members = sorted(p.parent for p in (tmp_path / "runs" / "sweeps").rglob("metrics.jsonl"))
    assert len(set(members)) == 2  # each member its own directory under the sweep
    assert all(max(r["step"] for r in read_metrics(p)) == 3 for p in members)


@pytest.mark.deep
def test_what_a_rerun_cannot_fix_is_not_retried_and_restarts_are_bounded(tmp_path) -> None:
    # a worker that exits 2 (the warm start it is told to read does not exist): one attempt, runner's paragraph
    bad = on_ray([*ARGS, "run.dir=bad", "run.init_from=missing-run", "hydra.launcher.max_restarts=5"], tmp_path)
    assert bad.returncode == 2, (bad.stdout + bad.stderr)[-3000:]
    assert "ray: ended after 1 attempt (0 restarts), exit 2" in bad.stdout
    assert bad.stderr.strip().splitlines()[-1].startswith("error: ") and "run.init_from" in bad.stderr.splitlines()[-1]
    assert "Traceback" not in bad.stderr

    # a fault on every attempt: max_restarts=1 allows two, then the last attempt's reason and code
    worn = on_ray([*ARGS, "run.dir=worn", "hydra.launcher.max_restarts=1"], tmp_path, RUNNER_FAULT="kill_at_step:2@1")
    out = worn.stdout + worn.stderr
    assert worn.returncode == 75, out[-3000:]
    assert "ray: attempt 2 started" in out and "ray: attempt 3" not in out
    assert "ray: ended after 2 attempts (1 restart), exit 75" in worn.stdout
    last = worn.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the last attempt ended: process 1 exited killed by SIGKILL"), last


@pytest.mark.deep
def test_no_ray_cluster_at_the_address_is_one_paragraph(tmp_path) -> None:
    """Ray finds no instance to join (address=auto): exit 2, one paragraph, nothing written. (A
    HOST:PORT nobody answers at is refused before Ray starts: the in-process test below.)"""
    joined = on_ray([*TINY, "run.dir=r", "hydra.launcher.address=auto"], tmp_path, timeout=120, RAY_ADDRESS="")
    assert joined.returncode == 2 and joined.stderr.count("error: ") == 1, joined.stderr[-2000:]
    assert "Ray could not start or join a cluster (Could not find any running Ray instance" in joined.stderr
    assert not (tmp_path / "r").exists()


def test_a_host_and_port_no_ray_cluster_answers_at_is_refused_before_ray_starts() -> None:
    """check_cluster, which the driver runs before it imports Ray: its UserError is the command's
    exit-2 paragraph (the address=auto case above shows that end to end)."""
    import socket

    from runner.errors import UserError
    from runner.main.ray_launcher import RaySettings, check_cluster

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError) as err:
        check_cluster(RaySettings(address=f"127.0.0.1:{port}"))
    assert "no Ray cluster answers there" in str(err.value) and f"ray start --head --port={port}" in str(err.value)


@pytest.mark.parametrize("bad, words", [
    ("hydra.launcher.max_restart=3", "Invalid config `hydra.launcher.max_restart`: runner has no setting of that name"),
    ("hydra.launcher.max_restarts=abc", "hydra.launcher.max_restarts=abc: Value 'abc' of type 'str' could not be "
                                        "converted to Integer"),
    ("hydra.launcher.hosts=two", "hydra.launcher.hosts=two: Value 'two' of type 'str' could not be converted"),
    ("hydra.launcher.cpus_per_host=true", "Value 'True' of type 'bool' could not be converted to Float"),
    ("hydra.launcher.env=3", "Cannot assign int to Dict[str, str]"),
])
def test_unknown_or_mistyped_launcher_settings_are_refused_by_the_schema(bad: str, words: str, capsys) -> None:
    """The settings are a typed Hydra config (hydra_plugins/runner_ray_launcher/config.py): OmegaConf
    refuses the key or the value as the command line is composed, one exit-2 paragraph."""
    line = refused_in_process(["hydra/launcher=ray", bad], capsys)
    assert words in line and "Fix: " in line, line


def test_the_launcher_is_one_typed_config_whose_class_path_is_written_once() -> None:
    """hydra/launcher=ray composes to the schema ConfigStore holds (ray.yaml only extends it); its
    _target_ is the class Hydra instantiates; what the command line gives reaches the settings typed."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hydra_plugins.runner_ray_launcher.config import TARGET
    from hydra_plugins.runner_ray_launcher.ray_launcher import RayLauncher
    from runner.main.cli import CONF_DIR, prepare
    from runner.main.ray_launcher import settings_from_hydra

    prepare()
    assert TARGET == f"{RayLauncher.__module__}.{RayLauncher.__qualname__}"
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", return_hydra_config=True, overrides=[
            "hydra/launcher=ray", "hydra.launcher.max_restarts=5", "hydra.launcher.env={XLA_FLAGS: x, N: 2}",
            "+hydra.launcher.env.MORE=y"])
    launcher = cfg.hydra.launcher
    assert OmegaConf.get_type(launcher).__name__ == "RayLauncherConf"  # typed: ConfigStore's schema
    settings = settings_from_hydra(launcher)
    assert settings is not None and settings.max_restarts == 5 and settings.cpus_per_host == 1.0
    assert settings.env == {"XLA_FLAGS": "x", "N": "2", "MORE": "y"}
    assert settings_from_hydra(OmegaConf.create({"_target_": "hydra._internal.BasicLauncher"})) is None


@pytest.mark.parametrize("bad, words", [
    ("max_restarts: -2", "`hydra.launcher.max_restarts=-2`: it must be -1 (no limit) or more"),
    ("hosts: -1", "`hydra.launcher.hosts=-1`: it must be 0 (the topology's hosts) or more"),
    ("object_store_mb: 10", "at least 80 (Ray's minimum)"),
    ("address: nowhere", "it is not HOST:PORT"),
    ("max_retries: 3", "Invalid config `hydra.launcher.max_retries`: Key 'max_retries' not in 'RayLauncherConf'"),
])
def test_launcher_settings_we_cannot_honour_are_refused(bad: str, words: str) -> None:
    """What types cannot say (ranges, an address), and a key added with `+` (Hydra's `+` adds past the
    schema; it is refused when the settings are read)."""
    from omegaconf import OmegaConf

    from runner.errors import UserError
    from runner.main.ray_launcher import TARGET, check_cluster, settings_from_hydra

    launcher = OmegaConf.merge({"_target_": TARGET}, OmegaConf.create(bad))
    with pytest.raises(UserError) as err:
        check_cluster(settings_from_hydra(launcher))  # type: ignore[arg-type]
    assert words in str(err.value), str(err.value)


def test_tpu_slices_are_reserved_by_their_topology() -> None:
    from ray.train import ScalingConfig

    from runner.errors import UserError
    from runner.main.ray_launcher import RaySettings, scaling
    from runner.spec import ExecutionSpec

    kwargs, hosts = scaling(ExecutionSpec(topology="v5p-128"), RaySettings())
    assert hosts == 16 and kwargs == {"num_workers": 16, "use_tpu": True, "topology": "4x4x4",
                                      "accelerator_type": "TPU-V5P", "resources_per_worker": {"TPU": 4}}
    ScalingConfig(**kwargs)  # Ray's own checks of a TPU reservation
    kwargs, hosts = scaling(ExecutionSpec(topology="cpu-4"), RaySettings(hosts=2, cpus_per_host=2))
    assert hosts == 2 and kwargs == {"num_workers": 2, "use_gpu": False, "resources_per_worker": {"CPU": 2}}
    with pytest.raises(UserError, match="reserves one TPU slice"):
        scaling(ExecutionSpec(topology="2xv5p-128"), RaySettings())
    with pytest.raises(UserError, match="has 16 hosts"):
        scaling(ExecutionSpec(topology="v5p-128"), RaySettings(hosts=2))


def test_which_exits_are_retried() -> None:
    """By the code alone: what the process printed does not matter."""
    assert RunnerExit(0, 75, "").retryable and RunnerExit(1, -9, "").retryable and RunnerExit(1, -6, "").retryable
    assert RunnerExit(0, 1, "").retryable and RunnerExit(0, 1, "error: Training stopped at step 5").retryable  # crash
    assert not RunnerExit(0, 65, "Traceback (most recent call last):").retryable  # the guard, a hook
    assert not RunnerExit(0, 2, "error: bad").retryable and not RunnerExit(0, 3, "").retryable
    assert not RunnerExit(0, 76, "").retryable and not RunnerExit(0, -2, "").retryable  # a stop asked for, Ctrl-C
    code, message = final_outcome({0: RunnerExit(0, 2, "error: Invalid config `x`: y. Fix: z"),
                                   1: RunnerExit(1, -6, "aborted")})
    assert (code, message) == (2, "Invalid config `x`: y. Fix: z")
    code, message = final_outcome({0: RunnerExit(0, 65, "error: Training stopped at step 5: non-finite loss."),
                                   1: RunnerExit(1, 134, "")})
    assert (code, message) == (65, "Training stopped at step 5: non-finite loss.")
    code, message = final_outcome({1: RuntimeError("actor died")})
    assert code == 75 and "its Ray worker died" in message


def test_each_attempt_s_launch_line_comes_from_the_run_directory(tmp_path) -> None:
    """Rank 0's watcher reports the line its attempt's process 0 adds to launches.jsonl (lines there
    before the attempt are not its own), once; the driver's line says where it resumed and the costs."""
    import threading
    from types import SimpleNamespace

    from runner.main.ray_launcher import LaunchWatcher, launch_event
    from runner.observability import goodput, launches

    g = goodput.Goodput(started=0.0, clock=lambda: 10.0)
    g.spent.update(restore=1.25, compile=2.5)
    g.start_loop()  # no run_dir: no line
    assert not (tmp_path / launches.FILE).exists()
    launches.append(tmp_path, launches.record(g, SimpleNamespace(step=None, tier=""), 1, now=5.0))
    got: list[dict] = []
    seen = threading.Event()
    watcher = LaunchWatcher(str(tmp_path), lambda line: (got.append(line), seen.set()), every_s=0.05)
    assert not watcher.look()  # the first launch's line was there before this attempt
    g.launches_before, g.attempt = 1, 2
    launches.append(tmp_path, launches.record(g, SimpleNamespace(step=8, tier="local"), 2))
    assert seen.wait(10)
    watcher.stop()
    assert got == [launches.read(tmp_path)[1]] and got[0]["restored_step"] == 8 and got[0]["attempt"] == 2
    assert launches.read(tmp_path)[0] == {"launch": 1, "attempt": 1, "restored_step": None, "tier": "",
                                          "startup_s": 6.25, "restore_s": 1.25, "compile_s": 2.5, "processes": 1,
                                          "time": 5.0}
    assert launch_event(2, got[0]) == "attempt 2: resumed from step 8 (local tier; startup 6.2 s, restore 1.2 s, " \
                                      "compile 2.5 s)"
    assert launch_event(1, launches.read(tmp_path)[0]).startswith("attempt 1: training from the start (startup")
    empty = LaunchWatcher(str(tmp_path / "elsewhere"), got.append)
    empty.stop()
    assert empty.before == [] and len(got) == 1  # no line yet, none reported



def test_a_watcher_whose_first_read_fails_looks_again(tmp_path, monkeypatch) -> None:
    """A bucket that does not answer as the attempt starts: the watcher keeps looking, and takes the
    lines written since it started as its attempt's (an older line is not reported)."""
    import threading
    import time
    from types import SimpleNamespace

    from runner.main.ray_launcher import LaunchWatcher
    from runner.observability import goodput, launches

    g = goodput.Goodput(started=0.0, clock=lambda: 10.0)
    launches.append(tmp_path, launches.record(g, SimpleNamespace(step=None, tier=""), 1, now=time.time() - 60))
    real, calls = launches.read, []

    def flaky(run_dir: Any) -> list[dict]:
        calls.append(run_dir)
        if len(calls) <= 2:  # the watcher's first look, and its thread's first
            raise OSError("503 Service Unavailable")
        return real(run_dir)

    monkeypatch.setattr(launches, "read", flaky)
    got: list[dict] = []
    seen = threading.Event()
    watcher = LaunchWatcher(str(tmp_path), lambda line: (got.append(line), seen.set()), every_s=0.05)
    assert watcher.before is None
    g.launches_before, g.attempt = 1, 2
    launches.append(tmp_path, launches.record(g, SimpleNamespace(step=8, tier="durable"), 1))
    assert seen.wait(10)
    watcher.stop()
    assert [line["attempt"] for line in got] == [2] and len(calls) >= 3

def test_ray_s_warnings_lose_their_traceback_and_errors_keep_it() -> None:
    """What Train's controller logged on a busy CI machine (a 5 s timeout it calls safe to ignore):
    one line with the exception's summary. Errors, and other libraries' warnings, are untouched."""
    import io
    import logging

    from runner.main.ray_logs import HOOK, one_line_warnings

    saved = logging.getLogRecordFactory()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    loggers = [logging.getLogger(name) for name in ("ray.train.v2.scaling", "jax.somewhere")]
    try:
        one_line_warnings()
        one_line_warnings()  # idempotent: Ray may run the hook where the driver already did
        for logger in loggers:
            logger.addHandler(handler)
            logger.propagate = False
        try:
            raise TimeoutError("Get timed out: some object(s) not ready.\nmore detail")
        except TimeoutError:
            loggers[0].warning("Failed to send resource request for %s. It's safe to ignore.", "train-1", exc_info=True)
            loggers[0].error("a real failure", exc_info=True)
            loggers[1].warning("another library's warning", exc_info=True)
    finally:
        logging.setLogRecordFactory(saved)
        for logger in loggers:
            logger.removeHandler(handler)
            logger.propagate = True
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("Failed to send resource request for train-1. It's safe to ignore. "
                        "(TimeoutError: Get timed out: some object(s) not ready.)")
    assert lines[1] == "a real failure" and lines[2] == "Traceback (most recent call last):"
    assert "another library's warning" in lines and stream.getvalue().count("Traceback") == 2
    assert HOOK == "runner.main.ray_logs.one_line_warnings"


def test_the_hook_is_named_to_ray_unless_a_submitted_job_has_its_own(monkeypatch) -> None:
    import json

    from runner.main.ray_launcher import setup_hook

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert setup_hook() == {"worker_process_setup_hook": "runner.main.ray_logs.one_line_warnings"}
    job = {"runtime_env": {"worker_process_setup_hook": "theirs.setup"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert setup_hook() == {}  # Ray would refuse to merge two hooks: theirs runs, Ray's warnings keep their tracebacks
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "."}}))
    assert setup_hook() == {"worker_process_setup_hook": "runner.main.ray_logs.one_line_warnings"}


ELASTIC = [*BASE, "logging.progress=plain"]  # the shared two-process run's, less its watchdog


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited {proc.returncode} before {what}: {log.read_text()[-4000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-4000:]}")


@pytest.mark.deep
def test_elastic_goes_on_with_the_hosts_left_and_grows_back(tmp_path, monkeypatch, two_processes) -> None:
    """A Ray cluster of two nodes (this process starts it); one node is taken away for good mid-run:
    the run goes on on the other, the data axis halved and the accumulation doubled; when a node
    returns, Ray stops the one-host group (runner saves on SIGTERM) and the run ends on two. Every
    step's loss is within float32 tolerance of an uninterrupted two-process run (the shared one:
    its watchdog changes no number). The first two-host group stops for good before step 8
    (`stall_in_step:8#1`: attempt 1 only), so it is still there however late the test takes the node
    away (Ray then kills the failed group); the one-host group waits before step 10 until it is
    signalled (`hold_alone`), so it is still there however late Ray sees the node come back. No step
    is paced: each wait is on what the test itself does."""
    import numpy as np
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    node_args = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    driver: Any = None  # a Popen, or a forked copy
    try:
        other = cluster.add_node(**node_args)
        log = (tmp_path / "driver.log").open("w")
        args = ["hydra/launcher=ray", f"hydra.launcher.address={cluster.address}",
                "hydra.launcher.hosts=2", "hydra.launcher.elastic=true", "hydra.launcher.resize_check_s=3",
                # what the hosts' runner processes need: the cluster's workers have the environment of its nodes
                f'hydra.launcher.env={{XLA_FLAGS: "{xla_flags(2)}", RUNNER_FAULT: "stall_in_step:8#1,hold_alone:10"}}',
                *ELASTIC, "run.dir=run"]
        # a group Ray cannot place (the lost node still counted) is given up after 10 s, not 60; no
        # actor polling for drained nodes (a cloud's preemption notices: this cluster has none)
        env = runner_env(tmp_path, 2, RAY_AUTH_MODE="disabled", RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="10",
                         RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0")
        # forked (tests/forked.py) where its environment allows, as the other runs: its output to the log
        driver = fork_server().start("module", "runner", args, tmp_path, env, output=log) or subprocess.Popen(
            [sys.executable, "-m", "runner", *args], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True,
            env=env)
        out = lambda: (tmp_path / "driver.log").read_text()  # noqa: E731
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 6, 300, "step 6", driver,
                 tmp_path / "driver.log")
        cluster.remove_node(other)  # a host lost for good
        wait_for(lambda: re.search(r"attempt \d: resumed from step", out()) is not None, 300, "a one-host attempt",
                 driver, tmp_path / "driver.log")
        assert "elastic: 1 of 2 hosts" in out() and "train.accumulate_steps 1 -> 2 keeps the global batch of 8" in out()
        cluster.add_node(**node_args)  # it comes back
        driver.wait(timeout=400)
        text = out()
        assert driver.returncode == 0, text[-5000:]
        assert re.search(r"ray: attempt \d started on 2 hosts[\s\S]*ray: attempt \d started on 1 host[\s\S]*"
                         r"ray: attempt \d started on 2 hosts", text), text[-5000:]
        assert "stopped by signal SIGTERM" in text  # the one-host group saved before growing back
    finally:
        if driver is not None and driver.poll() is None:  # a wait above timed out: end it, not leave it
            driver.kill()
            driver.wait()
        cluster.shutdown()
    run = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r}
    reference = {r["step"]: r["loss"] for r in read_metrics(two_processes) if "loss" in r}
    assert sorted(run) == sorted(reference) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([run[s] for s in sorted(run)], [reference[s] for s in sorted(run)], rtol=2e-6)


def test_hosts_the_cluster_cannot_hold_are_refused_at_once_on_a_local_cluster() -> None:
    from runner.errors import UserError
    from runner.main.ray_launcher import RaySettings, check_resources

    class FakeRay:
        @staticmethod
        def cluster_resources() -> dict[str, float]:
            return {"CPU": 2.0}

    said: list[str] = []
    gpus = {"num_workers": 2, "resources_per_worker": {"CPU": 1, "GPU": 8}}
    with pytest.raises(UserError, match=r"2 host\(s\) need 16 GPU \(it has 0\)"):
        check_resources(FakeRay, gpus, 2, RaySettings(), said.append)
    check_resources(FakeRay, gpus, 2, RaySettings(address="head:6379"), said.append)  # an autoscaler may add them
    assert said == ["ray: waiting for 16 GPU (it has 0): the cluster has fewer now (an autoscaler may add them)"]
    elastic = {"num_workers": (1, 4), "resources_per_worker": {"CPU": 2}}
    check_resources(FakeRay, elastic, 4, RaySettings(), said.append)  # one host of two CPUs is enough to start
    assert len(said) == 1


def test_ray_s_callbacks_lose_the_datasets_manager_everywhere_and_the_cleaner_on_the_local_cluster() -> None:
    """runner's workers read their own data, so Ray Data's datasets manager (an actor that keeps a
    core busy all run) is left out on every cluster; the placement-group cleaner, which asks a
    dashboard the local cluster does not start, only there. Ray's other callbacks stay."""
    from ray.train.v2.jax import JaxTrainer

    from runner.main.ray_launcher import RaySettings, make_trainer

    scaling = {"num_workers": 2, "resources_per_worker": {"CPU": 1}}
    names = {}
    for address in ("local", "10.0.0.1:6379"):
        trainer = make_trainer(RaySettings(address=address), scaling, {}, None)
        names[address] = {type(c).__name__ for c in trainer._create_default_callbacks()}
    ray_s = {type(c).__name__ for c in JaxTrainer._create_default_callbacks(trainer)}
    assert {"DatasetsCallback", "PlacementGroupCleanerCallback", "BackendSetupCallback"} <= ray_s  # what Ray adds
    assert names["10.0.0.1:6379"] == ray_s - {"DatasetsCallback"}
    assert names["local"] == ray_s - {"DatasetsCallback", "PlacementGroupCleanerCallback"}
