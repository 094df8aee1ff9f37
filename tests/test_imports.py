"""Imports flow one way: the graph of runner's modules (top-level and deferred imports alike)
has no cycle, and the spec module imports none of runner's components."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "runner"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def executed_nodes(tree: ast.AST):
    """Every node that can run: all of them but the bodies of `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield node.test
            for other in node.orelse:
                yield other
                yield from executed_nodes(other)
            continue
        yield node
        yield from executed_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """module -> the runner modules it imports anywhere in its body (functions included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in executed_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from runner import x` imports runner.x when x is a module
                targets = [f"{node.module}.{alias.name}" for alias in node.names
                           if f"{node.module}.{alias.name}" in modules] or [node.module]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_is_built_from_real_imports() -> None:
    graph = import_graph()
    assert "runner.trainer" in graph and "runner.loop" in graph["runner.trainer"]
    assert "runner.job" in graph["runner.evaluation.standalone"]  # a deferred import counts too
    assert "runner.config" in graph["runner.cli"]


def test_runner_imports_have_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_would_be_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_spec_imports_no_component() -> None:
    allowed = {"runner.errors", "runner.exits"}
    assert import_graph()["runner.spec"] <= allowed
