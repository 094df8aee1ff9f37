"""Host-local training batches, prefetched by grain, laid out so a batch is a function of its step.

Row layout: with micro-batch size ``B = global_batch // accumulate_steps``, row ``b`` of micro-batch
``m`` of step ``s`` is global row ``d * global_batch + m * B + b`` of the dataset, where ``d`` is the
data-stream batch of step ``s``: ``s`` itself, or later past the windows a run skips
(runner.data.skips). Process ``p`` of ``P`` owns rows ``b`` in ``[p * B/P, (p+1) * B/P)`` of every
micro-batch and reads only those, so the union over processes is the same global batch whatever
``P`` is.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Iterator

import grain
import numpy as np

from runner.data.skips import DataSkips
from runner.errors import ConfigError

Batch = dict[str, np.ndarray]  # "x", "y", "mask": (accumulate_steps, B/P, seq_len)


@dataclass(frozen=True)
class RowLayout(grain.transforms.DatasetSelectionMap):
    """Local row ``k`` of this process (step-major) -> (dataset 0, global row)."""

    global_batch: int
    micro_batch: int
    accumulate_steps: int
    process_index: int
    process_count: int
    skips: DataSkips = DataSkips()

    @property
    def local_micro(self) -> int:
        return self.micro_batch // self.process_count

    @property
    def rows_per_step(self) -> int:
        return self.accumulate_steps * self.local_micro

    def global_row(self, k: int) -> int:
        step, r = divmod(int(k), self.rows_per_step)
        micro, b = divmod(r, self.local_micro)
        step = self.skips.position(step) if self.skips else step
        return step * self.global_batch + micro * self.micro_batch + self.process_index * self.local_micro + b

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, k: int) -> tuple[int, int]:
        return 0, self.global_row(k)


class BatchLoader(Iterator[Batch]):
    """Yields this process's share of the batches of steps ``start_step, start_step + 1, ...``.

    Batches are computed ``prefetch`` steps ahead on ``num_threads`` grain threads, so in steady
    state the training step never waits; ``wait_seconds`` measures when it does.
    """

    def __init__(
        self,
        dataset: grain.MapDataset,
        *,
        global_batch: int,
        accumulate_steps: int,
        start_step: int,
        process_index: int = 0,
        process_count: int = 1,
        prefetch: int = 2,
        num_threads: int = 2,
        skips: DataSkips = DataSkips(),
    ) -> None:
        _check_layout(global_batch, accumulate_steps, process_count)
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.layout = RowLayout(
            global_batch, global_batch // accumulate_steps, accumulate_steps, process_index, process_count, skips
        )
        self.shape = (accumulate_steps, self.layout.local_micro)
        rows = grain.MapDataset.select_from_datasets([dataset], self.layout)
        self._by_step = rows.batch(self.layout.rows_per_step, drop_remainder=True).map(self._reshape)
        self.next_step = start_step
        self.wait_seconds = 0.0
        read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
        self._iter = iter(self._by_step.slice(slice(start_step, None)).to_iter_dataset(read))
        self._iter.start_prefetch()

    def _reshape(self, batch: Batch) -> Batch:
        return {k: v.reshape(*self.shape, *v.shape[1:]) for k, v in batch.items()}

    def global_rows(self, step: int) -> np.ndarray:
        """The dataset rows of this process's share of ``step``, shape (accumulate_steps, B/P)."""
        first = step * self.layout.rows_per_step
        ks = range(first, first + self.layout.rows_per_step)
        return np.array([self.layout.global_row(k) for k in ks], dtype=np.int64).reshape(self.shape)

    def batch_at(self, step: int) -> Batch:
        """This process's share of ``step``, computed now (what iteration yields for that step)."""
        return self._by_step[step]

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        start = time.perf_counter()
        batch = next(self._iter)
        self.wait_seconds += time.perf_counter() - start
        self.next_step += 1
        return batch

    def close(self) -> None:
        """Stop the prefetch threads (idempotent)."""
        self._iter.close()


def _check_layout(global_batch: int, accumulate_steps: int, process_count: int) -> None:
    if global_batch < 1:
        raise ConfigError("train.batch_size", global_batch, "must be a positive number of rows.", "use e.g. 32.")
    if accumulate_steps < 1:
        raise ValueError(f"accumulate_steps must be >= 1, got {accumulate_steps}")
    if global_batch % accumulate_steps:
        raise ConfigError(
            "train.batch_size", global_batch,
            f"is not divisible by the {accumulate_steps} gradient accumulation steps.",
            f"use a multiple of {accumulate_steps}, or change the accumulation steps.",
        )
    micro = global_batch // accumulate_steps
    if micro % process_count:
        raise ConfigError(
            "train.batch_size", global_batch,
            f"gives micro-batches of {micro} rows, which do not split evenly over {process_count} processes.",
            f"use a multiple of {accumulate_steps * process_count} (accumulation steps x processes).",
        )
