"""The Evaluator protocol, the registry, and what every evaluator needs (rows split by process).

An evaluator is anything with a ``name`` and ``evaluate(context, state) -> {metric: float}``,
where ``context`` is an `EvalContext`: the few parts of a run an evaluator may use (spec, mesh,
data strategy, model, the compiled validation step, how to put rows on the devices), never
the trainer. The trainer prefixes the names with ``eval/`` and logs them. Optional parts, used
when present:

* ``every: int | None``: its cadence in steps (None: ``eval.every``; 0: only at start and end);
* ``prepare(context)``: called once before the first evaluation, so bad data or prompts stop
  the job before training rather than mid-run;
* ``texts() -> {name: str}``: text made by the latest ``evaluate`` (samples, say). Metrics are
  floats; this is the side channel for text, logged as string fields of metrics.jsonl and as a
  wandb table;
* a classmethod ``check(spec, settings, key)``: checks of its settings at config time (exit 2
  before any device work).

A user's own evaluator is selected from config by import path (``my_pkg.evals:MyEvaluator``)
with no change to runner. Every evaluator is constructed as ``cls(spec, settings)``, where
``settings`` is its ``runner.spec.EvaluatorSpec`` entry of ``eval.evaluators``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Generic,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    TypeVar,
    runtime_checkable,
)

import jax
import numpy as np

from runner.errors import ConfigError, UserError
from runner.registry import Registry
from runner.spec import EvaluatorSpec

if TYPE_CHECKING:
    from runner.spec import ExecutionSpec

M = TypeVar("M", covariant=True)


@dataclass(frozen=True)
class EvalContext:
    """What an evaluator may use of a run."""

    spec: "ExecutionSpec"
    mesh: jax.sharding.Mesh
    strategy: Any  # the run's DatasetStrategy: validation splits, tokenizer, vocabulary
    val_step: Callable[[Any, Any], Any]  # compiled: (state, (S, B, T) batch) -> (loss_sum, count, meta)
    to_device: Callable[[Mapping[str, np.ndarray]], Any]  # this process's (S, B, T) rows -> global arrays
    model: Any = None  # the flax module (apply with {"params": state.params})
    model_config: Any = None


@runtime_checkable
class Evaluator(Protocol, Generic[M]):
    """A name and an evaluate call returning a flat mapping of metric names to floats."""

    name: str

    def evaluate(self, context: Any, state: Any) -> Mapping[str, float]: ...


def prepare_all(evaluators: Sequence[Any], context: EvalContext) -> None:
    """Let each evaluator load and check its data now, so a bad file or prompt stops the job
    before training (or before the first evaluation of a resumed run)."""
    for ev in evaluators:
        prepare = getattr(ev, "prepare", None)
        if callable(prepare):
            prepare(context)


def run_all(evaluators: Sequence[Any], context: EvalContext, state: Any) -> tuple[dict[str, float], dict[str, str]]:
    """Every evaluator on `state`: (metrics as `eval/<name>`, texts as `eval/<name>`)."""
    results: dict[str, float] = {}
    texts: dict[str, str] = {}
    for ev in evaluators:
        results.update({f"eval/{k}": float(v) for k, v in ev.evaluate(context, state).items()})
        made = getattr(ev, "texts", None)
        if callable(made):
            texts.update({f"eval/{k}": str(v) for k, v in made().items()})
    return results, texts


EVALUATORS: Registry[type] = Registry("evaluator", "eval.evaluators")


def evaluator_class(name: str, key: str = "eval.evaluators") -> type:
    """The evaluator class registered as `name` or at import path `name`; a mistake lists the
    built-in names whatever went wrong."""
    try:
        cls = EVALUATORS.get(name)
    except ConfigError as err:
        problem = str(err).split("`: ", 1)[-1].split(" Fix:")[0]
        raise ConfigError(key, name, problem, f"use one of the built-in evaluators ({', '.join(EVALUATORS.names())}) "
                          "or the import path of your own, `my_pkg.module:MyEvaluator`, whose module is importable "
                          "(on PYTHONPATH).") from None
    if not callable(cls) or not hasattr(cls, "evaluate"):
        raise ConfigError(key, name, "it is not an evaluator class (it has no `evaluate` method).",
                          f"name a class with `name` and `evaluate(context, state)`, or one of: "
                          f"{', '.join(EVALUATORS.names())}.")
    return cls


def build_evaluators(spec: "ExecutionSpec") -> Sequence[Evaluator[Any]]:
    """The evaluators the spec lists, each constructed with (spec, its settings)."""
    return [evaluator_class(s.name, f"eval.evaluators[{i}]")(spec, s) for i, s in enumerate(spec.eval.evaluators)]


class EvaluatorBase:
    """Convenience base for evaluators: keeps the spec and settings, resolves the cadence and
    the number of rows against the eval.* defaults, and has no-op optional hooks."""

    name = ""
    default_label = ""

    def __init__(self, spec: "ExecutionSpec", settings: Optional[EvaluatorSpec] = None) -> None:
        self.spec = spec
        self.settings = settings or EvaluatorSpec(name=self.name)
        self.every: int = spec.eval.every if self.settings.every is None else self.settings.every
        self.rows: int = spec.eval.rows if self.settings.rows is None else self.settings.rows
        self.label: str = self.label_for(self.settings)
        self._texts: dict[str, str] = {}

    @property
    def config_key(self) -> str:
        """Where this evaluator's settings are in the config, for error messages."""
        entries = self.spec.eval.evaluators
        return f"eval.evaluators[{entries.index(self.settings)}]" if self.settings in entries else "eval.evaluators"

    def key(self, metric: str) -> str:
        """A metric name under this evaluator's label."""
        return f"{self.label}/{metric}" if self.label else metric

    # The metric names it logs below its label, as fnmatch patterns ("*/loss"): what run.objective
    # is checked against before training. None: unknown (a user's evaluator may log anything).
    metrics: Optional[tuple[str, ...]] = None

    @classmethod
    def label_for(cls, settings: EvaluatorSpec) -> str:
        """The label its metrics are logged under: the one set, else the evaluator's own."""
        return settings.label or cls.default_label

    @classmethod
    def metric_patterns(cls, settings: EvaluatorSpec, spec: "ExecutionSpec") -> tuple[str, ...] | None:
        """`eval/<label>/<metric>` patterns these settings log (None: unknown)."""
        if cls.metrics is None:
            return None
        label = cls.label_for(settings)
        return tuple(f"eval/{label}/{m}" if label else f"eval/{m}" for m in cls.metrics)

    def prepare(self, context: Any) -> None:
        """Load and check data once, before the first evaluation."""

    def texts(self) -> Mapping[str, str]:
        return dict(self._texts)


# ----------------------------------------------------------------------------- shared helpers


def text_tokenizer(ctx: Any, key: str) -> Any:
    """The tokenizer of the training data, for evaluators that turn text into tokens: the
    strategy's own `load_tokenizer()` if it has one, else its first store's, else the
    registered tokenizer of that name."""
    from runner.data.tokenizer import TOKENIZERS

    strategy = ctx.strategy
    name = getattr(strategy, "tokenizer", None)
    if name and callable(getattr(strategy, "load_tokenizer", None)):
        return strategy.load_tokenizer()
    sources = getattr(strategy, "sources", None) or ()
    store = getattr(sources[0], "store", None) if sources else None
    if name and callable(getattr(store, "load_tokenizer", None)):
        return store.load_tokenizer()
    if not name:
        raise UserError(
            f"The evaluator {key} works on text, but data.strategy={ctx.spec.data.strategy} has no "
            "tokenizer (its tokens are not text). Fix: train on text data (a token store, or `default`), "
            "or remove that evaluator from eval.evaluators."
        )
    return TOKENIZERS.get(name)()


def batch_ways(ctx: Any) -> int:
    """How many ways the mesh splits a batch (data x fsdp)."""
    shape = ctx.mesh.shape
    return int(shape.get("data", 1) * shape.get("fsdp", 1))


def global_batch(count: int, ctx: Any, batch_size: int | None = None) -> int:
    """Rows per evaluation batch: `batch_size` (eval.batch_size), or for a small job the fewest
    rows that hold `count` and split evenly over the mesh and the processes."""
    if batch_size is not None:
        return batch_size
    unit = math.lcm(batch_ways(ctx), jax.process_count())
    return max(unit, -(-count // unit) * unit)


def process_batches(rows: Sequence[Mapping[str, np.ndarray]], batch: int) -> list[dict[str, np.ndarray]]:
    """Split rows into global batches of `batch` (the last padded with blank rows, whose `id`
    is -1 and `mask` 0) and keep this process's share of each: the same rows on any topology."""
    if not rows:
        return []
    procs, me = jax.process_count(), jax.process_index()
    per_proc = batch // procs
    blank = {k: (np.full_like(v, -1) if k == "id" else np.zeros_like(v)) for k, v in rows[0].items()}
    padded = list(rows) + [blank] * (-len(rows) % batch)
    out = []
    for start in range(0, len(padded), batch):
        mine = padded[start + me * per_proc: start + (me + 1) * per_proc]
        out.append({k: np.stack([r[k] for r in mine]) for k in rows[0]})
    return out


def to_global(ctx: Any, local: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows -> global arrays with the batch (leading) axis split over the mesh."""
    from runner.parallel.mesh import batch_sharding

    sharding = batch_sharding(ctx.mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()}


def replicated(ctx: Any) -> jax.sharding.NamedSharding:
    """Outputs every process can read whole."""
    return jax.sharding.NamedSharding(ctx.mesh, jax.sharding.PartitionSpec())


# What training logs at every logged step (runner.observability.metrics), and the prefixes of what it may log
# besides: a run.objective that is not an evaluator's is one of these.
TRAIN_METRICS = ("loss", "lr", "grad_norm", "tokens", "tokens_seen", "tokens_per_s", "tokens_per_s_per_device",
                 "tflops_per_device", "mfu", "step_time_s", "data_wait_s", "nonfinite", "skipped", "spike")
TRAIN_PREFIXES = ("goodput/", "param_norm/", "update_norm/")


def check_spec(spec: "ExecutionSpec") -> None:
    """The eval section: every evaluator exists, and passes its own `check` of its settings; and
    run.objective names a metric something logs."""
    classes = []
    for i, ev in enumerate(spec.eval.evaluators):
        key = f"eval.evaluators[{i}]"
        cls = evaluator_class(ev.name, f"{key}.name")
        classes.append(cls)
        check = getattr(cls, "check", None)
        if callable(check):  # an evaluator's own checks of its settings (files, prompts, ...)
            check(spec, ev, key)
    check_objective(spec, classes)


def check_objective(spec: "ExecutionSpec", classes: Sequence[type]) -> None:
    """run.objective must be a metric the run logs: a training metric, or one a configured evaluator
    logs (when the evaluators say what they log). A sweep whose every member would return NaN is
    refused before any trains, naming the evaluators that would log it."""
    import fnmatch

    name = spec.run.objective
    if not name:
        return
    if not name.startswith("eval/"):
        if name in TRAIN_METRICS or name.startswith(TRAIN_PREFIXES):
            return
        raise ConfigError("run.objective", name, "training logs no metric of that name, and evaluators' metrics "
                          "start with eval/.", f"use one of: {', '.join(TRAIN_METRICS)}, or an evaluator's "
                          "eval/<label>/<metric> (e.g. eval/stdlib/loss).")
    patterns = [cls.metric_patterns(ev, spec) if hasattr(cls, "metric_patterns") else None
                for cls, ev in zip(classes, spec.eval.evaluators)]
    if any(p is None for p in patterns) or any(fnmatch.fnmatchcase(name, p) for ps in patterns for p in ps):
        return
    logged = sorted({p for ps in patterns for p in ps})
    metric = name.rsplit("/", 1)[-1]
    would = sorted(n for n in EVALUATORS.names() if metric in (getattr(EVALUATORS.get(n), "metrics", None) or ())
                   or any(m.endswith("*") for m in getattr(EVALUATORS.get(n), "metrics", None) or ()))
    raise ConfigError("run.objective", name, f"no configured evaluator logs it (eval.evaluators log "
                      f"{', '.join(logged) or 'nothing'}), so every sweep member would return NaN.",
                      f"choose a metric they log, or add an evaluator that logs {metric!r} with the label in the "
                      f"name ({', '.join(would) or 'none registered'}; e.g. eval.evaluators=[heldout,"
                      "{name:multiple_choice,label:mc,path:QUESTIONS.jsonl}] for eval/mc/acc).")
