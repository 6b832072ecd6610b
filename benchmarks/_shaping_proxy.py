"""A TCP proxy that gives every connection a fixed round-trip time and bandwidth.

A real object store is far away and each stream is slow: a request waits one round trip, and a
single connection moves tens of MB/s. A local moto server answers in microseconds at whatever
rate the CPU allows, so parallel transfers have nothing to overlap. This proxy sits between the
client and the local server and shapes each TCP connection, in each direction, like a link of
``rtt_s`` round-trip time and ``mbps`` MB/s:

* a new connection waits one ``rtt_s`` before its first byte moves (the TCP handshake);
* every chunk is delivered ``rtt_s / 2`` after it has been serialised at ``mbps`` on that
  connection's own link (connections do not share a bandwidth budget, as streams of an object
  store mostly do not);
* a bounded queue per direction gives backpressure, so memory stays at a few chunks.

It runs in its own process (``start_proxy``), so its work does not compete with the client for
the GIL.

    python benchmarks/_shaping_proxy.py --upstream 127.0.0.1:9000 --port 9100 --rtt-ms 20 --mbps 50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["start_proxy"]

CHUNK = 64 << 10


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay_s: float,
    rate: float,
) -> None:
    """Copy ``reader`` to ``writer`` through a link of one-way ``delay_s`` and ``rate`` B/s."""
    loop = asyncio.get_running_loop()
    depth = max(8, int(rate * delay_s * 2 / CHUNK) + 8)  # a bandwidth-delay product, and some
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(maxsize=depth)

    async def receive() -> None:
        free = loop.time()  # when this link finishes serialising what it has so far
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                free = max(free, loop.time()) + len(data) / rate
                await queue.put((free + delay_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put(None)

    async def send() -> None:
        while True:
            item = await queue.get()
            if item is None:
                break
            due, data = item
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()

    rx = asyncio.ensure_future(receive())
    try:
        await send()
    except (ConnectionError, OSError):
        rx.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await rx


async def _serve(upstream: tuple[str, int], port: int, rtt_s: float, rate: float) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            await asyncio.sleep(rtt_s)  # the handshake
            ur, uw = await asyncio.open_connection(*upstream)
        except OSError:
            cw.close()
            return
        for w in (cw, uw):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(
            _pump(cr, uw, rtt_s / 2, rate), _pump(ur, cw, rtt_s / 2, rate), return_exceptions=True
        )
        for w in (cw, uw):
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=256)
    async with server:
        await server.serve_forever()


def start_proxy(
    upstream: str, rtt_s: float = 0.020, mbps: float = 50.0, timeout_s: float = 30.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the proxy in its own process in front of ``upstream`` (``http://host:port``).

    Returns the process and the endpoint URL to use instead of ``upstream``."""
    hostport = upstream.split("://", 1)[-1].rstrip("/")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--upstream",
            hostport,
            "--port",
            str(port),
            "--rtt-ms",
            str(rtt_s * 1e3),
            "--mbps",
            str(mbps),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the shaping proxy did not start within {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="host:port of the server behind the proxy")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--mbps", type=float, default=50.0, help="MB/s per connection and direction")
    args = ap.parse_args()
    host, port = args.upstream.rsplit(":", 1)
    asyncio.run(_serve((host, int(port)), args.port, args.rtt_ms / 1e3, args.mbps * 1e6))


if __name__ == "__main__":
    main()
