"""Print the sbatch file that `python -m runner -m hydra/launcher=slurm ...` would submit.

Why: a wrong process count or partition costs a queue wait to discover. This composes the same
conf/ with the same overrides, builds the launcher hydra-submitit-launcher would build, and has
submitit render its sbatch file without submitting anything. It needs neither SLURM nor a cluster.

    python tools/slurm_dry_run.py job=gpt_small hydra.launcher.nodes=2 \
        hydra.launcher.tasks_per_node=8 hydra.launcher.gpus_per_node=8

`hydra/launcher=slurm` is added unless another launcher is named. A sweep (`optimizer.lr=1e-3,3e-3`)
is one SLURM array job with one task per member; the members are listed on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

USAGE_EXIT_CODE = 2
# What hydra-submitit-launcher's BaseSubmititLauncher.launch() passes to the executor's
# constructor rather than to update_parameters().
_INIT_KEYS = ("submitit_folder", "max_num_timeout")


def fail(message: str) -> None:
    print("error: " + " ".join(message.split()), file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)


def sweep_members(overrides: Sequence[str]) -> list[list[str]]:
    """Expand sweep syntax (a,b / range / choice) into one override list per member, as Hydra's
    basic sweeper does."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as err:
        fail(f"An override cannot be parsed: {err}. Fix: write overrides as key=value, as for python -m runner.")
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(member) for batch in batches for member in batch]


def compose_config(overrides: Sequence[str]) -> Any:
    """The full config (the hydra node included) of one member, composed like runner does."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.main.cli import CONF_DIR, CONFIG_NAME
    from runner.spec import register_schema

    register_schema()  # the job classes are not needed to compose: jax is not imported
    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            return compose(CONFIG_NAME, overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        if "submitit_slurm" in text:
            fail("The SLURM launcher is not installed (hydra/launcher/submitit_slurm was not found). "
                 "Fix: pip install -e '.[slurm]' (hydra-submitit-launcher).")
        fail(f"The configuration is invalid: {text}. Fix: check the override's key and value.")


def sbatch_text(cfg: Any, members: int = 1) -> str:
    """The sbatch file submitit would write for this config's launcher (an array of `members`)."""
    import hydra.utils
    from submitit.auto.auto import AutoExecutor
    from submitit.slurm.slurm import SlurmExecutor

    class RenderOnlySlurmExecutor(SlurmExecutor):
        """submitit's SlurmExecutor where srun is absent: it only renders files here."""

        @classmethod
        def affinity(cls) -> int:
            return 1

    if not str(cfg.hydra.launcher.get("_target_", "")).endswith(".SlurmLauncher"):
        fail(f"hydra.launcher is {cfg.hydra.launcher.get('_target_')}, not the SLURM launcher. "
             "Fix: add hydra/launcher=slurm (or leave the launcher out).")
    launcher = hydra.utils.instantiate(cfg.hydra.launcher)  # the plugin's own object and params
    params = dict(launcher.params)
    executor = RenderOnlySlurmExecutor(params["submitit_folder"], max_num_timeout=params["max_num_timeout"])
    # What AutoExecutor(cluster="slurm").update_parameters() does with the plugin's parameters:
    # type-check and rename the generic ones, pass the SLURM-specific ones through.
    kwargs = {k: v for k, v in params.items() if k not in _INIT_KEYS and v is not None}
    generics = AutoExecutor._typed_parameters()
    for name, expected in generics.items():
        expected = (int, float) if expected is float else expected
        if name in kwargs and not isinstance(kwargs[name], expected):
            fail(f"hydra.launcher.{name}={kwargs[name]!r} must be of type {expected}. Fix: give a number.")
    converted = executor._convert_parameters({k: v for k, v in kwargs.items() if k in generics})
    converted.update({k: v for k, v in kwargs.items() if k not in generics})
    try:
        executor._internal_update_parameters(**converted)
    except ValueError as err:
        fail(f"submitit rejects the launcher settings: {err}. Fix: correct hydra.launcher.*.")
    if members > 1:
        executor.parameters["map_count"] = members
    return executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return
    if any(a.startswith("-") for a in args):
        fail(f"Unexpected flag {next(a for a in args if a.startswith('-'))!r}: this tool takes only "
             "Hydra overrides (no -m; a sweep's comma lists are expanded anyway). Fix: drop the flag.")
    if not any(a.split("=", 1)[0] == "hydra/launcher" for a in args):
        args = ["hydra/launcher=slurm", *args]
    # The sweep directory `python -m runner -m` gives this command line (submitit's logs go there).
    from runner.main.sweep import sweep_root

    args += [f"hydra.sweep.dir={sweep_root(['-m', *args])}", "hydra.sweep.subdir=."]
    members = sweep_members(args)
    cfg = compose_config(members[0])
    launcher = cfg.hydra.launcher
    for i, member in enumerate(members):
        shown = [o for o in member if not o.startswith("hydra.sweep.")]
        print(f"member {i}: {' '.join(shown)}", file=sys.stderr)
    processes = launcher.nodes * launcher.tasks_per_node
    print(f"{len(members)} SLURM job(s) of {launcher.nodes} node(s) x {launcher.tasks_per_node} task(s): "
          f"{processes} JAX process(es) each", file=sys.stderr)
    print(sbatch_text(cfg, len(members)), end="", flush=True)


if __name__ == "__main__":
    main()
