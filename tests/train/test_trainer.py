"""BaseTrainer pieces in-process: accumulation, sharded init, the state's layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.spec import register_schema
from runner.train.job import JOBS, load_job_modules
from tests.conftest import TINY

register_schema()
load_job_modules()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "runner-cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("RUNNER_CACHE", str(cache))
    overrides = [*TINY, f"run.dir={tmp_path_factory.mktemp('run')}", "train.steps=5"]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        spec = build_spec(compose(CONFIG_NAME, overrides=overrides), overrides)
    job = JOBS.get(spec.job.trainer)(spec)
    job.load()
    yield job
    mp.undo()


def _batch(rows: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 257, (rows, seq), dtype=np.int32)
    y = rng.integers(0, 257, (rows, seq), dtype=np.int32)
    mask = np.ones((rows, seq), np.float32)
    mask[1, seq // 2:] = 0.0  # padding: these targets must count for nothing
    mask[5, :3] = 0.0
    return {"x": x, "y": y, "mask": mask}


def test_accumulating_s_micro_batches_equals_one_big_batch(trainer) -> None:
    cls, state = type(trainer), trainer.state
    flat = _batch(8, trainer.spec.train.seq_len)
    key = jax.random.PRNGKey(1)
    one = {k: jnp.asarray(v)[None] for k, v in flat.items()}  # (1, 8, T)
    four = {k: jnp.asarray(v).reshape(4, 2, -1) for k, v in flat.items()}  # (4, 2, T)
    step = jax.jit(cls.train_step, static_argnums=3)
    s1, loss1, meta1 = step(state, one, key, 1)
    s4, loss4, meta4 = step(state, four, key, 4)
    assert float(meta1["tokens"]) == float(meta4["tokens"]) == flat["mask"].sum()
    np.testing.assert_allclose(loss1, loss4, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_padded_targets_do_not_change_the_update(trainer) -> None:
    cls, state = type(trainer), trainer.state
    flat = _batch(8, trainer.spec.train.seq_len)
    changed = {k: v.copy() for k, v in flat.items()}
    changed["y"][1, -1] = (changed["y"][1, -1] + 1) % 257  # a padded target
    key = jax.random.PRNGKey(1)
    step = jax.jit(cls.train_step, static_argnums=3)
    a, _, _ = step(state, {k: jnp.asarray(v)[None] for k, v in flat.items()}, key, 1)
    b, _, _ = step(state, {k: jnp.asarray(v)[None] for k, v in changed.items()}, key, 1)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(x, y)


def test_state_is_born_sharded_and_float32(trainer) -> None:
    leaves = jax.tree.leaves(trainer.state.params)
    assert all(leaf.dtype == jnp.float32 for leaf in leaves)
    assert all(leaf.sharding == s for leaf, s in zip(leaves, jax.tree.leaves(trainer.program.state_sharding.params)))
    assert int(trainer.state.step) == 0


def test_abstract_state_is_the_created_states_shape(trainer) -> None:
    """abstract_state reuses the model's traced parameter shapes (one model trace fewer per
    launch); it must describe exactly the state that create_state builds."""
    created = jax.eval_shape(trainer.program.create_state, jax.random.PRNGKey(trainer.spec.seed))
    abstract, _ = trainer.program.abstract_state()
    assert jax.tree.structure(created) == jax.tree.structure(abstract)
    for a, b in zip(jax.tree.leaves(created), jax.tree.leaves(abstract)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    real = [(x.shape, x.dtype) for x in jax.tree.leaves(trainer.program.init_state())]
    assert real == [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]


def test_sharded_init_returns_variables_and_shardings(trainer) -> None:
    variables, sharding = type(trainer).sharded_init(
        trainer.model, jax.random.PRNGKey(0), *trainer.init_args(), mesh=trainer.mesh,
        rules=trainer.logical_axis_rules)
    kernel = variables["params"]["wte"]["embedding"]
    assert kernel.shape == (trainer.spec.job.model.vocab_size, trainer.spec.job.model.d_model)
    assert jax.tree.structure(variables) == jax.tree.structure(sharding)


def test_time_interval_below_a_second_is_kept() -> None:
    """checkpoint.every_minutes is a float: 0.005 min is a 0.3 s interval, not 'no interval'."""
    from runner.checkpoint.checkpointer import SavePolicy
    from runner.spec import CheckpointSpec

    now = [0.0]
    policy = SavePolicy(CheckpointSpec(every_steps=0, every_minutes=0.005), clock=lambda: now[0])
    now[0] = 0.29
    assert not policy.due(1)
    now[0] = 0.3
    assert policy.due(2)


def test_save_and_load_honour_the_suffix(trainer) -> None:
    """save(suffix) also writes a named snapshot outside the rotation; load(suffix) restores it (or
    the step of that number), exactly."""
    from pathlib import Path

    trainer.save(Path("before-change"))
    snapshot = trainer.run_dir / "snapshots" / "before-change"
    assert (snapshot / "state").is_dir() and (snapshot / "meta").is_dir()
    saved = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
    trainer.state = trainer.state.replace(params=jax.tree.map(lambda x: x + 1.0, trainer.state.params))
    assert trainer.load(Path("before-change"))
    for a, b in zip(jax.tree.leaves(trainer.state.params), saved):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert trainer.step == 0 and trainer.checkpointer.steps() == [0]
    assert trainer.load(Path("0"))  # a number names that step of checkpoints/
    with pytest.raises(Exception, match="no checkpoint at"):
        trainer.load(Path("nope"))


def test_loop_runs_with_a_frozen_heap(trainer) -> None:
    """The step loop runs with the pre-loop heap frozen (no full GC passes over it), and the heap
    is unfrozen again afterwards."""
    import gc

    seen: list[int] = []
    trainer.on_step_start = lambda state, step: seen.append(gc.get_freeze_count())
    try:
        trainer.train()
    finally:
        del trainer.on_step_start
    assert seen and min(seen) > 1000, seen
    assert gc.get_freeze_count() == 0


def test_a_last_step_found_only_in_the_local_tier_is_saved_durably_once(tmp_path, capsys) -> None:
    """A launch that reached train.steps but whose durable save failed kept the step in the local
    tier: the rerun, with nothing left to train, saves it to run.dir; a rerun after that (both
    tiers hold it) only says the run is finished."""
    overrides = [*TINY, f"run.dir={tmp_path / 'run'}", "train.steps=2", f"checkpoint.local.dir={tmp_path / 'local'}",
                 "checkpoint.local.every_steps=1"]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        spec = build_spec(compose(CONFIG_NAME, overrides=overrides), overrides)

    def launch() -> object:
        job = JOBS.get(spec.job.trainer)(spec)
        job.load()
        return job

    first = launch()
    first.step = 2  # (as if trained) the final state, kept by the local tier alone
    first.checkpoints.save_local()
    first.close()
    second = launch()
    assert second.restored_tier == "local" and second.done and second.checkpointer.steps() == []
    second.finished_already()
    second.close()
    assert second.checkpointer.steps() == [2]
    assert "had reached step 2 (train.steps=2), but that step was only in the local tier" in capsys.readouterr().out
    durable = tmp_path / "run" / "checkpoints"
    written = {p: p.stat().st_mtime_ns for p in durable.rglob("*")}
    assert any(p.name == "2" for p in written)
    third = launch()
    assert third.restored_tier == "local" and third.done  # (the local copy is as new as the durable one)
    third.finished_already()
    third.close()
    out = capsys.readouterr().out
    assert "already finished at step 2" in out and "only in the local tier" not in out
    assert third.checkpointer.steps() == [2]
    assert {p: p.stat().st_mtime_ns for p in durable.rglob("*")} == written  # not saved a second time
