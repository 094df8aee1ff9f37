"""jax.distributed, initialized once per process and only when the run spans several.

Where the settings come from, first match wins: the `distributed.*` keys of the spec; the
standard JAX variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); and
JAX's own cluster auto-detection on Cloud TPU pods and SLURM allocations. A process that dies
is noticed by the others through the coordinator's heartbeats: they abort (non-zero exit) within
`distributed.heartbeat_timeout_s` (default 60 s) plus a few seconds, instead of waiting forever
at a collective.
"""

from __future__ import annotations

import os
from typing import Any

from runner.errors import ConfigError
from runner.spec import DistributedSpec

INIT_TIMEOUT_S = 300

_initialized = False


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def settings(spec: DistributedSpec, topology_hosts: int = 0) -> tuple[str | None, int | None, int | None, bool]:
    """(coordinator, num_processes, process_id, auto_detect) for this process; pure.

    JAX's own cluster detection is used on SLURM allocations of several tasks, on TPU pods that
    name their workers, and whenever the topology asked for spans several TPU hosts (inside a
    container the worker variables may be missing; JAX then asks the TPU VM's metadata)."""
    coordinator = spec.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num = spec.num_processes if spec.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = spec.process_id if spec.process_id is not None else _env_int("JAX_PROCESS_ID")
    on_slurm = (_env_int("SLURM_NTASKS") or 1) > 1 and "SLURM_JOB_ID" in os.environ
    tpu_hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    auto = coordinator is None and (on_slurm or len(tpu_hosts) > 1 or topology_hosts > 1)
    return coordinator, num, pid, auto


def spans_several_processes(spec: DistributedSpec, topology_hosts: int = 0) -> bool:
    coordinator, num, _, auto = settings(spec, topology_hosts)
    return auto or (coordinator is not None and (num or 1) > 1)


def maybe_initialize(spec: DistributedSpec, topology_hosts: int = 0) -> None:
    """Initialize jax.distributed exactly once, before any other JAX use, if needed.
    `topology_hosts` is the host count of the TPU topology asked for (0 if not a TPU name)."""
    global _initialized
    if _initialized or not spans_several_processes(spec, topology_hosts):
        return
    import jax

    coordinator, num, pid, auto = settings(spec, topology_hosts)
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        # CPU processes need a cross-process collectives backend.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(initialization_timeout=INIT_TIMEOUT_S, heartbeat_timeout_seconds=spec.heartbeat_timeout_s)
    if auto:
        jax.distributed.initialize(**kwargs)
    else:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=pid, **kwargs)
    _initialized = True


def leave_together(timeout_s: float = 330) -> None:
    """Disconnect from the coordination service once every process has (jax.distributed's
    shutdown barrier), for a run stopping on every process at once but not at the same moment
    (a bucket that stays down: each process keeps its step in the local tier first, and those
    saves use the service). Process 0 hosts the service: leaving before the others would abort
    them mid-save. A process that never arrives releases the others after the service's own
    shutdown timeout (300 s); `timeout_s` bounds the wait here in case it does not."""
    global _initialized
    if not _initialized:
        return
    import threading

    import jax

    def shutdown() -> None:
        try:
            jax.distributed.shutdown()
        except Exception:  # a peer that never arrived: nothing left to coordinate
            pass

    waiter = threading.Thread(target=shutdown, name="runner-leave", daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    _initialized = False


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process (a tiny allgather; call it on every process)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag]))))


def all_processes(flag: bool) -> bool:
    """Whether `flag` is set on every process (call it on every process)."""
    return not any_process(not flag)


def steps_by_process(steps: list[int]) -> dict[int, frozenset[int]]:
    """{step: the processes that have it} over every process's `steps` (each passes its own
    list; call it on every process)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return {int(s): frozenset({0}) for s in steps}
    width = int(np.max(multihost_utils.process_allgather(np.asarray([len(steps)]))))
    if width == 0:
        return {}
    padded = np.full((width,), -1, dtype=np.int32)
    padded[:len(steps)] = steps
    everyone = multihost_utils.process_allgather(padded)
    held: dict[int, set[int]] = {}
    for process, row in enumerate(everyone):
        for s in row:
            if s >= 0:
                held.setdefault(int(s), set()).add(process)
    return {s: frozenset(p) for s, p in held.items()}


def hosts_by_process() -> list[int]:
    """Each process's machine, numbered from 0 in the order of first appearance (process 0's is 0):
    processes that share a host name share a number (call it on every process: an allgather of a
    hash of socket.gethostname()). len(set(...)) is the run's hosts: a machine's failure takes all
    of its processes, and SLURM starts one process per GPU."""
    import socket
    import zlib

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return [0]
    mine = np.asarray([zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF], dtype=np.int32)
    everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
    numbers: dict[int, int] = {}
    return [numbers.setdefault(int(h), len(numbers)) for h in everyone]


def from_process(source: int, text: str | None) -> str:
    """`text` as process `source` has it, on every process (call it on every process)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return text or ""
    mine = jax.process_index() == source
    data = np.frombuffer((text or "").encode(), dtype=np.uint8) if mine else np.zeros((0,), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.asarray(len(data), np.int32), is_source=mine))
    padded = np.zeros((size,), np.uint8)
    padded[:len(data)] = data[:size]
    return bytes(multihost_utils.broadcast_one_to_all(padded, is_source=mine)).decode()


def check_spec(spec: Any) -> None:
    """The distributed section: several processes need a coordinator and a process id (or a
    cluster JAX detects by itself), else each would train alone, silently."""
    d = spec.distributed
    coordinator, num, pid, auto = settings(d)
    if auto or num is None or num <= 1:
        return
    if coordinator is None:
        raise ConfigError("distributed.coordinator_address", None,
                          f"distributed.num_processes={num} asks for {num} processes, but nothing says where "
                          "they meet.", "set distributed.coordinator_address=HOST:PORT (the same on every process; "
                          "process 0 listens there) or JAX_COORDINATOR_ADDRESS, or drop distributed.num_processes "
                          "to train in one process.")
    if pid is None:
        raise ConfigError("distributed.process_id", None,
                          f"with distributed.num_processes={num}, each process needs its own number.",
                          f"set distributed.process_id=0 .. {num - 1} (or JAX_PROCESS_ID) on each process.")
