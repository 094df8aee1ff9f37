"""The Evaluator protocol and registry: anything that turns a train state into metrics.

A user's own evaluator is selected from config by import path (``my_pkg.evals:MyEvaluator``)
with no change to runner; it is constructed with the ExecutionSpec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

from runner.registry import Registry

if TYPE_CHECKING:
    from runner.spec import ExecutionSpec

M = TypeVar("M", covariant=True)


@runtime_checkable
class Evaluator(Protocol, Generic[M]):
    """A name and an evaluate call returning a flat mapping of metric names to floats."""

    name: str

    def evaluate(self, trainer: Any, state: Any) -> Mapping[str, float]: ...


EVALUATORS: Registry[type] = Registry("evaluator", "eval.evaluators")


def build_evaluators(spec: "ExecutionSpec") -> Sequence[Evaluator[Any]]:
    """The evaluators the spec lists, each constructed with the spec."""
    return [EVALUATORS.get(name)(spec) for name in spec.eval.evaluators]
