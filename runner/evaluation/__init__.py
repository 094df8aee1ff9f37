"""Evaluators: the protocol, the registry and the built-in ones (heldout, multiple_choice, generate)."""

from runner.evaluation import generate, heldout, multiple_choice  # noqa: F401  (registers the built-ins)
from runner.evaluation.base import EVALUATORS, Evaluator, EvaluatorBase, build_evaluators, evaluator_class

__all__ = ["EVALUATORS", "Evaluator", "EvaluatorBase", "build_evaluators", "evaluator_class"]
