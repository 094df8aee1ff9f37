"""hydra/launcher=ray (conf/hydra/launcher/ray.yaml; its typed settings: config.py): Hydra loads
launchers only from the hydra_plugins package, so the class lives here and the work in
runner.main.ray_launcher.

A sweep's members run one after another from this process, exactly as with Hydra's basic launcher
(the summary, Optuna's trials and the objective are today's), and each member's training runs on
the Ray cluster: runner's task function sees this launcher in the Hydra config and hands the run to
Ray Train. A single run (no -m) takes the same path without this class."""

from __future__ import annotations

from typing import Any

from hydra._internal.core_plugins.basic_launcher import BasicLauncher


class RayLauncher(BasicLauncher):
    def __init__(self, **settings: Any) -> None:
        super().__init__()
        self.settings = settings  # read again by runner.main.ray_launcher from the member's Hydra config
