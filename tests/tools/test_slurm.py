"""conf/hydra/launcher/slurm.yaml: what hydra-submitit-launcher gets, and the sbatch file it writes.

No SLURM here: the config is composed with the real plugin's schema, and the dry run has the real
submitit render the sbatch file (tools/slurm_dry_run.py), so a wrong process count, partition or
signal shows up without a cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import xla_flags

ROOT = Path(__file__).resolve().parents[2]
DRY_RUN = ROOT / "tools" / "slurm_dry_run.py"


@pytest.fixture
def compose(monkeypatch: pytest.MonkeyPatch):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from runner.main.cli import CONF_DIR, CONFIG_NAME
    from runner.spec import register_schema

    register_schema()
    for name in ("RUNNER_SLURM_PARTITION", "RUNNER_SLURM_ACCOUNT", "RUNNER_SLURM_QOS", "RUNNER_SLURM_TIMEOUT_MIN"):
        monkeypatch.delenv(name, raising=False)

    def run(overrides: list[str]):
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            return hydra_compose(CONFIG_NAME, overrides=overrides, return_hydra_config=True)

    return run


def test_launcher_node_resolves_for_a_gpu_allocation(compose, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_SLURM_PARTITION", "a100")
    monkeypatch.setenv("RUNNER_SLURM_TIMEOUT_MIN", "720")
    cfg = compose(["hydra/launcher=slurm", "job=gpt_small", "hydra.launcher.nodes=2",
                   "hydra.launcher.tasks_per_node=8", "hydra.launcher.gpus_per_node=8"])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 8, 8)
    assert launcher["partition"] == "a100" and launcher["account"] is None and launcher["qos"] is None
    assert launcher["timeout_min"] == 720 and isinstance(launcher["timeout_min"], int)
    assert launcher["name"] == "runner-gpt_small"
    # runner saves on SIGTERM; submitit's default SIGUSR2 would end the job without a save.
    assert launcher["additional_parameters"] == {"signal": "TERM@180"}
    assert launcher["max_num_timeout"] == 0
    # The job config is untouched by the launcher choice.
    assert cfg.job.name == "gpt_small"


def test_launcher_defaults_without_environment(compose) -> None:
    launcher = OmegaConf.to_container(compose(["hydra/launcher=slurm"]).hydra.launcher, resolve=True)
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (1, 1, None)
    assert launcher["partition"] is None and launcher["timeout_min"] == 1440


def dry_run(*overrides: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_SLURM_")}
    full_env.update(env)
    return subprocess.run([sys.executable, str(DRY_RUN), *overrides], capture_output=True, text=True,
                          env=full_env, cwd=ROOT, timeout=300)


@pytest.mark.e2e
def test_dry_run_prints_the_sbatch_file() -> None:
    out = dry_run("job=gpt_small", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=8",
                  "hydra.launcher.gpus_per_node=8", "optimizer.lr=1e-3,3e-3", RUNNER_SLURM_PARTITION="a100")
    assert out.returncode == 0, out.stderr
    from runner.main.sweep import sweep_root  # the directory `python -m runner -m <same overrides>` uses

    overrides = ["-m", "hydra/launcher=slurm", "job=gpt_small", "optimizer.lr=1e-3,3e-3"]
    folder = ROOT / sweep_root(overrides) / ".submitit"
    assert folder.parent.name.startswith("gpt_small-")
    python = sys.executable
    assert out.stdout == f"""#!/bin/bash

# Parameters
#SBATCH --array=0-1%2
#SBATCH --gpus-per-node=8
#SBATCH --job-name=runner-gpt_small
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output={folder}/%A_%a/%A_%a_0_log.out
#SBATCH --partition=a100
#SBATCH --signal=TERM@180
#SBATCH --time=1440
#SBATCH --wckey=submitit

# setup
export PYTHONUNBUFFERED=1

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output {folder}/%A_%a/%A_%a_%t_log.out {python} -u -m submitit.core._submit {folder}/%j
"""
    assert "2 SLURM job(s) of 2 node(s) x 8 task(s): 16 JAX process(es) each" in out.stderr
    assert "optimizer.lr=0.001" in out.stderr and "optimizer.lr=0.003" in out.stderr


@pytest.mark.e2e
def test_dry_run_single_cpu_job_and_errors() -> None:
    out = dry_run("hydra.launcher.tasks_per_node=4", "hydra.launcher.cpus_per_task=2", "hydra.launcher.mem_gb=64",
                  "hydra.launcher.setup=[module load python/3.12]")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "#SBATCH --ntasks-per-node=4" in lines and "#SBATCH --cpus-per-task=2" in lines
    assert "#SBATCH --mem=64GB" in lines and "module load python/3.12" in lines
    assert not any(line.startswith("#SBATCH --array") or line.startswith("#SBATCH --gpus") for line in lines)

    bad = dry_run("hydra.launcher.nodes=two")
    assert bad.returncode == 2 and bad.stderr.startswith("error: The configuration is invalid")
    assert len(bad.stderr.strip().splitlines()) == 1
    unparsable = dry_run("job=[")
    assert unparsable.returncode == 2 and unparsable.stderr.startswith("error: An override cannot be parsed")
    flag = dry_run("-m", "job=gpt_small")
    assert flag.returncode == 2 and "takes only Hydra overrides" in flag.stderr


TINY = ["job.model.d_model=32", "job.model.n_layers=2", "job.model.n_heads=2", "job.model.context_length=32",
        "train.seq_len=32", "train.batch_size=8", "train.log_every=5", "eval.rows=16", "eval.batch_size=8",
        "logging.wandb=disabled", "schedule.warmup_steps=2", "train.steps=10"]


@pytest.mark.e2e
@pytest.mark.skipif(os.environ.get("RUNNER_SLURM_TEST") != "1",
                    reason="submits to a real SLURM cluster (sbatch on PATH): set RUNNER_SLURM_TEST=1")
def test_submits_two_processes_to_a_real_slurm(tmp_path: Path) -> None:
    """One member, 2 tasks: srun starts 2 processes that find each other through JAX's SLURM
    detection, train together, and the sbatch file submitted is the dry run's, byte for byte."""
    overrides = ["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=20", *TINY]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_SLURM_")}
    env.update(JAX_PLATFORMS="cpu", WANDB_MODE="offline", RUNNER_CACHE=str(tmp_path / "cache"),
               XLA_FLAGS=xla_flags(1))
    out = subprocess.run([sys.executable, "-m", "runner", "-m", *overrides], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (submitted,) = tmp_path.glob("runs/sweeps/*/.submitit/*/*_submission.sh")
    rendered = subprocess.run([sys.executable, str(DRY_RUN), *overrides[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
    assert rendered.stdout == submitted.read_text()
    (log,) = submitted.parent.glob("*_0_log.out")
    assert "over 2 devices, 2 process(es)" in log.read_text()
    (metrics,) = tmp_path.glob("runs/sweeps/*/gpt_tiny/*/metrics.jsonl")
    assert max(json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()) == 10
