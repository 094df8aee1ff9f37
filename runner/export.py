"""`python -m runner.export RUN_OR_STEP OUT`, the public path (the code lives in runner.main.export)."""

import os
import sys

if __name__ == "__main__":  # the command reads files on the CPU: no accelerator probe (libtpu's page of
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # complaints on a machine without a TPU), before JAX loads

from runner.main.export import export, main  # noqa: E402

__all__ = ["export", "main"]

if __name__ == "__main__":
    sys.exit(main())
