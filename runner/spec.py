"""The ExecutionSpec: everything a run depends on, typed, validated and immutable.

The same frozen dataclasses are the Hydra schema (registered in the ConfigStore, so unknown
keys and wrong types are rejected at composition) and the spec handed to the job. Building a
spec is pure: no device queries, no distributed init, no files written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import ConfigError, first_line

MODES = (
    "train",  # train the job from its newest checkpoint (or from scratch) to train.steps (the default)
    "eval",  # evaluate a checkpoint's parameters (eval.checkpoint, else run.dir's newest) with eval.evaluators
    "compile",  # compile the train step for the topology without running it: memory per chip, fit (exit 3 if not)
    "plan",  # search the layouts (mesh, micro-batches, remat, pipeline, offload) by compiling them: the fastest first
)
WANDB_MODES = ("offline", "online", "disabled")
PROGRESS_STYLES = ("auto", "rich", "plain", "none")
ON_DAMAGED = ("fallback", "stop")
# job.model.activation: transformers' names (ACT2FN) for the functions runner computes the same way
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "relu")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
DTYPES = ("float32", "bfloat16")

# Overrides that may change between launches of the same run, so they do not name its directory
# (`job=` itself is already part of the path). A key is matched exactly or as a prefix.
NON_IDENTIFYING_EXACT = ("job", "mode", "topology", "train.steps", "train.log_every", "train.accumulate_steps",
                         "train.time_limit_minutes", "train.time_limit_margin_s", "train.max_steps_this_launch",
                         "train.stop_file", "callbacks")
NON_IDENTIFYING_PREFIXES = ("mesh", "run", "eval", "checkpoint", "logging", "distributed", "hydra", "debug", "plan")


def _freeze(value: Any) -> Any:
    """Lists from OmegaConf become tuples so the spec is hashable and immutable."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


class _Frozen:
    """Turns list fields into tuples after construction (frozen dataclasses need setattr)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, _freeze(value))


@dataclass(frozen=True)
class RopeSpec(_Frozen):
    """Rotary embeddings (llama and deepseek families)."""

    theta: float = 10000.0  # the rotary base frequency
    # none | linear (positions divided by factor) | llama3 (Llama 3.1+'s frequency scaling: factor,
    # low/high_freq_factor, original_context) | yarn (YaRN: factor, original_context, beta_fast,
    # beta_slow, attention_factor, truncate), as transformers computes them
    scaling: str = "none"
    factor: float = 8.0  # linear, llama3, yarn: how many times the original context is stretched
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_context / this are scaled fully
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_context / this are kept
    original_context: int = 8192  # llama3, yarn: the context length the model was pretrained at
    beta_fast: float = 32.0  # yarn: dimensions turning more than this often over original_context are kept
    beta_slow: float = 1.0  # yarn: dimensions turning less than this often are interpolated fully
    attention_factor: float = 0.0  # yarn: cos/sin scale; 0: 0.1 * ln(factor) + 1, YaRN's default
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    # yarn, deepseek family: the attention scores also times (0.1 * mscale_all_dim * ln(factor) + 1)^2
    # (DeepSeek's softmax scale; its config.json's mscale_all_dim); 0: not scaled
    mscale_all_dim: float = 0.0

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("job.model.rope", self, (("scaling", ROPE_SCALINGS), ("mscale_all_dim", ">= 0")))


@dataclass(frozen=True)
class HFOriginSpec(_Frozen):
    """What an export to Hugging Face keeps of the model a run was imported from (run.init_from=hf:DIR
    fills it from config.json): its architecture and its token ids."""

    # the transformers class to export as, e.g. MistralForCausalLM; empty: the one the model settings call for
    architecture: str = ""
    # the exported beginning-of-sequence id; None: the training data's end-of-document id
    bos_token_id: Optional[int] = None
    # the exported end-of-sequence ids; empty: the training data's end-of-document id
    eos_token_id: list[int] = field(default_factory=list)
    # deepseek family: the files' rotary rows in DeepSeek's interleaved pairs (transformers'
    # rope_interleave), read that way on import and written that way on export; false: rotate-half
    rope_interleave: bool = True


@dataclass(frozen=True)
class WindowSpec(_Frozen):
    """Sliding-window attention (llama and gemma families; runner.models.attention.kernels): a query attends
    to at most `size` keys, itself included (Hugging Face's `sliding_window`), in the layers the
    pattern names; off while size is 0."""

    size: int = 0  # keys a query sees, itself included; 0: every earlier key (no window)
    # every this-many-th layer (layers N-1, 2N-1, ...) attends globally and the rest through the
    # window (Gemma 3's sliding_window_pattern, 6); 0: every layer through the window (Mistral v0.1)
    global_every: int = 0
    # the windowed layers' rotary base (Gemma 3's rope_local_base_freq, 10000); 0: job.model.rope.theta
    local_rope_theta: float = 0.0

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("job.model.window", self, (("size", ">= 0"), ("global_every", ">= 0"),
                                                ("local_rope_theta", ">= 0")))
        if self.size == 0 and (self.global_every or self.local_rope_theta):
            key = "global_every" if self.global_every else "local_rope_theta"
            raise ConfigError(f"job.model.window.{key}", getattr(self, key), "it shapes the sliding window, and "
                              "job.model.window.size is 0 (no window): it would change nothing.",
                              "set job.model.window.size (e.g. 1024), or drop it.")


@dataclass(frozen=True)
class MLASpec(_Frozen):
    """Multi-head latent attention (DeepSeek-V2/V3; the deepseek family): queries and keys/values
    through low-rank latents, each head's query and key split into a part without positions and a
    rotary part whose key is shared by every head."""

    q_lora_rank: int = 1536  # the query latent's width; 0: queries projected directly (V2-Lite)
    kv_lora_rank: int = 512  # the key/value latent's width (what a cache would hold)
    qk_nope_head_dim: int = 128  # each head's query/key width without positions
    qk_rope_head_dim: int = 64  # each head's rotary query width, and the shared rotary key's
    v_head_dim: int = 128  # each head's value width

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("job.model.mla", self, (
            ("q_lora_rank", ">= 0"), ("kv_lora_rank", "> 0"), ("qk_nope_head_dim", "> 0"),
            ("qk_rope_head_dim", "> 0"), ("v_head_dim", "> 0")))
        if self.qk_rope_head_dim % 2:
            raise ConfigError("job.model.mla.qk_rope_head_dim", self.qk_rope_head_dim, "rotary embeddings rotate "
                              "pairs of dimensions.", "use an even width, e.g. 64.")


@dataclass(frozen=True)
class MTPSpec(_Frozen):
    """Multi-token prediction (DeepSeek-V3; the deepseek family): `depth` extra modules, the k-th
    predicting the token k+1 places ahead from the trunk's hidden state and the next token's
    embedding; their mean loss, times `loss_weight`, is added to the main loss. They train the
    trunk; the main loss and the logits are the trunk's alone."""

    depth: int = 0  # MTP modules (DeepSeek-V3: 1); 0: none
    loss_weight: float = 0.3  # lambda, DeepSeek-V3's for its first 10T tokens

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("job.model.mtp", self, (("depth", ">= 0"), ("loss_weight", ">= 0")))


@dataclass(frozen=True)
class SoftcapSpec(_Frozen):
    """Logit soft-capping, cap * tanh(x / cap) (Gemma 2; the gemma family); 0: off."""

    attention: float = 0.0  # on the attention scores (Gemma 2: 50)
    final: float = 0.0  # on the output logits (Gemma 2: 30)

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("job.model.softcap", self, (("attention", ">= 0"), ("final", ">= 0")))


MOE_DISPATCHES = ("auto", "ragged", "gmm", "capacity", "dense")
MOE_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoESpec(_Frozen):
    """A mixture-of-experts feed-forward in every layer (the llama family; runner.models.common.moe):
    off while n_experts is 0."""

    n_experts: int = 0  # experts per layer; 0: a dense MLP
    top_k: int = 2  # experts per token
    d_ff_expert: int = 0  # each expert's hidden width; 0: job.model.d_ff
    n_shared_experts: int = 0  # experts every token goes through as well (DeepSeek-V3's)
    first_dense_layers: int = 0  # leading layers that keep a dense MLP of width job.model.d_ff (DeepSeek-V3's 3)
    score: str = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3)
    normalize_top_k: bool = True  # the chosen experts' weights sum to one
    # auto (gmm on TPU, else ragged) | ragged (dropless grouped matmuls) | gmm (ragged by megablox's TPU
    # kernel) | capacity (at most capacity_factor x an even share per expert) | dense (every expert, every token)
    dispatch: str = "auto"
    capacity_factor: float = 1.25  # capacity dispatch: slots per expert, as a multiple of an even share
    aux_loss: float = 0.01  # the Switch/Mixtral load-balancing loss's coefficient
    z_loss: float = 0.001  # the router z-loss's coefficient
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores to choose
    # experts (never to their weights), moved by this much after each step toward even load; 0: off
    bias_update_rate: float = 0.0
    # DeepSeek-V3's group-limited routing: the experts in this many equal groups (1: one group, every expert)
    n_group: int = 1
    topk_group: int = 1  # the groups a token picks, those whose two best scores sum highest (DeepSeek-V3: 4 of 8)
    routed_scaling: float = 1.0  # the chosen experts' weights times this (DeepSeek-V3's 2.5)

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("job.model.moe", self, (
            ("n_experts", ">= 0"), ("top_k", "> 0"), ("d_ff_expert", ">= 0"), ("n_shared_experts", ">= 0"),
            ("first_dense_layers", ">= 0"), ("score", MOE_SCORES), ("dispatch", MOE_DISPATCHES),
            ("capacity_factor", "> 0"),
            ("aux_loss", ">= 0"), ("z_loss", ">= 0"), ("bias_update_rate", ">= 0"), ("n_group", "> 0"),
            ("topk_group", "> 0"), ("routed_scaling", "> 0")))
        if self.n_experts and (self.n_experts % self.n_group or self.topk_group > self.n_group):
            raise ConfigError("job.model.moe.n_group", self.n_group, f"the {self.n_experts} experts must split into "
                              f"n_group equal groups, of which a token picks topk_group={self.topk_group}.",
                              "use a divisor of job.model.moe.n_experts, at least job.model.moe.topk_group.")
        if self.n_experts and self.n_group > 1 and self.top_k > self.topk_group * (self.n_experts // self.n_group):
            raise ConfigError("job.model.moe.topk_group", self.topk_group, f"a token's top_k={self.top_k} experts "
                              "must come from the groups it picks, and they hold fewer.",
                              "raise job.model.moe.topk_group, or lower job.model.moe.top_k.")
        if self.n_experts and self.top_k > self.n_experts:
            raise ConfigError("job.model.moe.top_k", self.top_k, f"a token cannot choose more experts than the "
                              f"{self.n_experts} there are (job.model.moe.n_experts).",
                              f"use top_k <= {self.n_experts}.")
        if self.n_experts and self.first_dense_layers >= spec.job.model.n_layers:
            raise ConfigError("job.model.moe.first_dense_layers", self.first_dense_layers,
                              f"it leaves none of the {spec.job.model.n_layers} layers (job.model.n_layers) with "
                              "experts.", "use fewer dense layers, or job.model.moe.n_experts=0 for a dense model.")


@dataclass(frozen=True)
class ModelSpec(_Frozen):
    """job.model: the model's shape and numerics. A family (job.model.family) reads the keys it
    knows and refuses another family's keys set away from their defaults."""

    family: str = "gpt"  # gpt | llama | gemma | deepseek | import path of your own family (runner.models)
    vocab_size: int = 320  # rows of the embedding table: at least the tokenizer's vocabulary
    context_length: int = 128  # the longest sequence the model takes (gpt: learned positions)
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention (query) heads
    d_ff: int = 0  # the MLP's hidden width; 0: 4 * d_model
    tie_embeddings: bool = True  # the output projection is the embedding table (no separate lm head)
    dropout: float = 0.0  # gpt: residual dropout rate during training, in [0, 1)
    compute_dtype: str = "float32"  # float32 | bfloat16: activations and matmuls
    param_dtype: str = "float32"  # float32 | bfloat16: the stored parameters (and their gradients)
    attention: str = "auto"  # auto | xla | cudnn | splash (runner.models.attention.kernels)
    # with mesh.context > 1, attention across the split rows: auto | allgather | ring | ulysses | usp
    # (runner.models.attention.context)
    context_parallel: str = "auto"
    # usp: how many consecutive context shards exchange heads by all-to-all (the rest of mesh.context is
    # a ring); 0: the most that divide the heads a device holds, below mesh.context. Only usp reads it.
    ulysses_ways: int = 0
    # auto (dots when layers are scanned, none when unrolled: measured fastest on CPU, docs/performance.md)
    # | none (save every activation) | full (recompute the block) | dots (save the weight matmuls' outputs)
    # | offload (as full, each block's input kept in host memory until the backward pass: TPU, GPU)
    remat: str = "auto"
    # the output head and its loss over this many tiles of each row's tokens, each tile's logits
    # recomputed in the backward pass, so the whole logits never exist (runner.models.common.tiling); 1: whole;
    # 0: auto (tiled once one device's float32 logits would pass 1 GiB)
    loss_tiles: int = 0
    # the feed-forward block over this many tiles of each row's tokens, each recomputed in the backward
    # pass, so its activations are one tile's (ALST's TiledMLP); 1: whole. Dense MLPs only
    mlp_tiles: int = 1
    use_bias: bool = True  # gpt: biases on the projections and LayerNorms
    scan_layers: bool = True  # layers as one scanned, stacked layer (fast compiles); false: unrolled
    # int8 | fp8: the matmuls quantization_scope names run quantized, through Qwix
    # (runner.models.common.quantization); none: in compute_dtype
    quantization: str = "none"
    # attention (q, k, v, out projections) | mlp | experts | head (the output projection)
    quantization_scope: tuple[str, ...] = ("attention", "mlp", "experts")
    # how quantized operands are scaled: channel (an absolute max per row/column) | tensor (one per
    # operand: what fp8 matmul units fuse) | auto (tensor for fp8, channel for int8)
    quantization_scaling: str = "auto"
    # Size scaling by one integer: scale > 0 sets n_heads = scale, d_model = scale * head_dim and
    # d_ff = 4 * d_model (width, MLP width and head count together), so a model-size sweep is
    # one multirun line: `-m job.model.scale=2,4,8`.
    scale: int = 0
    head_dim: int = 64  # with scale (gpt); the llama family's per-head width, independent of d_model
    # llama family
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: n_heads
    qk_norm: bool = False  # RMSNorm on queries and keys per head (Qwen3)
    qkv_bias: bool = False  # biases on the query/key/value projections (Qwen2)
    out_bias: bool = False  # a bias on the attention output projection (Llama's attention_bias has both)
    mlp_bias: bool = False  # biases on the MLP's projections (Llama's mlp_bias)
    # the MLP's activation: silu, gelu (exact), gelu_new / gelu_pytorch_tanh (tanh approximation),
    # quick_gelu, relu; empty: the family's own (gpt: gelu_new, llama: silu, gated as SwiGLU)
    activation: str = ""
    norm_eps: float = 1e-5  # RMSNorm's (llama) and LayerNorm's (gpt) epsilon
    # gemma: the queries scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5; 0: head_dim
    query_pre_attn_scalar: float = 0.0
    rope: RopeSpec = field(default_factory=RopeSpec)
    window: WindowSpec = field(default_factory=WindowSpec)
    softcap: SoftcapSpec = field(default_factory=SoftcapSpec)
    moe: MoESpec = field(default_factory=MoESpec)
    mla: MLASpec = field(default_factory=MLASpec)
    mtp: MTPSpec = field(default_factory=MTPSpec)
    hf: HFOriginSpec = field(default_factory=HFOriginSpec)

    def check(self, spec: ExecutionSpec) -> None:
        """Sizes and choices first, then the rotary settings, then the ranges of norm_eps and dropout."""
        _check_rules("job.model", self, (
            ("scale", ">= 0"), ("head_dim", "> 0"), ("vocab_size", "> 0"), ("context_length", "> 0"),
            ("d_model", "> 0"), ("n_layers", "> 0"), ("n_heads", "> 0"), ("d_ff", ">= 0"),
            ("compute_dtype", DTYPES), ("param_dtype", DTYPES), ("remat", ("auto", "none", "full", "dots", "offload")),
            ("context_parallel", ("auto", "allgather", "ring", "ulysses", "usp")), ("ulysses_ways", ">= 0"),
            ("loss_tiles", ">= 0"), ("mlp_tiles", "> 0"),
            ("quantization_scaling", ("auto", "channel", "tensor")),
            ("activation", ("", *ACTIVATIONS))))
        if self.ulysses_ways and self.context_parallel != "usp":
            raise ConfigError("job.model.ulysses_ways", self.ulysses_ways, "only context_parallel=usp splits the "
                              f"context axis into all-to-all groups, and it is {self.context_parallel}.",
                              "set job.model.context_parallel=usp, or drop job.model.ulysses_ways.")
        self.rope.check(spec)
        self.window.check(spec)
        self.softcap.check(spec)
        self.moe.check(spec)
        self.mla.check(spec)
        self.mtp.check(spec)
        _check_rules("job.model", self, (
            ("norm_eps", lambda v: v > 0, "it must be positive.", "use e.g. 1e-5 or 1e-6."),
            ("dropout", lambda v: 0.0 <= v < 1.0, "it must be in [0, 1).", "use e.g. 0.0 or 0.1.")))


@dataclass(frozen=True)
class JobSpec(_Frozen):
    """job: what is trained, chosen with job=NAME (conf/job/NAME.yaml), which also sets other
    sections' values."""

    name: str = "gpt_tiny"  # the conf/job/*.yaml that was chosen
    trainer: str = "gpt"  # registered job class, or an import path `pkg.module:Class`
    model: ModelSpec = field(default_factory=ModelSpec)
    # The learning rate this job trains at, per optimizer name: optimizer.lr of the group chosen is
    # the job's entry for it, else the group's own (conf/optimizer/*.yaml); optimizer.lr=X on the
    # command line sets it outright.
    lr: dict[str, float] = field(default_factory=dict, hash=False)

    def check(self, spec: ExecutionSpec) -> None:
        self.model.check(spec)


@dataclass(frozen=True)
class MeshSpec(_Frozen):
    """mesh: the devices split over six named axes (runner.parallel.mesh); the sizes multiply to
    the device count."""

    # the layers split into this many pipeline stages (the pipeline section; above 1 it is the axis
    # split across slices)
    stage: int = 1
    # Each axis below is a device count, -1 for the devices the others leave (at most one -1).
    data: int = -1  # plain data parallelism: batch split, parameters replicated (across slices if mesh.stage=1)
    fsdp: int = 1  # splits the batch and shards parameters and optimizer state (FSDP / ZeRO-3)
    expert: int = 1  # shards a mixture of experts' experts (job.model.moe); elsewhere it splits the batch
    context: int = 1  # splits every row's sequence (long context: job.model.context_parallel)
    tensor: int = 1  # shards within layers (heads, MLP width): tensor parallelism

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("mesh", self, tuple(
            (axis, lambda v: v != 0 and v >= -1, "mesh sizes are positive, or -1 for 'the rest'.",
             f"set mesh.{axis} to a positive size or -1.") for axis in ("data", "fsdp", "expert", "context",
                                                                       "tensor")))
        _check_rules("mesh", self, (("stage", lambda v: v >= 1, "it is the number of pipeline stages the layers "
                                     "split into, a positive count (no -1: another axis takes the rest).",
                                     "set mesh.stage to 1 (no pipeline) or to the number of stages."),))


PIPELINE_SCHEDULES = ("gpipe", "circular")


@dataclass(frozen=True)
class PipelineSpec(_Frozen):
    """pipeline: how the layers' stages (mesh.stage) take turns on the micro-batches
    (runner.models.common.pipeline, docs/pipeline.md). Set only with mesh.stage above 1 (refused otherwise)."""

    # gpipe: each stage runs its consecutive layers once per microbatch | circular: the layers go
    # round the stages `repeats` times, each stage holding every stage-th group of layers (a smaller bubble)
    schedule: str = "gpipe"
    microbatches: int = 0  # each micro-batch's rows in this many pipeline microbatches; 0: mesh.stage
    repeats: int = 1  # circular: how many times the layers go round the stages (gpipe: 1)

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("pipeline", self, (("schedule", PIPELINE_SCHEDULES), ("microbatches", ">= 0"),
                                        ("repeats", "> 0")))
        if spec.mesh.stage == 1 and self != PipelineSpec():
            changed = next(k for k in ("schedule", "microbatches", "repeats")
                           if getattr(self, k) != getattr(PipelineSpec(), k))
            raise ConfigError(f"pipeline.{changed}", getattr(self, changed), "the pipeline section schedules the "
                              "layers' stages, and mesh.stage=1: there is one stage, nothing to schedule.",
                              f"set mesh.stage to the number of stages, or drop pipeline.{changed}.")
        if self.schedule == "gpipe" and self.repeats != 1:
            raise ConfigError("pipeline.repeats", self.repeats, "the gpipe schedule runs each stage's layers once "
                              "per microbatch.", "drop pipeline.repeats, or use pipeline.schedule=circular.")
        if self.schedule == "circular" and self.repeats < 2:
            raise ConfigError("pipeline.repeats", self.repeats, "the circular schedule takes the layers round the "
                              "stages at least twice (with 1 it is gpipe).",
                              "use pipeline.repeats=2 or more, or pipeline.schedule=gpipe.")


@dataclass(frozen=True)
class SourceSpec(_Frozen):
    """One token store a dataset strategy reads."""

    name: str = ""  # its name in metrics and the data fingerprint, unique; empty: the store's own name
    path: str = "default"  # "default": the embedded corpus; else a store directory or gs:// URL
    weight: float = 1.0  # its share of the mixture, relative to the others'; 0: validation only


@dataclass(frozen=True)
class StageSpec(_Frozen):
    """One stage of the `sequential` strategy: its sources train the steps before until_step."""

    until_step: Optional[int] = None  # the stage ends before this step; None: the last stage, to the end of training
    sources: tuple[SourceSpec, ...] = ()  # the stores this stage mixes, as data.sources does


@dataclass(frozen=True)
class DataSpec(_Frozen):
    """data: what the model trains on (a dataset strategy and its token stores) and how batches are
    fed."""

    # the dataset strategy (runner.data.strategies): mixture | sequential | synthetic | import path
    strategy: str = "mixture"
    sources: tuple[SourceSpec, ...] = (SourceSpec(),)  # mixture: the token stores, mixed by weight
    stages: tuple[StageSpec, ...] = ()  # sequential: the stages, in order
    prefetch: int = 2  # batches prepared ahead of the step that needs them
    num_threads: int = 2  # threads preparing batches (grain's read threads)
    # Packed rows carry segment ids and per-document positions: attention stops at each
    # end-of-document token, positions restart, and no target crosses a document boundary.
    document_mask: bool = False

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("data", self, (("prefetch", ">= 0"), ("num_threads", "> 0")))


@dataclass(frozen=True)
class OptimizerSpec(_Frozen):
    """optimizer: chosen with optimizer=NAME (conf/optimizer/NAME.yaml); each optimizer uses the
    settings that apply to it."""

    name: str = "adamw"  # registered optimizer (runner.optim.optimizers) or import path; optimizer=NAME sets it
    lr: float = 3e-3  # the peak learning rate; the group's own is job.lr's entry for its optimizer
    weight_decay: float = 0.1  # decoupled decay (sgd: added to the gradient); never on norms, biases, embeddings
    b1: float = 0.9  # adamw, lion: the first moment's decay; muon: its Adam half's
    b2: float = 0.95  # adamw: the second moment's decay; lion: its momentum's; muon: its Adam half's
    eps: float = 1e-8  # adamw, muon: added to the denominator
    momentum: float = 0.9  # sgd: momentum (0: none); muon: Muon's momentum
    nesterov: bool = False  # sgd, muon: Nesterov momentum
    clip_norm: Optional[float] = 1.0  # gradients are first clipped to this global norm; null: no clipping
    state_dtype: str = "float32"  # float32 | bfloat16: how the optimizer's moments are stored
    # none | host: keep the optimizer state in the host's pinned memory between steps, copied to the
    # device for the update only (runner.optim.offload: TPU, GPU; on a CPU it is the same memory)
    offload: str = "none"

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("optimizer", self, (("lr", "> 0"), ("state_dtype", DTYPES), ("offload", ("none", "host"))))


@dataclass(frozen=True)
class ScheduleSpec(_Frozen):
    """schedule: the learning rate over the steps, chosen with schedule=NAME
    (conf/schedule/NAME.yaml)."""

    name: str = "cosine"  # registered schedule (runner.optim.schedules) or import path; schedule=NAME sets it
    warmup_steps: int = 50  # a linear warmup from 0 to optimizer.lr over these steps (at most train.steps)
    final_lr_fraction: float = 0.1  # final learning rate as a fraction of optimizer.lr
    decay_fraction: float = 0.2  # wsd only: share of the steps spent decaying

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("schedule", self, (
            ("warmup_steps", ">= 0"),
            ("final_lr_fraction", lambda v: 0.0 <= v <= 1.0, "it must be in [0, 1].",
             "use e.g. 0.1 to end at a tenth of the peak learning rate.")))


@dataclass(frozen=True)
class TrainSpec(_Frozen):
    """train: how long, how big a batch, and when a launch stops early."""

    steps: int = 300  # optimizer steps of the whole run, over all its launches
    batch_size: int = 32  # global, in sequences, per optimizer step
    accumulate_steps: int = 1  # micro-batches per step
    seq_len: int = 128  # tokens per sequence (row); at most job.model.context_length
    log_every: int = 10  # steps between metric records (metrics.jsonl, wandb, the progress line)
    time_limit_minutes: float = 0.0  # stop cleanly (checkpoint, exit 75) shortly before this; 0: none
    time_limit_margin_s: float = 30.0  # room kept for the final save
    max_steps_this_launch: int = 0  # run this many more steps, then checkpoint and exit 75; 0: no limit
    stop_file: str = "STOP"  # its appearance (relative to run.dir) stops the run cleanly (exit 76); "": off
    # data-stream windows [start, end) of batches never trained on (docs/spikes.md); []: none
    skip_batches: list[list[int]] = field(default_factory=list, hash=False)

    def check(self, spec: ExecutionSpec) -> None:
        """Sizes are positive, a sequence fits the model's context and a batch splits into its micro-batches."""
        context = spec.job.model.context_length
        _check_rules("train", self, (
            ("steps", "> 0"), ("batch_size", "> 0"), ("accumulate_steps", "> 0"), ("seq_len", "> 0"),
            ("log_every", "> 0"), ("time_limit_minutes", ">= 0"), ("time_limit_margin_s", ">= 0"),
            ("max_steps_this_launch", ">= 0"),
            ("seq_len", lambda v: v <= context,
             f"it is longer than the model's context (job.model.context_length={context}).",
             f"use train.seq_len <= {context} or raise job.model.context_length."),
            ("batch_size", lambda v: not v % self.accumulate_steps,
             f"it is not divisible by train.accumulate_steps={self.accumulate_steps}.",
             "choose a batch size that is a multiple of the number of micro-batches.")))
        _check_windows("train.skip_batches", self.skip_batches)


@dataclass(frozen=True)
class EvaluatorSpec(_Frozen):
    """One entry of eval.evaluators: which evaluator, and its own settings. A bare name in the
    list stands for an entry with only `name` set. Your own evaluator reads these (and anything
    of its own under `options`); settings an evaluator does not use are ignored by it."""

    name: str = "heldout"  # registered name, or an import path `pkg.module:Class`
    label: str = ""  # prefix of its metric names; empty: the evaluator's default
    every: Optional[int] = None  # steps between runs; None: eval.every; 0: at start and end only
    rows: Optional[int] = None  # examples evaluated (windows per source, questions); None: eval.rows
    path: str = ""  # its data file (multiple_choice: a JSONL of context/choices/gold)
    delimiter: str = " "  # multiple_choice: between the context and each choice (lm-eval's target_delimiter)
    tasks: tuple[str, ...] = ()  # lm_eval: lm-evaluation-harness task (or group) names
    include_path: str = ""  # lm_eval: a directory of your own task YAMLs
    num_fewshot: Optional[int] = None  # lm_eval: examples in each prompt; None: each task's own default
    prompts: tuple[str, ...] = ()  # generate: the prompts to continue
    max_new_tokens: int = 32  # generate: tokens sampled per prompt
    temperature: float = 0.0  # generate: 0 is greedy, > 0 samples
    seed: int = 0  # generate: sampling seed (the same samples every time for the same weights)
    # Free-form settings for your own evaluators (left out of the spec's hash: dicts have none).
    options: dict[str, Any] = field(default_factory=dict, hash=False)


EVALUATOR_SETTINGS = tuple(f.name for f in dataclasses.fields(EvaluatorSpec))


def evaluator_spec(entry: Any, key: str) -> EvaluatorSpec:
    """An eval.evaluators entry (a name, a mapping, or an EvaluatorSpec) as a typed EvaluatorSpec."""
    if isinstance(entry, EvaluatorSpec):
        return entry
    if isinstance(entry, str):
        return EvaluatorSpec(name=entry)
    if isinstance(entry, DictConfig):
        entry = OmegaConf.to_container(entry)
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ConfigError(key, entry, "an evaluator entry is a name or a mapping with a `name`.",
                          "write e.g. `heldout` or `{name: generate, prompts: ['def ']}`.")
    for name in entry:
        if name not in EVALUATOR_SETTINGS:
            raise ConfigError(f"{key}.{name}", entry[name], "it is not an evaluator setting.",
                              f"use one of: {', '.join(EVALUATOR_SETTINGS)} (put settings of your own "
                              "evaluator under `options`).")
    try:
        node = _thaw(OmegaConf.structured(EvaluatorSpec))
        return OmegaConf.to_object(OmegaConf.merge(node, entry))  # type: ignore[return-value]
    except OmegaConfBaseException as err:  # a value of the wrong type
        setting = str(getattr(err, "full_key", "") or "").split(".")[0].split("[")[0]
        problem = first_line(err).rstrip(".")
        raise ConfigError(f"{key}.{setting}" if setting in entry else key, entry.get(setting, entry),
                          f"{problem}.", "give the setting a value of its type (see EvaluatorSpec in "
                          "runner/spec.py).") from None


@dataclass(frozen=True)
class GuardSpec(_Frozen):
    """guard: what a step with a non-finite loss, or a loss spike, does (docs/spikes.md)."""

    nonfinite: str = "stop"  # a NaN/Inf loss or grad norm: stop (save last good state) | skip | off
    max_consecutive_skips: int = 10  # more skipped steps in a row than this stops the run
    # a loss or grad norm above the band of its rolling window: off | skip (that update) | stop | rewind
    spike: str = "off"
    spike_window: int = 128  # healthy steps whose loss and grad norm the band's mean and deviation span
    spike_sigma: float = 6.0  # the band's top: the window's mean plus this many standard deviations
    spike_on: str = "loss"  # what is judged: loss | grad_norm | either (OLMo-core's and MaxText's rule)
    spike_warmup: int = 128  # healthy steps seen before spikes are judged (at least 2)
    spike_count: int = 1  # stop and rewind act when this many spikes come ...
    spike_within: int = 1  # ... within this many steps of the first (1, 1: at the first spike)
    rewind_back: int = 100  # rewind: to the newest checkpoint at least this many steps before the first spike
    rewind_skip: int = 200  # rewind: data-stream batches skipped from that checkpoint's position on
    max_rewinds: int = 3  # a spike past this many rewinds stops the run as the numerical guard stops it

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("guard", self, (
            ("nonfinite", ("stop", "skip", "off")), ("max_consecutive_skips", ">= 0"),
            ("spike", ("off", "skip", "stop", "rewind")), ("spike_window", "> 0"), ("spike_sigma", "> 0"),
            ("spike_on", ("loss", "grad_norm", "either")),
            ("spike_warmup", lambda v: v >= 2, "a standard deviation needs at least two healthy steps.",
             "use e.g. guard.spike_warmup=128."),
            ("spike_count", "> 0"),
            ("spike_within", lambda v: v >= self.spike_count,
             f"{self.spike_count} spikes (guard.spike_count) cannot come within fewer steps.",
             f"use guard.spike_within >= {self.spike_count}."),
            ("rewind_back", ">= 0"), ("rewind_skip", "> 0"), ("max_rewinds", ">= 0"),
            ("spike", lambda v: v != "rewind" or bool(spec.checkpoint.every_steps or spec.checkpoint.every_minutes),
             "a rewind goes back to a checkpoint saved during the run, and this run saves none "
             "(checkpoint.every_steps=0 and checkpoint.every_minutes=0).",
             "set checkpoint.every_steps (e.g. 100), or use guard.spike=skip or stop.")))


@dataclass(frozen=True)
class DebugSpec(_Frozen):
    """debug: help for finding a problem: one batch overfitted, a profiler trace, per-layer norms."""

    overfit_batch: bool = False  # train on the first batch over and over; the loss must approach 0
    profile_start: int = -1  # first step of a jax.profiler trace written to <run.dir>/profile
    profile_steps: int = 0  # steps the trace covers (0: no trace)
    norms_every: int = 0  # log per-layer parameter, gradient and update norms every N steps

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("debug", self, (("profile_steps", ">= 0"), ("norms_every", ">= 0")))


@dataclass(frozen=True)
class EvalSpec(_Frozen):
    """eval: what is evaluated, how often and on how many rows; mode=eval evaluates a checkpoint
    with it."""

    # steps between evaluations, besides one at step 0 of a fresh run and one at the end; 0: only those two
    every: int = 100
    batch_size: int = 32  # rows per evaluation batch, over all processes
    rows: int = 64  # validation windows per source, the same ones every time
    # Names (registered or import paths) or {name: ..., <EvaluatorSpec settings>} mappings; each
    # becomes an EvaluatorSpec. Typed Any because OmegaConf has no str-or-dataclass union.
    evaluators: tuple[Any, ...] = ("heldout",)
    checkpoint: str = ""  # mode=eval: a run dir, its checkpoints/ or one checkpoints/<step>; empty: run.dir

    def __post_init__(self) -> None:
        super().__post_init__()
        entries = self.evaluators if isinstance(self.evaluators, (tuple, list)) else (self.evaluators,)
        object.__setattr__(self, "evaluators", tuple(
            evaluator_spec(e, f"eval.evaluators[{i}]") for i, e in enumerate(entries)))

    def check(self, spec: ExecutionSpec) -> None:
        """The section's sizes, then each evaluator's own (an unset every or rows takes the section's)."""
        _check_rules("eval", self, (("every", ">= 0"), ("batch_size", "> 0"), ("rows", "> 0")))
        for i, entry in enumerate(self.evaluators):
            _check_rules(f"eval.evaluators[{i}]", entry, (
                ("every", ">= 0"), ("rows", "> 0"), ("max_new_tokens", "> 0"), ("temperature", ">= 0")))


@dataclass(frozen=True)
class LocalCheckpointSpec(_Frozen):
    """checkpoint.local: the fast tier, each process's own directory on its host (node-local disk,
    /dev/shm), saved more often than the durable tier in run.dir (runner.checkpoint.local_tier)."""

    dir: str = ""  # a local path on every host; empty: no local tier
    every_steps: int = 0  # steps between local saves; 0: no step-based local saves
    every_minutes: float = 0.0  # minutes between local saves; 0: no time-based local saves
    keep: int = 2  # newest K local checkpoints kept per process
    # checkpoint.cadence=auto: the fraction of failures that lose a host with its local disk or RAM (its shards then
    # come from a copy on another host, else from the durable tier). 0.78: Llama 3's share of hardware interruptions
    host_loss_fraction: float = 0.78
    keep_best = 0  # (not a setting: the save policy's best-K, which only the durable tier has)

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("checkpoint.local", self, (
            ("every_steps", ">= 0"), ("every_minutes", ">= 0"), ("keep", "> 0"),
            ("host_loss_fraction", lambda v: 0 <= v <= 1, "it is a fraction of failures.",
             "set checkpoint.local.host_loss_fraction to a value from 0 to 1 (default 0.78)."),
            ("dir", lambda v: "://" not in v, "the local tier is each host's own disk, not an object store.",
             "give a local path (node-local NVMe, or /dev/shm for RAM); run.dir is the durable tier and may be gs://."),
            ("dir", lambda v: not v or self.every_steps or self.every_minutes,
             "checkpoint.local.dir is set but neither checkpoint.local.every_steps nor every_minutes is, so the "
             "local tier would never save.", "set checkpoint.local.every_steps=N (or every_minutes), or unset "
             "checkpoint.local.dir.")))


@dataclass(frozen=True)
class CheckpointSpec(_Frozen):
    """checkpoint: when the durable tier (run.dir) saves and what it keeps; `local` is the fast
    tier."""

    every_steps: int = 100  # steps between saves to run.dir; 0: no step-based saves
    every_minutes: float = 0.0  # minutes between saves to run.dir; 0: no time-based saves
    keep: int = 3  # the newest K checkpoints are kept
    keep_every: int = 0  # and every P-th step's permanently (0: none)
    async_save: bool = True  # write checkpoints in the background while training goes on
    on_damaged: str = "fallback"  # fallback to the previous complete checkpoint, or stop
    allow_data_change: bool = False  # resume a run although its data fingerprint changed
    keep_best: int = 0  # also keep the K checkpoints with the best best_metric (0: off)
    best_metric: str = ""  # a logged eval metric, e.g. eval/stdlib/loss
    best_mode: str = "min"  # min | max: which end of best_metric is best
    # how long one durable save may wait on run.dir's storage (a bucket that is down) before the
    # run stops with exit 75, its newest step kept in the local tier
    storage_timeout_minutes: float = 10.0
    # fixed: every_steps / every_minutes | auto: both tiers' intervals chosen from each save's measured blocking
    # time, the relaunch cost and the failure rate (docs/cadence.md); the fixed ones until a save is measured
    cadence: str = "fixed"
    # per host: mean hours between failures that stop the job (the job's MTBF is this over its hosts); auto and
    # tools/goodput_forecast.py. 6300: Llama 3 405B's 419 interruptions in 54 days on 2,048 hosts
    mtbf_hours: float = 6300.0
    # checkpoint.cadence=auto: the longest interval it chooses (a failure rate near zero would say never)
    auto_max_minutes: float = 60.0
    local: LocalCheckpointSpec = field(default_factory=LocalCheckpointSpec)

    def check(self, spec: ExecutionSpec) -> None:
        self.local.check(spec)
        _check_rules("checkpoint", self, (
            ("every_steps", ">= 0"), ("every_minutes", ">= 0"), ("keep", "> 0"), ("keep_every", ">= 0"),
            ("storage_timeout_minutes", "> 0"), ("on_damaged", ON_DAMAGED), ("keep_best", ">= 0"),
            ("best_mode", ("min", "max")),
            ("best_metric", lambda v: bool(v) or not self.keep_best, "checkpoint.keep_best needs a metric to rank by.",
             "name a logged eval metric, e.g. checkpoint.best_metric=eval/stdlib/loss."),
            ("cadence", ("fixed", "auto")), ("mtbf_hours", "> 0"), ("auto_max_minutes", "> 0"),
            ("cadence", lambda v: v != "auto" or self.every_steps or self.every_minutes,
             "auto measures a save before it chooses, and with checkpoint.every_steps=0 and every_minutes=0 no save "
             "would come before the launch's last.", "set checkpoint.every_steps=N (or every_minutes): the interval "
             "auto keeps until it has measured a save."),
            ("cadence", lambda v: v != "auto" or not self._local_never_saves(), "under the fixed intervals auto starts "
             f"from, every local save (checkpoint.local.every_steps={self.local.every_steps}) falls on a durable one "
             f"(checkpoint.every_steps={self.every_steps}), so the local tier's cost would never be measured.",
             "give the local tier an interval that is not a multiple of the durable one, e.g. "
             "checkpoint.local.every_steps=N with N < checkpoint.every_steps.")))
        if self.cadence == "fixed":  # auto's own settings: under the fixed cadence nothing would read them
            changed = [(key, value) for key, value, default in (
                ("checkpoint.auto_max_minutes", self.auto_max_minutes, CheckpointSpec.auto_max_minutes),
                ("checkpoint.local.host_loss_fraction", self.local.host_loss_fraction,
                 LocalCheckpointSpec.host_loss_fraction)) if value != default]
            if changed:
                key, value = changed[0]
                raise ConfigError(key, value, "it is checkpoint.cadence=auto's, and checkpoint.cadence=fixed: "
                                  "nothing would read it.", f"add checkpoint.cadence=auto, or drop {key}.")

    def _local_never_saves(self) -> bool:
        """Every local step save falls on a durable one (and nothing is saved by time)."""
        c, local = self, self.local
        return bool(local.dir and local.every_steps and c.every_steps and not local.every_minutes
                    and not c.every_minutes and local.every_steps % c.every_steps == 0)


@dataclass(frozen=True)
class LoggingSpec(_Frozen):
    """logging: where metrics go besides <run.dir>/metrics.jsonl, and the progress display."""

    wandb: str = "offline"  # wandb's mode: offline (files only, sync later) | online | disabled
    project: str = "runner"  # the wandb project
    entity: Optional[str] = None  # the wandb entity (user or team); null: wandb's default
    progress: str = "auto"  # the progress display: auto (rich on a terminal, else plain) | rich | plain | none
    tensorboard: bool = False  # also write every scalar as TensorBoard events under <run.dir>/tensorboard

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("logging", self, (("wandb", WANDB_MODES), ("progress", PROGRESS_STYLES)))


@dataclass(frozen=True)
class DistributedSpec(_Frozen):
    """distributed: how the JAX processes of a run find each other (runner.parallel.distributed)."""

    coordinator_address: Optional[str] = None  # HOST:PORT of process 0; null: JAX_COORDINATOR_ADDRESS or auto-detected
    num_processes: Optional[int] = None  # JAX processes in the run; null: JAX_NUM_PROCESSES or auto-detected
    process_id: Optional[int] = None  # this process's index, from 0; null: JAX_PROCESS_ID or auto-detected
    heartbeat_timeout_s: int = 60  # a process silent this long is dead: the others exit non-zero
    stop_check_every: int = 10  # steps between cross-process checks for a stop request (SIGTERM)

    def check(self, spec: ExecutionSpec) -> None:
        """Unset values are runner.parallel.distributed's to judge: it also reads JAX's environment."""
        _check_rules("distributed", self, (
            ("heartbeat_timeout_s", "> 0"), ("stop_check_every", "> 0"), ("num_processes", "> 0"),
            ("process_id", lambda v: self.num_processes is None or 0 <= v < self.num_processes,
             f"it must be in [0, distributed.num_processes={self.num_processes}).",
             "number the processes 0, 1, ..., N-1.")))


@dataclass(frozen=True)
class RunSpec(_Frozen):
    """run: the run's directory, what it starts from, its sweep, compilation cache and watchdog."""

    root: str = "runs"  # derived run directories are <root>/<job>/<overrides>; sweeps go under <root>/sweeps
    # the run's directory (checkpoints, metrics), local or gs://; empty: derived from the job and the overrides
    dir: str = ""
    init_from: str = ""  # warm start a new run from another run's (or a step's) checkpoint
    init_mode: str = "params"  # params: fresh optimizer at step 0 | full: the whole state
    sweep: str = ""  # the sweep's name (empty: derived from its command line); members only
    compile_cache: str = "default"  # persistent compilation cache: default | none | a directory
    # What a sweep member returns to the sweeper (Optuna minimizes or maximizes it, as
    # hydra.sweeper.direction says): a logged metric's last value; "": the first held-out loss.
    objective: str = ""
    # The watchdog (runner.train.watchdog): a process without progress (a step, a save, an evaluation)
    # this long writes its stacks to <run.dir>/hangs/ and every process exits 75. A duration (90s,
    # 10m, 1h, seconds); auto: from the compile time and the median step; 0: off.
    hang_timeout: str = "auto"

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("run", self, (
            ("init_mode", ("params", "full")),
            ("hang_timeout", lambda v: v == "auto" or duration_seconds(v) is not None,
             "it is neither auto nor a duration.",
             "write a duration such as 600, 90s, 10m or 1h; auto to derive it from the compile and step "
             "times; or 0 to turn the watchdog off.")))


@dataclass(frozen=True)
class PlanSpec(_Frozen):
    """plan: mode=plan's budget (runner.main.plan, docs/planning.md); set only with mode=plan."""

    compiles: int = 12  # at most this many layouts are compiled, the most promising first
    minutes: float = 10.0  # no compile starts after this many minutes (those running finish)
    workers: int = 0  # compiles at once, each its own process; 0: the machine's cores (at most 8)
    cache: bool = True  # reuse a compile's report for the same command, runner and compilers (runner's cache)
    rows: int = 10  # rows the table shows

    def check(self, spec: ExecutionSpec) -> None:
        _check_rules("plan", self, (("compiles", "> 0"), ("minutes", "> 0"), ("workers", ">= 0"), ("rows", "> 0")))
        if spec.mode != "plan" and self != PlanSpec():
            changed = next(k for k in ("compiles", "minutes", "workers", "cache", "rows")
                           if getattr(self, k) != getattr(PlanSpec(), k))
            raise ConfigError(f"plan.{changed}", getattr(self, changed), "the plan section sets mode=plan's "
                              f"budget, and mode={spec.mode}: nothing would read it.",
                              f"add mode=plan, or drop plan.{changed}.")


@dataclass(frozen=True)
class ExecutionSpec(_Frozen):
    """The whole run, as one immutable value; saved with every checkpoint."""

    job: JobSpec = field(default_factory=JobSpec)
    # the hardware: auto (what JAX sees) | cpu-N | gpu-N, h100-N, h200-N, a100-N | a Cloud TPU slice such
    # as v4-32 or 2xv5p-256 (runner.parallel.topology)
    topology: str = "auto"
    mode: str = "train"  # what the command does: train | eval | compile (MODES)
    seed: int = 0  # seeds the parameters' initialisation, dropout and the order of the data
    mesh: MeshSpec = field(default_factory=MeshSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    data: DataSpec = field(default_factory=DataSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    distributed: DistributedSpec = field(default_factory=DistributedSpec)
    run: RunSpec = field(default_factory=RunSpec)
    guard: GuardSpec = field(default_factory=GuardSpec)
    debug: DebugSpec = field(default_factory=DebugSpec)
    plan: PlanSpec = field(default_factory=PlanSpec)
    callbacks: tuple[str, ...] = ()  # import paths of callback classes (see runner.train.callbacks)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def schema_node() -> DictConfig:
    """The spec as a Hydra schema. OmegaConf marks frozen dataclasses read-only; Hydra must
    merge overrides into it, so the flags are cleared while the types stay enforced."""

    return _thaw(OmegaConf.structured(ExecutionSpec))


def _thaw(node: Any) -> Any:
    """Clear OmegaConf's read-only flags (set for frozen dataclasses) on a node and its children."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig):
        for key in node.keys():
            _thaw(node._get_node(key))
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            _thaw(node._get_node(i))
    return node


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="execution_spec", node=schema_node())


# ----------------------------------------------------------------------------- run directory


def _identifies_run(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    if key in NON_IDENTIFYING_EXACT:
        return False
    return not any(key == k or key.startswith((k + ".", k + "/")) for k in NON_IDENTIFYING_PREFIXES)


def derive_run_dir(root: str, job_name: str, overrides: list[str] | tuple[str, ...]) -> str:
    """A deterministic directory for a job and its overrides (no timestamps), so the same
    command finds the same run again. Settings that may change on resume are left out."""

    root = root.rstrip("/") or root
    kept = sorted(o for o in overrides if _identifies_run(o))
    if not kept:
        return f"{root}/{job_name}/default"
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(kept))
    if len(name) > 120:
        digest = hashlib.sha256(",".join(kept).encode()).hexdigest()[:12]
        name = f"{name[:100]}-{digest}"
    return f"{root}/{job_name}/{name}"


# ----------------------------------------------------------------------------- validation


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(s|m|min|h)?\s*$")
_UNIT_S = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def duration_seconds(text: str) -> Optional[float]:
    """`90`, `90s`, `10m`, `1.5h` in seconds; None for anything else (`auto` included)."""
    match = _DURATION.match(str(text))
    return float(match.group(1)) * _UNIT_S[match.group(2)] if match else None


def _positive(key: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(key, value, f"it must be {bound}.", f"set `{key}` to a value {bound}.")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, "it is not a known choice.", f"use one of: {', '.join(allowed)}.")


def _check_windows(key: str, windows: Any) -> None:
    """train.skip_batches: a list of [start, end) pairs of batch numbers, start < end."""
    for window in windows or ():
        if not (isinstance(window, (list, tuple)) and len(window) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in window)):
            raise ConfigError(key, windows, f"each window must be a pair [start, end] of batch numbers; {window!r} "
                              "is not.", "write e.g. train.skip_batches=[[1200,1450]].")
        start, end = window
        if start < 0 or end <= start:
            raise ConfigError(key, windows, f"the window [{start}, {end}] is empty or negative: a window is "
                              "[start, end) with 0 <= start < end.", "write e.g. [[1200,1450]].")


def _check_rules(prefix: str, section: Any, rules: tuple[tuple[Any, ...], ...]) -> None:
    """Check a section's fields against its rules, in order, so the first bad value is reported.
    A rule is (field, "> 0" | ">= 0" | the allowed choices) or (field, predicate, problem, fix);
    a None value is unset and has nothing to check."""
    for name, test, *words in rules:
        key, value = f"{prefix}.{name}", getattr(section, name)
        if value is None:
            continue
        if isinstance(test, tuple):
            _one_of(key, value, test)
        elif callable(test):
            if not test(value):
                raise ConfigError(key, value, *words)
        else:
            _positive(key, value, allow_zero=test == ">= 0")


# The sections with rules, in the order they are checked: the first bad value found is the one reported.
CHECKED_SECTIONS = ("job", "train", "guard", "debug", "mesh", "pipeline", "data", "optimizer", "schedule", "eval",
                    "checkpoint", "run", "logging", "distributed", "plan")


def validate(spec: ExecutionSpec) -> None:
    """Reject every bad value the spec alone can judge (ranges, choices, one key against
    another): each section checks itself. The components check their own sections
    (runner.main.config). Raises ConfigError."""

    _one_of("mode", spec.mode, MODES)
    for name in CHECKED_SECTIONS:
        getattr(spec, name).check(spec)


def scaled_model(model: ModelSpec) -> ModelSpec:
    """Apply `scale` (if set): width, MLP width and head count grow together."""
    if model.scale <= 0:
        return model
    d_model = model.scale * model.head_dim
    return dataclasses.replace(model, n_heads=model.scale, d_model=d_model, d_ff=4 * d_model)


# Settings that existed once, with what replaced them: refused with this fix (docs/spikes.md, "Migrating").
RETIRED = {
    "guard.spike_factor": ("runner no longer has this setting: a loss above a multiple of its moving average was "
                           "replaced by a band of the rolling window's mean and deviation of the loss and the "
                           "gradient norm.",
                           "use guard.spike=skip (the same policy) with guard.spike_sigma (default 6) for the band, "
                           "guard.spike_window and guard.spike_warmup as before; see docs/spikes.md."),
}


def retired(key: str) -> Optional[tuple[str, str]]:
    """(problem, fix) for a setting runner no longer has, if `key` is one."""
    return RETIRED.get(key.lstrip("+~"))


def unknown_keys(cfg: Any, schema: type | None = None, prefix: str = "") -> list[tuple[str, Any]]:
    """Keys of a composed config that no spec dataclass has (added with `+key=...`): OmegaConf
    lets them through and only the frozen dataclass refuses them, with a traceback."""
    schema = schema or ExecutionSpec
    fields = {f.name: f for f in dataclasses.fields(schema)}
    found: list[tuple[str, Any]] = []
    for key in cfg.keys():
        if key == "hydra" and not prefix:
            continue
        if key not in fields:
            found.append((f"{prefix}{key}", OmegaConf.select(cfg, str(key), throw_on_missing=False)))
            continue
        kind = fields[key].type
        kind = globals().get(kind, kind) if isinstance(kind, str) else kind
        node = cfg._get_node(key)
        if dataclasses.is_dataclass(kind) and isinstance(node, DictConfig) and not node._is_none():
            found += unknown_keys(node, kind, f"{prefix}{key}.")
    return found


def resolve_spec(cfg: DictConfig | dict, overrides: list[str] | tuple[str, ...] = (),
                 sweep_root: str | None = None) -> ExecutionSpec:
    """Composed config -> frozen ExecutionSpec with its run directory filled in and its values
    checked (`validate`); runner.main.config.build_spec adds the components' checks.

    A sweep member's directory lies under its sweep's root, named by the member's overrides."""

    if isinstance(cfg, dict):
        cfg = OmegaConf.merge(schema_node(), cfg)
    for key, value in unknown_keys(cfg)[:1]:
        if retired(key):
            raise ConfigError(key, value, *retired(key))
        raise ConfigError(key, value, "runner has no setting of that name.",
                          "remove it, or check its spelling and section: `python -m runner --cfg job` prints every "
                          "key with its value.")
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    spec: ExecutionSpec = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=scaled_model(spec.job.model)))
    if sweep_root is not None:
        name = sweep_root.rstrip("/").rsplit("/", 1)[-1]
        run_dir = spec.run.dir or derive_run_dir(sweep_root, spec.job.name, list(overrides))
        spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, dir=run_dir, sweep=name))
    elif not spec.run.dir:
        run_dir = derive_run_dir(spec.run.root, spec.job.name, list(overrides))
        spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, dir=run_dir))
    validate(spec)
    return spec


def spec_from_dict(data: dict[str, Any]) -> ExecutionSpec:
    """Rebuild a spec saved with a checkpoint (no validation: it was valid when saved)."""
    return OmegaConf.to_object(OmegaConf.merge(schema_node(), data))  # type: ignore[return-value]
