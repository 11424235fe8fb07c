"""Request context for every route: request id, body-size limit, access log, counters.

Pure ASGI, not ``BaseHTTPMiddleware``: streaming responses (SSE) and the
long-poll's disconnect watch need ``receive``/``send`` untouched in timing.

* **Request id.** A well-formed ``X-Request-ID`` from the client is kept (so a
  trace spans the caller and us), anything else is replaced by a fresh one; it
  is echoed on the response and available to handlers as
  ``request.state.request_id`` (for event metadata).
* **Body limit.** A declared ``Content-Length`` over the limit is refused with
  413 before the application runs; a chunked body is counted as it arrives and
  refused the moment it passes the limit (a route declared without a body
  reads it before its handler runs, :mod:`umbra.api.routing`, so it is counted
  there too). Either way nothing is written.
* **No stored copies.** An answer to a request carrying a credential (an
  ``Authorization`` header, or a stream's ``?access_token=``) is
  ``Cache-Control: no-store`` unless its route said otherwise: it holds the
  organization's data, and neither a browser nor a proxy should keep it.
* **Access log.** One structured line per request: id, method, path (never the
  query string, which is where a careless client would put a secret), route
  template, status, duration, client, and who called (credential id and
  organization, never the token). Headers are not logged at all.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, Sequence

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from umbra import metrics

from .errors import unexpected_error
from .http import MAX_BODY_BYTES, IPNetwork, PayloadTooLarge, forwarded_client, json_response
from .params import integer

log = logging.getLogger(__name__)

#: A client's ``X-Request-ID`` kept as the request's id (any other is replaced by a fresh one). ``$`` alone
#: also matches before a final newline (msgspec validates a body's with ``re.search``): ``(?!\n)`` refuses it.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:@-]{1,128}$(?!\n)"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id":
            candidate = value.decode("latin-1").strip()
            if _REQUEST_ID.match(candidate):
                return candidate
            break
    return uuid.uuid4().hex


def _credentialed(scope: Scope) -> bool:
    """Whether the request carries a credential: an ``Authorization`` header, or a stream's ``?access_token=``."""
    return any(name == b"authorization" for name, _ in scope["headers"]) or b"access_token=" in scope.get("query_string", b"")


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return integer(value.decode("latin-1"))
    return None


class RequestContext:
    def __init__(self, app: ASGIApp, *, route_templates: dict[Any, str], max_body: int = MAX_BODY_BYTES,
                 trusted_proxies: Sequence[IPNetwork] = ()) -> None:  # fmt: skip
        self.app = app
        self.max_body = max_body
        #: ``UMBRA_TRUSTED_PROXIES``: the access log names the client behind them, as the rate limit does
        #: (by its address: the rate limit counts an IPv6 one by its network, :func:`umbra.api.http.address_block`).
        self.trusted_proxies = trusted_proxies
        #: endpoint function -> path template, for bounded metric labels.
        self.route_templates = route_templates

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(scope["headers"])
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["received_at"] = time.monotonic()  # what ``Umbra-Held-Seconds`` counts from (``api.agent``)
        status = 500
        credentialed = _credentialed(scope)

        responded = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, responded
            if message["type"] == "http.response.start":
                status = message["status"]
                responded = True
                headers = MutableHeaders(scope=message)
                headers["X-Request-ID"] = request_id
                if credentialed and "cache-control" not in headers:
                    headers["Cache-Control"] = "no-store"
            await send(message)

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise PayloadTooLarge()
            return message

        try:
            declared = _declared_length(scope["headers"])
            if declared is not None and declared > self.max_body:
                exc = PayloadTooLarge()
                await json_response(exc.to_json(), status=exc.status)(scope, receive, send_with_id)
            else:
                try:
                    await self.app(scope, limited_receive, send_with_id)
                except Exception as exc:
                    if responded:
                        raise
                    # Answered here: Starlette's outermost handler re-raises after answering, and
                    # uvicorn then drops the connection, so a keep-alive client lost the 500 itself.
                    response = await unexpected_error(Request(scope), exc)
                    await response(scope, receive, send_with_id)
        finally:
            self._record(scope, request_id, status, time.perf_counter() - started)

    def _record(self, scope: Scope, request_id: str, status: int, seconds: float) -> None:
        route = self.route_templates.get(scope.get("endpoint"), "unmatched")
        metrics.HTTP_REQUESTS.labels(method=scope["method"], route=route, status=str(status)).inc()
        if not log.isEnabledFor(logging.INFO):
            return
        who = scope.get("state", {}).get("principal")
        peer = scope.get("client")
        client = forwarded_client(peer[0], Headers(scope=scope).getlist("x-forwarded-for"), self.trusted_proxies) if peer else None
        log.info(
            "request",
            extra={
                "action": "http_request",
                "request_id": request_id,
                "method": scope["method"],
                "path": scope["path"],
                "route": route,
                "status": status,
                "duration_ms": round(seconds * 1000, 2),
                "client": client,
                "credential_id": str(who.credential_id) if who is not None else None,
                "organization_id": str(who.organization_id) if who is not None else None,
            },
        )
