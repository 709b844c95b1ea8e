"""A fault-injecting TCP proxy in front of an HTTP server (S3): refused connections, connections reset mid-upload,
503 SlowDown, slow responses, 507 storage full for writes. (A hung server is a real one stopped with SIGSTOP.)

Each request gets a connection of its own (the proxy adds `Connection: close`, a header SigV4 does not sign), so
the fault is chosen per request: `proxy.fault = "reset"` applies to the next requests until set back to "none".
"""

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

from tests.fixtures.processes import free_port

Fault = Literal["none", "refuse", "reset", "slowdown", "slow", "full"]
_ERROR = (
    "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n{body}"
)
_ERROR_BODY = "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
SLOW_DELAY_S = 0.5  # per chunk of the response in "slow"


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.fault: Fault = "none"
        self.injected = 0  # requests that got a fault
        # Called with each request's head before its fault is chosen: a test may set `fault` from it (e.g. after
        # the first request of some kind).
        self.on_request: Callable[[bytes], None] | None = None
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.Server | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        self.listen(True)

    def listen(self, on: bool) -> None:
        """Accept connections (on) or refuse them: nothing listens on the port meanwhile."""
        asyncio.run_coroutine_threadsafe(self._listen(on), self.loop).result(timeout=10)

    async def _listen(self, on: bool) -> None:
        if on and self.server is None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
        elif not on and self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    def stop(self) -> None:
        self.listen(False)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            head = await client_reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            client_writer.close()
            return
        method = head.split(b" ", 1)[0]
        if self.on_request is not None:
            self.on_request(head)
        fault = self.fault
        writes = method in (b"PUT", b"POST")
        if fault == "slowdown" or (fault == "full" and writes):
            self.injected += 1
            status, code = ("503 Slow Down", "SlowDown") if fault == "slowdown" else ("507 Insufficient Storage", "")
            body = _ERROR_BODY.format(code=code or "InsufficientStorage", message=f"injected {fault}")
            client_writer.write(_ERROR.format(status=status, length=len(body), body=body).encode())
            await client_writer.drain()
            client_writer.close()
            return
        head = head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_writer.close()
            return
        upstream_writer.write(head)
        reset_after = 64 * 1024 if fault == "reset" and writes else None
        if reset_after is not None:
            self.injected += 1
        await asyncio.gather(
            self._pipe(client_reader, upstream_writer, reset_after=reset_after, other=client_writer),
            self._pipe(upstream_reader, client_writer, delay_s=SLOW_DELAY_S if fault == "slow" else 0.0),
            return_exceptions=True,
        )
        if fault == "slow":
            self.injected += 1

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        reset_after: int | None = None,
        other: asyncio.StreamWriter | None = None,
        delay_s: float = 0.0,
    ) -> None:
        sent = 0
        try:
            while chunk := await reader.read(64 * 1024):
                if delay_s:
                    await asyncio.sleep(delay_s)
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
                if reset_after is not None and sent >= reset_after:
                    for side in (writer, other):  # RST both ways: an upload torn mid-body
                        if side is not None:
                            _reset(side)
                    return
        finally:
            with contextlib.suppress(Exception):
                writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextmanager
def fault_proxy(upstream_endpoint_url: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(int(upstream_endpoint_url.rsplit(":", 1)[1]))
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
