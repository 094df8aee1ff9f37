"""How a model runs, apart from what it is: one set of fields every family's config inherits, so a
family declares only its architecture. `runner.models.model_config` resolves them once per run (the
attention implementation and context parallelism for the platform, the tiles, the pipeline) and
`fields_of` fills them from job.model; a layer reads them from its config as before."""

from __future__ import annotations

from dataclasses import dataclass

from runner.models.common.layers import COMPUTE_DTYPES, Dtypes

REMATS = ("auto", "none", "full", "dots", "offload")  # runner.models.common.decoder.REMAT_POLICIES, and auto, none


@dataclass(frozen=True, kw_only=True)
class Runtime(Dtypes):
    """The run-time settings (keyword-only, after a family's own fields)."""

    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "auto"  # runner.models.attention.kernels
    context_parallel: str = "auto"  # runner.models.attention.context
    ulysses_ways: int = 0  # usp: the shards of each all-to-all group (runner.models.model_config resolves 0)
    remat: str = "auto"  # runner.models.common.decoder.remat_of
    loss_tiles: int = 1  # the output head and loss over tiles of the tokens (runner.models.common.tiling; 0: whole)
    mlp_tiles: int = 1  # the dense feed-forward over tiles of the tokens (runner.models.common.tiling)
    scan_layers: bool = True
    pipeline_stages: int = 1  # mesh.stage: the layers in this many stages (runner.models.common.pipeline)
    pipeline_microbatches: int = 1  # pipeline.microbatches, resolved (runner.models.model_config)
    pipeline_repeats: int = 1  # pipeline.repeats
    quantization: str = "none"  # job.model.quantization (runner.models.common.quantization)
    quantization_scope: tuple[str, ...] = ("attention", "mlp", "experts")
    quantization_scaling: str = "auto"

    def __post_init__(self) -> None:
        """A config built in code (tests, a user's script) is checked as job.model's keys are."""
        for name in ("compute_dtype", "param_dtype"):
            if getattr(self, name) not in COMPUTE_DTYPES:
                raise ValueError(f"{name} must be one of {sorted(COMPUTE_DTYPES)}")
        if self.remat not in REMATS:
            raise ValueError(f"remat must be 'auto', 'none', 'full', 'dots' or 'offload', got {self.remat!r}")
