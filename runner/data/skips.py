"""Windows of the data stream a run never trains on: given by hand (train.skip_batches) or
recorded by a rewind after a loss spike (runner.train.rewind).

A window ``[start, end)`` counts batches of the data stream: batch ``d`` is the one step ``d + 1``
trains on in a run without skips. With skips, step ``s + 1`` trains on the ``s``-th batch outside
every window, so a skip moves the data stream and nothing else: the step counter, the learning
rate schedule and the step's PRNG key stay where they are, the skipped rows are never read, and
the batches after a window follow in their usual order. Two runs with the same windows train on
the same batches at every step, whichever of them found the windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

Window = tuple[int, int]


def normalized(windows: Iterable[Sequence[int]]) -> tuple[Window, ...]:
    """Sorted, empty windows dropped, overlapping or touching ones merged."""
    merged: list[list[int]] = []
    for start, end in sorted((int(a), int(b)) for a, b in windows):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((a, b) for a, b in merged)


@dataclass(frozen=True)
class DataSkips:
    """The windows in force; `position(s)` is the data-stream batch step ``s + 1`` trains on."""

    windows: tuple[Window, ...] = ()

    @classmethod
    def of(cls, *groups: Iterable[Sequence[int]]) -> "DataSkips":
        return cls(normalized(w for group in groups for w in group))

    def __bool__(self) -> bool:
        return bool(self.windows)

    def position(self, step: int) -> int:
        """The data-stream batch that 0-based step `step` trains on."""
        position = int(step)
        for start, end in self.windows:
            if start > position:
                break
            position += end - start
        return position

    def skipped(self) -> int:
        return sum(end - start for start, end in self.windows)

    def before(self, step: int) -> tuple[Window, ...]:
        """The windows that decided the batches of the first `step` steps (those a checkpoint of
        that step was trained through)."""
        if step <= 0:
            return ()
        last = self.position(step - 1)
        return tuple(w for w in self.windows if w[0] <= last)

    def agrees_until(self, other: "DataSkips", step: int) -> bool:
        """Whether both train the first `step` steps on the same batches: a checkpoint of that step
        made under `other` continues exactly under these windows."""
        return self.before(step) == other.before(step)

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.windows]
