"""Command line: compose conf/ -> ExecutionSpec -> distributed init -> job class -> run.

User mistakes (bad overrides, invalid values, missing data) end in one clear paragraph and
exit code 2, without a traceback. A run stopped by SIGTERM saves and exits 75, one stopped by SIGINT
or the stop file 76 (runner.exits: every code, and which a supervisor restarts).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from runner.checkpoint.files import atomic_write
from runner.errors import UserError
from runner.exits import CRASHED_EXIT_CODE, PREEMPTED_EXIT_CODE, STOPPED_ON_REQUEST_EXIT_CODE, USAGE_EXIT_CODE

CONF_DIR = Path(os.environ.get("RUNNER_CONF_DIR", Path(__file__).resolve().parents[2] / "conf"))
CONFIG_NAME = "config"
# Hydra flags that print something and exit: no run, no job modules, no JAX (shell completion
# asks on every <TAB>).
_INFO_FLAGS = ("-c", "--cfg", "-h", "--help", "--hydra-help", "-i", "--info", "--version", "-sc",
               "--shell-completion", "-p", "--package", "--resolve")


def _tpu_present() -> bool:
    import glob

    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_ACCELERATOR_TYPE"))


def skip_absent_tpu(argv: Sequence[str]) -> None:
    """With libtpu installed (the `tpu` extra), JAX probes for a TPU on every start and prints a
    screen of warnings where there is none. Without TPU device nodes, and unless the user chose
    platforms or asked to compile for a TPU, use the GPU if present, else the CPU."""
    if "JAX_PLATFORMS" in os.environ or "mode=compile" in argv or "mode=plan" in argv or _tpu_present():
        return
    os.environ["JAX_PLATFORMS"] = "cuda,cpu"


def _quiet_libraries(log_to_stderr: bool = True) -> None:
    """Libraries' warnings as one line each (not for Hydra's info flags: Hydra prints those
    through its own handler, and a second one would print every line twice); colour codes only on
    a terminal (Optuna's colorlog formatter colours unconditionally, but honours NO_COLOR)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not sys.stderr.isatty():
        os.environ.setdefault("NO_COLOR", "1")
    if log_to_stderr:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncio").addFilter(_drop_abandoned_readers)
    logging.getLogger("gcsfs").addFilter(_one_line_when_out_of_retries)
    _without_late_reads()
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
        # orbax logs a failed background save with a traceback per thread; runner reports the
        # failure itself, as one paragraph, when it waits for the save.
        logging.getLogger("absl").setLevel(logging.CRITICAL)
    except ImportError:
        pass


def _drop_abandoned_readers(record: logging.LogRecord) -> bool:
    """orbax reads a checkpoint with one asyncio task per array; when one read fails (a damaged
    checkpoint), the others' failures are never awaited, and asyncio logs each, with a traceback,
    whenever the garbage collector finds it, possibly before runner prints its one paragraph about
    the damage. Those records say nothing the paragraph does not."""
    return "exception was never retrieved" not in str(record.msg)


def _one_line_when_out_of_retries(record: logging.LogRecord) -> bool:
    """gcsfs logs a request that ran out of retries (a bucket down) with its traceback; runner
    handles every such failure (exit 75 with a paragraph, or a warning), so the line is kept, as a
    line, and the traceback through gcsfs's retry loop is dropped."""
    if "out of retries" in str(record.msg):
        record.exc_info, record.exc_text = None, None
    return True


def _late_read(kind: type[BaseException] | None, value: BaseException | None, tb: Any) -> bool:
    """tensorstore hands each finished read to orbax's event loop by calling the loop's
    call_soon_threadsafe from C; reads that finish after orbax gave up (a damaged checkpoint) find
    the loop closed, and that RuntimeError reaches the interpreter's hooks, a traceback per read.
    Called from C, its traceback starts in call_soon_threadsafe: nothing else's does."""
    return (kind is RuntimeError and str(value) == "Event loop is closed" and tb is not None
            and tb.tb_frame.f_code.co_name == "call_soon_threadsafe")


def _without_late_reads() -> None:
    """Both hooks through which C code reports an exception it cannot raise (PyErr_Print,
    PyErr_WriteUnraisable) leave out tensorstore's late reads and pass on everything else."""
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def quiet_excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not _late_read(kind, value, tb):
            excepthook(kind, value, tb)

    def quiet_unraisablehook(unraisable: Any) -> None:
        if not _late_read(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback):
            unraisablehook(unraisable)

    sys.excepthook, sys.unraisablehook = quiet_excepthook, quiet_unraisablehook


def fail(message: str, code: int = USAGE_EXIT_CODE) -> None:
    """Print one paragraph to stderr and exit. What the interpreter reports after it while
    exiting, about coroutines or threads the failure abandoned (orbax's readers of a damaged
    checkpoint: "Exception ignored in: <coroutine ...>" with a traceback), is left out: the
    paragraph already says what went wrong."""
    paragraph = "error: " + " ".join(message.split()) + "\n"
    if not _is_command or _in_sweep_process:  # in-process (a tool, a test), or a sweep that goes on
        print(paragraph, end="", file=sys.stderr, flush=True)
        sys.exit(code)
    sys.stderr.flush()
    terminal = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # asyncio's "never retrieved", "Exception ignored in <coroutine>", "Event loop is closed"
    sys.stderr = open(os.devnull, "w")
    os.write(terminal, paragraph.encode())  # one write: no other thread's output lands inside it
    os.close(terminal)
    sys.stdout.flush()
    if code == PREEMPTED_EXIT_CODE:  # storage unavailable: its clients' threads may retry for many minutes
        from runner.parallel import distributed

        distributed.leave_together()  # the other processes may still be keeping their step locally
        os._exit(code)
    _exit_without_finalizing(code)


def _exit_without_finalizing(code: int) -> None:
    """Run the libraries' exit handlers (wandb, jax.distributed, logging), then leave without
    finalizing the interpreter: tensorstore's threads, still finishing a failed save's writes, may
    call into Python while it finalizes, and on Python 3.12 such a C++ thread is ended by a forced
    unwind that aborts the process (seen in CI: exit -6 after the paragraph of a full disk)."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(code)


def _composition_error(err: Exception) -> str:
    """Hydra's error with its causes (\"Error merging override\" alone hides \"could not be converted
    to Float\"), without the advice runner does not take (`+key` adds a key runner refuses) or
    Hydra's config search path."""
    import re

    from runner.spec import retired

    parts: list[str] = []
    keys: list[str] = []  # the keys the errors name (a config file's key is given only as full_key)
    seen: BaseException | None = err
    while seen is not None and len(parts) < 4:
        text = " ".join(line.strip() for line in str(seen).splitlines() if line.strip())
        keys += re.findall(r"full_key: ([\w.]+)", text)
        text = re.split(r" Config search path:| full_key:| object_type=", text)[0].strip()
        if text and "$VALUE" not in text and not any(text in p for p in parts):
            parts.append(text.rstrip("."))
        seen = seen.__cause__ or seen.__context__
    message = ": ".join(parts)
    unknown = re.search(r"Could not override '([^']+)'\. To append to your config use \+\S+", message)
    for key in ([unknown.group(1)] if unknown else []) + keys:
        if retired(key):
            problem, fix = retired(key)  # type: ignore[misc]
            return f"Invalid config `{key.lstrip('+~')}`: {problem} Fix: {fix}"
    if unknown:
        group = unknown.group(1).startswith("hydra.launcher.")  # a launcher's typed settings (hydra/launcher=...)
        shows = ("`python -m runner --cfg hydra -p hydra.launcher hydra/launcher=NAME` prints the launcher's keys "
                 "with their values" if group else "`python -m runner --cfg job` prints every key with its value")
        return (f"Invalid config `{unknown.group(1)}`: runner has no setting of that name (every setting exists "
                f"already, so there is nothing to add with +). Fix: check its spelling and section: {shows}.")
    return (f"The command-line configuration is invalid: {message}. Fix: check the key and value; "
            "`python -m runner --cfg job` prints every key with its current value.")


def precheck(overrides: Sequence[str], multirun: bool = False, build: bool = False) -> Any:
    """Check the command line before anything runs, so every mistake is one exit-code-2
    paragraph instead of Hydra's exit code 1 or a traceback: Hydra's own errors (unknown keys,
    wrong types, unknown group options) for a single run; for a sweep, every member's whole
    spec (values, names, `+new_key`) before any member trains (runner.main.sweep.member_overrides).
    Returns the composed config (of the last member checked)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.main.config import build_spec
    from runner.main.sweep import member_overrides

    for override in overrides:
        if override.startswith("~") and not override.lstrip("~").startswith("hydra"):
            fail(f"`{override}` deletes a setting, but every runner setting has a default to fall back to, so "
                 "it would change nothing but the derived run directory. Fix: set the value you want (e.g. "
                 f"{override.lstrip('~').split('=')[0]}=VALUE), or drop the override to keep the default.")
    try:
        members = member_overrides(overrides) if multirun else [list(overrides)]
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        fail(_composition_error(err))
    cfg = None
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        for member in members:
            where = f"In the sweep member `{' '.join(member)}`: " if multirun and len(members) > 1 else ""
            try:
                cfg = compose(CONFIG_NAME, overrides=member)
                if multirun or build:
                    build_spec(cfg, member, sweep_root="runs/sweeps/check" if multirun else None)
            except (HydraException, OmegaConfBaseException, ValueError) as err:
                fail(where + _composition_error(err))
            except UserError as err:
                fail(where + str(err))
    return cfg


def jax_process_zero() -> bool:
    import jax

    return jax.process_index() == 0


def write_resolved_spec(spec: Any) -> None:
    """Write spec.yaml into the run directory (process 0), which also proves it is writable."""
    import jax
    from omegaconf import OmegaConf

    from runner.checkpoint import storage

    if jax.process_index() != 0:
        return
    run_dir = storage.path(spec.run.dir)
    try:
        storage.makedirs(run_dir)
        atomic_write(run_dir / "spec.yaml", OmegaConf.to_yaml(OmegaConf.structured(spec)))
    except OSError as err:
        raise UserError(f"Cannot write the run directory run.dir={spec.run.dir!r}: {err.strerror}. "
                        "Fix: choose a writable location with free space for run.dir.") from None


def compile_only(spec: Any) -> int:
    """mode=compile (the train step for the topology) and mode=plan (each layout compiled in a process
    of its own): their exit codes."""
    from runner.train.job import JOBS

    if spec.mode == "compile":
        from runner.parallel.compile import run_compile

        return run_compile(spec, JOBS.get(spec.job.trainer))
    from hydra.core.hydra_config import HydraConfig

    from runner.main.plan import run_plan

    return run_plan(spec, list(HydraConfig.get().overrides.task), say=lambda line: print(line, flush=True))


def execute(spec: Any, in_sweep: bool = False) -> None:
    """Run one validated spec in this process. A run halted by its guard or a hook exits with
    their paragraph; in a sweep (`in_sweep`) they are raised, for the sweep to record."""
    from runner.train.job import JOBS

    if spec.mode in ("compile", "plan"):  # one process: no cluster to join, no devices to claim
        code = compile_only(spec)
        if code:
            sys.exit(code)
        return
    from runner.checkpoint import storage
    from runner.parallel import compile_cache, distributed
    from runner.parallel.topology import parse_topology

    writes = {"run.dir": spec.mode == "train" or not spec.eval.checkpoint, "eval.checkpoint": spec.mode == "eval",
              "run.compile_cache": True, "run.init_from": False}  # mode=eval writes into the checkpoint it reads
    for key, location in (("run.dir", spec.run.dir), ("run.init_from", spec.run.init_from),
                          ("eval.checkpoint", spec.eval.checkpoint), ("run.compile_cache", spec.run.compile_cache)):
        storage.check_reachable(location, key, write=writes[key])
    # every local place the run writes (the watchdog's stacks go under run.dir): before any device work
    for key, location in (("run.dir", spec.run.dir if writes["run.dir"] else ""),
                          ("checkpoint.local.dir", spec.checkpoint.local.dir if spec.mode == "train" else ""),
                          ("run.compile_cache", compile_cache.directory(spec.run.compile_cache) or "")):
        storage.check_local_writable(location, key)
    compile_cache.enable(spec.run.compile_cache)
    topology = parse_topology(spec.topology)
    tpu_hosts = topology.num_hosts if topology.platform == "tpu" and _tpu_present() else 0
    distributed.maybe_initialize(spec.distributed, tpu_hosts)  # before any other JAX use
    from runner.exits import HookError, Preempted, TrainingHalted

    if spec.mode == "eval":  # evaluate a checkpoint's parameters; no training, run dir untouched
        from runner.main.evaluate import evaluate_checkpoint

        evaluate_checkpoint(spec)
        return
    if spec.mode != "train":
        raise UserError(f"mode={spec.mode} is not available yet in this version of runner. "
                        "Fix: use mode=train (the default).")
    job_class = JOBS.get(spec.job.trainer)
    fresh = jax_process_zero() and not storage.path(spec.run.dir).exists()
    try:
        write_resolved_spec(spec)
        job = job_class(spec)
        job.run()
    except UserError as err:  # refused before training (a mesh, data, a checkpoint): leave no directory behind
        if fresh and not isinstance(err, storage.StorageUnavailable):  # (an unreachable bucket: leave it be)
            storage.remove_if_only(spec.run.dir, {"spec.yaml"})
        raise
    except Preempted as stop:
        sys.exit(stop.exit_code)
    except (HookError, TrainingHalted) as err:  # the last good state is saved
        if in_sweep:
            raise
        fail(str(err), err.exit_code)


_in_sweep_process = False  # True in the process that launched a multirun (and runs members locally)
_prepared: set[str] = set()  # what prepare() has done in this process: "schema", "jobs"


def prepare(jobs: bool = True) -> None:
    """Register the config schema and (with `jobs`) import the job modules, each once per process:
    in the command (main), or in a sweep member's own process (a SLURM job via submitit), where
    main() never ran. Hydra's info flags need the schema only."""
    from runner.spec import register_schema
    from runner.train.job import load_job_modules

    if "schema" not in _prepared:
        register_schema()
        _prepared.add("schema")
    if jobs and "jobs" not in _prepared:
        load_job_modules()
        _prepared.add("jobs")


def task(cfg: Any) -> Any:
    """Hydra's task function: one run, or one sweep member (whose failure is recorded, not raised).
    A member may run in another process (a SLURM job via submitit), where main() never ran."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from runner.main.config import build_spec

    prepare()
    overrides = list(HydraConfig.get().overrides.task)
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        try:
            spec = build_spec(cfg, overrides)
            if not on_ray(spec, overrides):
                execute(spec)
        except UserError as err:
            fail(str(err), err.exit_code)
        except RayRunEnded as ended:
            fail(ended.message, ended.code)
        return None
    return run_sweep_member(cfg, overrides)


class RayRunEnded(Exception):
    """A run on Ray that did not finish: the driver's exit code and paragraph."""

    def __init__(self, code: int, message: str) -> None:
        self.code, self.message = code, message
        super().__init__(message)


def on_ray(spec: Any, overrides: list[str]) -> bool:
    """hydra/launcher=ray: train `spec` on the Ray cluster (runner.main.ray_launcher) instead of in
    this process. False for any other launcher; raises RayRunEnded for a run that did not finish."""
    from hydra.core.hydra_config import HydraConfig

    from hydra_plugins.runner_ray_launcher.config import TARGET

    launcher = HydraConfig.get().launcher
    if launcher.get("_target_") != TARGET:
        return False
    from runner.main.ray_launcher import run_on_ray, settings_from_hydra

    settings = settings_from_hydra(launcher)
    assert settings is not None
    code, message = run_on_ray(spec, overrides, settings)
    if code:
        raise RayRunEnded(code, message)
    return True


class FailedObjective:
    """What a failed member returns to the sweeper: not a number, so an optimizing sweeper
    (Optuna) records a failed trial instead of telling its study a NaN (which optuna refuses)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __float__(self) -> float:
        raise ValueError(self.reason)

    def __str__(self) -> str:
        return f"the member failed: {self.reason}"


def run_sweep_member(cfg: Any, overrides: list[str]) -> float | FailedObjective:
    """One member: train it, record it in the sweep's summary, and return its objective
    (run.objective) for the sweeper to optimize. A member that fails for any reason (its guard,
    a hook, a crash, missing data) is recorded as failed with its reason and exit code, and the sweep
    goes on; a stop to be resumed (SIGTERM, exit 75) ends a local sweep, and a stop you asked for
    (the stop file, SIGINT: 76) any sweep."""
    import gc
    import traceback

    import jax
    from hydra.core.hydra_config import HydraConfig

    from runner.checkpoint import storage
    from runner.exits import HookError, TrainingHalted
    from runner.main.config import build_spec
    from runner.main.sweep import SweepSummary
    from runner.observability import goodput

    goodput.mark_launch()  # each member is a launch of its own run
    hydra_cfg = HydraConfig.get()
    summary = SweepSummary(storage.path(storage.remote_of(hydra_cfg.sweep.dir)))
    run_dir, status, message, objective, code = "", "finished", "", "", 0
    stops = {PREEMPTED_EXIT_CODE: "stopped (resumable)", STOPPED_ON_REQUEST_EXIT_CODE: "stopped (on request)"}
    try:
        spec = build_spec(cfg, overrides, sweep_root=str(summary.root))
        run_dir, objective = spec.run.dir, spec.run.objective
        already = _already_finished(spec)
        if not on_ray(spec, overrides):
            execute(spec, in_sweep=True)
        status = "skipped (already finished)" if already else "finished"
    except (UserError, HookError, TrainingHalted) as err:
        status, message, code = "failed", " ".join(str(err).split()), err.exit_code
        print(f"error: {message}", file=sys.stderr, flush=True)
    except RayRunEnded as ended:  # a stop to resume does not end a sweep on Ray: the next member goes on
        status, code = stops.get(ended.code, "failed"), ended.code
        message = f"exit code {ended.code}: {' '.join(ended.message.split())}"
        print(f"error: {ended.message}", file=sys.stderr, flush=True)
        if code == STOPPED_ON_REQUEST_EXIT_CODE:  # you asked: the sweep ends here; rerun it to go on
            summary.record(hydra_cfg.job.num, overrides, run_dir, status, message, exit_code=code)
            raise SystemExit(code) from None
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else CRASHED_EXIT_CODE
        if code in stops and _in_sweep_process:  # a stop ends the local sweep; rerun resumes
            summary.record(hydra_cfg.job.num, overrides, run_dir, f"stopped (exit {code})", exit_code=code)
            raise
        status, message = stops.get(code, "failed"), f"exit code {code}"
    except Exception as err:  # one member's crash must not stop the others
        status, message, code = "failed", f"{type(err).__name__}: {err}", CRASHED_EXIT_CODE
        traceback.print_exc()
    finally:
        jax.clear_caches()  # compiled programs of this member
        gc.collect()
    entry = summary.record(hydra_cfg.job.num, overrides, run_dir, status, message, objective, code)
    value = entry.get("objective")
    if value is None:
        return FailedObjective(message or f"{entry.get('objective_name') or 'the objective'} was never logged")
    return float(value)


def _already_finished(spec: Any) -> bool:
    import json

    from runner.checkpoint import storage

    path = storage.path(spec.run.dir) / "metrics.jsonl"
    if not path.exists():
        return False
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return bool(steps) and max(steps) >= spec.train.steps


# Hydra's flags that take the next word as their value (`--cfg job`, `-p hydra.launcher`)
_VALUED_FLAGS = ("-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                 "--config-dir", "--experimental-rerun", "-sc", "--shell-completion")


def _flag_value(argv: Sequence[str], names: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return None


def command_line_overrides(argv: Sequence[str]) -> list[str]:
    """The overrides of a command line: its words less Hydra's flags and their values."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _VALUED_FLAGS
        else:
            out.append(arg)
    return out


_is_command = False  # True in `python -m runner` / `runner`: fail() may then silence the process's stderr


def main(argv: Sequence[str] | None = None) -> None:
    global _in_sweep_process, _is_command
    _is_command = True
    from runner.observability import goodput

    goodput.mark_launch()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:  # `runner plot RUN_OR_SWEEP_DIR... --out plot.png` (runner.main.plot)
        from runner.main.plot import main as plot

        sys.exit(plot(argv[1:]))
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    info_only = bool(flags & set(_INFO_FLAGS))
    multirun = bool(flags & {"-m", "--multirun"}) and not info_only
    skip_absent_tpu(argv)
    _quiet_libraries(log_to_stderr=not info_only)
    import hydra

    from runner.main.sweep import SweepSummary, sampler_seed, sweep_root

    prepare(jobs=False)
    overrides = command_line_overrides(argv)
    printed = _flag_value(argv, ("-c", "--cfg"))
    printing = printed in ("job", "all") and not flags & {"-h", "--help", "--hydra-help", "-sc", "--shell-completion",
                                                          "-i", "--info", "--version"}
    if not info_only or printing:  # what --cfg job prints is checked as a run's spec is, and shown resolved
        prepare()
        precheck(overrides, multirun, build=printing)
        if printing and "--resolve" not in argv:
            argv = [*argv, "--resolve"]
    summary = None
    if multirun:
        _in_sweep_process = True
        from runner.checkpoint import storage

        summary = SweepSummary(sweep_root(argv))
        # Hydra keeps its sweep bookkeeping in local files: a gs:// sweep's go to its local mirror
        argv = [*argv, *sampler_seed(argv), f"hydra.sweep.dir={storage.local_mirror(summary.root)}",
                "hydra.sweep.subdir=."]
    sys.argv = [sys.argv[0], *argv]
    hydra.main(config_path=str(CONF_DIR), config_name=CONFIG_NAME, version_base=None)(task)()
    if summary is not None and summary.members:
        print(summary.table(), flush=True)
        if summary.exit_code:  # its members' (runner.exits.of_members): a code a rerun may fix first
            sys.exit(summary.exit_code)
