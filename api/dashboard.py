"""The live dashboard: one static page at ``/`` and its two assets.

There is no build step: ``api/static/`` holds plain HTML, CSS and JavaScript,
read once at import. The page itself carries no data and needs no credential;
it asks for an API key, keeps it in the browser's localStorage, and reads the
JSON API (``/v1/projections/*``) like any other client, so it can never show
more than that key may see.

Only the three known files are served (a fixed table, not a directory), and
every answer carries a Content-Security-Policy that allows scripts and styles
from this origin only, so nothing injected into a job's payload or a node name
can run in an operator's browser.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from umbra.errors import NotFound

from .routing import endpoint

STATIC_DIR = Path(__file__).parent / "static"

_ASSETS: dict[str, tuple[bytes, str]] = {
    name: ((STATIC_DIR / name).read_bytes(), media_type)
    for name, media_type in {
        "dashboard.html": "text/html; charset=utf-8",
        "dashboard.css": "text/css; charset=utf-8",
        "dashboard.js": "text/javascript; charset=utf-8",
    }.items()
}

_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> Response:
    body, media_type = _ASSETS[name]
    return Response(body, media_type=media_type, headers=_HEADERS)


async def page(request: Request) -> Response:
    return _asset("dashboard.html")


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name == "dashboard.html" or name not in _ASSETS:
        raise NotFound("not_found", "No such file.")
    return _asset(name)


routes = [
    endpoint(
        "GET",
        "/",
        page,
        summary="The live dashboard page (HTML; it asks for an API key and reads the projections).",
        auth="none",
        produces="text/html",
    ),
    endpoint(
        "GET",
        "/static/{name}",
        asset,
        summary="The dashboard's stylesheet and script (dashboard.css, dashboard.js).",
        auth="none",
        produces=("text/css", "text/javascript"),
        errors={404: "No such asset (`not_found`)."},
    ),
]
