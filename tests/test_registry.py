"""The one registry helper: registration, unknown names, import paths."""

from __future__ import annotations

import pytest

from runner.errors import ConfigError
from runner.registry import Registry


def make() -> Registry:
    reg: Registry = Registry("widget", "widget.name")

    @reg.register("b")
    class B: ...

    @reg.register("a")
    def a() -> str:
        return "a"

    return reg


def test_names_are_sorted_and_lookups_work() -> None:
    reg = make()
    assert reg.names() == ["a", "b"] and "a" in reg and list(reg) == ["a", "b"]
    assert reg.get("a")() == "a"


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        make().get("c")
    assert info.value.key == "widget.name" and "a, b" in str(info.value)


def test_import_paths_plug_in_user_code() -> None:
    reg = make()
    assert reg.get("collections:OrderedDict").__name__ == "OrderedDict"
    assert reg.get("collections.OrderedDict").__name__ == "OrderedDict"
    with pytest.raises(ConfigError, match="cannot be imported"):
        reg.get("no_such_module_xyz:Thing")
    with pytest.raises(ConfigError, match="has no attribute"):
        reg.get("collections:NoSuchThing")


def test_import_paths_can_be_disallowed_and_duplicates_rejected() -> None:
    reg: Registry = Registry("widget", "widget.name", allow_import_paths=False)
    with pytest.raises(ConfigError):
        reg.get("collections:OrderedDict")
    reg.register("x")(int)
    with pytest.raises(ValueError, match="twice"):
        reg.register("x")(float)


def test_every_project_table_uses_the_registry() -> None:
    from runner.data.strategies import DATASET_STRATEGIES
    from runner.data.tokenizer import TOKENIZERS
    from runner.evaluation import EVALUATORS
    from runner.optim import OPTIMIZERS, SCHEDULES
    from runner.train.job import JOBS, load_job_modules

    load_job_modules()
    assert {"adamw", "adafactor", "lion", "sgd", "muon"} <= set(OPTIMIZERS.names())
    assert {"constant", "cosine", "linear", "wsd", "inverse_sqrt"} <= set(SCHEDULES.names())
    assert {"mixture", "synthetic"} <= set(DATASET_STRATEGIES.names())
    assert "heldout" in EVALUATORS and "gpt" in JOBS and "byte" in TOKENIZERS
    for table in (OPTIMIZERS, SCHEDULES, DATASET_STRATEGIES, EVALUATORS, JOBS, TOKENIZERS):
        assert isinstance(table, Registry)


def test_an_unknown_attribute_of_an_import_path_names_the_kind_in_its_plural() -> None:
    from runner.registry import plural

    assert plural("model family") == "model families" and plural("optimizer") == "optimizers"
    with pytest.raises(ConfigError, match="name one of the model families defined there"):
        Registry("model family", "job.model.family").get("runner.registry:Nope")
