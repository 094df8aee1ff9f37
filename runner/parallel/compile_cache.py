"""The persistent compilation cache (`run.compile_cache`): a relaunch after a preemption loads
its compiled programs instead of compiling them again.

JAX keys every entry by the program's HLO, the compile options, the devices and topology, the
XLA flags and the jax/jaxlib versions, so a changed model, mesh, batch or library never picks up
a stale executable: it misses and compiles. `default` is a directory under runner's cache
(`$RUNNER_CACHE/xla`, else `~/.cache/runner/xla`) unless `JAX_COMPILATION_CACHE_DIR` names one;
on a pod give a path every host reaches (a shared mount). `none` turns it off. mode=compile never
uses it: it reports how long compiling takes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from runner.checkpoint.storage import cache_root

OFF = ("none", "off", "")


def directory(setting: str) -> Optional[str]:
    """Where `run.compile_cache=setting` keeps compiled programs (None: off)."""
    if setting.strip().lower() in OFF:
        return None
    if setting == "default":
        return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(cache_root() / "xla")
    return str(Path(setting).expanduser()) if "://" not in setting else setting


def enable(setting: str) -> Optional[str]:
    """Point JAX's persistent cache at `directory(setting)`, caching every program however quick
    to compile (a relaunch pays for the many small ones too), or turn it off (`none`). Call before
    the first compilation: JAX decides once a process whether it uses a cache."""
    import jax

    where = directory(setting)
    if where is None:  # JAX would still use a JAX_COMPILATION_CACHE_DIR from the environment
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where
