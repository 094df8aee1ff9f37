"""tools/sky_task.py: the SkyPilot managed-job task it writes, loaded by SkyPilot's own parser (the
client in .venv-sky, offline: no credentials, no API server), its run line executed as a node would,
and its refusals. `sky launch --dryrun` cannot run here: SkyPilot 0.14's CLI needs an API server and
cloud credentials even for a dry run."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e  # every test here starts a process

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "sky_task.py"
SKY_PYTHON = ROOT / ".venv-sky" / "bin" / "python"


def sky_task(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "SKY_CHECK_HOME": str(tmp_path / "home")})


def test_the_skypilot_client_is_installed() -> None:
    """tools/venv.sh test installs it; a missing client fails here rather than skipping its tests."""
    assert SKY_PYTHON.exists(), "run `bash tools/venv.sh sky` (tools/venv.sh test does)"


def test_a_tpu_pod_task_is_accepted_by_skypilot_and_runs_runners_command(tmp_path) -> None:
    out = sky_task(tmp_path, "--accelerators", "tpu-v5p-128", "--run-dir", "gs://bucket/runs/llama", "--env",
                   "WANDB_API_KEY", "--spot", "--out", "task.yaml", "--check", "--", "job=llama3_8b", "train.steps=100")
    assert out.returncode == 0, out.stderr
    assert "runner: 1 node(s), {'tpu-v5p-128': 1}" in out.stdout  # SkyPilot's own reading of the file
    # 75 (stopped early after saving) recovered every time; any other nonzero code (a crash, but SkyPilot cannot
    # tell it from 2, 3, 65 or 76 there) from a budget of 3 restarts, so a repeating crash ends the job
    assert "'max_restarts_on_errors': 3, 'recover_on_exit_codes': [75]" in out.stdout
    task = yaml.safe_load((tmp_path / "task.yaml").read_text())
    assert task["num_nodes"] == 1 and task["resources"]["use_spot"] is True
    assert task["envs"] == {"PYTHONUNBUFFERED": "1", "WANDB_API_KEY": None}  # the secret is given at launch
    assert task["setup"].strip() == "bash tools/venv.sh tpu"
    words = shlex.split(task["run"])
    assert words[:3] == [".venv/bin/python", "-m", "runner"]
    assert words[3:] == ["job=llama3_8b", "train.steps=100", "topology=v5p-128", "run.dir=gs://bucket/runs/llama"]

    # the overrides are a valid runner spec (JAX's TPU detection finds the pod's hosts: no distributed.*)
    from hydra import compose, initialize_config_dir

    from runner.main.cli import CONF_DIR, CONFIG_NAME, prepare
    from runner.main.config import build_spec

    prepare()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        spec = build_spec(compose(CONFIG_NAME, overrides=words[3:]), words[3:])
    assert spec.topology == "v5p-128" and spec.run.dir == "gs://bucket/runs/llama"



def test_skypilots_own_recovery_rule_resumes_75_always_and_a_repeating_crash_three_times(tmp_path) -> None:
    """The written job_recovery fed to SkyPilot's own decision (StrategyExecutor.should_restart_on_failure):
    75 never spends the budget; any other code (a crash, and also a halt: SkyPilot cannot tell them apart)
    is relaunched 3 times, then the job ends."""
    out = sky_task(tmp_path, "--accelerators", "tpu-v5p-8", "--run-dir", "gs://b/r", "--out", "t.yaml")
    assert out.returncode == 0, out.stderr
    script = (
        "import sys, types, yaml\n"
        "from sky.jobs import recovery_strategy as rs\n"
        "rec = yaml.safe_load(open(sys.argv[1]))['resources']['job_recovery']\n"
        "ex = types.SimpleNamespace(recover_on_exit_codes=rec['recover_on_exit_codes'], restart_cnt_on_failure=0,\n"
        "                           max_restarts_on_errors=rec['max_restarts_on_errors'])\n"
        "decide = lambda code: rs.StrategyExecutor.should_restart_on_failure(ex, exit_codes=[code])\n"
        "print([decide(c) for c in (75, 1, 75, 1, 65, 75, 1, 75)])\n")
    ran = subprocess.run([str(SKY_PYTHON), "-c", script, str(tmp_path / "t.yaml")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HOME": str(tmp_path / "home")})
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip().splitlines()[-1] == "[True, True, True, True, True, True, False, True]"

def test_gpu_nodes_meet_at_the_first_node_as_skypilot_numbers_them(tmp_path) -> None:
    out = sky_task(tmp_path, "--accelerators", "H100:8", "--nodes", "2", "--run-dir", "gs://b/r", "--out", "gpu.yaml",
                   "--check", "--", "job=llama3_1b")
    assert out.returncode == 0, out.stderr
    assert "runner: 2 node(s), {'H100': 8}" in out.stdout
    task = yaml.safe_load((tmp_path / "gpu.yaml").read_text())
    assert task["setup"].strip() == "bash tools/venv.sh cuda"
    # run the node's line with a stand-in python that prints what it was given
    node = tmp_path / "node"
    (node / ".venv" / "bin").mkdir(parents=True)
    (node / ".venv" / "bin" / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (node / ".venv" / "bin" / "python").chmod(0o755)
    ran = subprocess.run(["bash", "-c", task["run"]], cwd=node, capture_output=True, text=True, timeout=30,
                         env={"PATH": os.environ["PATH"], "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8",
                              "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1"})
    assert ran.stdout.split("\n")[:-1] == [
        "-m", "runner", "job=llama3_1b", "topology=gpu-16", "run.dir=gs://b/r",
        "distributed.coordinator_address=10.0.0.7:8476", "distributed.num_processes=2", "distributed.process_id=1"]


@pytest.mark.parametrize("args, message", [
    (["--accelerators", "tpu-v5p-128", "--run-dir", "/mnt/runs"], "must outlive every host"),
    (["--accelerators", "tpu-v5p-128", "--run-dir", "gs://b/r", "--", "topology=v4-32"], "does not match"),
    (["--accelerators", "tpu-v5p-128", "--run-dir", "gs://b/r", "--nodes", "2"], "one slice per task"),
    (["--accelerators", "v5p", "--run-dir", "gs://b/r"], "neither a TPU slice"),
    (["--accelerators", "H100:8", "--run-dir", "gs://b/r", "--", "run.dir=gs://b/x"], "give it as --run-dir"),
    (["--accelerators", "H100:8", "--run-dir", "gs://b/r", "--", "distributed.process_id=0"], "drop the distributed"),
    (["--accelerators", "H100:8", "--run-dir", "gs://b/r", "--env", "1BAD"], "is not a variable name"),
])
def test_tasks_that_would_not_run_as_asked_are_refused(tmp_path, args, message) -> None:
    out = sky_task(tmp_path, *args)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""


def test_what_skypilot_itself_refuses_is_reported_as_one_paragraph(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sky_task
    finally:
        sys.path.pop(0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nresources:\n  acclerators: tpu-v5p-128\nrun: echo\n")
    result = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); "
                             f"import sky_task; sky_task.check_with_skypilot(__import__('pathlib').Path({str(bad)!r}), "
                             f"{str(SKY_PYTHON)!r})"], capture_output=True, text=True, timeout=120)
    assert sky_task.USAGE_EXIT_CODE == result.returncode == 2
    assert "SkyPilot refuses" in result.stderr and "did you mean 'accelerators'" in result.stderr
