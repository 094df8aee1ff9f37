"""Writing a file so that a reader (or a resumed run after a kill) sees the old version or the new
one, never half of one: locally, write beside it under a unique temporary name, then rename over
it; on an object store (gs://), one object upload is all or nothing by itself."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from runner.checkpoint import storage


def atomic_write(path: str | os.PathLike[str], data: str | bytes, durable: bool = False) -> Any:
    """Replace `path` with `data` in one rename (one upload for a URL). `durable` also fsyncs the
    data first (for files that are the only record of finished work, not for ones rewritten
    every launch)."""
    if storage.is_remote(path):
        target = storage.path(path)
        with target.open("wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
        return target
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as out:
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike[str], data: Any, durable: bool = False, **dumps: Any) -> Any:
    return atomic_write(path, json.dumps(data, **dumps) + "\n", durable=durable)


def read_jsonl(path: Any) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, local or remote (a line cut short by a kill is skipped);
    [] if it is absent."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
