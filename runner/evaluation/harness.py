"""lm-evaluation-harness tasks as a runner evaluator, in the training loop and in mode=eval.

Settings (an `eval.evaluators` entry): `tasks` (lm-eval task or group names), `include_path`
(a directory of your own task YAMLs, searched first), `num_fewshot` (None: each task's own),
`rows` (lm-eval's `limit`: the first N documents of each task; None: eval.rows). Example:

    eval.evaluators=[heldout,{name:lm_eval,tasks:[my_mc],include_path:tasks/,every:500}]

The state being evaluated is wrapped as an lm-eval model (runner.evaluation.lm_adapter.RunnerLM)
and handed to `lm_eval.simple_evaluate`. Nothing is downloaded: the evaluator runs Hugging Face
`datasets` offline (HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 unless you set them), and
`prepare` loads every task's documents before training, so a task whose data is not local stops
the job with the fix instead of failing mid-run. Each numeric result becomes
`<label>/<task>/<metric>` (`_<filter>` appended for filters other than lm-eval's `none`), the
label defaulting to `lm_eval`; standard errors are left out. lm-eval itself is the optional
dependency `pip install 'runner[lm_eval]'`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from runner.errors import ConfigError, UserError, first_line
from runner.evaluation.base import EVALUATORS, EvaluatorBase
from runner.spec import EvaluatorSpec, ExecutionSpec


def _lm_eval_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("lm_eval") is not None


@EVALUATORS.register("lm_eval")
class LmEval(EvaluatorBase):
    """lm-evaluation-harness tasks (`tasks`, local data only), scored in the loop and in mode=eval."""

    name = "lm_eval"
    metrics = ("*",)  # <task>/<metric>, per task
    default_label = "lm_eval"

    def __init__(self, spec: ExecutionSpec, settings: Optional[EvaluatorSpec] = None) -> None:
        super().__init__(spec, settings)
        self._tasks: Any = None  # lm-eval's TaskManager, indexed once
        self._said: set[str] = set()  # lines lm-eval printed at an earlier evaluation

    @classmethod
    def check(cls, spec: ExecutionSpec, settings: EvaluatorSpec, key: str) -> None:
        if not settings.tasks:
            raise ConfigError(f"{key}.tasks", [], "lm_eval needs at least one lm-evaluation-harness task.",
                              "set it, e.g. eval.evaluators=[{name:lm_eval,tasks:[my_task],include_path:tasks/}].")
        if settings.include_path and not Path(settings.include_path).expanduser().is_dir():
            raise ConfigError(f"{key}.include_path", settings.include_path, "it is not a directory.",
                              "point it at the directory that holds your task YAMLs (relative paths are from the "
                              "directory you run in).")
        if not _lm_eval_installed():
            raise ConfigError(f"{key}.name", settings.name, "lm-evaluation-harness is not installed.",
                              "install it with `pip install 'runner[lm_eval]'` (lm_eval 0.4.13).")

    def prepare(self, ctx: Any) -> None:
        """Index the tasks once and check every name, so a typo stops the job before training.
        lm-eval's own ~15,000 task YAMLs are indexed only if include_path lacks a name."""
        if self._tasks is not None:
            return
        for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # read when `datasets` is imported
            os.environ.setdefault(variable, "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        for name in ("lm_eval", "lm-eval"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from lm_eval.tasks import TaskManager, get_task_dict

        key, wanted = self.config_key, list(self.settings.tasks)
        include = str(Path(self.settings.include_path).expanduser()) if self.settings.include_path else None
        tasks = TaskManager(include_path=include, include_defaults=False) if include else None
        if tasks is None or any(t not in tasks.all_tasks for t in wanted):
            tasks = TaskManager(include_path=include)
        unknown = [t for t in wanted if t not in tasks.all_tasks]
        if unknown:
            where = f"in {include} or " if include else ""
            raise UserError(
                f"{key}.tasks names {', '.join(repr(t) for t in unknown)}, which is no lm-evaluation-harness task "
                f"{where}among lm-eval's own. Fix: check the spelling (`lm_eval ls tasks"
                f"{' --include_path ' + include if include else ''}` lists them), or point {key}.include_path at the "
                "directory of your task YAMLs."
            )
        try:
            with filtered_stderr(self._said):
                get_task_dict(wanted, tasks)  # reads each task's documents (datasets caches them)
        except Exception as err:
            raise UserError(
                f"lm-evaluation-harness could not load the tasks {key}.tasks={wanted}: {first_line(err, 300)}. Fix: "
                "make each task's data local (a task YAML in include_path with `dataset_path: json` and `data_files`), "
                "or, to let `datasets` download it, set HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0."
            ) from None
        self._tasks = tasks

    def evaluate(self, ctx: Any, state: Any) -> Mapping[str, float]:
        self.prepare(ctx)
        import lm_eval

        from runner.evaluation.lm_adapter import RunnerLM

        with filtered_stderr(self._said):
            out = lm_eval.simple_evaluate(
                model=RunnerLM(ctx, state, self.spec.eval.batch_size), tasks=list(self.settings.tasks),
                num_fewshot=self.settings.num_fewshot, limit=self.rows, task_manager=self._tasks, bootstrap_iters=0,
                random_seed=self.spec.seed, numpy_random_seed=self.spec.seed, torch_random_seed=self.spec.seed,
                fewshot_random_seed=self.spec.seed, log_samples=False)
        return flat_metrics(out["results"], self.key)


# progress bars (tqdm's, and datasets' "Generating test split: N examples [..., N examples/s]"); lm-eval
# asking git for its commit; lm-eval's notes that it filled in its documented defaults for a task YAML
# that leaves a metric's aggregation (mean) or direction (higher is better) out
NOISE = ("it/s]", "s/it]", "examples/s]", "fatal: not a git repository", "but aggregation is not. using default",
         "but higher_is_better is not. using default")


@contextlib.contextmanager
def filtered_stderr(said: set[str]) -> Iterator[None]:
    """Run a block with stderr (the file descriptor: lm-eval, datasets, tqdm and git all write
    there) collected, then pass on what it printed without progress bars, git's complaint outside
    a repository, and lines already passed on at an earlier evaluation (`said`): a run that
    evaluates every 500 steps shows lm-eval's warnings once, not at every evaluation."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as collected:
        os.dup2(collected.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            collected.seek(0)
            lines = collected.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = [line for line in lines
                    if line.strip() and not any(n in line for n in NOISE) and line not in said]
            said.update(kept)
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def flat_metrics(results: Mapping[str, Mapping[str, Any]], key: Any) -> dict[str, float]:
    """lm-eval's {task: {"acc,none": 0.5, "acc_stderr,none": ...}} as {<label>/<task>/acc: 0.5}."""
    flat = {}
    for task, values in results.items():
        for name, value in values.items():
            metric, _, filtered = name.partition(",")
            if "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)) or not filtered:
                continue
            suffix = "" if filtered == "none" else f"_{filtered}"
            flat[key(f"{task}/{metric}{suffix}")] = float(value)
    return flat
