"""hydra/launcher=ray's settings as a typed Hydra config, as Hydra's own submitit plugin declares its
launchers': registered in Hydra's ConfigStore (group hydra/launcher, name runner_ray), which
conf/hydra/launcher/ray.yaml extends. OmegaConf then refuses an unknown key or a value of the wrong
type when the command line is composed (runner: one exit-2 paragraph); the checks types cannot say
(ranges, the cluster's address) are runner.main.ray_launcher's. Hydra imports every module of the
hydra_plugins package when it starts, which registers this one. (No `from __future__ import
annotations`: Hydra's scan runs a module before sys.modules holds it, and dataclasses would look its
string annotations up there.)"""

from dataclasses import dataclass, field
from typing import Dict

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.runner_ray_launcher.ray_launcher import RayLauncher

TARGET = f"{RayLauncher.__module__}.{RayLauncher.__qualname__}"  # the class path, written nowhere else


@dataclass
class RayLauncherConf:
    """hydra.launcher under hydra/launcher=ray (docs/launching.md, Ray)."""

    _target_: str = TARGET
    # local: a Ray cluster on this machine for this command; auto: RAY_ADDRESS or the cluster this machine belongs
    # to; HOST:PORT: the head's GCS address
    address: str = "local"
    hosts: int = 0  # Ray workers, one JAX process each; 0: the TPU topology's hosts, else 1
    cpus_per_host: float = 1.0  # Ray CPUs each worker reserves (CPU training: the host's cores)
    gpus_per_host: int = 0  # GPUs each worker reserves (one JAX process sees all of them)
    max_restarts: int = 3  # attempts after the first; -1: no limit (preemptions never count: Ray's own budget)
    object_store_mb: int = 256  # address=local only: the object store (runner passes no data through it)
    # variables for every runner process: hydra.launcher.env={XLA_FLAGS: "...", RUNNER_CACHE: /shared/cache}
    env: Dict[str, str] = field(default_factory=dict)
    # true: a restart that finds fewer hosts goes on with them (at least min_hosts), the mesh's data axis smaller
    # and train.accumulate_steps larger (the same global batch; losses equal to float32 tolerance, not
    # bit-exact); Ray grows it back when hosts return
    elastic: bool = False
    min_hosts: int = 1  # elastic: the fewest hosts worth training on
    resize_check_s: float = 60.0  # elastic: how often Ray looks for returned hosts
    stop_grace_s: float = 120.0  # a healthy group Ray stops (growing back): seconds for runner to save and exit 75


def schema() -> DictConfig:
    """The settings as OmegaConf holds them: typed, closed to unknown keys, but `env` open to any
    variable's name (a typed Dict node inherits the closing, and Hydra merges a dict given on the
    command line into it key by key)."""
    node = OmegaConf.structured(RayLauncherConf)
    OmegaConf.set_struct(node.env, False)
    return node


ConfigStore.instance().store(group="hydra/launcher", name="runner_ray", node=schema(), provider="runner")
