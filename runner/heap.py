"""Keep Python's garbage collector out of the step loop.

By the time the loop starts, the process holds hundreds of thousands of long-lived objects (jax,
flax, orbax, the compiled steps). A full (generation 2) collection walks all of them, which takes
100-200 ms on a small CPU, and the loop's own allocations trigger one every few dozen steps: a
few per cent of the step time of a small model, as stalls. Collecting once and freezing what
exists moves those objects out of the collector's view for the loop; what the loop itself creates
is still collected as usual.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect, freeze the surviving objects for the duration, unfreeze afterwards."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
