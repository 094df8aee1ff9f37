"""Lets lm-evaluation-harness find runner's model, `lm_eval --model runner`, at no startup cost.

lm-eval 0.4 looks models up in its own registry and reads no plugin entry points, so runner
installs `runner-lm-eval.pth`, which imports this module when Python starts. It imports
neither lm-eval nor runner: it only puts a finder on `sys.meta_path`. When something first
imports `lm_eval.api.registry`, the finder lets it load, then imports lm-eval's own model table
(`lm_eval.models`: `get_model` reads it only into an empty registry) and registers "runner" as
lm-eval's documented lazy placeholder, "runner.main.lm_eval:CheckpointLM". Nothing
here may ever break an unrelated program: any failure is one line on stderr.
"""

from __future__ import annotations

import sys

REGISTRY = "lm_eval.api.registry"
NAME, TARGET = "runner", "runner.main.lm_eval:CheckpointLM"


def register(registry: object) -> None:
    """Add runner to lm-eval's model registry (after lm-eval's own models)."""
    try:
        import lm_eval.models  # noqa: F401

        if NAME not in registry.model_registry:
            registry.model_registry.register(NAME, target=TARGET)
    except Exception as err:  # an lm-eval whose registry changed shape: lm-eval still works
        print(f"runner: could not register the lm-eval model {NAME!r}: {err!r}", file=sys.stderr)


class _Loader:
    """The registry's own loader, then `register` (duck-typed: importlib.abc costs 20 ms at startup)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def create_module(self, spec: object) -> object:
        return self.inner.create_module(spec)

    def exec_module(self, module: object) -> None:
        self.inner.exec_module(module)
        register(module)

    def __getattr__(self, name: str) -> object:  # get_source, get_filename, ... for tracebacks
        return getattr(self.inner, name)


class _Finder:
    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name != REGISTRY:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Put the finder first on sys.meta_path, once."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
