"""`python -m runner` (or another module, such as `runner.export`, or `python -c SCRIPT`) started
as a fork of a process that has already imported what runner imports: the tests start about 300
such processes, and a fresh interpreter spends 3.5 to 4 of its 8 to 11 seconds importing jax,
flax, optax, orbax, grain and hydra.

One server a pytest process (`python -m tests.forked SOCKET`) imports those modules and nothing
more: no JAX backend, no thread, no Hydra state, so a fork of it is safe and starts where a fresh
`python -m runner` would be after its imports. A request carries the command, the working
directory, the environment and the three standard streams (as file descriptors); the server
forks, and the copy takes them, writes what the imports printed, runs the module (`runner`, or
another) as `__main__` (or the script), and leaves as the interpreter would (its threads
joined, its exit handlers run, its streams flushed). The server sends back the copy's pid, then
its exit code (-N for a signal, as `subprocess` says). The copy is a process of its own: its own devices
(`XLA_FLAGS` is read when its backend starts), signals, exit code and output.

Only an environment the imports cannot have read differently is forked: one that differs from
the server's in nothing but `RUNTIME_KEYS`. Anything else, and everything when
`RUNNER_TEST_FORK=0`, starts a fresh interpreter (`subprocess`).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, Optional, Sequence

# What a fresh `python -m runner` imports before its first step (runner.train.faults reads its
# variable when asked, not on import).
PRELOAD = ["jax", "jax.numpy", "flax.linen", "optax", "orbax.checkpoint", "grain", "hydra", "omegaconf",
           "numpy", "runner.main.cli", "runner.main.sweep", "runner.models", "runner.train.trainer",
           "runner.checkpoint.checkpointer", "runner.data.documents", "runner.data.strategies",
           "runner.evaluation.base", "runner.parallel.mesh"]
# Read after the imports (when a backend starts, a run begins or a library is first imported by
# the copy), so a copy may have its own: jax reads the three JAX_ ones when jax.distributed starts,
# ALLOW_MULTIPLE_LIBTPU_LOAD when the TPU backend does, XLA's logging TF_CPP_MIN_LOG_LEVEL at its
# first message, rich NO_COLOR when a console is made; neither Ray nor wandb nor transformers,
# datasets or tokenizers is among the preloaded modules (runner sets the five before PYTEST_CURRENT_TEST
# itself, in the pytest process too when a test calls it there, so they may differ from the server's);
# the storage emulator's are read when a client is made (gcsfs, google-cloud-storage and tensorstore's
# GCS driver are not made before a run), after the copy derives the last three from the first as
# importing runner does (`configure_endpoint`).
RUNTIME_KEYS = {"XLA_FLAGS", "RUNNER_FAULT", "RUNNER_ATTEMPT", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                "JAX_PROCESS_ID", "HOOK_LOG", "HOOK_FAIL_AT", "HF_HOME", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE",
                "TOKENIZERS_PARALLELISM", "ALLOW_MULTIPLE_LIBTPU_LOAD", "TF_CPP_MIN_LOG_LEVEL", "NO_COLOR",
                "PYTEST_CURRENT_TEST", "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "HOOK_FAIL_SEED",
                "KMP_DUPLICATE_LIB_OK", "TORCHINDUCTOR_CACHE_DIR"}
# Set in the pytest process by a library a test imports after the server started: jax's Mosaic GPU
# module sets its MOSAIC_GPU_ paths on import (from the installed packages: the same in every process
# of the session) and reads them for GPU kernels only; threadpoolctl and scikit-learn set
# KMP_DUPLICATE_LIB_OK on import, read by Intel's OpenMP runtime when it loads (nothing preloaded
# loads it); torch's inductor sets TORCHINDUCTOR_CACHE_DIR (its default, the same in every process)
# when a test's torch first asks for its cache, and reads it only in torch (nothing preloaded imports
# torch): a session with the Hugging Face tests started 5 of 18 processes fresh for it.
# HOOK_FAIL_SEED, like HOOK_*, is read by tests/callback_fixture.py when a run builds
# it. A clean-clone run before these were allowed started 77 of its 270 processes fresh.
RUNTIME_PREFIXES = ("RAY_", "WANDB_", "MOSAIC_GPU_")
PACKET = 1 << 20


# ---- the server --------------------------------------------------------------------------------

def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter reports it
    return 1


def _child(request: dict[str, Any], fds: list[int], imported: bytes) -> None:
    """In the forked copy: take the request's streams, directory, environment and command, run
    it, and leave as the interpreter would. Never returns."""
    import atexit as exits
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from runner.checkpoint.storage import configure_endpoint

    configure_endpoint()  # what importing runner does with the environment (the emulator's variables)
    code = 0
    try:
        if imported:
            os.write(2, imported)
        if request["kind"] == "module":
            sys.argv = ["-m", *request["args"]]
            sys.path[0] = os.getcwd()
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *request["args"]]
            sys.path[0] = ""
            exec(compile(request["target"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException as err:  # noqa: BLE001 (what the interpreter does with an uncaught one)
        sys.excepthook(type(err), err, err.__traceback__)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
        exits._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def serve(path: str) -> None:
    """Import PRELOAD (what it prints kept for every copy), then fork a copy for each request on
    the socket at `path` until the process that started this one is gone."""
    import importlib
    import tempfile

    parent = os.getppid()
    with tempfile.TemporaryFile() as printed:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(printed.fileno(), 1)
        os.dup2(printed.fileno(), 2)
        try:
            for name in PRELOAD:
                importlib.import_module(name)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        printed.seek(0)
        imported = printed.read()
    # What the imports made lives as long as the copies: out of the collector's sight, a copy's
    # collections walk only what it makes itself (a tiny run 7.4 s -> 6.8 s), and its pages stay shared.
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # ready: clients connect only now
    waiting: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                message, fds, _, _ = socket.recv_fds(conn, PACKET, 3)
                request = json.loads(message)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _child(request, fds, imported)
            for fd in fds:
                os.close(fd)
            try:
                conn.send(json.dumps({"pid": pid}).encode())
            except OSError:
                pass
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()


# ---- the client --------------------------------------------------------------------------------

class Forked:
    """What `subprocess.Popen` offers the tests (pid, poll, wait, communicate, send_signal, kill,
    terminate, returncode, stdout, stderr), for a copy the server forked."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, stdout: Any, stderr: Any) -> None:
        self.args, self._conn, self.pid, self.stdout, self.stderr = args, conn, pid, stdout, stderr
        self.returncode: Optional[int] = None

    def _status(self, timeout: Optional[float]) -> Optional[int]:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                message = self._conn.recv(PACKET)
            except (socket.timeout, BlockingIOError):
                return None
            if not message:
                raise RuntimeError(f"the fork server went away before process {self.pid} ended")
            self.returncode = json.loads(message)["status"]
            self._conn.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._status(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def communicate(self, timeout: Optional[float] = None) -> tuple[Any, Any]:
        """Both streams to their end, then the exit code (the streams end when every process
        holding them has: the copy and what it started)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        read: dict[str, Any] = {}
        readers = [threading.Thread(target=lambda n=name, s=stream: read.__setitem__(n, s.read()), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream is not None]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return read.get("stdout"), read.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)


class Server:
    """This pytest process's fork server, started on first use and ended with the process."""

    def __init__(self, path: Path, env: dict[str, str]) -> None:
        self.path, self.env = path, env
        self._proc: Optional[subprocess.Popen] = None
        # what it did, for the session's summary: copies forked, and why the others started fresh
        self.tally: dict[str, Any] = {"forked": 0, "fresh": {}}

    def _start(self) -> bool:
        import time

        if self._proc is None:
            self.path.unlink(missing_ok=True)
            self._proc = subprocess.Popen([sys.executable, "-m", "tests.forked", str(self.path)], env=self.env,
                                          cwd=Path(__file__).resolve().parent.parent, stdin=subprocess.DEVNULL)
            atexit.register(self._stop)
        deadline = time.monotonic() + 120
        while not self.path.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return self._proc.poll() is None

    def _stop(self) -> None:
        import shutil

        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self.path.parent, ignore_errors=True)

    def differs(self, env: dict[str, str]) -> list[str]:
        """Why a copy with `env` would not start as a fresh interpreter would: the variables, other
        than the ones read after the imports, in which it differs from the server's."""
        if os.environ.get("RUNNER_TEST_FORK", "1") == "0":
            return ["RUNNER_TEST_FORK=0"]
        keys = {k for k in set(env) | set(self.env) if k not in RUNTIME_KEYS and not k.startswith(RUNTIME_PREFIXES)}
        return sorted(k for k in keys if env.get(k) != self.env.get(k))

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a copy with `env` starts as a fresh interpreter would."""
        return not self.differs(env)

    def _fresh(self, why: str) -> None:
        self.tally["fresh"][why] = self.tally["fresh"].get(why, 0) + 1

    def start(self, kind: str, target: str, args: Sequence[str], cwd: Path, env: dict[str, str],
              output: Optional[IO[Any]] = None) -> Optional[Forked]:
        """A forked copy running `target` (`kind` "module": any module, as `python -m`; "code": a
        script's text, as `python -c`), its stdout and stderr piped to this process as text, or
        both written to the open file `output` (as `Popen(stdout=output, stderr=STDOUT)`); None
        when this server cannot serve it."""
        differs = self.differs(env)
        if differs:
            self._fresh(" ".join(differs))
            return None
        if not self._start():
            self._fresh("the server did not start")
            return None
        self.tally["forked"] += 1
        streams = [os.open(os.devnull, os.O_RDONLY)]
        ours: list[Any] = []
        if output is not None:
            output.flush()
            streams += [os.dup(output.fileno()), os.dup(output.fileno())]
            ours = [None, None]
        for _ in range(2 if output is None else 0):
            r, w = os.pipe()
            ours.append(os.fdopen(r, "r"))
            streams.append(w)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(str(self.path))
            request = {"kind": kind, "target": target, "args": list(args), "cwd": str(cwd), "env": env}
            socket.send_fds(conn, [json.dumps(request).encode()], streams)
            pid = json.loads(conn.recv(PACKET))["pid"]
        except (OSError, ValueError) as err:  # the server is gone: nothing was started
            conn.close()
            for stream in ours:
                if stream is not None:
                    stream.close()
            raise RuntimeError(f"the fork server at {self.path} did not start the process: {err}") from err
        finally:
            for fd in streams:
                os.close(fd)
        shown = ["python", "-m" if kind == "module" else "-c", target if kind == "module" else "SCRIPT", *args]
        return Forked(shown, conn, pid, *ours)


def run(server: Optional[Server], kind: str, target: str, args: Sequence[str], cwd: Path, env: dict[str, str],
        timeout: Optional[float]) -> subprocess.CompletedProcess:
    """subprocess.run(..., capture_output=True, text=True, timeout=timeout) of `python -m target
    args` (or `python -c target args`), forked by `server` when it can serve it."""
    proc = server.start(kind, target, args, cwd, env) if server is not None else None
    command = [sys.executable, "-m" if kind == "module" else "-c", target, *args]
    if proc is None:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


if __name__ == "__main__":
    serve(sys.argv[1])
