"""Loss spikes in-process: the data windows a run skips, the detector in the step, the policies,
and the rewind's mechanics in the loop with a fake step and fake checkpoints. The end-to-end proofs
(a real run that spikes, rewinds and ends bit-exact with a manual skip) are in
tests/train/test_rewind_runs.py."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from runner.data.loader import BatchLoader
from runner.data.skips import DataSkips, normalized
from runner.data.strategies import build_strategy
from runner.errors import UserError
from runner.observability.goodput import Goodput
from runner.spec import GuardSpec, resolve_spec
from runner.train.guards import GuardMonitor, guard_update, initial_guard_state
from runner.train.loop import Component, Loop
from runner.train.rewind import RECORD, RewindJournal, Rewinds
from tests.conftest import refused_in_process


# ------------------------------------------------------------------ the data windows

def test_a_window_moves_the_data_stream_and_nothing_else() -> None:
    assert normalized([[5, 7], [1, 2], [2, 3], [9, 9], [6, 8]]) == ((1, 3), (5, 8))
    skips = DataSkips.of([[3, 5]], [[8, 10]])
    # step s trains on the s-th batch outside every window
    assert [skips.position(s) for s in range(8)] == [0, 1, 2, 5, 6, 7, 10, 11]
    assert skips.skipped() == 4 and not DataSkips() and skips
    # a checkpoint of step 3 (batches 0-2) is the same under both; one of step 4 (batch 5) is not
    assert skips.agrees_until(DataSkips(), 3) and not skips.agrees_until(DataSkips(), 4)
    assert skips.before(3) == () and skips.before(4) == ((3, 5),)
    assert DataSkips.of([[3, 5]]).agrees_until(skips, 6) and not DataSkips.of([[3, 5]]).agrees_until(skips, 7)


def test_the_loader_never_reads_a_skipped_window_and_keeps_the_order_after_it() -> None:
    strategy = build_strategy("synthetic", {"vocab_size": 97})
    layout = dict(global_batch=4, accumulate_steps=2)
    plain = BatchLoader(strategy.train(8, seed=1), start_step=0, **layout)
    skips = DataSkips.of([[2, 5]])
    skipping = BatchLoader(strategy.train(8, seed=1), start_step=1, skips=skips, **layout)
    halves = [BatchLoader(strategy.train(8, seed=1), start_step=1, skips=skips, process_index=p, process_count=2,
                          **layout) for p in range(2)]
    try:
        for step in range(1, 7):
            expected = plain.batch_at(skips.position(step))
            got = next(skipping)
            assert all(np.array_equal(got[k], expected[k]) for k in expected)
            joined = [next(h) for h in halves]
            assert np.array_equal(np.concatenate([j["x"] for j in joined], axis=1), expected["x"])
        assert skipping.global_rows(2).ravel().tolist() == list(range(20, 24))  # step 2 reads batch 5
    finally:
        for loader in (plain, skipping, *halves):
            loader.close()


# ------------------------------------------------------------------ the detector in the step

@struct.dataclass
class _State:
    params: dict
    opt_state: dict
    step: Any
    guard: dict


def _step(spec: GuardSpec, state: _State, loss: float, grad_norm: float = 1.0) -> tuple[_State, dict]:
    new = state.replace(params={"w": state.params["w"] + 1}, step=state.step + 1)
    state, flags = guard_update(spec, state, new, jnp.float32(loss), jnp.float32(grad_norm))
    return state, {k: float(v) for k, v in flags.items()}


def _fresh(window: int) -> _State:
    return _State({"w": jnp.zeros(2)}, {"m": jnp.zeros(2)}, jnp.int32(0), initial_guard_state(window))


def _healthy(spec: GuardSpec, state: _State, n: int) -> _State:
    rng = np.random.default_rng(0)
    for _ in range(n):
        state, flags = _step(spec, state, 3.0 + 0.01 * rng.standard_normal(), 1.0 + 0.01 * rng.standard_normal())
        assert flags["spike"] == 0 and flags["skipped"] == 0
    return state


def test_a_loss_or_grad_norm_above_the_band_is_a_spike_and_its_update_is_dropped() -> None:
    spec = GuardSpec(spike="skip", spike_on="either", spike_window=8, spike_warmup=4, spike_sigma=6.0)
    state = _fresh(8)
    state, flags = _step(spec, state, 50.0)  # during the warm-up nothing is judged
    assert flags["spike"] == 0 and int(state.guard["count"]) == 1
    state = _healthy(spec, _fresh(8), 12)  # the window wraps: the last 8 healthy steps
    assert int(state.guard["count"]) == 12
    assert flags.keys() >= {"loss_band", "grad_norm_band", "spike_fire", "spike_first"}
    before = state.params["w"]
    for loss, grad in ((3.5, 1.0), (3.0, 1.5)):  # a loss spike; a gradient-norm spike
        state, flags = _step(spec, state, loss, grad)
        assert flags["spike"] == 1 and flags["skipped"] == 1 and flags["spike_fire"] == 1
        np.testing.assert_array_equal(state.params["w"], before)
        assert int(state.guard["count"]) == 12  # a spike never enters the window
    assert int(state.step) == 14  # the step counter (data, PRNG, schedule) moved on
    state, flags = _step(spec, state, 3.0)  # a healthy step after them is applied
    assert flags["skipped"] == 0 and float(state.params["w"][0]) == float(before[0]) + 1
    # judged on the loss alone (the default), a gradient-norm excursion is no spike; on it alone, it is
    loss_only, grad_only = (dataclasses.replace(spec, spike_on=on) for on in ("loss", "grad_norm"))
    assert _step(loss_only, state, 3.0, 1.5)[1]["spike"] == 0 and _step(loss_only, state, 3.5)[1]["spike"] == 1
    assert _step(grad_only, state, 3.0, 1.5)[1]["spike"] == 1 and _step(grad_only, state, 3.5)[1]["spike"] == 0


def test_the_rule_fires_at_the_nth_spike_within_the_steps_and_forgets_older_ones() -> None:
    spec = GuardSpec(spike="rewind", spike_window=8, spike_warmup=4, spike_count=2, spike_within=3)
    state = _healthy(spec, _fresh(8), 8)
    state, flags = _step(spec, state, 9.0)  # step 9: first spike, the rule waits
    assert flags["spike"] == 1 and flags["spike_fire"] == 0 and flags["spike_first"] == 9
    state = _healthy(spec, state, 3)  # steps 10-12: the 3 steps pass, the spike is forgotten
    state, flags = _step(spec, state, 9.0)  # step 13: a first spike again
    assert flags["spike_fire"] == 0 and flags["spike_first"] == 13
    state, flags = _step(spec, state, 9.0)  # step 14: the second within 3 steps fires
    assert flags["spike_fire"] == 1 and flags["spike_first"] == 13
    assert int(state.guard["spikes"]) == 0 and int(state.guard["first_spike"]) == 0


def test_with_detection_off_every_finite_step_is_applied() -> None:
    spec = GuardSpec(spike="off", spike_window=8, spike_warmup=4)
    state = _healthy(spec, _fresh(8), 8)
    state, flags = _step(spec, state, 1e6, 1e6)
    assert flags == {"skipped": 0.0, "nonfinite": 0.0, "spike": 0.0}
    assert float(state.params["w"][0]) == 9


def test_the_policies_on_the_host() -> None:
    stop = GuardMonitor(GuardSpec(spike="stop", nonfinite="skip"))
    assert "guard.spike=stop" in stop.observe(7, {"skipped": 1.0, "spike": 1.0, "spike_fire": 1.0, "loss": 9.0,
                                                  "loss_band": 3.2, "grad_norm": 1.0, "grad_norm_band": 1.1})
    skip = GuardMonitor(GuardSpec(spike="skip", max_consecutive_skips=1))
    assert skip.observe(1, {"skipped": 1.0, "spike": 1.0, "spike_fire": 1.0}) is None
    assert "2 consecutive steps skipped for a loss spike" in skip.observe(2, {"skipped": 1.0, "spike": 1.0})
    skip.rewound()
    assert skip.consecutive == 0


# ------------------------------------------------------------------ the settings

@pytest.mark.parametrize("override, words", [
    ("guard.spike_factor=2", "runner no longer has this setting"),
    ("+guard.spike_factor=2", "runner no longer has this setting"),
    ("guard.spike=rewind checkpoint.every_steps=0", "checkpoint.every_steps (e.g. 100)"),
    ("guard.spike=sometimes", "rewind"),
    ("guard.spike_on=weights", "either"),
    ("guard.spike_count=3", "use guard.spike_within >= 3"),
    ("guard.spike_warmup=1", "at least two healthy steps"),
    ("train.skip_batches=[[5,3]]", "0 <= start < end"),
    ("train.skip_batches=[[5]]", "a pair [start, end]"),
    ("train.skip_batches=[[5,x]]", "train.skip_batches"),
])
def test_settings_that_cannot_be_honoured_are_refused(override: str, words: str, capsys, tmp_path,
                                                      monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = refused_in_process(override.split(), capsys, build=True)
    assert override.split()[0].split("=")[0].lstrip("+") in line and words in line, line
    assert "guard.spike=skip" in line if "spike_factor" in override else True
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ the rewind in the loop

POISON = range(10, 13)  # data-stream batches that make the fake step spike


class Holder:
    def __init__(self) -> None:
        self.state: dict = {"seen": ()}
        self.step = 0


class FakeCheckpoints(Component):
    """Saves the holder's state every `every` steps into a dict; `abandon_after` as the real one."""

    def __init__(self, holder: Holder, every: int) -> None:
        self.holder, self.every, self.saved, self.abandoned = holder, every, {}, []
        self.checkpointer = SimpleNamespace(steps=lambda: sorted(self.saved))

    def after_step(self, loop: Loop, step: int) -> None:
        if step % self.every == 0 and not loop.stopping:
            self.saved[step] = dict(self.holder.state)

    def wait(self) -> None:
        pass

    def abandon_after(self, step: int) -> list[int]:
        newer = [s for s in self.saved if s > step]
        self.abandoned += newer
        for s in newer:
            del self.saved[s]
        return newer


def _spiking_step(poison: range):
    def step(state: dict, batch: int) -> tuple[dict, dict]:
        spike = float(batch in poison)
        return {"seen": state["seen"] + ((batch,) if not spike else ())}, {"loss": 1.0, "spike_fire": spike}
    return step


def _run(tmp_path: Path, guard: dict, skip_batches: list, steps: int = 20,
         poison: range = POISON) -> tuple[Holder, FakeCheckpoints, Any]:
    tmp_path.mkdir()
    spec = resolve_spec({"run": {"dir": str(tmp_path)}, "train": {"skip_batches": skip_batches},
                         "guard": {"spike": "rewind", "rewind_back": 3, "rewind_skip": 5, **guard},
                         "checkpoint": {"every_steps": 4}})
    holder, journal, said, logged = Holder(), RewindJournal(spec, tmp_path), [], []
    checkpoints = FakeCheckpoints(holder, 4)

    def batches():
        return (journal.skips.position(s) for s in itertools.count(holder.step))

    def go_back(step: int):
        holder.state, holder.step = dict(checkpoints.saved[step]), step
        return batches()

    logger = SimpleNamespace(progress=SimpleNamespace(message=said.append), event=said.append,
                             rewound=lambda step: logged.append(step),
                             log=lambda step, record: logged.append((step, record)))
    rewinds = Rewinds(spec, journal, checkpoints, go_back, logger, Goodput())
    ending = Loop(holder, _spiking_step(poison), batches(), [rewinds, checkpoints], steps).run()
    return holder, checkpoints, SimpleNamespace(ending=ending, said=said, logged=logged, journal=journal)


def test_a_rewind_goes_back_skips_the_window_and_equals_the_manual_skip(tmp_path: Path) -> None:
    holder, checkpoints, run = _run(tmp_path / "auto", {}, [])
    assert run.ending.finished and holder.step == 20
    # batch 10 spikes at step 11 (read one step late): back to checkpoint 8 (<= 11 - 3), batches [8, 13) skipped
    record = json.loads((tmp_path / "auto" / RECORD).read_text())["rewinds"]
    assert [(r["spike_step"], r["first_spike"], r["restored_step"], r["window"]) for r in record] == \
        [(11, 11, 8, [8, 13])]
    assert checkpoints.abandoned == []  # nothing was saved past 8 before the spike was read
    assert holder.state["seen"] == (*range(8), *range(13, 25))
    assert run.logged[0] == 8 and run.logged[1][0] == 8 and run.logged[1][1]["rewind/skip_start"] == 8
    assert any(line.startswith("rewind 1/3: a loss spike at step 11") for line in run.said)
    manual, _, again = _run(tmp_path / "manual", {}, [[8, 13]])
    assert manual.state == holder.state and not again.journal.records
    # the relaunch of the rewound run reads the record and skips the same window
    assert RewindJournal(resolve_spec({}), tmp_path / "auto").skips == DataSkips.of([[8, 13]])


def test_a_spike_at_the_last_step_still_rewinds(tmp_path: Path) -> None:
    """Its metrics are read after the loop's last step: the loop goes back all the same."""
    holder, _, run = _run(tmp_path / "last", {}, [], poison=range(19, 20))
    assert run.ending.finished and holder.step == 20 and records_of(tmp_path / "last") == [(20, 16, [16, 21])]
    assert holder.state["seen"] == (*range(16), *range(21, 25))


def records_of(run_dir: Path) -> list[tuple]:
    return [(r["spike_step"], r["restored_step"], r["window"])
            for r in json.loads((run_dir / RECORD).read_text())["rewinds"]]


def test_rewinds_are_bounded_and_need_a_checkpoint_old_enough(tmp_path: Path) -> None:
    _, _, run = _run(tmp_path / "none", {"max_rewinds": 0}, [])
    assert "after 0 rewinds (guard.max_rewinds=0" in run.ending.halt and run.ending.step == 12
    _, _, run = _run(tmp_path / "young", {"rewind_back": 9}, [])
    assert "no checkpoint is at least guard.rewind_back=9 steps older than the first spike (step 11)" in run.ending.halt
    assert "train.skip_batches=[[1,11]]" in run.ending.halt  # by hand: from R steps before the spike, past it


def test_an_unreadable_record_stops_the_launch(tmp_path: Path) -> None:
    (tmp_path / RECORD).write_text("{not json")
    with pytest.raises(UserError, match="rewinds.json cannot be read"):
        RewindJournal(resolve_spec({}), tmp_path)


def test_callbacks_hear_of_a_rewind() -> None:
    from runner.train.callbacks import Callbacks

    heard = []

    class Listener:
        def on_rewind(self, trainer: Any, step: int) -> None:
            heard.append((trainer, step))

    trainer = SimpleNamespace(state=None)
    Callbacks(trainer, [Listener()]).rewound(None, 40)  # type: ignore[arg-type]
    assert heard == [(trainer, 40)]


def test_a_spike_halt_is_final_for_every_supervisor() -> None:
    """Exit 65 (a halt) without a traceback: not restartable by the code alone (runner.exits: Ray's launcher
    and launch_tpu --restart; tests/main/test_ray.py, test_launch.py). SkyPilot counts it against its error
    budget, which it cannot spend on crashes alone (tests/tools/test_sky.py)."""
    from runner.exits import HALTED_EXIT_CODE, restartable
    from runner.main.ray_launcher import RunnerExit
    from runner.spec import GuardSpec
    from runner.train.guards import halted

    logger = SimpleNamespace(ending=lambda code: None)
    reason = ("a loss spike at step 51: loss 8.9 (band top 4.6), ..., after 3 rewinds (guard.max_rewinds=3; the "
              "record: run/rewinds.json). Fix: find the cause")
    err = halted(reason, GuardSpec(spike="rewind"), 52, "run/checkpoints/52", logger)
    assert err.exit_code == HALTED_EXIT_CODE == 65 and not restartable(err.exit_code)
    assert "Fix: find the cause" in str(err)
    assert str(err).count("Fix:") == 1  # the reason's own fix, not the numerical guard's
    assert not RunnerExit(0, err.exit_code, f"error: {err}").retryable


def test_a_job_file_that_still_sets_the_retired_key_gets_the_migration(capsys, tmp_path, monkeypatch) -> None:
    """A config file names the key only in Hydra's full_key: the same paragraph as on the command line."""
    (tmp_path / "conf" / "job").mkdir(parents=True)
    (tmp_path / "conf" / "job" / "old.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /job/gpt_tiny\nguard:\n  spike_factor: 2.0\n")
    monkeypatch.chdir(tmp_path)
    line = refused_in_process([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "job=old"], capsys, build=True)
    assert "`guard.spike_factor`: runner no longer has this setting" in line and "guard.spike=skip" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conf"]  # nothing written
