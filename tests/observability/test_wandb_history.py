"""runner.observability.wandb_history reads wandb's own run files: records split across 32 KiB
blocks come back whole, and the torn tail a SIGKILL leaves is dropped, not misread."""

from __future__ import annotations

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

from runner.observability.wandb_history import BLOCK, history_steps, records


def history(step: int, padding: int = 0) -> bytes:
    record = wandb_internal_pb2.Record()
    record.history.step.num = step
    item = record.history.item.add()
    item.key, item.value_json = "loss", "1.0" + " " * padding
    return record.SerializeToString()


def log_file(payloads: list[bytes]) -> bytes:
    """wandb's framing: a 7-byte header, then 32 KiB blocks of chunks (crc, length, type)."""
    out = bytearray(b":W&B" + b"\x00\x01\x00")
    for payload in payloads:
        first = True
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < 7:
                out += b"\x00" * left
                continue
            take = min(len(payload), left - 7)
            last = take == len(payload)
            kind = 1 if first and last else 2 if first else 4 if last else 3
            out += struct.pack("<IHB", 0, take, kind) + payload[:take]
            payload, first = payload[take:], False
            if last:
                break
    return bytes(out)


def test_records_across_blocks_come_back_whole_and_a_torn_tail_is_dropped(tmp_path: Path) -> None:
    payloads = [history(1), history(2, padding=40_000), history(3), history(4)]  # step 2 spans two blocks
    data = log_file(payloads)
    run = tmp_path / "offline-run-1" / "run-abc.wandb"
    run.parent.mkdir()
    run.write_bytes(data)
    assert [r.history.step.num for r in records(run)] == [1, 2, 3, 4]
    run.write_bytes(data[:-5])  # killed while writing step 4
    assert [r.history.step.num for r in records(run)] == [1, 2, 3]
    assert history_steps(tmp_path, "abc") == {1, 2, 3}
    run.write_bytes(b"not a wandb file")
    assert records(run) == []
