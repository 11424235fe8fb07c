"""A minimal keep-alive HTTP/1.1 client for benchmark agents.

Real agents run on their own machines; here they share two cores with the
server and PostgreSQL, so whatever CPU the client spends is taken from the
system being measured. httpx spends about as much CPU per request as the
server does (``docs/PERFORMANCE.md``), which made the HTTP drain figures a
measurement of the client as much as of the server. This client does only
what the agent protocol needs: one persistent connection, a request line,
a few headers, a ``Content-Length`` body, and a ``Content-Length`` response
(which is all the server sends for JSON). Anything else is refused loudly
rather than misread.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

_encode = msgspec.json.encode
_decode = msgspec.json.decode


class WireError(Exception):
    pass


class Response:
    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body

    def json(self) -> Any:
        return _decode(self.body)

    def raise_for_status(self) -> None:
        if self.status >= 400:
            raise WireError(f"HTTP {self.status}: {self.body[:300]!r}")


class Connection:
    """One persistent connection; requests on it are sequential (as one agent's are)."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self._host, self._port = host, port
        fixed = {"Host": f"{host}:{port}", **(headers or {})}
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in fixed.items()).encode("latin-1")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @classmethod
    def to(cls, base: str, headers: dict[str, str] | None = None) -> "Connection":
        host, port = base.removeprefix("http://").rsplit(":", 1)
        return cls(host, int(port), headers)

    async def post(self, path: str, body: Any = None) -> Response:
        return await self.request("POST", path, body)

    async def request(self, method: str, path: str, body: Any = None) -> Response:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        payload = b"" if body is None else _encode(body)
        head = f"{method} {path} HTTP/1.1\r\n".encode("latin-1") + self._fixed
        if body is not None:
            head += b"Content-Type: application/json\r\n"
        self._writer.write(head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        reader = self._reader
        assert reader is not None
        status_line = await reader.readline()
        if not status_line:
            raise WireError("connection closed by the server")
        status = int(status_line.split(b" ", 2)[1])
        length = 0
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                raise WireError("chunked responses are not supported by this client")
        return Response(status, await reader.readexactly(length) if length else b"")

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
            self._writer = self._reader = None
