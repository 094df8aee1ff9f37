"""`python -m runner job=... topology=...`: see runner.cli."""

from runner.cli import main

main()
