"""Routes that describe themselves.

Every API route is declared with :func:`endpoint`, which records its request
struct, its auth (which credential kind and scopes), its answers and a summary
on the Route. The refusals a route answers because of its declaration (a
credential, a path id, a body, query parameters) follow from it by
:func:`refusals`; a route names only those particular to it.
The OpenAPI document is generated from these records and the same structs that
validate requests, and the tenant-isolation test walks the same table, so a new
endpoint cannot be left out of either.

A route declared without a body still receives whatever the client sends, and
the size limit (:mod:`umbra.api.middleware`) is enforced on a body only as it
is read. So the handler of such a route runs only once the body has been read
to its end (nothing at all, for a client that sends none): one past the limit
is refused with 413 before the route authenticates or changes anything, as a
declared ``Content-Length`` past it already is.

Handlers authenticate, and check the scope, before they look at path ids,
query parameters or the body: a caller without a credential learns 401, and
one without the scope 403, whatever else its request holds.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Match, Route, Router
from starlette.types import Receive, Scope, Send


@dataclass(frozen=True)
class EndpointInfo:
    method: str
    path: str
    summary: str
    #: "api_key", "node", "none" (unauthenticated) or "api_key|node".
    auth: str
    #: Any one of these scopes suffices.
    scopes: tuple[str, ...] = ()
    #: msgspec Struct type of the JSON body, if any.
    body: type | None = None
    #: Query parameters: name -> (python type, required, description).
    query: dict[str, tuple[type, bool, str]] = field(default_factory=dict)
    #: Status codes this endpoint answers with on success.
    success: tuple[int, ...] = (200,)
    #: msgspec type of the success body (for the OpenAPI document), if any.
    response: Any = None
    #: "application/json", "text/event-stream"...; several when the answer's type depends on what is asked for.
    produces: str | tuple[str, ...] = "application/json"
    #: Refusals particular to this route: status -> when. Those that follow from the declaration
    #: itself (auth, path id, body, query) are added by :func:`refusals` and need not be repeated.
    errors: dict[int, str] = field(default_factory=dict)
    #: msgspec type of the refusals' body, when it is not the shared ``{"error", "message"}``.
    error_body: Any = None


#: Refusals a route answers because of how it is declared (API.md "Conventions" and "Where this
#: server pins the contract down"); each rule is (applies to the declaration?, status, when).
_RULES: tuple[tuple[Callable[[EndpointInfo], bool], int, str], ...] = (
    (lambda i: i.auth != "none", 401, "No, unknown or revoked token (`unauthenticated`)."),
    (lambda i: i.auth != "none", 403, "The token lacks the scope, or is of the wrong kind (`forbidden`)."),
    (lambda i: "{id}" in i.path, 404,
     "No such object in this organization (`job_not_found`, `node_not_found`...); another's reads the same."),
    (lambda i: i.method in ("POST", "PUT", "PATCH"), 413,
     "The body is over 1 MiB (`payload_too_large`); nothing is done."),
    (lambda i: i.body is not None or bool(i.query), 422,
     "The body or a query parameter is invalid (`invalid_request`, naming the field)."),
    (lambda i: i.auth != "none", 429,
     "Too many wrong secrets for this token's prefix lately (`rate_limited`, with `Retry-After`)."),
    (lambda i: i.auth != "none", 503,
     "The database is unavailable (`database_unavailable`, with `Retry-After: 1`); send the request again."),
)


def refusals(info: EndpointInfo) -> dict[int, str]:
    """Every refusal ``info``'s route answers, by status: the rules' and its own (which win on a status both name).

    Rules rather than lists per route, so a new route declares only what is particular to it.
    """
    found = {status: text for applies, status, text in _RULES if applies(info)}
    found.update(info.errors)
    return dict(sorted(found.items()))


Handler = Callable[[Request], Awaitable[Response]]


def matching_whole_path(route: Any) -> Any:
    """``route``, matching only a path that ends where its pattern does.

    Starlette ends a route's pattern with ``$``, which also matches before a
    path's last newline: ``PUT /v1/models/gemma%0A`` reached the route as
    ``gemma``, and changed a model the client did not name. With ``\\Z`` such a
    path matches no route (404).
    """
    pattern = getattr(route, "path_regex", None)
    if pattern is not None and pattern.pattern.endswith("$"):
        route.path_regex = re.compile(pattern.pattern[:-1] + r"\Z")
    return route


def redirect_trailing_slash(router: Router) -> None:
    """Answer a path written with a trailing slash (``/v1/jobs/``) with a redirect *relative to the request*.

    Starlette's own redirect names an absolute address built from what the
    server sees: behind a proxy that ends TLS, ``http://`` — a client that
    follows a 307 sends its body, and perhaps its key, again in the clear. A
    path alone (with the query) keeps the client on the scheme and host it
    used. Any other unknown path is the router's 404, as before.
    """
    router.redirect_slashes = False
    not_found = router.not_found

    async def default(scope: Scope, receive: Receive, send: Send) -> None:
        raw_path = scope.get("raw_path") or scope["path"].encode()
        if scope["type"] == "http" and scope["path"] != "/" and scope["path"].endswith("/"):
            stripped = dict(scope, path=scope["path"].rstrip("/"))
            if any(route.matches(stripped)[0] is not Match.NONE for route in router.routes):
                query = scope.get("query_string") or b""
                location = raw_path.rstrip(b"/").decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
                await RedirectResponse(location or "/", status_code=307)(scope, receive, send)
                return
        await not_found(scope, receive, send)

    router.default = default


def endpoint(
    method: str,
    path: str,
    handler: Handler,
    *,
    summary: str,
    auth: str,
    scopes: tuple[str, ...] = (),
    body: type | None = None,
    query: dict[str, tuple[type, bool, str]] | None = None,
    success: tuple[int, ...] = (200,),
    response: Any = None,
    produces: str | tuple[str, ...] = "application/json",
    errors: dict[int, str] | None = None,
    error_body: Any = None,
) -> Route:
    route = Route(path, handler if body is not None else _bodiless(handler), methods=[method])
    route.endpoint_info = EndpointInfo(  # type: ignore[attr-defined]
        method=method,
        path=path,
        summary=summary,
        auth=auth,
        scopes=scopes,
        body=body,
        query=query or {},
        success=success,
        response=response,
        produces=produces,
        errors=errors or {},
        error_body=error_body,
    )
    return route


def _bodiless(handler: Handler) -> Handler:
    """``handler``, run once the body it does not expect has arrived whole and within the limit."""

    @functools.wraps(handler)
    async def within_the_limit(request: Request) -> Response:
        # Read and kept (nothing, as a rule), not discarded: the handler may still read it.
        await request.body()
        return await handler(request)

    return within_the_limit
