"""What wandb's own local run files hold (`<run.dir>/wandb/*run-*/run-<id>.wandb`), so a resumed
launch can give wandb the steps a killed one logged but wandb never wrote: wandb commits a step's
history row only when the next step begins and writes it from its own process, so a SIGKILL loses
the rows in flight while metrics.jsonl, written before every checkpoint, has them.

wandb 0.31 writes these files from its Go core and ships no Python reader; the format is a
leveldb-style log (a 7-byte ":W&B" header, then 32 KiB blocks of chunks: crc32 (4 bytes), length
(2), type (1: full, 2: first, 3: middle, 4: last)) of `wandb_internal_pb2.Record` protobufs, which
the wandb package does ship.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024


def records(path: Path) -> list[Any]:
    """Every complete record of one run file (a torn tail, as a kill leaves, is dropped)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        return []
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):
            break  # torn: the writer was killed mid-record
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except Exception:  # a damaged record: what follows cannot be trusted either
                break
            out.append(record)
            pending = b""
    return out


def history_steps(wandb_dir: Path, run_id: str) -> set[int]:
    """The steps of every history row wandb wrote for run `run_id`, over all its launches."""
    steps: set[int] = set()
    for path in wandb_dir.glob(f"*run-*/run-{run_id}.wandb"):
        steps |= {r.history.step.num for r in records(path) if r.WhichOneof("record_type") == "history"}
    return steps
