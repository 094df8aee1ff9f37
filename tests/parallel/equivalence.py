"""What the mesh-equivalence scripts share (they run in a process of their own, with fake devices):
a model's loss, logits and gradients on packed rows, and the error of a sharded run against them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def logits_and_grads(model: Any, params: Any, tokens: jax.Array, segment_ids: jax.Array,
                     positions: jax.Array, compiled: bool = False) -> tuple[Any, str]:
    """((sum of sin(logits), logits), gradients) of `model` under the current mesh, and the
    program's text (to see which collectives it uses): as lowered, or as XLA compiled it."""
    def loss(p: Any) -> tuple[jax.Array, jax.Array]:
        logits = model.apply({"params": p}, tokens, segment_ids=segment_ids, positions=positions)
        return jnp.sum(jnp.sin(logits)), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    lowered = step.lower(params)
    return step(params), lowered.compile().as_text() if compiled else lowered.as_text()


def relative_error(got: Any, want: Any) -> float:
    """The largest difference of any leaf, relative to that leaf's largest magnitude (at least 1).
    In numpy, on the gathered leaves: on the device every leaf's shape and layout would compile
    three small programs of its own (a quarter of a script's time)."""
    import numpy as np

    return max(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1.0)
               for a, b in zip((np.asarray(x, np.float64) for x in jax.tree.leaves(got)),
                               (np.asarray(x, np.float64) for x in jax.tree.leaves(want))))


def run_script(script: str, tmp_path: Any, devices: int = 4) -> dict[str, Any]:
    """Run an equivalence script in a process of its own with `devices` CPU devices; its last
    line of output, as JSON."""
    import json

    from tests.conftest import ROOT, fork_server, runner_env
    from tests.forked import run

    proc = run(fork_server(), "code", script, [], ROOT, runner_env(tmp_path, devices=devices), 900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_close_losses(got: dict[int, float], want: dict[int, float], steps: Any, name: str) -> None:
    """`got`'s logged loss at each of `steps` is `want`'s within float32 rounding."""
    import pytest

    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=2e-4, abs=2e-4), (name, step)
