"""Generate the reference pages in docs/reference/ from the code, so they cannot drift from it.

    python tools/reference.py           # write docs/reference/{config,names,exit-codes,cli}.md
    python tools/reference.py --check   # exit 1, naming the stale pages, if they differ from the code

What each page is made of:

* config.md: every key of runner.spec.ExecutionSpec (nested sections dotted, list entries as
  `[]`), its type and default as the schema has them, the default `python -m runner` composes
  from conf/ (when it is another), the values the checks allow (the `_check_rules` tuples and
  bounds in runner/spec.py, and the registry a key selects from), and its description: the
  field's comment in runner/spec.py, trailing or on the lines just above it.
* names.md: every name in every registry (the first sentence of the registered object's
  docstring, or of the comment at its registration) and every option of the config groups
  conf/job, conf/optimizer, conf/schedule and hydra/launcher (the yaml's leading comment); jobs
  with their parameter counts, computed by their model family without building the model.
* exit-codes.md: the *_EXIT_CODE constants of runner/exits.py (with their comments) and the
  exceptions that carry them.
* cli.md: the modes, the Hydra flags runner accepts and what it adds to them, and the flags of
  runner's other commands (read from their argparse parsers).

Everything is sorted or in source order, without timestamps or absolute paths, so the output
depends on the code alone. tests/test_reference.py fails when a key or name has no description
and when the committed pages differ from what this script generates.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT_DIR = ROOT / "docs" / "reference"
CONF = ROOT / "conf"
COMMAND = "python tools/reference.py"
NOTICE = (f"*This page is generated from the code by `{COMMAND}`: do not edit it by hand. Change the code "
          "(or its comments and docstrings) and run the command again.*")

# Every registry: (module, variable, title, what to import so that its entries register).
REGISTRIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("runner.train.job", "JOBS", "Job classes", ("jobs",)),
    ("runner.models.family", "MODEL_FAMILIES", "Model families", ("runner.models",)),
    ("runner.models.attention.kernels", "ATTENTION", "Attention implementations", ()),
    ("runner.models.common.quantization", "FORMATS", "Quantization formats", ()),
    ("runner.optim.optimizers", "OPTIMIZERS", "Optimizers", ()),
    ("runner.optim.schedules", "SCHEDULES", "Schedules", ()),
    ("runner.evaluation.base", "EVALUATORS", "Evaluators", ("runner.evaluation",)),
    ("runner.data.strategies", "DATASET_STRATEGIES", "Dataset strategies", ()),
    ("runner.data.tokenizer", "TOKENIZERS", "Tokenizers", ()),
    ("runner.train.callbacks", "CALLBACKS", "Callbacks", ()),
)
# Keys whose choices are a constant of the component that checks them, not its registry's names
# (the attention registry also holds splash_interpret, which is what splash means off a TPU).
CHOICE_CONSTANTS = {
    "job.model.attention": ("runner.models.attention.kernels", "CHOICES"),
    "job.model.quantization_scope": ("runner.models.common.quantization", "SCOPES"),
}
# The config groups a command line picks from (GROUP=OPTION): group -> its directory in conf/.
GROUPS = (("job", "Jobs"), ("optimizer", "Optimizer groups"), ("schedule", "Schedule groups"),
          ("hydra/launcher", "Launchers"))
BASIC_LAUNCHER = "Hydra's own, the default: the run, or each sweep member in turn, in this process."
# Other commands with an argparse command line: (how it is run, module whose main(argv) parses it).
COMMANDS = (("python -m runner.data.prepare", "runner.data.prepare"), ("runner plot", "runner.main.plot"),
            ("python -m runner.export", "runner.main.export"))


# ----------------------------------------------------------------------------- text


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def first_paragraph(text: Optional[str]) -> str:
    return one_line(re.split(r"\n\s*\n", inspect.cleandoc(text or ""), maxsplit=1)[0])


def first_sentence(text: Optional[str]) -> str:
    """The first sentence of the first paragraph (`e.g.` and `i.e.` do not end one)."""
    paragraph = first_paragraph(text)
    return re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z`(\[])", paragraph, maxsplit=1)[0]


def cell(text: str) -> str:
    """Text for a Markdown table cell: outside code spans, pipes and asterisks escaped and `<` written
    as an entity (Python-Markdown would take `<run.dir>` for a tag); code spans are left as they are."""
    text = one_line(text)
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unbalanced backtick: no code spans
        parts = [text.replace("`", "'")]
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def code(text: str) -> str:
    text = str(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


_YAML_SPECIAL = re.compile(r"[\s,:\[\]{}#\"'|]")


def value_text(value: Any) -> str:
    """A value as it would be written on the command line (YAML flow style)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        plain = value and not _YAML_SPECIAL.search(value) and value.lower() not in ("true", "false", "null", "~")
        return value if plain and not re.fullmatch(r"[-+.\deE]+", value) else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def count_text(n: int) -> str:
    """124439808 -> 124.4M, 8030261248 -> 8.03B, 839552 -> 0.84M."""
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 10**8 else f"{n / 1e6:.2f}M"


# ----------------------------------------------------------------------------- comments in source


def comments_of(source: str) -> dict[int, tuple[str, bool]]:
    """line -> (the comment's text, whether it is the whole line)."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
    return found


def comment_for(comments: dict[int, tuple[str, bool]], first: int, last: int) -> str:
    """The comment that documents the statement on lines first..last: its trailing comment, else
    the block of comment lines directly above it."""
    trailing = [comments[n][0] for n in range(first, last + 1) if n in comments and not comments[n][1]]
    if trailing:
        return one_line(" ".join(trailing))
    block, line = [], first - 1
    while line in comments and comments[line][1]:
        block.insert(0, comments[line][0])
        line -= 1
    return one_line(" ".join(block))


def field_comments(cls: type) -> dict[str, str]:
    """A dataclass's field name -> the comment on (or just above) its line in the class's source."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comments = comments_of(source)
    classdef = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    return {node.target.id: comment_for(comments, node.lineno, node.end_lineno or node.lineno)
            for node in classdef.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def constant_comments(path: Path, suffix: str) -> dict[str, str]:
    """Module-level NAME = ... statements whose NAME ends with `suffix` -> their comments."""
    source = path.read_text()
    comments = comments_of(source)
    return {node.targets[0].id: comment_for(comments, node.lineno, node.end_lineno or node.lineno)
            for node in ast.parse(source).body if isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id.endswith(suffix)}


def element_comments(path: Path, name: str) -> dict[str, str]:
    """The string elements of the module-level tuple `name` -> their trailing comments."""
    source = path.read_text()
    comments = comments_of(source)
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return {e.value: comment_for(comments, e.lineno, e.end_lineno or e.lineno)
                    for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)}
    return {}


def yaml_comment(path: Path) -> str:
    """The first paragraph of a yaml file's leading comment (a `# @package` line is skipped)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("@package"):
            continue
        if not text and lines:
            break
        lines.append(text)
    return one_line(" ".join(lines))


# ----------------------------------------------------------------------------- config keys


@dataclass
class Key:
    key: str  # dotted; `[]` for every entry of a list
    type: str
    default: str
    doc: str
    allowed: str = ""


@dataclass
class Section:
    prefix: str  # "" for the top level
    doc: str
    keys: list[Key] = field(default_factory=list)


NOT_COMPOSED = object()


def class_doc(cls: type) -> str:
    doc = cls.__doc__ or ""
    return "" if doc.startswith(cls.__name__ + "(") else first_paragraph(doc)  # a dataclass's made-up doc


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]


def element_type(hint: Any, value: Any) -> Optional[type]:
    """The dataclass a list field holds: from its type, or (typed Any) from its default's entries."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    if isinstance(value, (tuple, list)) and value and dataclasses.is_dataclass(value[0]):
        return type(value[0])
    return None


def lookup(tree: Any, key: str) -> Any:
    if tree is None or "[]" in key:
        return NOT_COMPOSED
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return NOT_COMPOSED
        tree = tree[part]
    return tree


def as_field(cls: type, name: str, value: Any) -> str:
    """`value` as the dataclass holds it (its __post_init__ may turn a list's names into entries)."""
    try:
        return value_text(getattr(cls(**{name: value}), name))
    except Exception:  # a value the dataclass refuses alone
        return value_text(value)


def default_text(schema: Any, composed: Any, cls: Optional[type] = None, name: str = "") -> str:
    text = code(value_text(schema))
    if composed is NOT_COMPOSED or value_text(composed) == value_text(schema):
        return text
    if cls is not None and as_field(cls, name, composed) == as_field(cls, name, schema):
        return text
    return f"{code(value_text(composed))} (schema: {text})"


def config_sections(root: type, composed: Optional[dict] = None) -> list[Section]:
    """Every leaf key of the dataclass `root`, grouped by the dataclass it belongs to, in source
    order; `composed` is the config as composed (its values shown beside the schema's)."""
    out: list[Section] = []
    _visit(root, "", composed, out)
    return [s for s in out if s.keys]


def _visit(cls: type, prefix: str, composed: Optional[dict], out: list[Section]) -> None:
    docs, hints, instance = field_comments(cls), typing.get_type_hints(cls), cls()
    section = Section(prefix.rstrip("."), class_doc(cls))
    out.append(section)
    nested: list[tuple[type, str]] = []
    for f in dataclasses.fields(cls):
        key, hint = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            nested.append((hint, key + "."))  # type: ignore[arg-type]
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        default = default_text(field_default(f), lookup(composed, key), cls, f.name)
        section.keys.append(Key(key, kind, default, docs.get(f.name, "")))
        element = element_type(hint, getattr(instance, f.name))
        if element is not None:
            nested.append((element, key + "[]."))
    for kind, deeper in nested:
        _visit(kind, deeper, composed, out)


def undocumented_keys(sections: Sequence[Section]) -> list[str]:
    return [k.key for s in sections for k in s.keys if not k.doc]


# ----------------------------------------------------------------------------- allowed values


def _rule_prefix(node: ast.expr) -> str:
    """`"job.model"` -> job.model; `f"eval.evaluators[{i}]"` -> eval.evaluators[]."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "" for v in node.values)
    return ""


def _rules(node: ast.expr) -> Iterator[tuple[str, ast.expr, Optional[str]]]:
    """(field, test, problem) of a rules tuple, a literal one or `tuple(... for x in (...))`."""
    def rule(elt: ast.expr, env: dict[str, Any]) -> Optional[tuple[str, ast.expr, Optional[str]]]:
        if not isinstance(elt, ast.Tuple) or len(elt.elts) < 2:
            return None
        first, test = elt.elts[0], elt.elts[1]
        name = env.get(first.id) if isinstance(first, ast.Name) else getattr(first, "value", None)
        problem = elt.elts[2] if len(elt.elts) > 2 else None
        text = problem.value if isinstance(problem, ast.Constant) and isinstance(problem.value, str) else None
        return (name, test, text) if isinstance(name, str) else None

    if isinstance(node, ast.Tuple):
        found = [rule(e, {}) for e in node.elts]
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.GeneratorExp):
        gen = node.args[0]
        target = gen.generators[0].target
        values = ast.literal_eval(gen.generators[0].iter)
        found = [rule(gen.elt, {target.id: v}) for v in values] if isinstance(target, ast.Name) else []
    else:
        found = []
    yield from (r for r in found if r is not None)


def choices_text(values: Sequence[Any]) -> str:
    return ", ".join(code(value_text(v)) for v in values)


def _test_text(test: ast.expr, problem: Optional[str], module: types.ModuleType) -> str:
    if isinstance(test, ast.Constant) and isinstance(test.value, str):
        return {">= 0": "≥ 0", "> 0": "> 0"}.get(test.value, test.value)
    if isinstance(test, ast.Lambda):
        said = re.search(r"\bit must be (.+?)\.?$", problem or "")
        return said.group(1) if said else ""
    values = eval(compile(ast.Expression(test), module.__file__ or "<rule>", "eval"), vars(module))
    return choices_text(values)


def checked_values(module: types.ModuleType) -> dict[str, list[str]]:
    """key -> what the module's checks allow: each `_check_rules(prefix, section, rules)` rule
    (choices, bounds, and predicates whose problem says "it must be ...") and each
    `_one_of("key", value, CHOICES)`."""
    found: dict[str, list[str]] = {}
    tree = ast.parse(Path(module.__file__ or "").read_text())
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) == 3):
            continue
        if call.func.id == "_check_rules":
            prefix = _rule_prefix(call.args[0])
            for name, test, problem in _rules(call.args[2]):
                found.setdefault(f"{prefix}.{name}", []).append(_test_text(test, problem, module))
        elif call.func.id == "_one_of" and isinstance(call.args[0], ast.Constant):
            found.setdefault(str(call.args[0].value), []).append(_test_text(call.args[2], None, module))
    return found


def registry_choices(registry: Any) -> str:
    names = choices_text(registry.names())
    if not registry.allow_import_paths:
        return names
    return f"{names}, or an import path `pkg.module:Name`" if names else "an import path `pkg.module:Name`"


def allowed_values(sections: Sequence[Section], registries: Sequence["RegistryInfo"]) -> dict[str, str]:
    """key -> the values it allows, for the keys that have a rule, a registry or a choices constant."""
    import runner.spec

    keys = {k.key for s in sections for k in s.keys}
    found = {key: [t for t in texts if t] for key, texts in checked_values(runner.spec).items()}
    for info in registries:
        for key in (info.registry.key, info.registry.key + "[].name"):
            if key in keys:
                found.setdefault(key, []).insert(0, registry_choices(info.registry))
    for key, (module, name) in CHOICE_CONSTANTS.items():
        found[key] = [choices_text(getattr(importlib.import_module(module), name))]
    return {key: "; ".join(dict.fromkeys(texts)) for key, texts in found.items() if texts}


# ----------------------------------------------------------------------------- registries


@dataclass
class Entry:
    name: str
    where: str  # the registered object's import path, or the module it is registered in
    doc: str


@dataclass
class RegistryInfo:
    title: str
    module: str
    variable: str
    registry: Any
    entries: list[Entry]


def registration_comments(variable: str) -> dict[str, tuple[str, str]]:
    """name -> (module, comment) for each `VARIABLE.register("name")` in runner/ and jobs/: the
    documentation of what has no docstring of its own (an instance, a functools.partial)."""
    found: dict[str, tuple[str, str]] = {}
    for path in sorted([*ROOT.glob("runner/**/*.py"), *ROOT.glob("jobs/**/*.py")]):
        source = path.read_text()
        if f"{variable}.register(" not in source:
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        comments = comments_of(source)
        for stmt in ast.walk(ast.parse(source)):
            if not isinstance(stmt, ast.stmt) or isinstance(stmt, (ast.Module, ast.If)):
                continue
            heads = getattr(stmt, "decorator_list", None) or ([stmt.value] if isinstance(stmt, ast.Expr) else [])
            for call in (n for head in heads for n in ast.walk(head)):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "register" and isinstance(call.func.value, ast.Name)
                        and call.func.value.id == variable and call.args and isinstance(call.args[0], ast.Constant)):
                    first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
                    found[call.args[0].value] = (module, comment_for(comments, first, stmt.end_lineno or first))
    return found


def object_doc(thing: Any) -> Optional[str]:
    """A registered function's or class's own docstring ('' when it has none); None for anything
    else (an instance, a functools.partial), which is documented where it is registered."""
    if not isinstance(thing, (type, types.FunctionType)):
        return None
    doc = thing.__doc__ or ""
    return "" if isinstance(thing, type) and dataclasses.is_dataclass(thing) and doc.startswith(thing.__name__ + "(") \
        else doc


def load_registries() -> list[RegistryInfo]:
    """Every registry, filled: the modules that register its built-in entries are imported."""
    from runner.train.job import load_job_modules

    out = []
    for module, variable, title, fillers in REGISTRIES:
        for filler in fillers:
            load_job_modules(filler) if filler == "jobs" else importlib.import_module(filler)
        registry = getattr(importlib.import_module(module), variable)
        sites = registration_comments(variable)
        entries = []
        for name in registry.names():
            thing = registry.get(name)
            doc = object_doc(thing)
            site_module, site_comment = sites.get(name, (module, ""))
            where = f"{thing.__module__}.{thing.__qualname__}" if doc is not None else site_module
            entries.append(Entry(name, where, first_sentence(site_comment if doc is None else doc)))
        out.append(RegistryInfo(title, module, variable, registry, entries))
    return out


def registry_variables() -> list[tuple[str, str]]:
    """(module, variable) of every `X = Registry(...)` in runner/: what REGISTRIES must list."""
    found = []
    for path in sorted(ROOT.glob("runner/**/*.py")):
        for node in ast.parse(path.read_text()).body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            value = getattr(node, "value", None)
            if (isinstance(target, ast.Name) and isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id == "Registry"):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found.append((module.removesuffix(".__init__"), target.id))
    return found


# ----------------------------------------------------------------------------- config groups


@dataclass
class GroupOption:
    name: str
    doc: str
    columns: dict[str, str] = field(default_factory=dict)  # jobs: family, parameters, ...


def compose_all(overrides: Sequence[Sequence[str]]) -> list[Any]:
    """conf/config.yaml composed once per override list, in this process, as `python -m runner` does."""
    from hydra import compose, initialize_config_dir

    from runner.main.cli import CONFIG_NAME, prepare

    prepare(jobs=False)  # the schema
    with initialize_config_dir(str(CONF), version_base=None):
        return [compose(CONFIG_NAME, overrides=list(o)) for o in overrides]


def job_columns(cfg: Any, name: str) -> dict[str, str]:
    """A job's model: its family's exact parameter count (analytic: no model is built)."""
    from runner.models import MODEL_FAMILIES
    from runner.spec import resolve_spec

    spec = resolve_spec(cfg, [f"job={name}"])
    model = spec.job.model
    family = MODEL_FAMILIES.get(model.family)
    config = family.config(model)
    total = family.param_count(config)
    active = getattr(family, "active_param_count", None)
    active_count = active(config) if active else total
    return {"Family": model.family, "Trainer": spec.job.trainer, "Parameters": count_text(total),
            "Active": count_text(active_count) if active_count != total else "",
            "d_model": str(model.d_model), "n_layers": str(model.n_layers)}


def group_options() -> dict[str, list[GroupOption]]:
    out: dict[str, list[GroupOption]] = {}
    for group, _ in GROUPS:
        out[group] = [GroupOption(p.stem, first_sentence(yaml_comment(p)))
                      for p in sorted((CONF / group).glob("*.yaml"))]
    out["hydra/launcher"].insert(0, GroupOption("basic", BASIC_LAUNCHER))
    jobs = out["job"]
    for option, cfg in zip(jobs, compose_all([[f"job={o.name}"] for o in jobs])):
        option.columns = job_columns(cfg, option.name)
    return out


def default_groups() -> list[str]:
    """GROUP=OPTION of conf/config.yaml's defaults list (what `python -m runner` picks)."""
    import yaml

    defaults = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    return [f"{k}={v}" for d in defaults if isinstance(d, dict) for k, v in d.items() if not k.startswith("override")]


def undocumented_names(registries: Sequence[RegistryInfo], groups: dict[str, list[GroupOption]]) -> list[str]:
    missing = [f"{info.variable}:{e.name}" for info in registries for e in info.entries if not e.doc]
    return missing + [f"{group}={o.name}" for group, options in groups.items() for o in options if not o.doc]


# ----------------------------------------------------------------------------- pages


@dataclass
class Model:
    """Everything the pages are made of, gathered once."""

    sections: list[Section]
    registries: list[RegistryInfo]
    groups: dict[str, list[GroupOption]]


def gather() -> Model:
    from omegaconf import OmegaConf

    from runner.spec import ExecutionSpec

    registries = load_registries()
    composed = OmegaConf.to_container(compose_all([[]])[0], resolve=True)
    sections = config_sections(ExecutionSpec, composed)  # type: ignore[arg-type]
    allowed = allowed_values(sections, registries)
    for section in sections:
        for key in section.keys:
            key.allowed = allowed.get(key.key, "")
    return Model(sections, registries, group_options())


def config_page(model: Model) -> str:
    count = sum(len(s.keys) for s in model.sections)
    groups = ", ".join(code(g) for g in default_groups())
    out = ["# Configuration keys", "", NOTICE, "",
           f"Every setting of a run is one of these {count} keys of the schema `runner.spec.ExecutionSpec`, set "
           "on the command line as `KEY=VALUE` (`python -m runner train.steps=100 optimizer.lr=1e-3`). Unknown "
           "keys and values of the wrong type are refused before anything runs; `python -m runner --cfg job` "
           "prints every key with the value a command line gives it.", "",
           f"- **Default**: what `python -m runner` composes with no overrides (conf/config.yaml with {groups}); "
           "where the schema's own default (the dataclass field's) differs, it follows as *schema*. A job "
           "(`job=NAME`, see [names](names.md)) sets values of its own.",
           "- **Allowed**: what the checks accept, and the names of the registry a key selects from.",
           "- `[]` stands for every entry of a list: `data.sources[].path` is the `path` of each entry of "
           "`data.sources`.", ""]
    for section in model.sections:
        out += [f"## {code(section.prefix) if section.prefix else 'Top level'}", ""]
        if section.doc:
            out += [cell(section.doc).replace("\\|", "|"), ""]
        rows = [(code(k.key), code(k.type), k.default, k.allowed, k.doc) for k in section.keys]
        out += [table(("Key", "Type", "Default", "Allowed", "Description"), rows), ""]
    return "\n".join(out)


def _registry_intro(info: RegistryInfo) -> str:
    key = info.registry.key
    where = f"the registry `{info.variable}` in `{info.module}`"
    if key.startswith("--"):
        return f"The `{key}` flag of `python -m runner.data.prepare` picks from {where}."
    own = " An import path (`pkg.module:Name`) names your own." if info.registry.allow_import_paths else ""
    return f"`{key}` picks from {where}.{own}"


def names_page(model: Model) -> str:
    total = sum(len(i.entries) for i in model.registries) + sum(len(o) for o in model.groups.values())
    out = ["# Names", "", NOTICE, "",
           f"The {total} names a setting can take: the options of the config groups (`GROUP=OPTION` on the "
           "command line, a yaml file in conf/) and the entries of runner's registries (a key's value). "
           "The keys themselves are in [config](config.md).", ""]
    for group, title in GROUPS:
        options = model.groups[group]
        out += [f"## {title} (`{group}=NAME`)", "",
                f"`{group}=NAME` picks `conf/{group}/NAME.yaml`" + (
                    "; `basic` is Hydra's own launcher." if group == "hydra/launcher" else "."), ""]
        extra = list(options[0].columns) if options and options[0].columns else []
        if group == "job":
            out += ["Parameters: the exact count of the model's parameters, computed by its family "
                    "without building it; Active: the parameters one token uses, where that is fewer "
                    "(a mixture of experts).", ""]
        rows = [(code(o.name), *(o.columns.get(c, "") for c in extra), o.doc) for o in options]
        out += [table(("Name", *extra, "Description"), rows), ""]
    for info in model.registries:
        out += [f"## {info.title}", "", _registry_intro(info), ""]
        if not info.entries:
            out += ["None are built in.", ""]
            continue
        rows = [(code(e.name), e.doc, code(e.where)) for e in info.entries]
        out += [table(("Name", "Description", "Defined in"), rows), ""]
    return "\n".join(out)


def exit_raisers() -> dict[str, list[str]]:
    """*_EXIT_CODE constant -> the classes in runner/ whose `exit_code` is it."""
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.glob("runner/**/*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
                value = getattr(stmt, "value", None)
                if isinstance(target, ast.Name) and target.id == "exit_code" and isinstance(value, ast.Name):
                    found.setdefault(value.id, []).append(f"{module}.{node.name}")
    return {k: sorted(v) for k, v in found.items()}


OTHER_EXITS = (
    "A sweep (`-m`) ends, after its summary table, with its members' codes (`runner.exits.of_members`): one a "
    "rerun may fix first (rerunning the sweep skips its finished members), else the first other failure.",
    "134 (128 + SIGABRT, in the shell): a process aborted by JAX's coordination service because another "
    "process of the run died or stopped answering (`distributed.heartbeat_timeout_s`): a crash, restarted.",
    "A process killed by a signal reports 128 + its number in the shell (137: SIGKILL): a crash, restarted. "
    "SIGTERM and SIGINT are caught while training: the run saves and exits 75 (SIGTERM) or 76 (SIGINT, "
    "Ctrl-C); Ctrl-C before training starts is 130, a stop you asked for too.",
    "Ray's launcher, `tools/launch_tpu.py --restart` and a loop around a SLURM submission decide by "
    "`runner.exits.restartable` alone ([What restarts what](../launching.md#what-restarts-what)). SkyPilot "
    "(`tools/sky_task.py`) recovers 75 without limit and counts every other nonzero code against one budget "
    "(`max_restarts_on_errors: 3`): a repeating crash ends the job, but 2, 3, 65 and 76 are relaunched too, up "
    "to 3 times, since SkyPilot cannot tell them apart there.",
    "`python -m runner.data.prepare`, `runner plot` and `python -m runner.export` exit 0, or after one "
    "paragraph with the error's code (2 for a usage error); an interrupted `python -m runner.data.prepare` "
    "exits 130 and resumes when run again.",
)


def exit_codes_page() -> str:
    import runner.exits

    comments = constant_comments(Path(runner.exits.__file__ or ""), "_EXIT_CODE")
    raisers = exit_raisers()
    rows = [("0", "", "finished: the run reached train.steps (or a relaunch found it finished), mode=eval "
                      "evaluated, mode=compile found that the step fits", "no", "")]
    for name in sorted(comments, key=lambda n: (getattr(runner.exits, n), n)):
        raised = ", ".join(code(c) for c in raisers.get(name, [])) + (" and subclasses" if name in raisers else "")
        value = getattr(runner.exits, name)
        rows.append((str(value), code(name), comments[name], "yes" if runner.exits.restartable(value) else "no",
                     raised))
    out = ["# Exit codes", "", NOTICE, "",
           "What `python -m runner` (and `runner`) exits with. The constants are in `runner/exits.py`; a "
           "supervisor (Ray's launcher, SkyPilot, `tools/launch_tpu.py --restart`, SLURM, a shell loop) tells from "
           "the code alone whether to run the same command again: *Restarted* says what every one of them does "
           "(`runner.exits.restartable`), SkyPilot as far as its settings allow (below).", "",
           table(("Code", "Constant", "Meaning", "Restarted", "Raised as"), rows), "", "## Other exits", ""]
    out += [f"- {cell(text)}" for text in OTHER_EXITS]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- command line


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def command_parser(module: str) -> argparse.ArgumentParser:
    """The argparse parser `module.main(argv)` builds, caught as it starts parsing (nothing runs)."""
    def caught(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    main: Callable[..., Any] = importlib.import_module(module).main
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = caught  # type: ignore[method-assign]
    try:
        main([])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{module}.main did not parse its arguments")


def argument_rows(parser: argparse.ArgumentParser, notes: Optional[dict[str, str]] = None) -> list[tuple[str, ...]]:
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            names = ", ".join(code(o) for o in sorted(action.option_strings, key=len))
        else:
            names = code(action.metavar or action.dest)
        if action.choices:
            value = choices_text(list(action.choices))
        elif action.nargs == 0 or not action.option_strings:  # a positional's name is its value
            value = ""
        else:
            value = code(action.metavar or action.dest.upper())
        value += {"+": " (one or more)", "*": " (any number)", "?": " (optional)"}.get(str(action.nargs), "")
        if action.option_strings and action.required:
            value += " (required)"
        doc = one_line(str(action.help or "").split("\n")[0]).rstrip(":.")
        if notes and notes.get(action.dest):
            doc += f". Runner: {notes[action.dest]}"
        rows.append((names, value.strip(), doc))
    return rows


OWN_CONFIG = ("not supported: runner checks every command line against config.yaml in its own config directory "
              "first; set RUNNER_CONF_DIR to use another directory")
HYDRA_NOTES = {
    "help": "its page lists the config groups and the keys used most (conf/config.yaml's hydra.help)",
    "cfg": "`--cfg job` and `--cfg all` first check the values as a run's are checked, and print them resolved",
    "multirun": "a sweep: every member's settings are checked before any member trains; a table of the members "
                "at the end; its exit code is its members' ([exit codes](exit-codes.md))",
    "shell_completion": "bash and zsh: `eval \"$(runner -sc install=bash)\"`; fish: the output of "
                        "`runner -sc install=fish`, sourced",
    "run": "the default: one run",
    "resolve": "`--cfg job` prints resolved values without it",
    "config_path": OWN_CONFIG,
    "config_name": OWN_CONFIG,
    "config_dir": OWN_CONFIG,
    "experimental_rerun": "nothing to rerun: runner has Hydra write no .hydra/ directory "
                          "(hydra.output_subdir: null); run the same command again instead",
}


def hydra_rows() -> list[tuple[str, ...]]:
    from hydra._internal.utils import get_args_parser

    from runner.main.cli import _INFO_FLAGS

    parser = get_args_parser()
    parser._actions = [a for a in parser._actions if a.option_strings]  # the overrides are the usage line
    notes = dict(HYDRA_NOTES)
    for action in parser._actions:
        if set(action.option_strings) & set(_INFO_FLAGS) and action.dest not in ("cfg", "resolve"):
            said = [notes[action.dest]] if action.dest in notes else []
            notes[action.dest] = "; ".join([*said, "prints, and exits without running"])
    return argument_rows(parser, notes)


def cli_page() -> str:
    import yaml

    import runner.spec

    header = yaml.safe_load((CONF / "config.yaml").read_text())["hydra"]["help"]["header"]
    usage = header.split("Usage:", 1)[-1]
    modes = element_comments(Path(runner.spec.__file__ or ""), "MODES")
    out = ["# Command line", "", NOTICE, "", "## `runner` and `python -m runner`", "",
           "The same command under two names (`runner` is the console script `pip install` makes).", "",
           "```text", "Usage:" + usage.rstrip(), "```", "",
           "Arguments are Hydra overrides: `KEY=VALUE` sets a key ([config](config.md)), `GROUP=OPTION` "
           "picks a config group's option ([names](names.md)), and `KEY=A,B` with `-m` sweeps. The exit "
           "codes are in [exit codes](exit-codes.md).", "",
           "### Modes (`mode=NAME`)", "",
           table(("Mode", "What it does"), [(code(m), modes.get(m, "")) for m in runner.spec.MODES]), "",
           "### Subcommands", "",
           "`runner plot ...` plots runs (below); every other first word is an override.", "",
           "### Flags", "",
           "Hydra's flags, with what runner adds to them:", "",
           table(("Flag", "Value", "What it does"), hydra_rows()), ""]
    for command, module in COMMANDS:
        parser = command_parser(module)
        about = one_line(parser.description or "")
        docstring = importlib.import_module(module).__doc__ or ""
        if about and one_line(docstring).startswith(about):  # its --help shows the docstring's first line
            about = first_sentence(docstring)
        out += [f"## `{command}`", "", cell(about).replace("\\|", "|"), ""]
        out += [table(("Argument", "Value", "What it does"), argument_rows(parser)), ""]
        if parser.epilog:
            out += [cell(one_line(parser.epilog)).replace("\\|", "|"), ""]
    return "\n".join(out)


def pages(model: Optional[Model] = None) -> dict[str, str]:
    """File name (in docs/reference/) -> its text."""
    model = model or gather()
    texts = {"config.md": config_page(model), "names.md": names_page(model), "exit-codes.md": exit_codes_page(),
             "cli.md": cli_page()}
    return {name: text.rstrip("\n") + "\n" for name, text in sorted(texts.items())}


def stale_pages(generated: dict[str, str], directory: Optional[Path] = None) -> list[str]:
    """The pages whose committed text differs from `generated` (or that are missing)."""
    directory = directory or OUT_DIR
    return [name for name, text in generated.items()
            if not (directory / name).is_file() or (directory / name).read_text() != text]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and name the pages that differ from what the code generates")
    args = parser.parse_args(argv)
    generated = pages()
    stale = stale_pages(generated)
    if args.check:
        for name in stale:
            print(f"stale: docs/reference/{name}", file=sys.stderr)
        if stale:
            print(f"the pages differ from what the code generates: run `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in stale:
        (OUT_DIR / name).write_text(generated[name])
        print(f"wrote docs/reference/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
