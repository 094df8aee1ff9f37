"""The docs' runnable commands run, and exit as the page says.

A ```bash block right after the line `<!-- runnable -->` (README.md or any page under docs/) is run
here, command by command, in one fresh directory, as a user would paste it: a renamed key or mode
fails CI instead of a reader. Each command exits 0 unless its line ends in `# exit N`. Every
`python -m runner ...` gets tiny settings appended (a small model, a few rows), and the block's step
counts are mapped to tiny ones in the same order (the largest `train.steps` stays the largest), so
a block that stops early and resumes still does; `<!-- runnable as-is -->` runs the block unchanged.
A command that bash would only exec (one `python -m` or `python -c`, nothing to expand, redirect or
chain) is started through the fork server as the other process tests are (tests/forked.py: a copy
exits and prints as a fresh interpreter does, 3.5-4 s sooner); any other line is run by bash.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.conftest import ROOT, TINY, fork_server, runner_env
from tests.forked import run

MARKER = re.compile(r"^<!--\s*runnable(\s+as-is)?\s*-->\s*$")
EXIT = re.compile(r"#\s*exit\s+(\d+)\b.*$")  # to the end of the line: `# exit 75: stopped after saving`
# the interpreter or the console script that starts a command, after any VAR=value prefixes
LEADER = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)(\.venv/bin/python3?|python3?|runner)(?=\s|$)")
# step counts a block may use, mapped in order onto these tiny values
STEP_KEYS = {"train.steps": (4, 6, 8, 10), "train.max_steps_this_launch": (2, 3, 4),
             "checkpoint.every_steps": (2, 3, 4), "eval.every": (2, 3, 4)}
MIN_BLOCKS = 8  # the README tour's commands at least: a block losing its marker is noticed


@dataclass
class Command:
    text: str  # as the page writes it (continuations joined)
    exit_code: int


@dataclass
class Block:
    page: str
    line: int
    as_is: bool
    commands: list[Command] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(text: str, page: str) -> list[Block]:
    """The runnable blocks of one page."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        marker = MARKER.match(line.strip())
        if not marker:
            continue
        assert i + 1 < len(lines) and lines[i + 1].strip().startswith("```bash"), \
            f"{page}:{i + 1}: `<!-- runnable -->` must be right before a ```bash block"
        block = Block(page, i + 2, bool(marker.group(1)))
        pending = ""
        for body in lines[i + 2:]:
            if body.strip().startswith("```"):
                break
            pending += body.strip() if pending else body.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip() + " "
                continue
            command, pending = pending.strip(), ""
            if command and not command.startswith("#"):
                found = EXIT.search(command)
                block.commands.append(Command(command, int(found.group(1)) if found else 0))
        assert block.commands, f"{page}:{i + 1}: a runnable block with no command"
        blocks.append(block)
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in parse(p.read_text(), str(p.relative_to(ROOT)))]


def step_map(block: Block) -> dict[tuple[str, str], str]:
    """(key, the page's value) -> the tiny value, in the page's order."""
    mapped = {}
    for key, tiny in STEP_KEYS.items():
        values = sorted({int(v) for c in block.commands for v in re.findall(rf"(?<![\w.]){re.escape(key)}=(\d+)",
                                                                            c.text)})
        nonzero = [v for v in values if v > 0]
        assert len(nonzero) <= len(tiny), f"{block.id}: more distinct {key} values than this test maps"
        mapped.update({(key, str(v)): str(t) for v, t in zip(nonzero, tiny)})
    return mapped


def shell_line(command: Command, block: Block) -> str:
    """The command as this test runs it: this interpreter, and tiny settings unless as-is."""
    text = EXIT.sub("", command.text).rstrip()
    leader = LEADER.match(text)
    assert leader, f"{block.id}: {command.text!r} does not start with python, .venv/bin/python or runner"
    env, program = leader.group(1), leader.group(2)
    rest = text[leader.end():]
    python = shlex.quote(sys.executable)
    line = f"{env}{python} -m runner{rest}" if program == "runner" else f"{env}{python}{rest}"
    words = shlex.split(line, comments=True)
    if block.as_is or words[words.index(sys.executable) + 1:words.index(sys.executable) + 3] != ["-m", "runner"]:
        return line
    mapping = step_map(block)
    words = [next((f"{k}={mapping[(k, v)]}" for k, v in [w.split("=", 1)] if (k, v) in mapping), w)
             if "=" in w else w for w in words]
    setting = {w.split("=", 1)[0].lstrip("+~") for w in words if "=" in w}
    tiny = [t for t in [*TINY, "train.steps=4", "eval.every=2", "checkpoint.every_steps=2", "logging.progress=plain"]
            if t.split("=", 1)[0] not in setting]
    return shlex.join([*words, *tiny])


# what bash would expand or treat as syntax outside quotes (operators, redirections, globs, braces,
# variables, substitutions, history); inside double quotes it still expands these
SHELL_SYNTAX = set("|&;<>()$`*?[]{}~!\\")
IN_DOUBLE_QUOTES = set("$`\\!")


def simple_command(line: str) -> Optional[tuple[dict[str, str], str, str, list[str]]]:
    """`line` as (its VAR=value assignments, "module" or "code", the module or the script, the
    arguments) when bash would run it as one `python -m MODULE ...` or `python -c SCRIPT ...`
    whose words are the quote-removed text: nothing for bash to expand, redirect or chain. Such a
    command is started through the fork server (a fresh interpreter when its environment cannot
    be forked); any other line (None) is run by bash itself."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
            elif quote == '"' and char in IN_DOUBLE_QUOTES:
                return None
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):  # a comment to the end of the line
            line = line[:i]
            break
        elif char in SHELL_SYNTAX:
            return None
    words = shlex.split(line)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if len(words) < 3 or words[0] != sys.executable or words[1] not in ("-m", "-c"):
        return None
    return env, "module" if words[1] == "-m" else "code", words[2], words[3:]


def test_the_docs_mark_the_tour_s_commands_runnable() -> None:
    blocks = all_blocks()
    assert len(blocks) >= MIN_BLOCKS, [b.id for b in blocks]
    for block in blocks:
        for command in block.commands:
            shell_line(command, block)  # every command is one this test can run
    codes = {c.exit_code for b in blocks for c in b.commands}
    assert {0, 2, 75} <= codes, codes  # success, a refusal, a stop-and-resume


def test_the_parser_joins_lines_reads_exit_codes_and_maps_step_counts_in_order() -> None:
    page = "\n".join(["text", "<!-- runnable -->", "```bash", "# a comment", "python -m runner job=gpt_tiny \\",
                      "    train.steps=300 train.max_steps_this_launch=100  # exit 75: stopped", "",
                      "python -m runner train.steps=400", "runner mode=compile bogus=1  # exit 2", "```"])
    [block] = parse(page, "page.md")
    assert [(c.text, c.exit_code) for c in block.commands] == [
        ("python -m runner job=gpt_tiny train.steps=300 train.max_steps_this_launch=100  # exit 75: stopped", 75),
        ("python -m runner train.steps=400", 0), ("runner mode=compile bogus=1  # exit 2", 2)]
    first, second, third = (shlex.split(shell_line(c, block)) for c in block.commands)
    assert first[:3] == [sys.executable, "-m", "runner"]
    assert "train.steps=4" in first and "train.max_steps_this_launch=2" in first and "train.steps=300" not in first
    assert "train.steps=6" in second and "train.steps=4" not in second  # still the larger
    assert third[:4] == [sys.executable, "-m", "runner", "mode=compile"] and "bogus=1" in third
    with pytest.raises(AssertionError, match="must be right before"):
        parse("<!-- runnable -->\ntext\n```bash\npython -m runner\n```", "bad.md")


def test_only_a_command_bash_would_just_exec_is_forked() -> None:
    python = shlex.quote(sys.executable)
    assert simple_command(f"XLA_FLAGS=--x=4 {python} -m runner.export runs/a 'hf out' --overwrite  # its newest") == (
        {"XLA_FLAGS": "--x=4"}, "module", "runner.export", ["runs/a", "hf out", "--overwrite"])
    assert simple_command(shlex.join([sys.executable, "-m", "runner", "eval.evaluators=[heldout,{prompts:['def ']}]",
                                      "a#b"])) == ({}, "module", "runner", ["eval.evaluators=[heldout,{prompts:['def ']}]",
                                                                            "a#b"])
    assert simple_command(f"{python} -c 'print(1)' x") == ({}, "code", "print(1)", ["x"])
    for shell in (f"{python} -m runner && echo done", f"{python} -m runner > out.txt", f"{python} -m runner $HOME",
                  f'{python} -m runner "run.dir=$HOME"', f"{python} -m runner runs/*", f"{python} -m runner a{{b,c}}",
                  f"{python} -m runner | tee log", f"{python} tools/plot.py", f"{python} -u -m runner",
                  f"{python} -m runner ~/run", f"{python} -m runner (x)"):
        assert simple_command(shell) is None, shell


def tiered(blocks: list[Block]) -> list[Any]:
    """The README tour's blocks in the landing tier (`e2e`: the first thing a user runs), every other
    page's in the deep tier."""
    return [pytest.param(b, id=b.id, marks=pytest.mark.e2e if b.page == "README.md" else pytest.mark.deep)
            for b in blocks]


def test_the_readme_tour_lands_and_the_other_pages_go_deep() -> None:
    marks = {param.id: param.marks[0].name for param in tiered(all_blocks())}
    assert "e2e" in marks.values() and "deep" in marks.values()
    assert all((name == "e2e") == id_.startswith("README.md:") for id_, name in marks.items()), marks


@pytest.mark.parametrize("block", tiered(all_blocks()))
def test_a_runnable_block_runs_and_exits_as_the_page_says(block: Block, tmp_path: Path) -> None:
    for command in block.commands:
        line = shell_line(command, block)
        simple = simple_command(line)
        if simple is None:
            done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=runner_env(tmp_path), capture_output=True,
                                  text=True, timeout=600)
        else:  # what bash would exec, forked (tests/forked.py): the same exit code and output
            env, kind, target, args = simple
            done = run(fork_server(), kind, target, args, tmp_path, {**runner_env(tmp_path), **env}, 600)
        assert done.returncode == command.exit_code, (
            f"{block.id}: `{command.text}` exited {done.returncode}, the page says {command.exit_code}\n"
            f"ran: {line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
