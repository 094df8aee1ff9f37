"""Debug helpers: per-layer norms (computed inside the step), a profiler window, histograms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from runner.checkpoint import storage

SCANNED = ("blocks",)  # stacked layers: one norm per index of the leading axis


def _groups(tree: Any) -> dict[str, list[jax.Array]]:
    groups: dict[str, list[jax.Array]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        first = getattr(path[0], "key", getattr(path[0], "name", str(path[0])))
        groups.setdefault(str(first), []).append(leaf)
    return groups


def layer_norms(tree: Any, prefix: str) -> dict[str, jax.Array]:
    """L2 norm per top-level layer (per layer index for scanned stacks), as `<prefix>/<layer>`."""
    out: dict[str, jax.Array] = {}
    for name, leaves in _groups(tree).items():
        if name in SCANNED:
            per_layer = sum(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim))) for x in leaves)
            for i in range(per_layer.shape[0]):
                out[f"{prefix}/{name}_{i}"] = jnp.sqrt(per_layer[i])
        else:
            out[f"{prefix}/{name}"] = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))
    return out


def param_and_update_norms(old: Any, new: Any) -> dict[str, jax.Array]:
    update = jax.tree.map(lambda a, b: b - a, old, new)
    return {**layer_norms(new, "param_norm"), **layer_norms(update, "update_norm")}


class Profiler:
    """A jax.profiler trace of steps [start, start + steps) into <run_dir>/profile. The profiler
    writes local files only: for a gs:// run directory it traces into the local mirror
    (runner.checkpoint.storage.local_mirror) and uploads the trace when it stops."""

    def __init__(self, run_dir: Any, start: int, steps: int) -> None:
        where = f"profile/process_{jax.process_index()}"
        self.dir = storage.local_mirror(run_dir) / where
        self.upload_to = f"{run_dir}/{where}" if storage.is_remote(run_dir) else None
        self.start, self.end = start, start + steps
        self.active = False

    def before_step(self, step: int, state: Any) -> None:
        """`step` is the number of the step about to run (1-based)."""
        if self.end <= self.start:
            return
        if step == self.start and not self.active:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir))
            self.active = True
        elif step == self.end and self.active:
            self.stop(state)

    def stop(self, state: Any) -> None:
        if self.active:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False
            if self.upload_to is not None:
                storage.upload_tree(self.dir, self.upload_to)


def histograms(params: Any) -> dict[str, Any]:
    """wandb histograms of each top-level layer's parameters (host copy: only every N steps)."""
    import numpy as np
    import wandb

    return {f"params/{name}": wandb.Histogram(np.concatenate([np.asarray(jax.device_get(x)).ravel() for x in leaves]))
            for name, leaves in _groups(params).items()}
