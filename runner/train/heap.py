"""Keep Python's garbage collector out of the step loop.

By the time the loop starts, the process holds hundreds of thousands of long-lived objects (jax,
flax, orbax, the compiled steps). A full (generation 2) collection walks all of them, which takes
140-180 ms on a 2-core CPU, and the loop's own allocations trigger one every few dozen steps:
about 2% of gpt_tiny's step time, as stalls (docs/performance.md). Collecting once and freezing what
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
