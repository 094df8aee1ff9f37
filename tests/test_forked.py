"""The fork server (tests/forked.py) that starts the suite's `python -m runner` processes: a copy
behaves as a fresh interpreter does in what the tests read (exit codes, signals, output, its own
devices, directory, environment and arguments, exit handlers and threads at exit), and an
environment the imports could have read differently gets a fresh interpreter."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import fork_server, xla_flags
from tests.forked import run

pytestmark = pytest.mark.e2e

SCRIPT = """
import atexit, os, sys, threading, time
import jax
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
print(jax.device_count(), os.getcwd(), sys.argv[1:], os.environ.get("RUNNER_FAULT"), flush=True)
print("to stderr", file=sys.stderr)
what = sys.argv[1]
if what == "raise":
    raise ValueError("uncaught")
if what == "exit":
    sys.exit(7)
if what == "message":
    sys.exit("a message")
if what == "wait":  # until signalled; one that is not writes `woke` after a minute
    time.sleep(60)
    open("woke", "w").close()
"""


def test_a_copy_has_its_own_devices_directory_arguments_environment_and_exit(tmp_path) -> None:
    server = fork_server()
    results = {}
    for devices, what in ((4, "ok"), (2, "raise"), (1, "exit"), (1, "message")):
        # the server's environment, as the session started (a test in this process may have set more)
        env = {**server.env, "XLA_FLAGS": xla_flags(devices), "RUNNER_FAULT": f"f{devices}"}
        assert server.serves(env)
        results[what] = run(server, "code", SCRIPT, [what, "x"], tmp_path, env, 120)
    ok = results["ok"]
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.splitlines() == [f"4 {tmp_path} ['ok', 'x'] f4", "thread joined", "atexit ran"]
    assert ok.stderr == "to stderr\n"
    raised = results["raise"]
    assert raised.returncode == 1 and raised.stdout.splitlines()[0] == f"2 {tmp_path} ['raise', 'x'] f2"
    assert "Traceback (most recent call last)" in raised.stderr and raised.stderr.rstrip().endswith(
        "ValueError: uncaught")
    assert "atexit ran" in raised.stdout  # as at any exit
    assert results["exit"].returncode == 7
    assert results["message"].returncode == 1 and results["message"].stderr.endswith("a message\n")


def test_a_copy_is_signalled_waited_for_and_timed_out_as_a_process_is(tmp_path) -> None:
    server = fork_server()
    env = server.env
    for sig in (signal.SIGKILL, signal.SIGTERM):
        proc = server.start("code", SCRIPT, ["wait"], tmp_path, env)
        assert proc is not None and proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        seen = [proc.stdout.readline() for _ in range(2)]  # its first line, then its thread's
        assert seen[1] == "thread joined\n", seen
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -sig and "atexit ran" not in out  # killed: no exit handler runs
    with pytest.raises(subprocess.TimeoutExpired):
        run(server, "code", SCRIPT, ["wait"], tmp_path, env, 2)
    # `run` raises once the copy has ended (the server reports its exit): killed at its timeout,
    # not left to finish its sleep
    assert not (tmp_path / "woke").exists()


def test_runner_s_refusal_is_the_fresh_interpreter_s_and_a_changed_import_setting_is_not_forked(tmp_path) -> None:
    args = ["train.steps=oops"]
    server = fork_server()
    forked = server.start("module", "runner", args, tmp_path, server.env)
    assert forked is not None
    out, err = forked.communicate(timeout=300)
    fresh = subprocess.run([sys.executable, "-m", "runner", *args], cwd=tmp_path, env=server.env,
                           capture_output=True, text=True, timeout=300)
    assert forked.returncode == fresh.returncode == 2
    assert out == fresh.stdout and err == fresh.stderr
    assert len(err.strip().splitlines()) == 1 and "train.steps" in err
    before = dict(server.tally["fresh"])
    for changed in ({"JAX_ENABLE_X64": "1"}, {"PYTHONPATH": str(tmp_path)}, {"RUNNER_CONF_DIR": str(tmp_path)},
                    {"JAX_ENABLE_X64": "1", "PYTHONPATH": str(tmp_path)}):
        env = {**server.env, **changed}
        assert not server.serves(env) and server.start("module", "runner", [], tmp_path, env) is None
    # the session's summary counts them by the variables that made them fresh
    assert {why: n - before.get(why, 0) for why, n in server.tally["fresh"].items() if n != before.get(why, 0)} == {
        "JAX_ENABLE_X64": 1, "PYTHONPATH": 1, "RUNNER_CONF_DIR": 1, "JAX_ENABLE_X64 PYTHONPATH": 1}
    # the storage emulator's variables are read when a run makes a client: forked, and the copy
    # derives the clients' settings from STORAGE_EMULATOR_HOST as `import runner` does
    env = {**server.env, "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9/"}
    assert server.serves(env)
    # what libraries imported by tests after the server started set in the pytest process
    leaked = {"MOSAIC_GPU_CUDA_ROOT": "/x", "MOSAIC_GPU_NVSHMEM_SO_PATH": "/y", "KMP_DUPLICATE_LIB_OK": "True"}
    assert server.serves({**env, **leaked})
    forked_before = server.tally["forked"]
    endpoint = run(server, "code", "import os; print(*(os.environ.get(k) for k in ('TENSORSTORE_GCS_HTTP_URL', "
                   "'GOOGLE_AUTH_TOKEN_FOR_TESTING', 'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT')))", [], tmp_path, env, 120)
    assert endpoint.stdout.split() == ["http://127.0.0.1:9", "emulator", "false"]
    assert server.tally["forked"] == forked_before + 1
    x64 = run(server, "code", "import jax.numpy as jnp; print(jnp.zeros(1).dtype)", [], tmp_path,
              {**server.env, "JAX_ENABLE_X64": "1"}, 120)
    assert x64.stdout.strip() == "float64"  # a fresh interpreter read it


NAMES = "import sys; print(__name__, sys.argv, repr(sys.path[0])); print('to stderr', file=sys.stderr); sys.exit(3)"


def test_another_module_and_a_script_written_to_a_file_are_the_fresh_interpreter_s(tmp_path) -> None:
    """`python -m runner.export` (a module other than runner: its own `__main__`, argv[0] and
    refusal) and a `python -c` script whose output goes to a file (as a driver's log), forked and
    fresh: the same exit code and output."""
    server = fork_server()
    args = ["nowhere", "hf"]
    forked = run(server, "module", "runner.export", args, tmp_path, server.env, 300)
    fresh = subprocess.run([sys.executable, "-m", "runner.export", *args], cwd=tmp_path, env=server.env,
                           capture_output=True, text=True, timeout=300)
    assert forked.returncode == fresh.returncode == 2, fresh.stderr[-2000:]
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr and "nowhere" in fresh.stderr
    assert not (tmp_path / "hf").exists()

    logs = []
    for name in ("forked", "fresh"):
        with (tmp_path / f"{name}.log").open("w") as log:
            log.write("before\n")  # what the caller wrote first stays first (start flushes it; Popen does not)
            if name == "forked":
                proc = server.start("code", NAMES, ["x"], tmp_path, server.env, output=log)
            else:
                log.flush()
                proc = subprocess.Popen([sys.executable, "-c", NAMES, "x"], cwd=tmp_path, env=server.env, stdout=log,
                                        stderr=subprocess.STDOUT, text=True)
            assert proc is not None and proc.stdout is None
            assert proc.wait(timeout=120) == 3
        logs.append((tmp_path / f"{name}.log").read_text())
    assert logs[0] == logs[1] == "before\n__main__ ['-c', 'x'] ''\nto stderr\n", logs
