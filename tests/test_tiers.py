"""The tiers' promises (tests/conftest.py, docs/tests.md): an unmarked test cannot start a process, a
test marked e2e (landing) or deep can; a session without `-m deep` leaves the deep tests out, a test
named by its id runs whatever its tier, and a test marked with both tiers is refused."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

import pytest

from tests.conftest import deep_is_asked, split_tiers, tier_line


def test_an_unmarked_test_that_starts_a_process_fails() -> None:
    with pytest.raises(AssertionError, match="starts a process .*mark it @pytest.mark.e2e .*or @pytest.mark.deep"):
        subprocess.run(["true"], check=True)


@pytest.mark.e2e
def test_a_test_marked_e2e_may_start_one() -> None:
    assert subprocess.run(["true"], check=True).returncode == 0


@pytest.mark.deep
def test_a_test_marked_deep_may_start_one() -> None:
    assert subprocess.run(["true"], check=True).returncode == 0


@dataclass
class FakeItem:
    """What split_tiers reads of a collected test: its id and its marks."""

    nodeid: str
    marks: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.marks else None


FAST, LANDING, DEEP = FakeItem("t.py::fast"), FakeItem("t.py::landing", {"e2e"}), FakeItem("t.py::deep", {"deep"})


@pytest.mark.parametrize(("markexpr", "args", "kept", "left_out"), [
    ("", ["tests"], [FAST, LANDING], [DEEP]),  # the README's and CI's `pytest -q`: the landing tier
    ("not e2e", [], [FAST, LANDING], [DEEP]),  # the in-process part (`-m` then drops LANDING too)
    ("deep", ["tests/parallel"], [FAST, LANDING, DEEP], []),  # `-m deep` (then selects DEEP alone)
    ("deep or e2e", [], [FAST, LANDING, DEEP], []),
    ("not deep", [], [FAST, LANDING, DEEP], []),  # names the tier: `-m` decides alone
    ("", ["t.py::deep"], [FAST, LANDING, DEEP], []),  # a test named by its id runs whatever its tier
    ("deeper", [], [FAST, LANDING], [DEEP]),  # a mark that merely starts with "deep" asks for nothing
])
def test_the_deep_tier_runs_only_when_asked(markexpr: str, args: list[str], kept: list, left_out: list) -> None:
    items = [FAST, LANDING, DEEP]
    assert split_tiers(items, markexpr, args) == (kept, left_out)  # type: ignore[arg-type]
    assert deep_is_asked(markexpr, args) == (not left_out)


def test_a_test_in_both_tiers_is_refused_naming_it() -> None:
    both = FakeItem("t.py::both", {"e2e", "deep"})
    with pytest.raises(pytest.UsageError, match=r"1 test\(s\) marked both e2e and deep, e\.g\. t\.py::both"):
        split_tiers([FAST, both, DEEP], "", [])  # type: ignore[list-item]


def test_the_summary_says_which_tier_ran() -> None:
    assert tier_line(False, "", 131) == ("tiers: the landing tier; 131 deep tests left out (pytest -m deep runs "
                                         "the deep tier; docs/tests.md)")
    assert tier_line(False, "", 1).startswith("tiers: the landing tier; 1 deep test left out (")
    assert tier_line(True, "deep", 0) == "tiers: the tests -m 'deep' selects (docs/tests.md)"
    assert tier_line(True, "", 0) == "tiers: the tests named, whatever their tier (docs/tests.md)"
