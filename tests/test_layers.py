"""Imports flow one way: the graph of runner's modules (top-level, deferred and type-only imports
alike) has no cycle, no module imports from a higher layer than its own (LAYERS), and the spec
module imports none of runner's components."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "runner"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The house, bottom to top: a module may import its own layer and the ones below, never above.
# A module's layer is that of the longest prefix of its name listed here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("runner.errors", "runner.exits", "runner.registry", "runner.spec"),  # the core every layer uses
    ("runner.checkpoint", "runner"),  # storage, files, the checkpointer (runner/__init__ sets storage up)
    ("runner.parallel",),  # topology, mesh, distributed, mode=compile, compile cache
    ("runner.observability", "runner.data", "runner.models", "runner.optim"),
    ("runner.evaluation",),
    ("runner.train",),  # the spine: job, trainer, loop, components, steps, state
    ("runner.main", "runner.__main__", "runner.trainer", "runner.job", "runner.export"),  # entry points, public paths
)


def layer_of(module: str) -> int:
    best, level = "", -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, i
    assert level >= 0, f"{module} has no layer in LAYERS: add it"
    return level


def import_graph() -> dict[str, set[str]]:
    """module -> the runner modules it imports anywhere in its body (functions included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):  # type-only imports count too
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
    assert "runner.data.store" in graph["runner.data.corpus"]
    assert "runner.train.trainer" in graph and "runner.train.loop" in graph["runner.train.trainer"]
    assert "runner.train.job" in graph["runner.main.evaluate"]  # a deferred import counts too
    assert "runner.main.config" in graph["runner.main.cli"]


def test_runner_imports_have_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_would_be_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_spec_imports_no_component() -> None:
    allowed = {"runner.errors", "runner.exits"}
    assert import_graph()["runner.spec"] <= allowed


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = [f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
              for module, targets in sorted(import_graph().items()) for target in sorted(targets)
              if layer_of(target) > layer_of(module)]
    assert not upward, "imports running up the layers:\n" + "\n".join(upward)


def test_every_module_has_a_layer_and_the_table_is_read() -> None:
    graph = import_graph()
    assert {layer_of(m) for m in graph} == set(range(len(LAYERS)))  # every layer has modules
    assert layer_of("runner.main.cli") > layer_of("runner.train.trainer") > layer_of("runner.evaluation.base")
    assert (layer_of("runner.checkpoint.storage") < layer_of("runner.parallel.mesh")
            < layer_of("runner.models.gpt.model"))


def test_no_family_imports_another() -> None:
    """The families (a folder each under runner/models) share their parts through runner.models.common
    and runner.models.attention, never through each other; the shared parts import no family."""
    graph = import_graph()
    shared = ("runner.models.common.", "runner.models.attention.", "runner.models.hf.")
    folders = {m.split(".")[2] for m in graph if m.startswith("runner.models.") and m.count(".") == 3
               and not m.startswith(shared)}
    assert {"gpt", "llama"} <= folders
    for module, imports in graph.items():
        if not module.startswith("runner.models.") or module.count(".") != 3:
            continue
        own = module.split(".")[2]
        others = {m for m in imports if m.startswith("runner.models.") and m.count(".") == 3
                  and m.split(".")[2] in folders - {own}}
        assert not others, f"{module} imports {sorted(others)}: share it in runner.models.common"
    assert all("runner.models.common.layers" in graph[f"runner.models.{f}.model"] for f in folders)


SPINE = ("main", "train", "checkpoint", "parallel")


def test_no_function_in_the_spine_is_longer_than_60_lines() -> None:
    """The path from the command to a checkpoint reads in screens, not pages."""
    long = []
    for folder in SPINE:
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, "functions over 60 lines: " + ", ".join(long)


def test_the_public_paths_users_rely_on_still_work() -> None:
    """Moved code keeps its public names: the seed API, the job registry, `python -m runner.export`."""
    import runner.export
    import runner.job
    import runner.main.export
    import runner.train.job
    import runner.train.trainer
    import runner.trainer

    assert runner.trainer.BaseTrainer is runner.train.trainer.BaseTrainer
    assert runner.trainer.TrainState is runner.train.trainer.TrainState
    assert runner.job.JOBS is runner.train.job.JOBS and runner.job.RestoreableJob is runner.train.job.RestoreableJob
    assert runner.export.main is runner.main.export.main
    assert (ROOT / "runner" / "data" / "prepare.py").is_file()  # python -m runner.data.prepare stays where it was


def test_every_module_is_reached_by_its_dotted_path() -> None:
    """`import runner.models.attention.splash as s` resolves attributes from the package down: a
    package's __init__ that binds a name of one of its subpackages (`kernels as attention`) would
    shadow it, and such an import fail. The models' packages (the others are flat)."""
    import functools
    import importlib

    import runner

    for path in sorted((ROOT / "runner" / "models").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        assert functools.reduce(getattr, name.split(".")[1:], runner) is module, name
