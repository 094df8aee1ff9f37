"""A user's own callback and trainer subclass, selected from config by import path."""

from __future__ import annotations

import os
import time

from jobs.gpt import GPTTrainer


def _record(line: str) -> None:
    with open(os.environ["HOOK_LOG"], "a") as f:
        f.write(line + "\n")


class Recorder:
    """Writes every event it sees, with its step, to $HOOK_LOG; raises at step $HOOK_FAIL_AT (of
    the runs with seed $HOOK_FAIL_SEED, when set)."""

    def __init__(self, spec) -> None:
        self.fail_at = int(os.environ.get("HOOK_FAIL_AT", "0"))
        if int(os.environ.get("HOOK_FAIL_SEED", spec.seed)) != spec.seed:
            self.fail_at = 0

    def __getattr__(self, event: str):
        if not event.startswith("on_"):
            raise AttributeError(event)

        def hook(trainer, **info) -> None:
            _record(f"{event} {info.get('step', '')}".strip())
            if event == "on_step_end" and info.get("step") == self.fail_at:
                raise RuntimeError("boom")

        return hook


class HoldForStopFile:
    """Holds the run at the end of step 5 until its stop file (train.stop_file) exists, so a test
    can make the file mid-run however fast or slow the machine is. Changes timing only, never the
    numbers."""

    STEP = 5

    def __init__(self, spec) -> None:
        self.stop_file = spec.train.stop_file

    def on_step_end(self, trainer, **info) -> None:
        if info.get("step") == self.STEP:
            while not (trainer.run_dir / self.stop_file).exists():
                time.sleep(0.05)


class HookedTrainer(GPTTrainer):
    """Overrides the subclass hooks."""

    def on_step_start(self, state, step: int) -> None:
        _record(f"trainer.on_step_start {step}")

    def on_step_end(self, state, metrics, step: int) -> None:
        assert "loss" in metrics
        _record(f"trainer.on_step_end {step}")
