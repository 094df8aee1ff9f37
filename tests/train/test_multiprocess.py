"""Several JAX processes on localhost cooperate as one job (gloo collectives, fake CPU devices)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from tests.conftest import TINY, fork_server, read_metrics, run_runner, runner_env, shared_run, wait_for_lines
from tests.train.test_restore import params_of

STEPS = 12
BASE = [*TINY, f"train.steps={STEPS}", "checkpoint.every_steps=4", "eval.every=0", "optimizer.lr=1e-2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args: list[str], tmp_path: Path, processes: int = 2, devices: int = 2, via_config: bool = False,
           per_process: Optional[list[dict[str, str]]] = None, **env: str) -> list[subprocess.Popen]:
    """N processes joined through the standard JAX variables, or through the distributed.* keys;
    `per_process[i]`: process i's own variables (beside `env`, everyone's)."""
    port = free_port()
    procs = []
    for i in range(processes):
        mine = {**env, **(per_process[i] if per_process else {})}
        if via_config:
            e = runner_env(tmp_path, devices, **mine)
            extra = [f"distributed.coordinator_address=localhost:{port}", f"distributed.num_processes={processes}",
                     f"distributed.process_id={i}"]
        else:
            e = runner_env(tmp_path, devices, JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                           JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i), **mine)
            extra = []
        procs.append(fork_server().start("module", "runner", [*args, *extra], tmp_path, e) or subprocess.Popen(
            [sys.executable, "-m", "runner", *args, *extra], cwd=tmp_path, env=e, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, stderr))
    return out


def assert_close_runs(a: Path, b: Path) -> None:
    la = {r["step"]: r["loss"] for r in read_metrics(a) if "loss" in r}
    lb = {r["step"]: r["loss"] for r in read_metrics(b) if "loss" in r}
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([la[s] for s in sorted(la)], [lb[s] for s in sorted(lb)], rtol=1e-5)
    for x, y in zip(params_of(a, STEPS), params_of(b, STEPS)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)  # only the summation order differs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("one")
    result = run_runner([*BASE, "run.dir=run"], tmp, devices=4)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run"


@pytest.mark.e2e
def test_two_processes_train_like_one_with_four_devices(one_process, two_processes) -> None:
    """The shared two-process run (below: BASE with a watchdog, which changes no number)."""
    outputs = [(two_processes.parent / f"stdout-{i}.txt").read_text() for i in range(2)]
    assert "Finished gpt_tiny" in outputs[0]
    assert "step " not in outputs[1] and "Finished" not in outputs[1]  # one writer
    run_dir = two_processes
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, STEPS + 1))  # each step logged once
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1  # only process 0 creates a run
    assert_close_runs(run_dir, one_process)


@pytest.mark.deep
def test_two_process_checkpoint_resumes_in_one_process_and_back(tmp_path, one_process) -> None:
    killed = finish(launch([*BASE, "run.dir=a"], tmp_path, RUNNER_FAULT="kill_at_step:6"))
    # each process kills itself at step 6; one that is left waiting at a collective for its dead
    # partner is aborted by the heartbeat check instead
    codes = [code for code, _, _ in killed]
    assert -signal.SIGKILL in codes and all(code != 0 for code in codes), codes
    resumed = run_runner([*BASE, "run.dir=a"], tmp_path, devices=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4 " in resumed.stdout
    assert_close_runs(tmp_path / "a", one_process)

    first = run_runner([*BASE, "run.dir=b"], tmp_path, devices=4, RUNNER_FAULT="kill_at_step:6")
    assert first.returncode == -signal.SIGKILL
    results = finish(launch([*BASE, "run.dir=b"], tmp_path, via_config=True))
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    assert "resumed from step 4 " in results[0][1]
    assert_close_runs(tmp_path / "b", one_process)


@pytest.mark.deep
def test_sigterm_on_one_host_stops_every_host_at_the_same_step(tmp_path) -> None:
    args = [*BASE, "run.dir=run", "train.steps=100000", "checkpoint.every_steps=0", "distributed.stop_check_every=5"]
    procs = launch(args, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for_lines(metrics, 3, procs=procs)
    procs[1].send_signal(signal.SIGTERM)  # only one host is told
    results = finish(procs)
    assert [code for code, _, _ in results] == [75, 75], results[0][2][-2000:] + results[1][2][-2000:]
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and saved[0] % 5 == 0  # agreed at a check boundary
    assert f"stopped by a stop request from another process at step {saved[0]}" in results[0][1]


@pytest.mark.parametrize("victim", [1, 0])
@pytest.mark.e2e
def test_a_dead_process_makes_the_others_exit_in_bounded_time(tmp_path, victim) -> None:
    args = [*BASE, "run.dir=run", "train.steps=100000", "checkpoint.every_steps=0",
            "distributed.heartbeat_timeout_s=10", "logging.progress=none"]  # nothing fills the unread pipes
    procs = launch(args, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for_lines(metrics, 3, procs=procs)
    procs[victim].kill()
    survivor = procs[1 - victim]
    # the bound: the heartbeat timeout and a few seconds (documented); a survivor that hangs instead
    # is TimeoutExpired here, long past that (no timing asserted: the machines are shared)
    _, err = survivor.communicate(timeout=120)
    # what ended it: jax.distributed's coordination client, which aborts its process once the service
    # reports a task dead (not runner's own error, nor the bound above)
    assert survivor.returncode == -signal.SIGABRT, err[-3000:]
    assert "Terminating process because the JAX distributed service detected fatal errors" in err, err[-3000:]
    if victim == 1:  # process 0 hosts the service: its heartbeat timeout saw process 1 go silent
        assert "stopped sending heartbeats" in err, err[-3000:]
    # (process 0 killed takes the service with it: process 1's next call to it fails at once)


LEAVING = """
import fcntl, os, sys, time
from runner.parallel import distributed
from runner.spec import DistributedSpec
distributed.maybe_initialize(DistributedSpec())
import jax
from jax._src.distributed import global_state
how = sys.argv[1]
if jax.process_index() == 0:
    alive = open(f"alive-{how}", "w")  # locked while process 0 lives: its exit lets go
    fcntl.flock(alive, fcntl.LOCK_EX)
    open(f"done-{how}", "w").close()  # done: it leaves now
else:  # still at work on the coordination service when process 0 is done
    while not os.path.exists(f"done-{how}"):
        time.sleep(0.05)
    if how == "apart":  # and, apart, once it has gone
        fcntl.flock(open(f"alive-{how}"), fcntl.LOCK_EX)
    global_state.client.key_value_set("late", "1")
    print("late write done", flush=True)
if how == "together":
    distributed.leave_together()
sys.stdout.flush()
os._exit(0)  # as runner's exit 75 leaves
"""


@pytest.mark.deep
def test_process_zero_leaving_waits_for_the_processes_still_using_its_coordination_service(tmp_path) -> None:
    """Process 0 hosts the coordination service: leaving while another process still uses it (its
    local save on exit 75) aborts that process. `leave_together` waits for every process."""
    def both(how: str) -> list[tuple[int, str, str]]:
        port = free_port()
        envs = [runner_env(tmp_path, 1, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                           JAX_PROCESS_ID=str(i)) for i in range(2)]
        procs = [fork_server().start("code", LEAVING, [how], tmp_path, env) or subprocess.Popen(
            [sys.executable, "-c", LEAVING, how], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env) for env in envs]
        return finish(procs, timeout=120)

    apart = both("apart")
    assert apart[0][0] == 0 and apart[1][0] != 0 and "late write done" not in apart[1][1]
    together = both("together")
    assert [code for code, _, _ in together] == [0, 0], together[1][2][-2000:]
    assert "late write done" in together[1][1]


def test_when_jax_distributed_is_started(monkeypatch) -> None:
    from runner.parallel.distributed import settings, spans_several_processes
    from runner.spec import DistributedSpec

    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS", "SLURM_JOB_ID",
                "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    assert not spans_several_processes(DistributedSpec())  # a laptop: never
    assert spans_several_processes(DistributedSpec(), topology_hosts=4)  # v4-32: JAX's TPU detection
    keys = DistributedSpec(coordinator_address="h:1", num_processes=2, process_id=1)
    assert settings(keys) == ("h:1", 2, 1, False)  # documented keys win
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "e:2")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    assert settings(DistributedSpec()) == ("e:2", 3, 0, False)  # then the standard variables
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert settings(DistributedSpec())[3]  # a SLURM allocation of several tasks: auto-detect


# ------------------------------------------------------------------ the watchdog (run.hang_timeout)

HANG_S = 8
WATCHED = [*BASE, "eval.every=0", f"run.hang_timeout={HANG_S}s", "logging.progress=plain"]


# The reference is watched as the tests' runs are, with room to spare on a busy 2-core machine (HANG_S
# once fired in it there, while the watchdog still timed the compile of the evaluation at step 0).
REFERENCE_HANG_S = 120


def make_two_processes(tmp: Path) -> Path:
    watched = [*BASE, "eval.every=0", f"run.hang_timeout={REFERENCE_HANG_S}s", "logging.progress=plain"]
    results = finish(launch([*watched, "run.dir=run", "logging.wandb=offline"], tmp))
    for i, (code, stdout, stderr) in enumerate(results):
        assert code == 0, stderr[-3000:]
        (tmp / f"stdout-{i}.txt").write_text(stdout)
    return tmp / "run"


@pytest.fixture(scope="module")
def two_processes() -> Path:
    """An uninterrupted two-process run: the reference a healed run must equal bit for bit (here
    and in test_ray: the watchdog changes no number). Made once a session."""
    return shared_run("two-processes", make_two_processes)


def assert_identical_runs(a: Path, b: Path) -> None:
    from tests.checkpoint.test_local_tier import assert_bitwise

    assert_bitwise(a, b, STEPS)


def stalled_at_step_6(tmp_path: Path, fault: str, **env: str) -> list[tuple[int, str, str]]:
    """Two processes, process 1 stopping for good as step 6 is dispatched: their results. Both
    end on their own (a process still there long after run.hang_timeout fails the test as
    TimeoutExpired: a bound against a hang, no timing asserted)."""
    procs = launch([*WATCHED, "run.dir=run"], tmp_path, RUNNER_FAULT=f"{fault}:6@1", **env)
    wait_for_lines(tmp_path / "run" / "metrics.jsonl", 5, procs=procs)
    return finish(procs, timeout=HANG_S + 120)


@pytest.mark.e2e
def test_a_process_stalled_in_a_step_makes_every_process_exit_75_and_the_rerun_ends_bitwise(
        tmp_path, two_processes) -> None:
    results = stalled_at_step_6(tmp_path, "stall_in_step")
    assert [code for code, _, _ in results] == [75, 75], results[0][2][-2000:] + results[1][2][-2000:]
    for code, _, stderr in results:
        assert stderr.count("error: watchdog:") == 1 and "Every process stops with exit 75" in stderr
        assert "Traceback" not in stderr
    hangs = tmp_path / "run" / "hangs"
    stalled = (hangs / "process-1.txt").read_text()
    assert "in stall_in_step" in stalled and "last step done on this process: " in stalled
    # every thread (faulthandler names none, only their frames): the watchdog's own too
    assert re.search(r'watchdog\.py", line \d+ in _watch\n', stalled), stalled[-3000:]
    assert (hangs / "process-0.txt").exists()

    rerun = finish(launch([*WATCHED, "run.dir=run"], tmp_path))
    for code, _, stderr in rerun:
        assert code == 0, stderr[-3000:]
    assert "resumed from step 4 " in rerun[0][1]
    assert_identical_runs(tmp_path / "run", two_processes)


@pytest.mark.deep
def test_a_wedged_process_that_cannot_notice_is_noticed_by_the_other(tmp_path) -> None:
    """Process 1 holds the interpreter lock for good (no Python thread of it runs again): process 0
    notices alone and exits 75; process 1 is ended by faulthandler's own timer, its stack on stderr."""
    results = stalled_at_step_6(tmp_path, "wedge_in_step")
    (code0, _, err0), (code1, _, err1) = results
    assert code0 == 75, err0[-2000:]
    assert "no progress for" in err0 and "on process 0" in err0
    assert (tmp_path / "run" / "hangs" / "process-0.txt").exists()
    assert not (tmp_path / "run" / "hangs" / "process-1.txt").exists()  # its Python never ran again
    assert code1 != 0 and code1 != 75
    assert "in wedge_in_step" in err1, err1[-3000:]  # faulthandler's dump, written without the lock
