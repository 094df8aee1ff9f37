"""tools/suite_durations.py and the slowest-files-first order tests/conftest.py gives the workers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import DEFAULT_FILE_SECONDS, ROOT, slowest_files_first

sys.path.insert(0, str(ROOT / "tools"))

import suite_durations as tool  # noqa: E402

REPORT = """
============================= slowest durations ==============================
160.66s call     tests/main/test_ray.py::test_elastic
12.50s setup    tests/main/test_ray.py::test_sweep
0.40s teardown tests/models/test_moe.py::test_x[a-b]
99.91s call     tests/parallel/test_context_parallel.py::test_meshes
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
1 failed, 741 passed in 2376.20s (0:39:36)
"""


def test_a_durations_report_becomes_each_file_s_seconds_slowest_first(tmp_path: Path) -> None:
    assert list(tool.file_seconds(REPORT).items()) == [
        ("tests/main/test_ray.py", 173), ("tests/parallel/test_context_parallel.py", 100),
        ("tests/models/test_moe.py", 0)]
    (tmp_path / "run.txt").write_text(REPORT)
    assert tool.main([str(tmp_path / "run.txt"), "--out", str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["tests/main/test_ray.py"] == 173
    (tmp_path / "empty.txt").write_text("3 passed\n")
    assert tool.main([str(tmp_path / "empty.txt"), "--out", str(tmp_path / "e.json")]) == 2
    assert not (tmp_path / "e.json").exists()
    assert tool.main([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "m.json")]) == 2
    assert not (tmp_path / "m.json").exists()


def test_the_committed_table_names_only_files_that_exist() -> None:
    table = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert table and all((ROOT / name).is_file() for name in table), [n for n in table if not (ROOT / n).is_file()]


def test_files_are_collected_slowest_first_keeping_each_file_s_own_order(monkeypatch) -> None:
    seconds = {"tests/a.py": 5, "tests/b.py": 500}
    monkeypatch.setattr(json, "loads", lambda text: seconds)
    items = [SimpleNamespace(nodeid=n) for n in ("tests/a.py::t2", "tests/a.py::t1", "tests/c.py::t",
                                                 "tests/b.py::t9", "tests/b.py::t1")]
    slowest_files_first(items)
    assert DEFAULT_FILE_SECONDS > 5  # c.py, not in the table, sits between b (500 s) and a (5 s)
    assert [i.nodeid for i in items] == ["tests/b.py::t9", "tests/b.py::t1", "tests/c.py::t", "tests/a.py::t2",
                                         "tests/a.py::t1"]
