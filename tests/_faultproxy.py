"""A small fault-injecting HTTP proxy (standard library only) for tests against a local S3 server.

Point s3fs's ``endpoint_url`` at ``proxy.url``; every request is forwarded to ``upstream`` unless a
queued fault matches it::

    with FaultProxy("http://127.0.0.1:5000") as proxy:
        proxy.inject("drop", times=2)            # next 2 requests: connection closed, no reply
        proxy.inject("503", times=1, match="/shard-00001")  # a 503 SlowDown for that key
        proxy.inject("truncate")                 # reply headers + half the body, then close
        proxy.inject("403")                      # an S3 AccessDenied reply
        proxy.inject("stall")                    # half the body, then nothing until stop()
        proxy.inject("corrupt", method="PUT")    # one byte of the request body flipped on the way
        proxy.inject("drop_part")                # last <Part> left out of a multipart completion
        proxy.inject("lose_reply", method="POST")  # forwarded and done upstream, reply lost
        ...
        assert proxy.faults_served == 5

Faults are used in the order they were queued; ``match`` is a substring of the request path
(``/bucket/key?query``) and ``method`` restricts the HTTP method. ``proxy.requests`` records
``(method, path, outcome)`` for every request seen.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FAULTS", "FaultProxy"]

FAULTS = (
    "drop", "truncate", "stall", "503", "500", "403", "404", "corrupt", "drop_part", "lose_reply"
)  # fmt: skip

_ERROR_XML = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "403": (403, "AccessDenied", "Access Denied"),
    "404": (404, "NoSuchKey", "The specified key does not exist."),
}
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


@dataclass
class _Rule:
    kind: str
    times: int
    match: str | None
    method: str | None

    def applies(self, method: str, path: str) -> bool:
        return (self.match is None or self.match in path) and (
            self.method is None or self.method == method
        )


class FaultProxy:
    """Forward HTTP to ``upstream``, injecting queued faults. Usable as a context manager."""

    def __init__(self, upstream: str, timeout: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self._up_host = parsed.hostname or "127.0.0.1"
        self._up_port = parsed.port or 80
        self._timeout = timeout
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self.requests: list[tuple[str, str, str]] = []
        self.faults_served = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def inject(
        self, kind: str, times: int = 1, *, match: str | None = None, method: str | None = None
    ) -> None:
        """Queue ``times`` faults of ``kind`` (one of :data:`FAULTS`) for matching requests."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; expected one of {FAULTS}")
        with self._lock:
            self._rules.append(_Rule(kind, times, match, method))

    def clear(self) -> None:
        """Drop all queued faults."""
        with self._lock:
            self._rules.clear()

    def pending(self) -> int:
        """Faults queued but not served yet."""
        with self._lock:
            return sum(r.times for r in self._rules)

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="faultproxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- internals
    def _take(self, method: str, path: str) -> str | None:
        with self._lock:
            for rule in self._rules:
                if rule.applies(method, path):
                    rule.times -= 1
                    if rule.times <= 0:
                        self._rules.remove(rule)
                    self.faults_served += 1
                    return rule.kind
        return None

    def _record(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.requests.append((method, path, outcome))

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                method, path = self.command, self.path
                body = self._body()
                fault = proxy._take(method, path)
                proxy._record(method, path, fault or "ok")
                if fault == "drop":
                    self._abort()
                    return
                if fault == "corrupt" and body:  # a flipped bit that TCP's checksum missed
                    mid = len(body) // 2
                    body = body[:mid] + bytes([body[mid] ^ 0x01]) + body[mid + 1 :]
                elif fault == "drop_part":
                    body = re.sub(rb"<Part>(?:(?!<Part>).)*</Part>(\s*</CompleteMultipartUpload>)",
                                  rb"\1", body, flags=re.S)  # fmt: skip
                if fault in _ERROR_XML:
                    status, code, message = _ERROR_XML[fault]
                    xml = (
                        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                        f"<Message>{message}</Message><Resource>{path}</Resource>"
                        f"<RequestId>faultproxy</RequestId></Error>"
                    ).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                status, reason, headers, payload = self._forward(method, path, body)
                if fault == "lose_reply":  # the upstream did the request; its reply is lost
                    self._abort()
                    return
                if fault in ("truncate", "stall") and len(payload) > 1:
                    self.send_response(status, reason)
                    for k, v in headers:
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    if fault == "stall":
                        proxy._stopping.wait()
                    self._abort()
                    return
                self.send_response(status, reason)
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(payload)

            def _forward(
                self, method: str, path: str, body: bytes
            ) -> tuple[int, str, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(
                    proxy._up_host, proxy._up_port, timeout=proxy._timeout
                )
                try:
                    headers = {
                        k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS
                    }
                    if body or method in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    conn.request(method, path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    payload = resp.read()
                    out = [
                        (k, v)
                        for k, v in resp.getheaders()
                        if k.lower() not in _HOP_HEADERS and k.lower() != "content-length"
                    ]
                    length = resp.getheader("Content-Length") if method == "HEAD" else None
                    out.append(("Content-Length", length or str(len(payload))))
                    return resp.status, resp.reason, out, payload
                finally:
                    conn.close()

            def _abort(self) -> None:
                self.close_connection = True
                try:
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                    )  # RST on close: a connection reset, not a clean FIN
                    self.connection.close()
                except OSError:
                    pass

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815

        return Handler
