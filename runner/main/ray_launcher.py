"""A run on a Ray cluster through Ray Train's JaxTrainer, restarted when an attempt fails.

Ray does what it is good at: it reserves the hosts (a TPU slice by `topology`, GPUs or CPUs), starts
one worker per host, notices a dead worker or node, tears the group down and starts it again
(`FailureConfig(max_failures=hydra.launcher.max_restarts)`; preemptions have Ray's own budget).
runner's contract does the rest: every worker runs the same `python -m runner ...` command as one JAX
process (a fresh process each attempt: jax.distributed starts once per process, with a fresh
coordinator port), and runner's restore resumes from the newest checkpoint. Ray's own checkpoints
are not used.

Whether an attempt is retried is decided by the runner processes' exit codes alone
(runner.exits.restartable), never by what they printed: an end a rerun cannot change is not retried
(2 a setting, 3 does not fit, 65 a halt: the numerical guard or a hook, 76 a stop you asked for);
75 (a preemption's SIGTERM, the watchdog, a bucket down), a crash (1, a signal) and a host lost
are. Where each attempt took the run up, and what starting it cost, come from the run directory
(launches.jsonl, runner.observability.launches), which process 0 writes when its loop starts. The
driver prints each attempt, why it ended, and that line. The settings are typed
(hydra_plugins/runner_ray_launcher/config.py): OmegaConf refuses an unknown key or a mistyped value
when the command line is composed; `check_settings` says what types cannot (ranges).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Any, Callable, Mapping, Optional, Sequence

from hydra_plugins.runner_ray_launcher.config import TARGET, RayLauncherConf, schema
from runner.checkpoint import storage
from runner.errors import UserError, first_line
from runner.exits import PREEMPTED_EXIT_CODE, restartable
from runner.main.ray_logs import HOOK as ONE_LINE_WARNINGS
from runner.main.ray_logs import one_line_warnings

RaySettings = RayLauncherConf  # hydra.launcher under hydra/launcher=ray, typed
TAIL_LINES = 60
LAUNCH_POLL_S = (1.0, 5.0)  # how often rank 0 looks for its launch's line in launches.jsonl: local, gs://
# runner's TPU generations as Ray names them (ray.util.accelerators)
RAY_TPU_TYPES = {"v2": "TPU-V2", "v3": "TPU-V3", "v4": "TPU-V4", "v5p": "TPU-V5P", "v5e": "TPU-V5LITEPOD",
                 "v6e": "TPU-V6E", "tpu7x": "TPU-V7X"}


def settings_from_hydra(launcher: Any) -> Optional[RaySettings]:
    """The settings when hydra.launcher is runner's Ray launcher (else None), through its typed
    schema: composing has checked them already, save a key added with `+`, which OmegaConf refuses
    here."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if launcher is None or launcher.get("_target_") != TARGET:
        return None
    values = OmegaConf.to_container(launcher, resolve=True) if OmegaConf.is_config(launcher) else dict(launcher)
    try:
        settings = OmegaConf.to_object(OmegaConf.merge(schema(), values))
    except OmegaConfBaseException as err:
        key = f"hydra.launcher.{err.full_key}" if getattr(err, "full_key", None) else "hydra.launcher"
        raise UserError(f"Invalid config `{key}`: {first_line(err, 300)}. Fix: use the Ray launcher's settings "
                        "as hydra_plugins/runner_ray_launcher/config.py declares them (`python -m runner --cfg hydra "
                        "-p hydra.launcher hydra/launcher=ray` prints them).") from None
    settings.env = {str(k): str(v) for k, v in (settings.env or {}).items()}
    check_settings(settings)
    return settings


def check_settings(settings: RaySettings) -> None:
    """What the types cannot say: each setting's range."""
    rules = (("hosts", settings.hosts >= 0, "0 (the topology's hosts) or more"),
             ("cpus_per_host", settings.cpus_per_host >= 0, ">= 0"),
             ("gpus_per_host", settings.gpus_per_host >= 0, ">= 0"),
             ("max_restarts", settings.max_restarts >= -1, "-1 (no limit) or more"),
             ("object_store_mb", settings.object_store_mb >= 80, "at least 80 (Ray's minimum)"),
             ("min_hosts", settings.min_hosts >= 1, "1 or more"),
             ("resize_check_s", settings.resize_check_s > 0, "> 0"),
             ("stop_grace_s", settings.stop_grace_s >= 0, ">= 0"))
    for key, ok, bound in rules:
        if not ok:
            raise UserError(f"Invalid config `hydra.launcher.{key}={getattr(settings, key)!r}`: it must be {bound}. "
                            f"Fix: set hydra.launcher.{key} to {bound}.")


class RunnerExit(Exception):
    """One worker's runner process ended with a non-zero code (raised in the worker; Ray hands it
    to the failure policy and the driver)."""

    def __init__(self, rank: int, code: int, tail: str) -> None:
        self.rank, self.code, self.tail = rank, code, tail
        super().__init__(f"process {rank} exited {describe_code(code)}")

    def __reduce__(self) -> Any:
        return RunnerExit, (self.rank, self.code, self.tail)

    @property
    def retryable(self) -> bool:
        """By the code alone (runner.exits): 75 and a crash are; a setting, does not fit, a halt and a
        stop you asked for are not."""
        return restartable(self.code)

    @property
    def paragraph(self) -> str:
        """runner's own `error: ...` paragraph, if the process printed one."""
        lines = [line for line in self.tail.splitlines() if line.startswith("error: ")]
        return lines[-1][len("error: "):] if lines else ""


def describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"with code {code}"


def describe_failure(error: BaseException) -> str:
    if isinstance(error, RunnerExit):
        why = error.paragraph or ("" if error.code < 0 else (error.tail.strip().splitlines() or [""])[-1])
        return f"{error}{': ' + why[:300] if why else ''}"
    cause = getattr(error, "health_check_failure", None) or error
    return f"its Ray worker died ({type(cause).__name__}: {str(cause).splitlines()[0][:200] if str(cause) else ''})"


# ---------------------------------------------------------------------------------- the driver


def check_cluster(settings: RaySettings) -> None:
    """A HOST:PORT with no Ray head behind it is one paragraph at once (ray.init would retry for
    many minutes)."""
    if settings.address in ("local", "auto"):
        return
    host, _, port = settings.address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"Invalid config `hydra.launcher.address={settings.address!r}`: it is not HOST:PORT. Fix: "
                        "give the Ray head's address (`ray start --head` prints it), auto, or local.")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise UserError(f"hydra.launcher.address={settings.address!r}: no Ray cluster answers there "
                        f"({err.strerror or err}). Fix: start one (`ray start --head --port={port}` on the head "
                        "node), correct the address, or use hydra.launcher.address=local for a cluster on this "
                        "machine.") from None


def import_ray() -> Any:
    try:
        import ray
        from ray.train.v2.jax import JaxTrainer  # noqa: F401
    except ImportError:
        raise UserError("hydra/launcher=ray needs Ray Train, which is not installed. Fix: `bash tools/venv.sh ray` "
                        "(or pip install -e '.[ray]').") from None
    return ray


def scaling(spec: Any, settings: RaySettings) -> tuple[dict[str, Any], int]:
    """ScalingConfig's arguments and the number of hosts, from the topology and the settings."""
    from runner.parallel.topology import parse_topology

    topology = parse_topology(spec.topology)
    if topology.platform == "tpu":
        if settings.elastic:
            raise UserError(f"hydra.launcher.elastic=true with topology={spec.topology}: a TPU slice cannot lose a "
                            "host and go on (its chips are one interconnect). Fix: drop hydra.launcher.elastic; Ray "
                            "still restarts the slice's hosts after a failure.")
        if topology.num_slices > 1:
            raise UserError(f"topology={spec.topology} under hydra/launcher=ray: Ray Train's JaxTrainer reserves one "
                            "TPU slice. Fix: train on one slice under Ray, or launch several slices with "
                            "tools/launch_tpu.py or SkyPilot (docs/launching.md).")
        hosts = settings.hosts or topology.num_hosts
        if hosts != topology.num_hosts:
            raise UserError(f"Invalid config `hydra.launcher.hosts={settings.hosts}`: topology={spec.topology} has "
                            f"{topology.num_hosts} hosts, and every host of a slice runs one process. Fix: set "
                            f"hydra.launcher.hosts=0 (or {topology.num_hosts}).")
        assert topology.chip is not None and topology.physical_shape is not None
        kwargs: dict[str, Any] = {
            "use_tpu": True, "topology": "x".join(str(n) for n in topology.physical_shape),
            "accelerator_type": RAY_TPU_TYPES[topology.chip.name],
            "resources_per_worker": {"TPU": topology.num_chips // topology.num_hosts}}
        return {"num_workers": hosts, **kwargs}, hosts
    hosts = settings.hosts or 1
    resources: dict[str, float] = {"CPU": settings.cpus_per_host}
    if settings.gpus_per_host:
        resources["GPU"] = settings.gpus_per_host
    workers: Any = hosts
    if settings.elastic:
        if spec.mesh.data != -1:
            raise UserError(f"hydra.launcher.elastic=true with mesh.data={spec.mesh.data}: an elastic run shrinks "
                            "along the data axis, so it must fill what the other axes leave. Fix: set mesh.data=-1 "
                            "(the default), or drop hydra.launcher.elastic.")
        if not 1 <= settings.min_hosts <= hosts:
            raise UserError(f"Invalid config `hydra.launcher.min_hosts={settings.min_hosts}`: it must be between 1 "
                            f"and the {hosts} host(s) the run asks for. Fix: set hydra.launcher.min_hosts to "
                            f"1..{hosts}.")
        workers = (settings.min_hosts, hosts)
    return {"num_workers": workers, "use_gpu": bool(settings.gpus_per_host), "resources_per_worker": resources,
            **({"elastic_resize_monitor_interval_s": settings.resize_check_s} if settings.elastic else {})}, hosts


def worker_overrides(spec: Any, overrides: Sequence[str]) -> list[str]:
    """The command every worker runs: the run's own overrides with its run directory pinned (a
    sweep member's lies under its sweep), never the launcher's."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith("hydra")
            and o.split("=", 1)[0] not in ("run.dir", "run.sweep")]
    pinned = [f"run.dir={_quoted(spec.run.dir)}"]
    if spec.run.sweep:
        pinned.append(f"run.sweep={_quoted(spec.run.sweep)}")
    return [*kept, *pinned]


def _quoted(value: str) -> str:
    """A value for Hydra's override grammar, whatever it holds (a sweep member's directory is named
    by its overrides: `=` and `,`)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_on_ray(spec: Any, overrides: Sequence[str], settings: RaySettings,
               say: Any = lambda text: print(text, flush=True)) -> tuple[int, str]:
    """Train `spec` on the Ray cluster; (exit code, the paragraph for a failure, or "")."""
    if spec.mode != "train":
        raise UserError(f"mode={spec.mode} under hydra/launcher=ray: Ray runs training only (mode=compile needs no "
                        "cluster; mode=eval runs on one host). Fix: drop hydra/launcher=ray for this command.")
    check_cluster(settings)
    scaling_kwargs, hosts = scaling(spec, settings)
    quiet_ray(settings.address == "local")  # before Ray is imported: some settings are read then
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    join_cluster(ray, settings, hosts)
    check_resources(ray, scaling_kwargs, hosts, settings, say)
    # on the driver's node: it lives as long as the driver, whichever hosts come and go
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    book = ray.remote(AttemptBook).options(num_cpus=0, scheduling_strategy=here).remote()
    limit = "no limit" if settings.max_restarts < 0 else f"at most {settings.max_restarts}"
    elastic = f"; elastic down to {settings.min_hosts}" if settings.elastic else ""
    say(f"ray: training {spec.run.dir} on {hosts} host{'s' if hosts != 1 else ''} "
        f"({settings.address} cluster; restarts: {limit}{elastic})")
    config = {"overrides": worker_overrides(spec, overrides), "cwd": os.getcwd(), "env": dict(settings.env),
              "python": sys.executable, "book": book, "hosts": hosts,
              "run_dir": str(storage.absolute(spec.run.dir)),
              "accumulate_steps": spec.train.accumulate_steps, "batch_size": spec.train.batch_size}
    code, message = fit(make_trainer(settings, scaling_kwargs, config, book), EventPrinter(ray, book, say))
    try:
        attempts = ray.get(book.count.remote(), timeout=30)
    except Exception:  # the book is gone with its node (a head that died): the count is unknown
        attempts = 0
    restarts = max(0, attempts - 1)
    say(f"ray: {'finished' if code == 0 else 'ended'} after {attempts} attempt{'s' if attempts != 1 else ''} "
        f"({restarts} restart{'s' if restarts != 1 else ''}){'' if code == 0 else f', exit {code}'}")
    if settings.address == "local":
        ray.shutdown()
    return code, message


def join_cluster(ray: Any, settings: RaySettings, hosts: int) -> None:
    """Start a cluster on this machine (address=local) or join one; one paragraph if neither works.
    Every Ray process of the job prints Ray's warnings in one line (runner.main.ray_logs)."""
    one_line_warnings()
    common = dict(ignore_reinit_error=True, log_to_driver=True, configure_logging=False, runtime_env=setup_hook())
    try:
        if settings.address == "local":
            # CPUs are logical (as many as the hosts reserve); GPUs and TPUs are what Ray finds here
            ray.init(num_cpus=max(2, int(hosts * settings.cpus_per_host + 0.999)),
                     object_store_memory=settings.object_store_mb * 2**20, include_dashboard=False, **common)
        else:
            ray.init(address=settings.address, **common)
    except (ConnectionError, RuntimeError, ValueError) as err:  # e.g. auto with no cluster to join
        raise UserError(f"hydra.launcher.address={settings.address!r}: Ray could not start or join a cluster "
                        f"({first_line(err, 300)}). Fix: start one (`ray start --head`), give its HOST:PORT, or use "
                        "hydra.launcher.address=local.") from None


def setup_hook() -> dict[str, str]:
    """The runtime env that runs runner's hook in every Ray process, unless a job submitted with a
    setup hook of its own (`ray job submit --runtime-env`) runs this driver: Ray refuses two."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    if (job.get("runtime_env") or {}).get("worker_process_setup_hook"):
        return {}
    return {"worker_process_setup_hook": ONE_LINE_WARNINGS}


def make_trainer(settings: RaySettings, scaling_kwargs: Mapping[str, Any], config: dict[str, Any], book: Any) -> Any:
    """Ray Train's JaxTrainer with runner's failure policy, its callbacks, and none of Ray's
    checkpoints or jax.distributed set-up (runner's own processes do both)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig, UserCallback, WorkerGroupError
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
    from ray.train.v2.jax import JaxConfig, JaxTrainer

    class Policy(DefaultFailurePolicy):
        """Ray retries every worker failure; a runner exit a rerun cannot fix ends the job."""

        def make_decision(self, training_failed_error: Any) -> Any:
            if isinstance(training_failed_error, WorkerGroupError):
                failures = list(training_failed_error.worker_failures.values())
                if any(isinstance(e, RunnerExit) and not e.retryable for e in failures):
                    return FailureDecision.RAISE
            return super().make_decision(training_failed_error)

    class Trainer(JaxTrainer):
        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            kwargs["failure_policy"] = Policy(self.run_config.failure_config)
            return super()._initialize_and_run_controller(**kwargs)

        def _create_default_callbacks(self) -> list[Any]:
            """Without Ray Data's datasets manager (runner's workers read their own data; its actor
            keeps a core of the driver's node busy all run) and, on runner's local cluster (no
            dashboard: the cleaner asks its state API, a warning every second; the cluster ends
            with this process anyway), without the placement-group cleaner."""
            idle = ("DatasetsCallback", "PlacementGroupCleanerCallback" if settings.address == "local" else "")
            return [c for c in super()._create_default_callbacks() if type(c).__name__ not in idle]

    class Reporter(UserCallback):
        """Runs in Ray's controller: each failed attempt's reasons, for the driver to print."""

        def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
            book.ended.remote({int(r): describe_failure(e) for r, e in sorted(worker_exceptions.items())})

    return Trainer(
        run_worker, train_loop_config=config,
        jax_config=JaxConfig(use_tpu=False, use_gpu=False),  # runner's own processes start jax.distributed
        scaling_config=ScalingConfig(**scaling_kwargs),
        run_config=RunConfig(name=f"runner-{os.getpid()}-{int(time.time())}",
                             storage_path=os.path.join(tempfile.gettempdir(), "runner-ray"),
                             failure_config=FailureConfig(max_failures=settings.max_restarts),
                             callbacks=[Reporter(), graceful_stop(settings.stop_grace_s)]))


def fit(trainer: Any, printer: "EventPrinter") -> tuple[int, str]:
    """Run the job to its end, printing its events as they come: (exit code, paragraph)."""
    from ray.train import WorkerGroupError

    printer.start()
    try:
        trainer.fit()
        return 0, ""
    except WorkerGroupError as err:
        return final_outcome(err.worker_failures)
    except Exception as err:  # the controller failed (a group that could not start): Ray's own reason
        return PREEMPTED_EXIT_CODE, f"Ray could not run the job ({type(err).__name__}: {str(err)[:500]})"
    finally:
        printer.stop()


def check_resources(ray: Any, scaling_kwargs: Mapping[str, Any], hosts: int, settings: RaySettings,
                    say: Any) -> None:
    """What the hosts reserve against what the cluster has: a local cluster never grows, so a
    shortfall is one paragraph at once (Ray would wait for it, attempt after attempt); a remote one
    may have an autoscaler, so it is said and waited for."""
    per_host = dict(scaling_kwargs["resources_per_worker"])
    least = scaling_kwargs["num_workers"][0] if isinstance(scaling_kwargs["num_workers"], tuple) else hosts
    have = ray.cluster_resources()
    short = {name: (amount * least, have.get(name, 0.0)) for name, amount in per_host.items()
             if have.get(name, 0.0) < amount * least}
    if not short:
        return
    words = ", ".join(f"{need:g} {name} (it has {got:g})" for name, (need, got) in short.items())
    if settings.address == "local":
        raise UserError(f"hydra/launcher=ray: {least} host(s) need {words}, and the Ray cluster this command "
                        "starts on this machine has no more. Fix: lower hydra.launcher.hosts, cpus_per_host or "
                        "gpus_per_host, run on a machine that has them, or join a cluster that does "
                        "(hydra.launcher.address=HOST:PORT).")
    say(f"ray: waiting for {words}: the cluster has fewer now (an autoscaler may add them)")


def quiet_ray(local: bool) -> None:
    """Each worker line once (Train v2 also logs what a worker prints), without colour codes off
    a terminal, and Train's metrics off (they need the dashboard's agent); on runner's local
    cluster, no watcher for cloud preemption notices (an actor polling all the while)."""
    if local:
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def final_outcome(failures: Mapping[int, BaseException]) -> tuple[int, str]:
    """The exit code and paragraph of the last attempt: a code a rerun cannot fix first, then the
    first runner exit, else 75 (a worker died: rerun the same command to resume)."""
    exits = [e for _, e in sorted(failures.items()) if isinstance(e, RunnerExit)]
    chosen = next((e for e in exits if not e.retryable), exits[0] if exits else None)
    reasons = "; ".join(describe_failure(e) for _, e in sorted(failures.items()))
    if chosen is None:
        return PREEMPTED_EXIT_CODE, f"the last attempt ended: {reasons}. Rerun the same command to resume."
    if chosen.paragraph and not chosen.retryable:
        return chosen.code, chosen.paragraph
    code = chosen.code if chosen.code > 0 else PREEMPTED_EXIT_CODE
    return code, f"the last attempt ended: {reasons}. Rerun the same command to resume from the newest checkpoint."


class EventPrinter:
    """Prints what the attempt book records, as it happens, from a thread of the driver."""

    def __init__(self, ray: Any, book: Any, say: Any) -> None:
        self.ray, self.book, self.say = ray, book, say
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runner-ray-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._print()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._print()

    def _print(self) -> None:
        try:
            events = self.ray.get(self.book.since.remote(self.seen), timeout=10)
        except Exception:
            return
        self.seen += len(events)
        for text in events:
            self.say(f"ray: {text}")


class AttemptBook:
    """A small actor (ray.remote(AttemptBook)) the driver, the workers and the controller's callback
    share: attempts and their events, in order."""

    def __init__(self) -> None:
        self.attempts = 0
        self.events: list[str] = []

    def started(self, hosts: int) -> int:
        self.attempts += 1
        self.events.append(f"attempt {self.attempts} started on {hosts} host{'s' if hosts != 1 else ''}")
        return self.attempts

    def note(self, text: str) -> None:
        self.events.append(text)

    def ended(self, failures: dict[int, str]) -> None:
        reasons = "; ".join(failures.values())
        self.events.append(f"attempt {self.attempts} ended: {reasons}")

    def count(self) -> int:
        return self.attempts

    def since(self, index: int) -> list[str]:
        return self.events[index:]


# ---------------------------------------------------------------------------------- a worker


def graceful_stop(grace_s: float) -> Any:
    """A callback for Ray's controller: when it stops a healthy group (an elastic resize), each host's
    runner gets SIGTERM first and up to `grace_s` to save and exit 75, so nothing is recomputed. A
    failing group is stopped at once (its survivors are waiting on a dead peer)."""
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    class GracefulStop(WorkerGroupCallback):
        def __init__(self) -> None:
            self.failing = False

        def after_worker_group_start(self, worker_group: Any) -> None:
            self.failing = False

        def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
            if worker_group_status.errors:
                self.failing = True

        def before_worker_group_shutdown(self, worker_group: Any) -> None:
            if self.failing or grace_s <= 0:
                return
            import ray

            refs = worker_group.execute_async(stop_runner, grace_s)
            ray.wait(refs, num_returns=len(refs), timeout=grace_s + 10)

    return GracefulStop()


_running: Optional[subprocess.Popen] = None  # this worker's runner process, for stop_runner


def stop_runner(grace_s: float) -> None:
    """In a worker: SIGTERM to its runner process (it saves and exits 75), waiting up to grace_s."""
    proc = _running
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass


def elastic_accumulation(accumulate: int, batch: int, hosts: int, present: int) -> int:
    """Micro-batches per step on `present` of `hosts` hosts that keep each device's rows per
    micro-batch at most what they were: the global batch is kept, the data axis shrank."""
    wanted = -(-accumulate * hosts // present)
    return next((k for k in range(wanted, batch + 1) if batch % k == 0), wanted)


def _die_with_parent() -> None:
    """The runner process dies with its Ray worker (Ray kills a failed group's workers with
    SIGKILL; an orphan would hold the devices and the coordinator port)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _no_traceback_for_runner_exits() -> None:
    """Ray logs every exception of a training function with its traceback; a RunnerExit's is this
    module's own `raise`, and the process's own output (its paragraph) is already above it."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not ("Error in training function" in str(record.msg) and "RunnerExit" in str(record.msg))

    logging.getLogger("ray.train.v2._internal.util").addFilter(keep)


def run_worker(config: dict[str, Any]) -> None:
    """One host of one attempt: `python -m runner ...` as JAX process `rank` of `world`."""
    import ray
    from ray.train.collective import broadcast_from_rank_zero

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    book = config["book"]
    shared = None
    if rank == 0:
        attempt = ray.get(book.started.remote(world))
        shared = (attempt, f"{ray.util.get_node_ip_address()}:{_free_port()}")
    attempt, coordinator = broadcast_from_rank_zero(shared)
    env = {**os.environ, **config["env"], "RUNNER_ATTEMPT": str(attempt), "PYTHONUNBUFFERED": "1"}
    if world > 1:  # a fresh coordinator (port) every attempt
        env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(world), JAX_PROCESS_ID=str(rank))
    overrides = list(config["overrides"])
    if world != config["hosts"]:  # elastic: fewer hosts than asked for; the global batch is kept
        accumulate = elastic_accumulation(config["accumulate_steps"], config["batch_size"], config["hosts"], world)
        overrides = [o for o in overrides if o.split("=", 1)[0] != "train.accumulate_steps"]
        overrides.append(f"train.accumulate_steps={accumulate}")
        if rank == 0:
            book.note.remote(f"attempt {attempt}: elastic: {world} of {config['hosts']} hosts, the mesh's data axis "
                             f"shrinks; train.accumulate_steps {config['accumulate_steps']} -> {accumulate} keeps the "
                             f"global batch of {config['batch_size']}")
    # process 0 of the attempt writes its launch's line in the run directory: rank 0 passes it on
    watcher = LaunchWatcher(config["run_dir"], lambda line: book.note.remote(launch_event(attempt, line))) \
        if rank == 0 else None
    global _running
    proc = _running = subprocess.Popen([config["python"], "-m", "runner", *overrides], cwd=config["cwd"], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                       preexec_fn=_die_with_parent)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        tail.append(line)
    code = proc.wait()
    if watcher is not None:
        watcher.stop()
    if code != 0:
        _no_traceback_for_runner_exits()
        raise RunnerExit(rank, code, "".join(tail))


def launch_event(attempt: int, line: Mapping[str, Any]) -> str:
    """The driver's line for an attempt's record in launches.jsonl (runner.observability.launches)."""
    costs = ", ".join(f"{c} {float(line.get(f'{c}_s') or 0.0):.1f} s" for c in ("startup", "restore", "compile"))
    step, tier = line.get("restored_step"), line.get("tier") or ""
    where = "training from the start" if step is None else f"resumed from step {step}"
    return f"attempt {attempt}: {where} ({f'{tier} tier; ' if tier and step is not None else ''}{costs})"


class LaunchWatcher:
    """Rank 0's thread: the line its runner process adds to the run's launches.jsonl when its loop
    starts (where it resumed, what starting cost), handed to `report` once. Lines there before this
    attempt started are not its own; when the first read fails (a bucket that does not answer), the
    lines written since the watcher started (by time: process 0 runs on this host) are."""

    def __init__(self, run_dir: str, report: Callable[[dict[str, Any]], None],
                 every_s: Optional[float] = None) -> None:
        self.run_dir, self.report = run_dir, report
        self.every_s = every_s if every_s is not None else LAUNCH_POLL_S[storage.is_remote(run_dir)]
        # this attempt's line is written after this (launches.jsonl keeps its times to the millisecond, rounded)
        self.since = time.time() - 0.001
        self.before = self._lines()  # None: not read yet (looked at again by the thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runner-ray-launch", daemon=True)
        self._thread.start()

    def _lines(self) -> Optional[list[dict[str, Any]]]:
        from runner.observability import launches

        try:
            return launches.read(self.run_dir)
        except Exception:  # a bucket that does not answer now: looked at again later
            return None

    def look(self) -> bool:
        """Whether this attempt's line is there (and was reported)."""
        lines = self._lines()
        if lines is None:
            return False
        if self.before is None:  # the first read failed: the lines older than this attempt (they come first)
            self.before = list(itertools.takewhile(lambda line: float(line.get("time") or 0.0) < self.since, lines))
        if len(lines) <= len(self.before):
            return False
        self.report(lines[len(self.before)])
        return True

    def _run(self) -> None:
        while True:
            ended = self._stop.wait(self.every_s)
            if self.look() or ended:
                return

    def stop(self) -> None:
        """The process ended: one last look, then the thread ends."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
