"""`lm_eval --model runner --model_args checkpoint=RUN`: lm-eval's command line on a runner run.

lm-eval finds the name "runner" through the startup hook runner installs (`_runner_lm_eval.py`,
loaded by `runner-lm-eval.pth`) and builds `CheckpointLM(checkpoint=RUN, ...)`. This restores the
newest complete checkpoint under RUN (a run directory, its checkpoints/ or one
checkpoints/<step>), parameters only, with the model, data (its tokenizer) and seq_len of the
checkpoint's saved spec, exactly as `mode=eval` does; `overrides="topology=cpu-4
eval.batch_size=64"` passes runner settings. Mistakes are runner's paragraph and exit code 2.
(A module of its own: it composes the config through runner.main.cli, which imports the evaluators.)
"""

from __future__ import annotations

import os
from typing import Any

import jax

from runner.errors import UserError
from runner.evaluation.lm_adapter import RunnerLM, exit_with

LM_EVAL_ARGS = ("max_batch_size", "device")  # what lm-eval passes besides --model_args; unused here


class CheckpointLM(RunnerLM):
    """A runner checkpoint, restored, as lm-eval's model."""

    exit_on_mistakes = True

    def __init__(self, checkpoint: str = "", overrides: str = "", batch_size: Any = None, **unused: Any) -> None:
        unknown = sorted(set(unused) - set(LM_EVAL_ARGS))
        try:
            if unknown:
                raise UserError(f"lm-eval passed --model_args {', '.join(unknown)}, which the runner model does not "
                                "take. Fix: use checkpoint=RUN_DIR and, for runner settings, "
                                "overrides='key=value key=value'.")
            if not checkpoint:
                raise UserError("The runner model needs a checkpoint to score. Fix: pass --model_args "
                                "checkpoint=RUN_DIR (a run directory, its checkpoints/, or one checkpoints/<step>).")
            job, state, step_dir = restore(str(checkpoint), str(overrides or "").split())
        except UserError as err:
            exit_with(err)
        self._stack = job.program.context()  # mesh and logical-axis rules, for as long as the model is used
        self._stack.__enter__()
        super().__init__(job.eval_context(), state, batch_size, checkpoint=str(step_dir))

    def close(self) -> None:
        """Leave the job's mesh context (for a caller that goes on using JAX in this process)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(None, None, None)


def restore(checkpoint: str, overrides: list[str]) -> tuple[Any, Any, Any]:
    """(job, state, step directory) for `checkpoint`, as `python -m runner mode=eval` builds them."""
    from runner.main.cli import precheck, prepare, skip_absent_tpu
    from runner.main.config import build_spec
    from runner.main.evaluate import restore_for_eval, spec_for_checkpoint
    from runner.parallel import compile_cache

    skip_absent_tpu([])  # as `python -m runner` does: no TPU probe where there is none
    if "JAX_PLATFORMS" in os.environ:  # jax is imported already; its backends are not started yet
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    prepare()
    overrides = ["mode=eval", f"eval.checkpoint={checkpoint}", "eval.evaluators=[]", *overrides]
    spec = spec_for_checkpoint(build_spec(precheck(overrides), overrides))
    compile_cache.enable(spec.run.compile_cache)
    return restore_for_eval(spec)
