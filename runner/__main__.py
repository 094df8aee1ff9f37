"""`python -m runner job=... topology=...`: see runner.main.cli."""

from runner.main.cli import main

main()
