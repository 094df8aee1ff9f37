"""Rewrite tests/durations.json, each test file's seconds, from a pytest run's durations report.

    .venv/bin/python -m pytest -q --durations=0 > run.txt; .venv/bin/python tools/suite_durations.py run.txt

tests/conftest.py schedules the slowest files first from it (pytest-xdist gives whole files to its
workers in collection order), so the suite's wall time is not set by a long file that started last.
Seconds are summed over each file's setup, call and teardown phases and rounded to whole seconds:
the order matters, not the figures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(tests/[^:\s]+\.py)::")


def file_seconds(report: str) -> dict[str, int]:
    """{test file: its seconds}, slowest first."""
    totals: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        found = LINE.match(line)
        if found:
            totals[found.group(3)] += float(found.group(1))
    return {name: round(s) for name, s in sorted(totals.items(), key=lambda item: (-item[1], item[0]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="pytest's output with --durations=0")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "durations.json")
    args = parser.parse_args(argv)
    try:
        report = args.report.read_text()
    except OSError as err:
        print(f"error: cannot read the report {args.report} ({err.strerror}): save pytest's output with "
              "--durations=0 to a file and name it", file=sys.stderr)
        return 2
    seconds = file_seconds(report)
    if not seconds:
        print(f"error: no durations in {args.report}: run pytest with --durations=0", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"wrote {args.out}: {len(seconds)} files, {sum(seconds.values())} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
