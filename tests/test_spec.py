"""Spec composition through Hydra, and every validation error (exit code 2, no traceback)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from runner.errors import ConfigError
from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.spec import CHECKED_SECTIONS, ExecutionSpec, derive_run_dir, register_schema, spec_from_dict, validate
from runner.train.job import load_job_modules
from tests.conftest import TINY, refused_in_process, run_runner

register_schema()
load_job_modules()


def spec_for(*overrides: str) -> ExecutionSpec:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose(CONFIG_NAME, overrides=list(overrides))
    return build_spec(cfg, list(overrides))


def test_default_composition_is_the_tiny_job() -> None:
    spec = spec_for()
    assert spec.job.name == "gpt_tiny" and spec.job.trainer == "gpt"
    assert spec.optimizer.name == "adamw" and spec.schedule.name == "cosine"
    assert spec.topology == "auto" and spec.mode == "train"
    assert spec.run.dir == "runs/gpt_tiny/default"


def test_spec_is_frozen_and_lists_become_tuples() -> None:
    spec = spec_for()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 3  # type: ignore[misc]
    assert isinstance(spec.data.sources, tuple)
    hash(spec)


def test_groups_and_keys_compose() -> None:
    spec = spec_for("job=gpt_small", "topology=v4-32", "optimizer=lion", "schedule=wsd", "train.steps=7000", "seed=3")
    assert spec.job.model.d_model == 768 and spec.job.model.n_layers == 12
    assert spec.optimizer.name == "lion" and spec.schedule.name == "wsd"
    assert spec.train.steps == 7000 and spec.seed == 3 and spec.topology == "v4-32"


def test_spec_round_trips_through_a_dict() -> None:
    spec = spec_for("optimizer.lr=0.01")
    assert spec_from_dict(spec.to_dict()) == spec


def test_run_dir_is_derived_from_identifying_overrides_only() -> None:
    a = derive_run_dir("runs", "gpt_tiny", ["optimizer.lr=0.01", "seed=1"])
    b = derive_run_dir("runs", "gpt_tiny", ["seed=1", "optimizer.lr=0.01", "train.steps=900", "topology=cpu-2",
                                            "mesh.data=2", "checkpoint.keep=9"])
    assert a == b == "runs/gpt_tiny/optimizer.lr=0.01,seed=1"
    assert derive_run_dir("runs", "gpt_tiny", ["train.steps=5", "job=gpt_tiny"]) == "runs/gpt_tiny/default"
    assert derive_run_dir("runs", "gpt_tiny", ["job.model.d_model=64"]) == "runs/gpt_tiny/job.model.d_model=64"
    long = derive_run_dir("runs", "j", [f"job.model.d_model={i}" for i in range(40)])
    assert len(long.split("/")[-1]) <= 120
    assert spec_for("run.dir=/tmp/x").run.dir == "/tmp/x"


@pytest.mark.parametrize("overrides, key, needle", [
    (["train.steps=0"], "train.steps", "> 0"),
    (["train.seq_len=512"], "train.seq_len", "context"),
    (["train.batch_size=30", "train.accumulate_steps=4"], "train.batch_size", "accumulate"),
    (["topology=cpu-4", "mesh.data=4", "train.batch_size=6"], "train.batch_size", "4 ways"),
    (["topology=cpu-4", "mesh.data=3"], "mesh", "4"),
    (["mesh.fsdp=0"], "mesh.fsdp", "positive"),
    (["optimizer.name=adamq"], "optimizer.name", "adamw"),
    (["schedule.name=cosin"], "schedule.name", "cosine"),
    (["data.strategy=zipf"], "data.strategy", "mixture"),
    (["job.trainer=nope"], "job.trainer", "gpt"),
    (["mode=serve"], "mode", "train, eval, compile"),
    (["topology=v4-31"], "topology", "v4"),
    (["job.model.n_heads=3"], "job.model.n_heads", "divide"),
    (["optimizer.b2=1.5"], "optimizer.b2", ""),
    (["logging.wandb=maybe"], "logging.wandb", "offline"),
    (["checkpoint.keep=0"], "checkpoint.keep", "> 0"),
    (["checkpoint.cadence=often"], "checkpoint.cadence", "fixed, auto"),
    (["checkpoint.mtbf_hours=0"], "checkpoint.mtbf_hours", "> 0"),
    (["checkpoint.auto_max_minutes=-1"], "checkpoint.auto_max_minutes", "> 0"),
    (["checkpoint.local.host_loss_fraction=1.5"], "checkpoint.local.host_loss_fraction", "from 0 to 1"),
    # auto's settings under the fixed cadence: nothing would read them
    (["checkpoint.auto_max_minutes=30"], "checkpoint.auto_max_minutes", "add checkpoint.cadence=auto"),
    (["checkpoint.local.host_loss_fraction=0.5"], "checkpoint.local.host_loss_fraction", "checkpoint.cadence=fixed"),
    (["checkpoint.cadence=auto", "checkpoint.every_steps=0"], "checkpoint.cadence", "until it has measured a save"),
    (["checkpoint.cadence=auto", "checkpoint.every_steps=10", "checkpoint.local.dir=/tmp/local",
      "checkpoint.local.every_steps=20"], "checkpoint.cadence", "would never be measured"),
    (["eval.evaluators=[nonesuch]"], "eval.evaluators", "heldout"),
])
def test_validation_errors_name_the_key(overrides: list[str], key: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        spec_for(*overrides)
    assert info.value.key.startswith(key)
    assert needle in str(info.value)
    assert "Fix:" in str(info.value)



def test_autos_settings_are_accepted_with_the_auto_cadence() -> None:
    spec = spec_for("checkpoint.cadence=auto", "checkpoint.auto_max_minutes=30",
                    "checkpoint.local.host_loss_fraction=0.5")
    assert spec.checkpoint.auto_max_minutes == 30 and spec.checkpoint.local.host_loss_fraction == 0.5

# One bad value per section with rules: validate must reach every section's own check.
BAD_VALUE = {"job": ("job.model.n_layers", 0), "train": ("train.steps", 0), "guard": ("guard.nonfinite", "maybe"),
             "debug": ("debug.norms_every", -1), "mesh": ("mesh.fsdp", 0), "pipeline": ("pipeline.schedule", "1f1b"),
             "data": ("data.num_threads", 0),
             "optimizer": ("optimizer.lr", 0.0), "schedule": ("schedule.final_lr_fraction", 2.0),
             "eval": ("eval.rows", 0), "checkpoint": ("checkpoint.keep", 0), "run": ("run.init_mode", "half"),
             "logging": ("logging.progress", "loud"), "distributed": ("distributed.stop_check_every", 0),
             "plan": ("plan.compiles", 0)}


def with_value(section: Any, key: str, value: Any) -> Any:
    head, _, rest = key.partition(".")
    return dataclasses.replace(section, **{head: with_value(getattr(section, head), rest, value) if rest else value})


def test_validate_checks_every_section_that_has_rules() -> None:
    spec = ExecutionSpec()
    validate(spec)
    with_check = {f.name for f in dataclasses.fields(ExecutionSpec) if hasattr(getattr(spec, f.name), "check")}
    assert set(CHECKED_SECTIONS) == with_check == set(BAD_VALUE)
    for section in CHECKED_SECTIONS:
        key, value = BAD_VALUE[section]
        with pytest.raises(ConfigError) as info:
            validate(with_value(spec, key, value))
        assert info.value.key == key and info.value.value == value, section
    with pytest.raises(ConfigError) as info:
        validate(with_value(spec, "job.model.rope.scaling", "cubic"))
    assert info.value.key == "job.model.rope.scaling"


def test_no_function_in_the_spec_module_is_longer_than_60_lines() -> None:
    import runner.spec

    tree = ast.parse(Path(runner.spec.__file__).read_text())
    long = [(node.name, node.end_lineno - node.lineno) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno > 60]
    assert not long


@pytest.mark.parametrize("args, needle", [
    (["train.stepz=3"], "train.stepz"),  # found by Hydra's composition
    (["optimizer.lr=0"], "optimizer.lr"),  # found when the spec is built
    (["--cfg", "job", "train.stepz=3"], "runner has no setting of that name"),  # --cfg: runner's paragraph
    (["--cfg", "job", "optimizer.b1=1.5"], "optimizer.b1"),  # --cfg checks the spec as a run does
])
@pytest.mark.e2e
def test_cli_user_errors_exit_2_without_traceback(tmp_path, args: list[str], needle: str) -> None:
    result = run_runner(args, tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert needle in result.stderr and "+train" not in result.stderr  # never advice runner then refuses
    assert not (tmp_path / "runs").exists()  # nothing written for a rejected config


@pytest.mark.parametrize("args, needle", [
    (["train.steps=abc"], "train.steps"),
    (["job=gpt_huge"], "gpt_tiny"),
    (["optimizer.name=adamq"], "adamw, "),
    (["optimizer.lr=abc"], "could not be converted to Float"),  # Hydra's cause kept
])
def test_more_user_errors_are_the_same_exit_2_paragraph_in_process(tmp_path, monkeypatch, capsys, args: list[str],
                                                                   needle: str) -> None:
    """The check `python -m runner` makes of its command line (composed, then built into a spec as a
    run builds it), in this process, on more mistakes: exit 2, one paragraph, nothing written."""
    monkeypatch.chdir(tmp_path)
    line = refused_in_process(args, capsys, build=True)
    assert needle in line and "+train" not in line, line
    assert not list(tmp_path.iterdir())


@pytest.mark.e2e
def test_cfg_job_prints_the_resolved_config(tmp_path) -> None:
    result = run_runner(["--cfg", "job", "train.steps=17", "optimizer=lion"], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "steps: 17" in result.stdout and "trainer: gpt" in result.stdout
    assert "  lr: 0.0003\n" in result.stdout and "${" not in result.stdout  # the job's lion rate, resolved


@pytest.mark.e2e
def test_refusals_found_after_the_run_directory_is_made_leave_none_behind(tmp_path) -> None:
    """A mesh the devices cannot make, missing or garbage data, a vocabulary too small for it, a
    missing warm start: exit 2 with the paragraph, and the directory this launch made is gone; a
    run directory with a run in it is never removed."""
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "metadata.json").write_text("not json")
    cases = [("mesh.data=3", "mesh"), ("data.sources=[{path:nowhere}]", "no token store"),
             (f"data.sources=[{{path:{tmp_path / 'garbage'}}}]", "garbage"),
             ("job.model.vocab_size=10", "job.model.vocab_size"), ("run.init_from=nowhere", "run.init_from"),
             ("data.sources=[{path:default,weight:-1}]", "weight")]
    for override, needle in cases:
        result = run_runner([*TINY, override, "run.dir=run", "train.steps=1"], tmp_path)
        assert result.returncode == 2 and needle in result.stderr, (override, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and not (tmp_path / "run").exists(), override
    ok = run_runner([*TINY, "run.dir=run", "train.steps=1", "eval.every=0"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    again = run_runner([*TINY, "run.dir=run", "train.steps=2", "mesh.data=3"], tmp_path)
    assert again.returncode == 2 and (tmp_path / "run" / "metrics.jsonl").is_file()


def test_several_processes_without_a_coordinator_name_the_missing_key(monkeypatch) -> None:
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    with pytest.raises(ConfigError) as info:
        spec_for("distributed.num_processes=2")
    assert info.value.key == "distributed.coordinator_address" and "Fix:" in str(info.value)
    with pytest.raises(ConfigError) as info:
        spec_for("distributed.num_processes=2", "distributed.coordinator_address=localhost:1234")
    assert info.value.key == "distributed.process_id"
    spec_for("distributed.num_processes=2", "distributed.coordinator_address=localhost:1234",
             "distributed.process_id=1")  # complete: accepted
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    spec_for("distributed.num_processes=2")  # the standard JAX variables count too


@pytest.mark.parametrize("override,key", [("+bogus=1", "bogus"), ("+job.model.n_kv=2", "job.model.n_kv"),
                                          ("+train.stepz=3", "train.stepz")])
def test_a_key_runner_does_not_have_is_a_config_error(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        spec_for(override)
    assert info.value.key == key and "no setting of that name" in str(info.value)


@pytest.mark.e2e
def test_new_key_and_lone_process_count_exit_2_from_the_command_line(tmp_path) -> None:
    for args, key in ((["+bogus=1"], "`bogus=1`"), (["distributed.num_processes=2"], "distributed.coordinator_address")):
        result = run_runner([*args, "train.steps=1"], tmp_path, JAX_COORDINATOR_ADDRESS="")
        assert result.returncode == 2, result.stderr[-2000:]
        assert key in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1  # one paragraph


# The rule (docs/command.md, Learning rates): a job states its AdamW rate; Adafactor trains at the same, Lion at a
# tenth (Lion's authors: 3-10x smaller); SGD and Muon, whose rates are not on Adam's scale, at their
# group's own.
GROUP_LR = {"sgd": 0.1, "muon": 0.02}


def test_every_optimizer_on_every_job_resolves_to_its_intended_learning_rate() -> None:
    import yaml

    from runner.optim import OPTIMIZERS

    jobs = sorted(p.stem for p in (CONF_DIR / "job").glob("*.yaml"))
    assert set(OPTIMIZERS.names()) == {"adamw", "adafactor", "lion", "sgd", "muon"}
    for job in jobs:
        adamw = float(yaml.safe_load((CONF_DIR / "job" / f"{job}.yaml").read_text())["job"]["lr"]["adamw"])
        intended = {"adamw": adamw, "adafactor": adamw, "lion": adamw / 10, **GROUP_LR}
        for name in OPTIMIZERS.names():
            spec = spec_for(f"job={job}", f"optimizer={name}", "topology=cpu-1", "mesh.expert=1")
            assert spec.optimizer.lr == pytest.approx(intended[name]), (job, name)
        assert spec_for(f"job={job}", "optimizer=lion", "optimizer.lr=0.25", "topology=cpu-1",
                        "mesh.expert=1").optimizer.lr == 0.25
