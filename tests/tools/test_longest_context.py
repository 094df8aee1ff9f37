"""tools/bench/longest_context.py: its search stops at the first length that does not fit and keeps
what it compiled (a second run compiles nothing again), and its table says per kind and setting
the longest that fit and why the next did not. The compiles themselves are faked here; the
records it wrote for docs/performance.md are in docs/records/bench_longest_context.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "tools" / "bench"))

import longest_context as tool  # noqa: E402

GiB = 2**30


def fake_compile(asked: list) -> object:
    def compile_once(kind: str, setting: str, length: int, extra: list[str]) -> dict:
        asked.append((kind, setting, length))
        fits = length <= 2**21
        memory = {"total": length * 16 * 1024, "host": GiB if setting == "offload" else 0} if fits else None
        return {"kind": kind, "setting": setting, "length": length, "extra": extra, "exit": 0 if fits else 3,
                "seconds": 1.0, "memory": memory, "compiler_error": None if fits else "smem" * (kind == "ulysses"),
                "required_bytes": None if fits else 130 * GiB}
    return compile_once


def test_the_search_stops_at_the_first_misfit_keeps_its_records_and_tables_them(tmp_path: Path, monkeypatch,
                                                                                 capsys) -> None:
    out, asked = tmp_path / "records.jsonl", []
    monkeypatch.setattr(tool, "compile_once", fake_compile(asked))
    lengths = [2**20, 2**21, 2**22, 2**23]
    tool.search(out, ["ring", "ulysses"], ["offload"], lengths, [])
    assert asked == [("ring", "offload", 2**20), ("ring", "offload", 2**21), ("ring", "offload", 2**22),
                     ("ulysses", "offload", 2**20), ("ulysses", "offload", 2**21), ("ulysses", "offload", 2**22)]
    assert len(out.read_text().splitlines()) == 6 and json.loads(out.read_text().splitlines()[2])["exit"] == 3
    tool.search(out, ["ring"], ["offload"], lengths, [])  # all recorded: nothing compiled again
    assert len(asked) == 6
    assert "ring      offload   4,194,304  exit 3  130.00 GiB asked" in capsys.readouterr().out
    table = tool.table(out).splitlines()
    assert table[2] == "| ring | offload | 2,097,152 | 32.00 GiB + 1.00 GiB host | 4,194,304: 130.00 GiB asked |"
    assert table[3].endswith("| 4,194,304: splash's tables exceed scalar memory |")
