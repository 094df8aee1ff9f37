"""The fast tier's promise (tests/conftest.py): an unmarked test cannot start a process, a test
marked e2e can."""

from __future__ import annotations

import subprocess

import pytest


def test_an_unmarked_test_that_starts_a_process_fails() -> None:
    with pytest.raises(AssertionError, match="starts a process .*mark it @pytest.mark.e2e"):
        subprocess.run(["true"], check=True)


@pytest.mark.e2e
def test_a_test_marked_e2e_may_start_one() -> None:
    assert subprocess.run(["true"], check=True).returncode == 0
