"""The persistent compilation cache (run.compile_cache): a relaunch loads what the first launch
compiled, a changed model compiles its own programs, a run of another length (or one extended)
compiles no train step, and a damaged entry costs a recompile, not the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.parallel.compile_cache import directory
from tests.conftest import TINY, read_metrics, run_runner

ARGS = [*TINY, "train.steps=3", "eval.every=0"]


def entries(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*-cache")}


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.e2e
def test_a_relaunch_hits_the_cache_and_a_changed_model_misses_it(tmp_path: Path) -> None:
    cache = tmp_path / "xla"
    first = run_runner([*ARGS, "run.dir=first", f"run.compile_cache={cache}"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    filled = entries(cache)
    assert filled, "the first launch must fill the cache"
    again = run_runner([*ARGS, "run.dir=again", f"run.compile_cache={cache}"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert entries(cache) == filled  # every program came from the cache: nothing new compiled
    assert losses(tmp_path / "again") == losses(tmp_path / "first")  # and computes the same numbers
    for entry in cache.glob("*-cache"):  # a kill in the middle of a write leaves a truncated entry
        entry.write_bytes(entry.read_bytes()[:10])
    wider = run_runner([*ARGS, "run.dir=wider", f"run.compile_cache={cache}", "job.model.d_model=64"], tmp_path)
    assert wider.returncode == 0, wider.stderr[-3000:]
    assert entries(cache) - filled  # a changed model is a different program: compiled, not reused


def train_steps(cache: Path) -> set[str]:
    return {name for name in entries(cache) if name.startswith("jit_step")}


@pytest.mark.e2e
def test_runs_that_differ_only_in_length_share_the_train_step(tmp_path: Path) -> None:
    """The schedule's lengths (train.steps, the warmup, a decay's) are the train step's arguments,
    not constants compiled into it (issue 59): a run of another length and a finished run extended
    compile no train step, and each follows its own train.steps."""
    def trained(run: str, key: str) -> list[float]:
        return [r[key] for r in read_metrics(tmp_path / run) if "loss" in r]

    cache = tmp_path / "xla"
    args = [*TINY, "eval.every=0", f"run.compile_cache={cache}"]  # cosine after a 2-step warmup
    short = run_runner([*args, "run.dir=short", "train.steps=4"], tmp_path)
    assert short.returncode == 0, short.stderr[-3000:]
    compiled = train_steps(cache)
    assert len(compiled) == 1, sorted(entries(cache))
    first_loss, first_lr = trained("short", "loss"), trained("short", "lr")
    longer = run_runner([*args, "run.dir=long", "train.steps=6"], tmp_path)
    assert longer.returncode == 0, longer.stderr[-3000:]
    extended = run_runner([*args, "run.dir=short", "train.steps=6"], tmp_path)  # resumes at step 4
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert train_steps(cache) == compiled, sorted(entries(cache))  # neither compiled a train step
    long_lr = trained("long", "lr")
    assert long_lr[:3] == first_lr[:3] and long_lr[3] != first_lr[3]  # the cosines part after step 3,
    assert trained("long", "loss")[:4] == first_loss  # so the first 4 losses agree
    assert trained("short", "loss")[:4] == first_loss and trained("short", "lr")[4:] == long_lr[4:]  # 6-step cosine


@pytest.mark.deep
def test_none_turns_the_cache_off_even_where_the_environment_names_one(tmp_path: Path) -> None:
    """JAX reads JAX_COMPILATION_CACHE_DIR itself: run.compile_cache=none must still write nothing."""
    named = tmp_path / "named"
    off = run_runner([*ARGS, "run.dir=off", "run.compile_cache=none"], tmp_path, JAX_COMPILATION_CACHE_DIR=str(named))
    assert off.returncode == 0, off.stderr[-3000:]
    assert not named.exists() or not entries(named), sorted(entries(named))
    on = run_runner([*ARGS, "run.dir=on"], tmp_path, JAX_COMPILATION_CACHE_DIR=str(named))  # default: that one
    assert on.returncode == 0, on.stderr[-3000:]
    assert entries(named)
    assert losses(tmp_path / "on") == losses(tmp_path / "off")


def test_the_cache_directory_setting(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert directory("default") == str(tmp_path / "xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    assert directory("default") == "/elsewhere"
    assert directory("none") is None and directory("off") is None
    assert directory("~/c") == str(Path.home() / "c")
