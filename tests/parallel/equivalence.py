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

    lowered = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params)
    executable = lowered.compile()  # compiled once, and called: calling the jitted function would compile it again
    return executable(params), executable.as_text() if compiled else lowered.as_text()


def relative_error(got: Any, want: Any, floor: float = 1.0) -> float:
    """The largest difference of any leaf over max(that leaf's largest magnitude, `floor`): so
    `relative_error(got, want) < tol` asserts, leaf by leaf, max|got - want| <= tol * max|want|
    (relative) for a leaf whose largest magnitude is at least `floor`, and <= tol * floor (absolute)
    for a smaller one: a combined tolerance, rtol = tol and atol = tol * floor.

    The floor of 1 is the scale of what the leaves are sums of: the loss is a sum of sin(logits),
    each term at most 1, and a gradient sums products of such terms and activations of order 1.
    float32 rounding of a sum is relative to its terms, not to its result, so a leaf whose terms
    cancel to a small value (a bias's or a norm scale's gradient) carries the absolute error of
    order-1 terms: a purely relative bound would fail it on rounding alone, or have to be so loose
    that an order-1 leaf far off would pass.

    In numpy, on the gathered leaves: on the device every leaf's shape and layout would compile
    three small programs of its own (a quarter of a script's time)."""
    import numpy as np

    return max(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor)
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


# A sharded run's logged losses (and MoE aux losses) against one device's: the largest relative
# difference measured (2026-11-28, this 2-core CPU machine) was 7.6e-7 (3.8e-6 absolute, on losses of
# 3.9 to 5.4) over every curve of test_pipeline, test_context_parallel, test_expert_parallel and
# test_moe's mesh run: float32 summation order only. 1e-5 leaves 13x headroom for other machines'
# kernels and orders.
LOSS_RTOL = 1e-5


def assert_close_losses(got: dict[int, float], want: dict[int, float], steps: Any, name: str) -> None:
    """`got`'s logged value at each of `steps` is `want`'s within LOSS_RTOL, relative: the values
    compared (losses, an MoE's aux loss and load) are of order 1 and up, never near 0."""
    import pytest

    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), (name, step)
