"""Server-Sent Events plumbing: the per-organization "log moved" signal and the stream shape.

Streams never trust a notification's payload: a hint only says "re-read from
your last position". :class:`LogWatch` turns hints into one ``anyio.Event`` per
organization, replaced each time it fires; a stream takes the current event
*before* it reads the database, so a hint that lands during the read is not
lost. After a listener reconnect, or a notification naming no organization
(``*``), every stream is woken to re-read, and a jittered safety poll covers
notifications that never came.

:func:`sse_stream` wraps a stream body (an async generator of ready-made
messages) with what every stream needs: heartbeat comments so proxies and
clients see a live connection, an end when the server begins to stop (so a
graceful shutdown is not held open by dashboards), the open-streams gauge, and
its organization's place among its open streams (at most
``UMBRA_MAX_STREAMS_PER_ORGANIZATION`` per process; 429 past it).
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable
from uuid import UUID

import anyio
import psycopg
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from umbra import jitter, metrics
from umbra.compute.auth import Principal, authenticate, credential_is_live, revoked
from umbra.db import DATABASE_AWAY
from umbra.errors import RateLimited
from umbra.events import documents

from .http import bearer_token

#: Seconds of silence after which a stream sends a ``: ping`` comment line.
PING_SECONDS = 15.0
#: Reconnection delay suggested to EventSource clients (ms).
RETRY_MS = 2000
#: How long a stream's read, once begun, goes on after its client left (see :func:`watched_reads`).
READ_SHIELD_SECONDS = 10.0
#: The refusal a stream route may answer with, for its OpenAPI description.
TOO_MANY_STREAMS = {429: "The organization already holds `UMBRA_MAX_STREAMS_PER_ORGANIZATION` streams open on this "
                         "server (`rate_limited`, with `Retry-After`)."}
#: ``Retry-After`` of a stream refused because its organization has the most it may hold open.
STREAM_RETRY_SECONDS = 30


log = logging.getLogger(__name__)

#: One read of a stream: the messages to send (sent once the connection is given back) and
#: whether there is more to read at once.
StreamRead = Callable[[psycopg.AsyncConnection], Awaitable[tuple[list[bytes], bool]]]


class LogWatch:
    """Per-organization wake-ups for SSE streams, fed by the process's LogListener."""

    def __init__(self) -> None:
        self._signals: dict[UUID, anyio.Event] = {}
        self._everyone = anyio.Event()
        self.stopped = False
        self._open: dict[UUID, int] = {}  # organization -> its streams open on this process

    def admit(self, organization_id: UUID, most: int) -> None:
        """Count a new stream of the organization, or refuse it (429) when it already has ``most`` open."""
        count = self._open.get(organization_id, 0)
        if count >= most:
            raise RateLimited(f"This organization has {count} streams open on this server, the most it may; "
                              "close one, or try again later.", STREAM_RETRY_SECONDS)  # fmt: skip
        self._open[organization_id] = count + 1

    def open_streams(self, organization_id: UUID) -> int:
        """The organization's streams open on this process, as :meth:`admit` counts them."""
        return self._open.get(organization_id, 0)

    def leave(self, organization_id: UUID) -> None:
        """A stream :meth:`admit` counted has ended."""
        left = self._open.pop(organization_id) - 1
        if left:
            self._open[organization_id] = left
        else:  # no stream of it is left to wait: its signal goes too, or every organization that streamed once stays
            self._signals.pop(organization_id, None)

    def signal(self, organization_id: UUID) -> anyio.Event:
        """The event the next hint for this organization (or a reconnect, or stop) sets."""
        event = self._signals.get(organization_id)
        if event is None:
            event = self._signals[organization_id] = anyio.Event()
        return event

    def on_hint(self, organization_id: UUID, position: int, claimable: int) -> None:
        event = self._signals.pop(organization_id, None)
        if event is not None:
            event.set()

    def on_reconnect(self) -> None:
        self.wake_all()

    def on_recheck(self, organization_id: UUID) -> None:
        """A credential of the organization was revoked (``umbra_recheck``): its streams read now, and the
        one whose credential it was ends, instead of at its next hint or safety poll."""
        self.on_hint(organization_id, 0, 0)

    def stop(self) -> None:
        """The server is stopping: every stream ends after its current message."""
        self.stopped = True
        self.wake_all()

    def wake_all(self) -> None:
        signals, self._signals = self._signals, {}
        for event in signals.values():
            event.set()
        everyone, self._everyone = self._everyone, anyio.Event()
        everyone.set()

    async def wait(self, signal: anyio.Event, timeout: float) -> None:
        """Wait for ``signal`` (taken from :meth:`signal` before reading) or ``timeout``."""
        everyone = self._everyone
        with anyio.move_on_after(timeout):
            async with anyio.create_task_group() as tg:

                async def first(event: anyio.Event) -> None:
                    await event.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(first, signal)
                tg.start_soon(first, everyone)


async def stream_principal(request: Request, *any_of_scopes: str) -> Principal:
    """Like :func:`umbra.api.http.authorized`, also accepting ``?access_token=``.

    A browser's EventSource cannot send an Authorization header, so streams
    take the token from the query string too. The access log never records
    query strings, so the token is not written anywhere. A pooled connection
    is borrowed for the credential's queries alone, never during argon2.
    """
    token = bearer_token(request) or request.query_params.get("access_token")
    services = request.app.state.services
    who = await authenticate(services.pool, token, services.token_cache)
    if any_of_scopes:
        who.require(*any_of_scopes)
    request.state.principal = who
    return who


async def watched_reads(services: Any, watch: LogWatch, who: Principal, read: StreamRead) -> AsyncIterator[bytes]:
    """A stream body: ``read`` now, then again after every hint for the organization or the safety poll.

    A pooled connection is held only for a read, and only while the process's
    streams hold fewer than :attr:`~umbra.api.services.Services.stream_reads`
    (a read waits for its turn otherwise). Each read first checks the
    stream's credential again: a stream authenticates once and then outlives
    any request, and a revoked credential fails at once (SPEC), so the stream
    sends a last ``error`` message (the 401's body) and ends; an EventSource
    reconnecting then meets the 401 itself.

    A read that fails because the database is away (a restart, a failover),
    or is given up at its bound (:data:`READ_SHIELD_SECONDS`: a connection the
    network dropped silently; it says nothing of the credential, and a last
    ``error`` message told the client its credential was revoked),
    sends nothing and is tried again at the next wake: the stream stays open,
    its heartbeats go on, and ``read`` keeps its position, so nothing is
    skipped once the database is back (the listener's reconnect wakes every
    stream).
    """
    away = False
    while not watch.stopped:
        signal = watch.signal(who.organization_id)
        out: list[bytes] = []
        more = live = False
        try:
            async with services.stream_reads, services.pool.connection() as conn:
                # A read once begun is finished even if the client leaves meanwhile (for READ_SHIELD_SECONDS
                # at most): cancelled mid-query, psycopg closes the connection, and a crowd of dashboards
                # closing their tabs took the pool's connections down faster than it made new ones.
                with anyio.CancelScope(shield=True, deadline=anyio.current_time() + READ_SHIELD_SECONDS) as bounded:
                    live = await credential_is_live(conn, who)
                    if live:
                        out, more = await read(conn)
            if bounded.cancelled_caught:  # given up at its bound: the credential is not known to be revoked
                raise TimeoutError("stream read outlasted READ_SHIELD_SECONDS")
            if not live:
                yield message(revoked().to_json(), event="error")
                return
            away = False
        except (TimeoutError, *DATABASE_AWAY) as exc:
            if not away:
                log.warning("stream read failed; reading again at the next wake",
                            extra={"action": "stream_read_failed", "error": type(exc).__name__})  # fmt: skip
            away = True
        for chunk in out:
            yield chunk
        if more:
            continue
        await watch.wait(signal, wait_budget(services.settings.poll_fallback_seconds))
        yield b""


def jittered(seconds: float) -> float:
    return seconds * jitter.uniform(0.5, 1.5)


#: Characters JSON may carry raw that a client splitting lines as Python's ``str.splitlines`` does (httpx's
#: ``aiter_lines``) takes for line ends, tearing a ``data:`` line in two; escaped, the JSON is the same.
_LINE_ENDS_FOR_SOME_CLIENTS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def message(data: object, *, event: str | None = None, id: int | None = None) -> bytes:
    """One SSE message. Compact JSON has no raw CR or LF, nor (escaped here) any other character some
    clients end a line at, so ``data`` is one line."""
    parts = []
    if id is not None:
        parts.append(b"id: %d\n" % id)
    if event is not None:
        parts.append(b"event: " + event.encode() + b"\n")
    encoded = documents.encode(data)
    if b"\xe2\x80" in encoded or b"\xc2\x85" in encoded:
        for raw, escaped in _LINE_ENDS_FOR_SOME_CLIENTS:
            encoded = encoded.replace(raw, escaped)
    parts.append(b"data: " + encoded + b"\n\n")
    return b"".join(parts)


PING = b": ping\n\n"

def sse_stream(body: AsyncIterator[bytes], *, name: str, watch: LogWatch, who: Principal, most: int) -> StreamingResponse:
    """Wrap ``body`` with the retry hint, heartbeats, shutdown and the gauge, once ``who``'s organization
    has room for one more stream (:meth:`LogWatch.admit`, ``most``; 429 otherwise).

    ``body`` yields ``b""`` when it has nothing to say after a wait; that is
    where heartbeats go out.
    """

    async def framed() -> AsyncIterator[bytes]:
        gauge = metrics.SSE_STREAMS.labels(stream=name)
        gauge.inc()
        try:
            yield b"retry: %d\n\n" % RETRY_MS
            last_sent = time.monotonic()
            async for chunk in body:
                if watch.stopped:
                    break
                if chunk:
                    last_sent = time.monotonic()
                    yield chunk
                elif time.monotonic() - last_sent >= PING_SECONDS:
                    last_sent = time.monotonic()
                    yield PING
        finally:
            gauge.dec()
            await body.aclose()  # type: ignore[attr-defined]

    watch.admit(who.organization_id, most)
    return _CountedStream(framed(), media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                          leave=lambda: watch.leave(who.organization_id))  # fmt: skip


class _CountedStream(StreamingResponse):
    """A stream that gives back its organization's place when the response ends, however it ends: also
    when the client left before its body was ever started (the body's own ``finally`` never runs then)."""

    def __init__(self, *args: Any, leave: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._leave = leave

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._leave()


def wait_budget(poll_seconds: float) -> float:
    """How long a stream may wait for a hint before it re-reads anyway or pings."""
    return min(jittered(poll_seconds), PING_SECONDS)
