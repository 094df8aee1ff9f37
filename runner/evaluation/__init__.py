"""Evaluators: the protocol, the registry and the built-in ones."""

from runner.evaluation import heldout  # noqa: F401  (registers the built-ins)
from runner.evaluation.base import EVALUATORS, Evaluator, build_evaluators

__all__ = ["EVALUATORS", "Evaluator", "build_evaluators"]
