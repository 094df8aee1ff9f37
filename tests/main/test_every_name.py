"""Every name a registry offers trains through `python -m runner`, on one device and on a mesh
with fsdp and tensor axes; every optimizer resumes bit for bit from a run cut short at a checkpoint
(one of them by a real SIGKILL, the others from a copy cut to the same state) and on another mesh.

The names come from the registries themselves, so a new optimizer, schedule, dataset strategy
or evaluator is covered without touching this file. An entry that can't run on its name alone
(it needs a file or a list of stages) takes its settings from REQUIRED; a new entry of that kind
fails here, loudly, until it is given some. Each registry is one Hydra sweep (one process runs
all its names), which keeps the whole file to a few minutes; evaluators don't name a run, so all
of them evaluate one run together.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml

from runner.data.strategies import DATASET_STRATEGIES
from runner.evaluation.base import EVALUATORS
from runner.models import MODEL_FAMILIES
from runner.optim import OPTIMIZERS, SCHEDULES
from tests.conftest import ROOT, mc_task_yaml, read_metrics, run_runner
from tests.train.test_restore import params_of

STEPS = 4
SMALL = [
    "job.model.d_model=32", "job.model.n_layers=1", "job.model.n_heads=2", "job.model.context_length=32",
    "train.seq_len=32", "train.batch_size=8", "train.log_every=1", "eval.rows=8", "eval.batch_size=8",
    "logging.wandb=disabled", "schedule.warmup_steps=1", f"train.steps={STEPS}", "checkpoint.every_steps=2",
    "eval.every=0",
]
MESHES = {1: [], 4: ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]}

# The registries, by the key that selects from them.
REGISTRIES = {"optimizer": OPTIMIZERS, "schedule": SCHEDULES, "data.strategy": DATASET_STRATEGIES,
              "eval.evaluators": EVALUATORS, "job.model.family": MODEL_FAMILIES}

# The meshes each registry trains on: an optimizer's state and an evaluator's batches are sharded,
# so they run on one device and on the (1, 2, 2) mesh; a model family's parameters are sharded too,
# and the mesh is its harder case; a schedule is a function of the step and a dataset strategy of
# (seed, strategy, step), which no mesh changes, so one device proves them.
DEVICES = {"optimizer": (1, 4), "eval.evaluators": (1, 4), "job.model.family": (4,), "schedule": (1,),
           "data.strategy": (1,)}

# What an entry needs beyond its name: extra overrides, or (evaluators) its own settings.
MC_QUESTIONS = [{"context": "def main(", "choices": [")", "zzz"], "gold": 0},
                {"context": "import o", "choices": ["s", "q"], "gold": 0}]
REQUIRED: dict[tuple[str, str], list[str] | str] = {
    ("data.strategy", "sequential"): [
        "data.stages=[{until_step:2,sources:[{path:default}]},{sources:[{path:default}]}]"],
    ("eval.evaluators", "multiple_choice"): "{name:multiple_choice,path:mc.jsonl}",
    ("eval.evaluators", "generate"): "{name:generate,prompts:['def '],max_new_tokens:4}",
    ("eval.evaluators", "lm_eval"): "{name:lm_eval,tasks:[mc_task],include_path:tasks}",
    # Gemma 3 always norms queries and keys; its window and pattern, and DeepSeek-V3's latents and
    # MTP module, at SMALL's width
    ("job.model.family", "gemma"): ["job.model.qk_norm=true", "job.model.window.size=8",
                                    "job.model.window.global_every=2"],
    ("job.model.family", "deepseek"): ["job.model.mla.q_lora_rank=16", "job.model.mla.kv_lora_rank=16",
                                       "job.model.mla.qk_nope_head_dim=8", "job.model.mla.qk_rope_head_dim=8",
                                       "job.model.mla.v_head_dim=8", "job.model.mtp.depth=1"],
}
def sweeps(key: str) -> list[list[str]]:
    """The sweeps that run every name of one registry: names that need the same extra overrides
    share one sweep (usually all of them)."""
    names = REGISTRIES[key].names()
    if key == "eval.evaluators":  # one run, every evaluator
        return [[f"{key}=[{','.join(str(REQUIRED.get((key, name), name)) for name in names)}]"]]
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        groups.setdefault(tuple(REQUIRED.get((key, name), [])), []).append(name)
    return [[f"{key}={','.join(values)}", *extras] for extras, values in groups.items()]


def run_sweep(tmp_path: Path, key: str, devices: int) -> list[dict]:
    """Every name of `key`'s registry, trained for STEPS steps; the sweep's members."""
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in MC_QUESTIONS))
    (tmp_path / "tasks").mkdir(exist_ok=True)
    (tmp_path / "tasks" / "mc_task.yaml").write_text(mc_task_yaml("mc_task", tmp_path / "mc.jsonl"))
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    members: list[dict] = []
    for i, chosen in enumerate(sweeps(key)):
        sweep = f"{key.replace('.', '_')}_{i}"
        result = run_runner(["-m", *SMALL, *MESHES[devices], *chosen, f"run.sweep={sweep}"], tmp_path, devices=devices,
                            **offline)
        summary = json.loads((tmp_path / "runs" / "sweeps" / sweep / "summary.json").read_text())["members"]
        failed = [m for m in summary if m["status"] != "finished"]
        assert result.returncode == 0 and not failed, (failed, result.stderr[-3000:])
        members += summary
    return members


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """(key, devices) -> (directory, members) of that registry's sweep, each run once."""
    done: dict[tuple[str, int], tuple[Path, list[dict]]] = {}

    def get(key: str, devices: int) -> tuple[Path, list[dict]]:
        if (key, devices) not in done:
            tmp = tmp_path_factory.mktemp(f"{key.replace('.', '_')}-{devices}")
            done[(key, devices)] = (tmp, run_sweep(tmp, key, devices))
        return done[(key, devices)]

    return get


@pytest.mark.parametrize("key,devices", [(key, devices) for key in sorted(REGISTRIES) for devices in DEVICES[key]])
@pytest.mark.deep
def test_every_registered_name_trains(key: str, devices: int, swept) -> None:
    tmp_path, members = swept(key, devices)
    evaluators = len(REGISTRIES["eval.evaluators"].names()) if key == "eval.evaluators" else 1
    assert len(members) == len(REGISTRIES[key].names()) // evaluators
    for member in members:
        records = read_metrics(tmp_path / member["run_dir"])
        losses = [r["loss"] for r in records if "loss" in r]
        assert len(losses) == STEPS and np.all(np.isfinite(losses)), member["run_dir"]
        labels = {k.split("/")[1] for r in records if r["step"] == STEPS for k in r if k.startswith("eval/")}
        assert len(labels) >= evaluators, f"{member['run_dir']}: at the last step only {labels} evaluated"


def test_every_optimizer_and_schedule_has_its_config_group() -> None:
    """The docs (reference/names.md) offer `optimizer=<name>` and `schedule=<name>`: each needs its conf file."""
    for group, registry in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES)):
        for name in registry.names():
            path = ROOT / "conf" / group / f"{name}.yaml"
            assert path.exists(), f"{group}={name} is registered but has no {path}"
            assert yaml.safe_load(path.read_text())["name"] == name


KILLED = OPTIMIZERS.names()[0]  # the one optimizer whose run is really killed


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, swept) -> tuple[Path, str, str]:
    """Every optimizer's run stopped at step 3 on the (1, 2, 2) mesh, as a SIGKILL leaves it: the
    checkpoint of step 2 committed, nothing of 4. One run (KILLED's) is killed there for real; the
    others are their uninterrupted runs (the sweep's) copied with the checkpoints after step 2
    deleted, the state a kill at step 3 leaves (the logged steps past the checkpoint are dropped by
    the resume in both cases), which spares a process each. Then one sweep resumes them all there
    to the end, and another continues them all on one device for 2 more steps. The directory, and
    the two sweeps' outputs."""
    tmp = tmp_path_factory.mktemp("resumed")
    names = OPTIMIZERS.names()
    killed = run_runner([*SMALL, *MESHES[4], f"optimizer={KILLED}", f"run.dir=killed/{KILLED}"], tmp, devices=4,
                        RUNNER_FAULT="kill_at_step:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(int(c.name) for c in (tmp / "killed" / KILLED / "checkpoints").iterdir() if c.name.isdigit()) == [2]
    for name in names:
        if name != KILLED:
            cut = shutil.copytree(uninterrupted(swept, name), tmp / "killed" / name)
            for step in (c for c in (cut / "checkpoints").iterdir() if c.name.isdigit() and int(c.name) > 2):
                shutil.rmtree(step)
    every = [f"optimizer={','.join(names)}", "run.dir=killed/${optimizer.name}"]
    again = run_runner(["-m", *SMALL, *MESHES[4], *every, "run.sweep=again"], tmp, devices=4)
    assert again.returncode == 0, again.stderr[-3000:]
    longer = run_runner(["-m", *SMALL, *every, f"train.steps={STEPS + 2}", "run.sweep=longer"], tmp, devices=1)
    assert longer.returncode == 0, longer.stderr[-3000:]
    return tmp, again.stdout, longer.stdout


def uninterrupted(swept, name: str) -> Path:
    """Optimizer `name`'s run in the uninterrupted sweep on the (1, 2, 2) mesh."""
    swept_dir, members = swept("optimizer", 4)
    return next(swept_dir / m["run_dir"] for m in members
                if yaml.safe_load((swept_dir / m["run_dir"] / "spec.yaml").read_text())["optimizer"]["name"] == name)


@pytest.mark.parametrize("name", OPTIMIZERS.names())
@pytest.mark.deep
def test_every_optimizer_resumes_exactly_after_sigkill_and_on_another_mesh(name: str, swept, resumed) -> None:
    reference = uninterrupted(swept, name)
    tmp, again, longer = resumed
    run = tmp / "killed" / name
    assert f"resumed from step 2 ({run / 'checkpoints'})" in again
    for a, b in zip(params_of(run, STEPS), params_of(reference, STEPS), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise
    assert [r["loss"] for r in read_metrics(run) if "loss" in r and r["step"] <= STEPS] == \
        [r["loss"] for r in read_metrics(reference) if "loss" in r]

    # The optimizer state saved on the (1, 2, 2) mesh restores onto one device and trains on.
    assert f"resumed from step {STEPS} ({run / 'checkpoints'})" in longer
    assert np.isfinite([r["loss"] for r in read_metrics(run) if r["step"] == STEPS + 2 and "loss" in r][0])


@pytest.mark.deep
def test_an_optimizer_that_needs_matrices_on_a_model_without_any_is_a_config_error(tmp_path: Path) -> None:
    result = run_runner([*SMALL, "optimizer=muon", "job.trainer=tests.job_fixture:UnigramTrainer"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "optimizer.name='muon'" in lines[0] and "Fix:" in lines[0], result.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("checkpoints/*"))
