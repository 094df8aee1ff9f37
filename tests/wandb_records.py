"""Read the records of a wandb offline run file (`run-<id>.wandb`). wandb 0.31 writes these from
its Go core and ships no Python reader; the format is a leveldb-style log (a 7-byte ":W&B"
header, then 32 KiB blocks of chunks: crc32 (4 bytes), length (2), type (1: full, 2: first,
3: middle, 4: last)) of `wandb_internal_pb2.Record` protobufs, which the wandb package does ship."""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32 * 1024


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
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
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def launches(run_dir: Path) -> list[dict]:
    """Per launch (oldest first): the wandb run id, whether it was marked preempting, its exit code."""
    found = []
    for launch in sorted((run_dir / "wandb").glob("offline-run-*")):
        (file,) = launch.glob("run-*.wandb")
        kinds = {r.WhichOneof("record_type"): r for r in records(file)}
        found.append({"id": kinds["run"].run.run_id, "preempting": "preempting" in kinds,
                      "exit_code": kinds["exit"].exit.exit_code if "exit" in kinds else None})
    return found
