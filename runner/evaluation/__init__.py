"""Evaluators: the protocol, the registry and the built-in ones (heldout, multiple_choice, generate,
lm_eval)."""

from runner.evaluation import generate, harness, heldout, multiple_choice  # noqa: F401  (registers the built-ins)
from runner.evaluation.base import (
                                    EVALUATORS,
                                    EvalContext,
                                    Evaluator,
                                    EvaluatorBase,
                                    build_evaluators,
                                    check_spec,
                                    evaluator_class,
)

__all__ = ["EVALUATORS", "EvalContext", "Evaluator", "EvaluatorBase", "build_evaluators", "check_spec",
           "evaluator_class"]
