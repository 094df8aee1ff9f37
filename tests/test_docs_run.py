"""The docs' runnable commands run, and exit as the page says.

A ```bash block right after the line `<!-- runnable -->` (README.md or any page under docs/) is run
here, command by command, in one fresh directory, as a user would paste it: a renamed key or mode
fails CI instead of a reader. Each command exits 0 unless its line ends in `# exit N`. Every
`python -m runner ...` gets tiny settings appended (a small model, a few rows), and the block's step
counts are mapped to tiny ones in the same order (the largest `train.steps` stays the largest), so
a block that stops early and resumes still does; `<!-- runnable as-is -->` runs the block unchanged.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, runner_env

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


@pytest.mark.e2e
@pytest.mark.parametrize("block", all_blocks(), ids=lambda b: b.id)
def test_a_runnable_block_runs_and_exits_as_the_page_says(block: Block, tmp_path: Path) -> None:
    for command in block.commands:
        line = shell_line(command, block)
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=runner_env(tmp_path), capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == command.exit_code, (
            f"{block.id}: `{command.text}` exited {done.returncode}, the page says {command.exit_code}\n"
            f"ran: {line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
