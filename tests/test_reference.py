"""docs/reference/ is generated from the code by tools/reference.py: every config key, registry
name and config-group option has a description, and the committed pages are exactly what the
code generates now. In this process: no command is started."""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field

import pytest

import runner.exits
import runner.spec
from tools import reference

REGENERATE = f"run `{reference.COMMAND}` and commit docs/reference/"


@pytest.fixture(scope="module")
def model() -> reference.Model:
    return reference.gather()


@pytest.fixture(scope="module")
def pages(model: reference.Model) -> dict[str, str]:
    return reference.pages(model)


def keys_of(model: reference.Model) -> dict[str, reference.Key]:
    return {k.key: k for s in model.sections for k in s.keys}


# ----------------------------------------------------------------------------- every key and name has a doc


def test_every_config_key_has_a_description(model: reference.Model) -> None:
    missing = reference.undocumented_keys(model.sections)
    assert not missing, ("config keys without a description (add a comment on the field's line, or just above "
                         f"it, in runner/spec.py): {', '.join(missing)}")


def test_the_keys_are_every_leaf_of_the_schema(model: reference.Model) -> None:
    keys = keys_of(model)
    for key in ("train.steps", "job.model.d_model", "job.model.rope.theta", "job.lr", "data.sources",
                "data.sources[].path", "data.stages[].sources[].weight", "eval.evaluators[].name",
                "checkpoint.local.dir", "mode", "callbacks"):
        assert key in keys, key
    assert "job.model" not in keys and "eval.evaluators[]" not in keys  # sections are not keys
    assert len(keys) == len(set(keys)) > 150


def test_every_name_has_a_description(model: reference.Model) -> None:
    missing = reference.undocumented_names(model.registries, model.groups)
    assert not missing, ("names without a description (a docstring on the registered object, or a comment at "
                         f"its registration; a leading `# comment` in the yaml file): {', '.join(missing)}")


def test_every_registry_and_every_name_in_it_is_listed(model: reference.Model) -> None:
    listed = {(module, variable) for module, variable, *_ in reference.REGISTRIES}
    assert set(reference.registry_variables()) == listed, "add the new registry to REGISTRIES in tools/reference.py"
    for info in model.registries:
        assert [e.name for e in info.entries] == info.registry.names()
    assert {"adamw", "muon"} <= {e.name for i in model.registries if i.variable == "OPTIMIZERS" for e in i.entries}


def test_every_config_group_option_is_listed(model: reference.Model) -> None:
    for group, _ in reference.GROUPS:
        on_disk = sorted(p.stem for p in (reference.CONF / group).glob("*.yaml"))
        assert [o.name for o in model.groups[group] if o.name != "basic"] == on_disk
    assert model.groups["hydra/launcher"][0].name == "basic"


# ----------------------------------------------------------------------------- the generator notices a gap


@dataclass(frozen=True)
class _Entry:
    name: str = ""


@dataclass(frozen=True)
class _Inner:
    # documented on the line above
    above: int = 1
    bare: str = ""


@dataclass(frozen=True)
class _Root:
    top: int = 0  # documented on its line
    inner: _Inner = field(default_factory=_Inner)
    entries: tuple[_Entry, ...] = ()  # a list of entries


def test_an_undocumented_key_is_reported_by_its_dotted_key() -> None:
    sections = reference.config_sections(_Root)
    assert [s.prefix for s in sections] == ["", "inner", "entries[]"]
    docs = {k.key: k.doc for s in sections for k in s.keys}
    assert docs["top"] == "documented on its line" and docs["inner.above"] == "documented on the line above"
    assert reference.undocumented_keys(sections) == ["inner.bare", "entries[].name"]


def test_an_undocumented_name_is_reported() -> None:
    def bare(x: int) -> int:
        return x

    assert reference.object_doc(bare) == ""
    assert reference.object_doc(functools.partial(bare, 1)) is None  # documented where it is registered
    assert reference.object_doc(reference.first_sentence).startswith("The first sentence")
    info = reference.RegistryInfo("Things", "m", "THINGS", None, [reference.Entry("bare", "m.bare", "")])
    groups = {"job": [reference.GroupOption("mine", "")], "optimizer": [reference.GroupOption("ok", "Fine.")]}
    assert reference.undocumented_names([info], groups) == ["THINGS:bare", "job=mine"]


# ----------------------------------------------------------------------------- what the pages say


def test_allowed_values_come_from_the_checks_and_the_registries(model: reference.Model) -> None:
    keys = keys_of(model)
    assert keys["job.model.remat"].allowed == "`auto`, `none`, `full`, `dots`, `offload`"  # a _check_rules tuple
    assert keys["optimizer.lr"].allowed == "> 0" and keys["data.prefetch"].allowed == "≥ 0"
    assert keys["job.model.dropout"].allowed == "in [0, 1)"  # a predicate whose problem says "it must be"
    assert keys["mode"].allowed == "`train`, `eval`, `compile`, `plan`"  # _one_of in validate
    assert keys["eval.evaluators[].every"].allowed == "≥ 0"  # f"eval.evaluators[{i}]" rules
    assert "`adamw`" in keys["optimizer.name"].allowed and "import path" in keys["optimizer.name"].allowed
    assert "`heldout`" in keys["eval.evaluators[].name"].allowed
    assert keys["job.model.attention"].allowed == "`auto`, `xla`, `cudnn`, `splash`"  # attention.CHOICES
    assert keys["job.model.quantization"].allowed == "`fp8`, `int8`, `none`"  # no import paths there


def test_defaults_are_the_composed_ones_beside_the_schemas(model: reference.Model) -> None:
    keys = keys_of(model)
    assert keys["train.steps"].default == "`800` (schema: `300`)"  # conf/job/gpt_tiny.yaml's
    assert keys["optimizer.lr"].default == "`0.003`"  # job.lr.adamw through conf/optimizer/adamw.yaml
    assert keys["train.seq_len"].default == "`128`"
    assert keys["eval.evaluators"].default == "`[heldout]`"  # the same entries, however they are written


def test_jobs_have_their_parameter_counts(model: reference.Model) -> None:
    jobs = {o.name: o.columns for o in model.groups["job"]}
    assert jobs["gpt_small"]["Parameters"] == "124.5M" and jobs["gpt_small"]["Family"] == "gpt"
    assert jobs["llama3_8b"]["Parameters"] == "8.03B" and jobs["llama3_8b"]["Active"] == ""
    assert (jobs["mixtral_8x7b"]["Parameters"], jobs["mixtral_8x7b"]["Active"]) == ("46.70B", "12.88B")
    assert jobs["llama3_8b"]["d_model"] == "4096" and jobs["llama3_8b"]["n_layers"] == "32"


def test_the_exit_codes_page_lists_every_exit_code(pages: dict[str, str]) -> None:
    names = [n for n in dir(runner.exits) if n.endswith("_EXIT_CODE")]
    assert len(names) >= 4
    for name in names:
        assert f"| {getattr(runner.exits, name)} | `{name}` |" in pages["exit-codes.md"], name
    assert "`runner.exits.Preempted`" in pages["exit-codes.md"]


def test_the_cli_page_has_the_modes_and_the_flags(pages: dict[str, str]) -> None:
    cli = pages["cli.md"]
    for mode in runner.spec.MODES:
        assert f"| `{mode}` |" in cli
    for flag in ("`--multirun`", "`--cfg`", "`--shell-completion`", "`--tokenizer`", "`--overwrite`", "`--x`"):
        assert flag in cli, flag


def test_every_page_says_it_is_generated(pages: dict[str, str]) -> None:
    assert sorted(pages) == ["cli.md", "config.md", "exit-codes.md", "names.md"]
    for name, text in pages.items():
        assert text.startswith("# ") and reference.COMMAND in text.splitlines()[2], name
        assert str(reference.ROOT) not in text, f"{name} holds an absolute path"


# ----------------------------------------------------------------------------- the committed pages are current


def test_the_committed_pages_are_what_the_code_generates(pages: dict[str, str]) -> None:
    stale = reference.stale_pages(pages)
    diffs = []
    for name in stale:
        path = reference.OUT_DIR / name
        old = path.read_text().splitlines() if path.exists() else []
        diffs += list(difflib.unified_diff(old, pages[name].splitlines(), f"docs/reference/{name}", "generated",
                                           lineterm="", n=0))[:20]
    assert not stale, f"docs/reference/ is stale ({', '.join(stale)}): {REGENERATE}\n" + "\n".join(diffs)


def test_check_mode_names_the_stale_pages(pages: dict[str, str], tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(reference, "pages", lambda model=None: pages)
    monkeypatch.setattr(reference, "OUT_DIR", tmp_path)
    assert reference.main(["--check"]) == 1
    assert "stale: docs/reference/config.md" in capsys.readouterr().err
    assert reference.main([]) == 0  # writes them
    assert reference.main(["--check"]) == 0
    (tmp_path / "names.md").write_text(pages["names.md"] + "hand edit\n")
    assert reference.main(["--check"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == "stale: docs/reference/names.md"
