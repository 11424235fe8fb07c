"""Routes that describe themselves.

Every API route is declared with :func:`endpoint`, which records its request
struct, its auth (which credential kind and scopes) and a summary on the Route.
The OpenAPI document is generated from these records and the same structs that
validate requests, and the tenant-isolation test walks the same table, so a new
endpoint cannot be left out of either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


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
    #: "application/json" or "text/event-stream".
    produces: str = "application/json"


Handler = Callable[[Request], Awaitable[Response]]


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
    produces: str = "application/json",
) -> Route:
    route = Route(path, handler, methods=[method])
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
    )
    return route
