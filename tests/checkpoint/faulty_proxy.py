"""An HTTP proxy that misbehaves like a cloud bucket under load, in front of the GCS emulator:
a share of requests answered 503 or 429 without reaching the server, a share stalled before they
are forwarded, or (`down`) every request refused. Decisions come from a seeded generator, so a
test sees the same faults each run (in the order the requests arrive)."""

from __future__ import annotations

import http.client
import random
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator
from urllib.parse import unquote, urlsplit


@dataclass
class Faults:
    error_share: float = 0.0  # of requests answered 503 or 429 (alternately)
    stall_share: float = 0.0  # of requests held `stall_s` before being forwarded
    stall_s: float = 2.0
    down: bool = False  # every request answered 503
    down_from: str = ""  # go down at the first request naming this (in its URL or body), that one included
    seed: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"forwarded": 0, "503": 0, "429": 0, "stalled": 0})

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def decide(self) -> str:
        with self._lock:
            if self.down:
                return "503"
            x = self._rng.random()
            if x < self.error_share:
                return "503" if self._rng.random() < 0.5 else "429"
            if x < self.error_share + self.stall_share:
                return "stall"
            return "forward"

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


class FaultyProxy:
    """Listening on 127.0.0.1 (a free port); `url` is what STORAGE_EMULATOR_HOST points at."""

    def __init__(self, upstream: str, faults: Faults) -> None:
        self.faults = faults
        target = urlsplit(upstream)
        host, port = target.hostname, target.port

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if faults.down_from and (faults.down_from in unquote(self.path)
                                         or faults.down_from.encode() in (body or b"")):
                    faults.down = True
                decision = faults.decide()
                if decision in ("503", "429"):
                    faults.count(decision)
                    reply = b'{"error": {"code": %s, "message": "injected"}}' % decision.encode()
                    self.send_response(int(decision))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply)))
                    if decision == "429":
                        self.send_header("Retry-After", "0")
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                if decision == "stall":
                    faults.count("stalled")
                    time.sleep(faults.stall_s)
                faults.count("forwarded")
                upstream = http.client.HTTPConnection(host, port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _relay

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up on a stalled or refused request: expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FaultyProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve(upstream: str, faults: Faults) -> Iterator[FaultyProxy]:
    with FaultyProxy(upstream, faults) as proxy:
        yield proxy
