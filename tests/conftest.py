"""Shared helpers: run `python -m runner` in a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

# The test process itself never needs a TPU: don't let an installed libtpu probe for one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU backend below its default LLVM optimisation (2): the suite compiles thousands of small
# programs and runs most of them a few times, so compiling is its largest cost. Level 0 halves the
# in-process model tests (tests/models/test_moe_hf.py: 122 s -> 62 s) and takes a fifth off a tiny
# run's process (24 steps, nothing cached: 9.7 -> 7.9 CPU-seconds), but runs the compiled code at
# half speed. So the tests and the processes they start compile at level 0, except the few runs
# that learn for 100 steps or more, which ask for level 1 (`xla_flags(..., LEARNING)`): it compiles
# almost as fast as 0 (76 s) and runs as fast as 2 (llama_tiny, 100 steps: train 6.7 s against
# 7.6 s). No level changes what is computed (no fast-math at any level).
COMPILING, LEARNING = 0, 1  # XLA CPU levels: for what mostly compiles, for what trains a while
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""),
                                                 f"--xla_backend_optimization_level={COMPILING}"]))
platform.processor()  # runs `uname -p` once and keeps the answer, before the fast tier refuses processes

ROOT = Path(__file__).resolve().parent.parent


def xla_flags(devices: int, level: int = COMPILING) -> str:
    """XLA_FLAGS for a process a test starts: `devices` CPU devices, compiled at `level`."""
    return f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level={level}"


SESSION: dict[str, Path] = {}  # "dir": this session's directory, shared by its xdist workers
SESSION_ENV: dict[str, str] = {}  # this pytest process's environment as its tests start


@pytest.hookimpl(trylast=True)  # after pytest's own, which makes config._tmp_path_factory
def pytest_configure(config: pytest.Config) -> None:
    """SESSION["dir"], the directory of this test session that all its xdist workers share (each
    has its own basetemp, popen-gwN, inside it); and the persistent compilation cache in the pytest
    process too, in that directory: the tests compile many identical programs (a tiny model's loss
    in several files), so the fast tier takes 3:54 instead of 4:17 (user CPU 7:09 against 7:48).
    The processes the tests start use the same directory ($RUNNER_CACHE/xla)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        SESSION["dir"] = Path(config.option.basetemp).parent
    else:
        SESSION["dir"] = config._tmp_path_factory.getbasetemp()
    from runner.parallel.compile_cache import enable

    os.environ["JAX_COMPILATION_CACHE_DIR"] = enable(str(SESSION["dir"] / "runner-cache" / "xla"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """SESSION_ENV, the fork server's environment: this process's once the test modules are
    imported (libtpu, torch and transformers set variables on import) and before any test runs
    (a test's monkeypatch, runner's own settings when a test calls it in this process)."""
    SESSION_ENV.clear()
    SESSION_ENV.update(os.environ)


def shared_run(name: str, make: Callable[[Path], Path]) -> Path:
    """What `make(directory)` returns (a run directory inside `directory`), made once a session
    whichever xdist worker asks first; the others wait for it. For uninterrupted reference runs
    that several test files compare against and none writes to."""
    from filelock import FileLock

    where = SESSION["dir"] / "shared" / name
    where.parent.mkdir(exist_ok=True)
    with FileLock(f"{where}.lock"):
        done = where.parent / f"{name}.done"
        if not done.exists():
            shutil.rmtree(where, ignore_errors=True)  # an earlier attempt that failed
            where.mkdir()
            done.write_text(str(make(where).relative_to(where)))
    return where / done.read_text()


def runner_env(tmp_path: Path, devices: int = 1, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        # compiled programs and prepared data: shared by every test and xdist worker of the session
        "RUNNER_CACHE": str(SESSION["dir"] / "runner-cache"),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
        "XLA_FLAGS": xla_flags(devices),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
    })
    env.update(extra)
    return env


_SERVER: list[Any] = []  # this pytest process's fork server (tests/forked.py), made on first use


def fork_server() -> Any:
    """The server that starts this pytest process's `python -m runner` processes as forks of one
    that has already imported runner (tests/forked.py: 3.5-4 s less a process). Its socket lives
    in a short directory of its own (a Unix socket's path holds at most 107 bytes)."""
    import tempfile

    from tests.forked import Server

    if not _SERVER:
        where = Path(tempfile.mkdtemp(prefix="runner-fork-"))
        with pytest.MonkeyPatch.context() as mp:  # the session's environment, whatever a test has set
            for key in set(os.environ) - set(SESSION_ENV):
                mp.delenv(key)
            for key, value in SESSION_ENV.items():
                mp.setenv(key, value)
            _SERVER.append(Server(where / "socket", runner_env(where)))
    return _SERVER[0]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """This pytest process's fork-server tally, for the summary (fork-tally-WORKER.json)."""
    if _SERVER and "dir" in SESSION:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (SESSION["dir"] / f"fork-tally-{worker}.json").write_text(json.dumps(_SERVER[0].tally))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Which tier ran (`tier_line`), and how many processes the tests started as forks, how many
    fresh and why (the variables their environment changed), so a run that lost the server's gain
    says so."""
    if os.environ.get("PYTEST_XDIST_WORKER") or "dir" not in SESSION:
        return
    if (SESSION["dir"] / "tiers.txt").exists():
        terminalreporter.write_line((SESSION["dir"] / "tiers.txt").read_text())
    forked, fresh = 0, {}
    for tally in sorted(SESSION["dir"].glob("fork-tally-*.json")):
        counts = json.loads(tally.read_text())
        forked += counts["forked"]
        for why, n in counts["fresh"].items():
            fresh[why] = fresh.get(why, 0) + n
    if forked or fresh:
        whys = "; ".join(f"{n} for {why}" for why, n in sorted(fresh.items(), key=lambda item: -item[1]))
        terminalreporter.write_line(f"fork server (tests/forked.py): {forked} processes forked, "
                                    f"{sum(fresh.values())} fresh" + (f" ({whys})" if whys else ""))


def run_runner(args: list[str], tmp_path: Path, devices: int = 1, timeout: float = 600,
               **env: str) -> subprocess.CompletedProcess:
    """`python -m runner ARGS` in `tmp_path`, as subprocess.run(capture_output=True, text=True)
    gives it (forked by fork_server() where its environment allows)."""
    from tests.forked import run

    return run(fork_server(), "module", "runner", args, tmp_path, runner_env(tmp_path, devices, **env), timeout)


def refused_in_process(overrides: list[str], capsys: pytest.CaptureFixture, multirun: bool = False,
                       build: bool = False) -> str:
    """The check `python -m runner` makes of its command line before anything runs
    (runner.main.cli.precheck), in this process, on a mistake: asserts exit 2 and returns the one
    line it wrote to stderr. (Run it in an empty current directory to see that nothing is written.)"""
    from runner.main.cli import precheck, prepare

    prepare()
    with pytest.raises(SystemExit) as exit_:
        precheck(overrides, multirun=multirun, build=build)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def wait_for_lines(path: Path, lines: int, timeout: float = 300, procs: Sequence[Any] = ()) -> None:
    """Wait until a run has logged `lines` records (to signal it mid-run). Fails at once when one of
    `procs` (the processes writing them: Popen or forked copies) has ended first, and at `timeout`,
    with each process's exit code and output (those still running killed: nothing is left behind)."""
    import time

    def logged() -> int:
        return len(path.read_text().splitlines()) if path.exists() else 0

    deadline = time.monotonic() + timeout
    while logged() < lines:
        ended = [i for i, p in enumerate(procs) if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            if logged() >= lines:  # written just before it ended
                return
            why = (f"process {ended[0]} exited {procs[ended[0]].returncode}" if ended
                   else f"no process ended, {timeout:.0f} s passed")
            outputs = []
            for i, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                out, err = p.communicate(timeout=60)
                outputs.append(f"--- process {i}, exit {p.returncode}; stdout:\n{(out or '')[-1500:]}\n"
                               f"--- stderr:\n{(err or '')[-3000:]}")
            pytest.fail(f"{path}: {logged()} of {lines} records when {why}\n" + "\n".join(outputs), pytrace=False)
        time.sleep(0.05)


def start_runner_until(args: list[str], tmp_path: Path, run_dir: Path, lines: int, **env: str) -> subprocess.Popen:
    """Start `python -m runner` (with `env` beside the tests' variables) in the background and
    return once it has logged `lines` records, so a test can signal it mid-run."""
    environ = runner_env(tmp_path, **env)
    proc = fork_server().start("module", "runner", args, tmp_path, environ) or subprocess.Popen(
        [sys.executable, "-m", "runner", *args], cwd=tmp_path, env=environ, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    wait_for_lines(run_dir / "metrics.jsonl", lines, procs=[proc])
    return proc


def mc_task_yaml(name: str, data: Path, dataset: str = "json") -> str:
    """A local lm-evaluation-harness multiple-choice task over a JSONL of {context, choices, gold}
    (read offline by `datasets`' json loader)."""
    return f"""task: {name}
dataset_path: {dataset}
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Tiny, fast settings for end-to-end runs: seconds, not minutes.
TINY = [
    "job.model.d_model=32", "job.model.n_layers=2", "job.model.n_heads=2", "job.model.context_length=32",
    "train.seq_len=32", "train.batch_size=8", "train.log_every=1", "eval.rows=16", "eval.batch_size=8",
    "logging.wandb=disabled", "schedule.warmup_steps=2",
]


@pytest.fixture
def tiny() -> list[str]:
    return list(TINY)


@pytest.fixture(autouse=True)
def _processes_only_in_e2e(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier (`pytest -m "not e2e"`) starts no process: a test that does (`python -m runner`,
    several JAX processes, a shell script, an emulator) must say its tier, `e2e` (landing) or `deep`,
    or it fails here."""
    if any(request.node.get_closest_marker(tier) for tier in TIERS):
        return
    nodeid = request.node.nodeid

    def refuse(self: Any, args: Any, *_: Any, **__: Any) -> None:
        raise AssertionError(f"{nodeid} starts a process ({args!r:.200}); mark it @pytest.mark.e2e (the landing "
                             "tier: it carries a main claim) or @pytest.mark.deep (every other end-to-end proof)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    from tests.forked import Server

    monkeypatch.setattr(Server, "start", lambda self, kind, target, args, *_, **__: refuse(self, [target, *args]))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A tiny run trained in this process, start to final checkpoint (RestoreableJob.run): the
    fast tier's own checkpoint and metrics for mode=eval, lm-eval's model and plots. Returns (its
    spec, its run directory)."""
    from hydra import compose, initialize_config_dir

    from runner.main.cli import CONF_DIR, CONFIG_NAME, prepare
    from runner.main.config import build_spec
    from runner.train.job import JOBS

    prepare()
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    overrides = [*TINY, f"run.dir={run_dir}", "train.steps=4", "eval.every=2", "checkpoint.every_steps=2",
                 "logging.progress=none"]
    mp = pytest.MonkeyPatch()
    mp.setenv("RUNNER_CACHE", str(tmp_path_factory.getbasetemp() / "runner-cache"))
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        spec = build_spec(compose(CONFIG_NAME, overrides=overrides), overrides)
    JOBS.get(spec.job.trainer)(spec).run()
    yield spec, run_dir
    mp.undo()


# The slowest files first: pytest-xdist hands whole files (`--dist loadfile`) to the two workers in
# collection order, so the long ones start at once and the short ones fill in behind them, meant to
# keep a long file from starting last and running alone (the one CI run with it, 2026-11-26, showed
# no gain: an A/B on the CI machine is still to do). tests/durations.json holds each file's seconds
# in a full run on a 2-core machine (`python tools/suite_durations.py` rewrites it from a run's
# `--durations=0`); a file not in it counts as DEFAULT_FILE_SECONDS.
DEFAULT_FILE_SECONDS = 30.0


# The two tiers (docs/tests.md): the landing tier, which the README's `pytest -q` and CI run, holds the
# in-process tests and the end-to-end tests marked `e2e`, one proof of each main claim; the deep tier,
# `pytest -m deep`, holds every other end-to-end proof. A test is in exactly one.
TIERS = ("e2e", "deep")


def deep_is_asked(markexpr: str, args: list[str]) -> bool:
    """Whether this session runs the deep tier's tests: a `-m` expression that names `deep` (`-m deep`,
    `-m "deep or e2e"`), or tests named one by one (`pytest tests/x.py::test_y`), which run whatever
    their tier. Any other session (no `-m`, or `-m "not e2e"`) leaves them out."""
    import re

    return bool(re.search(r"\bdeep\b", markexpr)) or any("::" in arg for arg in args)


def split_tiers(items: list[pytest.Item], markexpr: str, args: list[str]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """(kept, deselected): the deep tier's tests leave a session that did not ask for them. A test
    marked with both tiers is a mistake, refused before anything runs."""
    both = [item.nodeid for item in items if all(item.get_closest_marker(tier) for tier in TIERS)]
    if both:
        raise pytest.UsageError(f"{len(both)} test(s) marked both e2e and deep, e.g. {both[0]}: a test is in "
                                "one tier; keep @pytest.mark.e2e if it carries a main claim no landing test "
                                "carries, else @pytest.mark.deep (docs/tests.md)")
    if deep_is_asked(markexpr, args):
        return items, []
    deep = [item for item in items if item.get_closest_marker("deep")]
    return [item for item in items if not item.get_closest_marker("deep")], deep


def tier_line(asked: bool, markexpr: str, left_out: int) -> str:
    """The summary's line on which tier the session ran, so a log says what its pass means."""
    if asked:
        return f"tiers: the tests -m {markexpr!r} selects (docs/tests.md)" if markexpr else \
            "tiers: the tests named, whatever their tier (docs/tests.md)"
    return (f"tiers: the landing tier; {left_out} deep test{'s' * (left_out != 1)} left out (pytest -m deep "
            "runs the deep tier; docs/tests.md)")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr, args = config.option.markexpr or "", list(config.args)
    kept, deep = split_tiers(items, markexpr, args)
    if deep:
        config.hook.pytest_deselected(items=deep)
        items[:] = kept
    if "dir" in SESSION:  # for the summary, which the xdist controller writes without collecting
        (SESSION["dir"] / "tiers.txt").write_text(tier_line(deep_is_asked(markexpr, args), markexpr, len(deep)))
    slowest_files_first(items)


def slowest_files_first(items: list[Any]) -> None:
    """Order `items` (in place) by their file's seconds in tests/durations.json, slowest first,
    keeping each file's own order."""
    table = ROOT / "tests" / "durations.json"
    seconds = json.loads(table.read_text()) if table.exists() else {}
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], DEFAULT_FILE_SECONDS),
                                 item.nodeid.split("::")[0], order[item.nodeid]))
