"""Which refusal comes first: the body's size, then the credential, then its scope, then the request's values.

API.md: no, unknown or revoked token → 401 ``unauthenticated``; a token
without the scope → 403 ``forbidden``. Those answers do not depend on what
else the request holds: a caller without a credential learns nothing about
which path ids, query parameters or bodies the route would accept.

The probes are generated from the route table (``api.app.all_routes()`` and
each route's ``EndpointInfo``), so a new route, path parameter or query
parameter is probed without anyone listing it. Each probe makes one thing
invalid (a path id, one query parameter, the ``Last-Event-ID`` of a stream,
the body), and a control request with a credential that may use the route
shows that the probe is refused for that thing (404 or 422), so it proves
something.

A body the route does not take is still held to the 1 MiB limit: a chunked
one (no ``Content-Length`` for the middleware to refuse up front) is refused
with 413 before the route does anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import httpx
import pytest

from umbra.api.app import all_routes
from umbra.compute.accounts import create_api_key
from umbra.compute.auth import API_KEY_SCOPES
from tests.helpers import bearer

from .route_credentials import holding_the_scopes, lacking_the_scopes

pytestmark = pytest.mark.anyio

_PATH_PARAM = re.compile(r"{([^}:]+)(?::[^}]+)?}")

#: A value each kind of query parameter refuses (every one the API has takes a bounded integer,
#: a boolean word, or one of a few words); the control request proves it is refused.
INVALID_QUERY = {int: "-1", bool: "maybe", str: "bogus", list[str]: ""}
#: Query parameters no value of which is refused as such, and why.
NOT_VALIDATED = {"access_token": "the credential itself, for EventSource clients: a wrong one is 401"}
#: A path parameter no value of which is refused as such: any slug names a model (one that may not exist yet).
FREE_PATH_PARAMS = {"slug"}

CPU = {"kind": "cpu", "label": "cpu0", "ram_total_mb": 16384, "ram_free_mb": 16000}


@dataclass(frozen=True)
class Probe:
    method: str
    path: str
    info: Any
    #: What is invalid: "nothing", "path", "query:<name>", "header:<name>" or "body".
    invalid: str
    params: dict[str, str]
    headers: dict[str, str]
    body: bytes | None

    def __str__(self) -> str:
        return f"{self.method} {self.path} [{self.invalid}]"


def authenticated_routes() -> list[tuple[str, Any]]:
    out = []
    for route in all_routes():
        info = getattr(route, "endpoint_info", None)
        if info is not None and info.auth != "none":
            out.append((route.path, info))
    return out


def _path(template: str, *, invalid: bool) -> str:
    def value(match: re.Match) -> str:
        if match.group(1) in FREE_PATH_PARAMS:
            return "probe-model"
        return "not-a-uuid" if invalid else str(uuid4())

    return _PATH_PARAM.sub(value, template)


def probes() -> list[Probe]:
    """For every authenticated route: one probe with nothing invalid, then one per invalid thing."""
    out = []
    for template, info in authenticated_routes():
        method = info.method

        def probe(invalid: str, *, path: str | None = None, params=None, headers=None, body=None) -> Probe:
            return Probe(method, path or _path(template, invalid=False), info, invalid, params or {}, headers or {}, body)

        out.append(probe("nothing"))
        if any(name not in FREE_PATH_PARAMS for name in _PATH_PARAM.findall(template)):
            out.append(probe("path", path=_path(template, invalid=True)))
        for name, (python_type, _, _) in info.query.items():
            if name in NOT_VALIDATED:
                continue
            if python_type not in INVALID_QUERY:
                raise AssertionError(f"{method} {template}: add an invalid value for a {python_type.__name__} parameter")
            out.append(probe(f"query:{name}", params={name: INVALID_QUERY[python_type]}))
        if info.produces == "text/event-stream" and "after" in info.query:
            out.append(probe("header:Last-Event-ID", headers={"Last-Event-ID": "-1"}))
        if info.body is not None:
            out.append(probe("body", body=b'{"not": json'))
    return out


async def _send(client: httpx.AsyncClient, probe: Probe, token: str | None) -> httpx.Response:
    headers = {**probe.headers, **(bearer(token) if token else {})}
    if probe.body is not None:
        headers["Content-Type"] = "application/json"
    return await client.request(probe.method, probe.path, params=probe.params, headers=headers, content=probe.body)


def outcome(answer: httpx.Response) -> tuple[int, str | None]:
    """The status and error code (None for an answer that is not a JSON error)."""
    try:
        return answer.status_code, answer.json().get("error")
    except (ValueError, AttributeError):
        return answer.status_code, None


_FINGERPRINT = """
SELECT (SELECT count(*) FROM events), (SELECT coalesce(max(position), 0) FROM events),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM jobs t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM nodes t),
       (SELECT count(*) FROM models), (SELECT count(*) FROM pairing_codes),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM node_credentials t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM api_keys t)
"""


async def fingerprint(conn) -> tuple:
    return tuple(await (await conn.execute(_FINGERPRINT)).fetchone())


@dataclass
class Callers:
    key: str
    node: str
    node_id: str
    #: Keys holding one API-key scope each.
    scoped: dict[str, str]


@pytest.fixture
async def callers(client, conn, org) -> Callers:
    org_id, key = org
    scoped = {scope: await create_api_key(conn, org_id, [scope]) for scope in API_KEY_SCOPES}
    code = (await client.post("/v1/pairings", json={"name": "probe-node"}, headers=bearer(key))).json()["code"]
    redeemed = await client.post("/v1/pairings/redeem", json={"code": code, "name": "probe-node", "devices": [CPU]})
    assert redeemed.status_code == 201, redeemed.text
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [CPU]}, headers=bearer(redeemed.json()["credential"]))
    assert beat.status_code == 200, beat.text
    return Callers(key, redeemed.json()["credential"], redeemed.json()["node_id"], scoped)


def test_every_authenticated_route_and_parameter_is_probed():
    made = probes()
    assert {(p.method, p.info.path) for p in made} == {(info.method, path) for path, info in authenticated_routes()}
    invalid = {(p.method, p.info.path, p.invalid) for p in made}
    for expected in [("GET", "/v1/jobs", "query:limit"), ("GET", "/v1/jobs", "query:status"),
                     ("GET", "/v1/jobs/{id}", "path"), ("GET", "/v1/jobs/{id}", "query:as_of"),
                     ("GET", "/v1/events", "query:after"), ("GET", "/v1/events/stream", "header:Last-Event-ID"),
                     ("GET", "/v1/projections/queue", "query:limit"), ("GET", "/v1/projections/stream", "query:views"),
                     ("POST", "/v1/jobs/{id}/cancel", "path"), ("GET", "/v1/jobs/{id}/explain", "path"),
                     ("GET", "/v1/jobs/{id}/events", "path"), ("GET", "/v1/nodes/{id}", "path"),
                     ("POST", "/v1/nodes/{id}/drain", "path"), ("POST", "/v1/agent/claim", "query:wait"),
                     ("POST", "/v1/agent/jobs/{id}/complete", "query:claim_next"),
                     ("POST", "/v1/agent/complete", "query:claim_next"), ("POST", "/v1/agent/jobs/{id}/renew", "path"),
                     ("POST", "/v1/jobs/batch", "body"), ("PUT", "/v1/models/{slug:path}", "body")]:  # fmt: skip
        assert expected in invalid, expected


async def test_no_credential_gets_401_before_path_query_or_body_validation(client, conn, callers):
    made = probes()
    before = await fingerprint(conn)
    failures = []
    for probe in made:
        for token in (None, "uk_unknown_notasecret"):
            answer = await _send(client, probe, token)
            if outcome(answer) != (401, "unauthenticated"):
                failures.append(f"{probe} with {token or 'no token'}: {answer.status_code} {answer.text[:200]}")
    assert failures == [], "\n".join(failures)
    assert await fingerprint(conn) == before


async def test_a_credential_without_the_scope_gets_403_before_path_query_or_body_validation(client, conn, callers):
    made = probes()
    before = await fingerprint(conn)
    failures = []
    for probe in made:
        for name, token in lacking_the_scopes(probe.info, callers.key, callers.node, callers.scoped):
            answer = await _send(client, probe, token)
            if outcome(answer) != (403, "forbidden"):
                failures.append(f"{probe} as {name}: {answer.status_code} {answer.text[:200]}")
    assert failures == [], "\n".join(failures)
    assert await fingerprint(conn) == before


async def test_with_the_scope_each_probe_is_refused_for_what_it_makes_invalid(client, conn, callers):
    """The control: the probes above would have been refused for their path, query or body."""
    made = [probe for probe in probes() if probe.invalid != "nothing"]
    before = await fingerprint(conn)
    failures = []
    for probe in made:
        for name, token in holding_the_scopes(probe.info, callers.key, callers.node):
            answer = await _send(client, probe, token)
            error = outcome(answer)[1] or ""
            if probe.invalid == "path":
                ok = answer.status_code == 404 and error.endswith("not_found")
            elif probe.invalid == "body":
                ok = answer.status_code in (400, 422) and error == "invalid_request"
            else:
                field = answer.json().get("field") if error else None
                ok = (answer.status_code, error, field) == (422, "invalid_request", probe.invalid.split(":")[1])
            if not ok:
                failures.append(f"{probe} as {name}: {answer.status_code} {answer.text[:200]}")
    assert failures == [], "\n".join(failures)
    assert await fingerprint(conn) == before


async def _oversized():
    for _ in range(40):  # 2.5 MiB, chunked: no Content-Length for the middleware to refuse up front
        yield b"x" * (64 * 1024)


async def test_a_body_a_route_does_not_take_is_still_refused_past_the_limit(client, conn, callers):
    """Every route declared without a body, called with what it would act on (a queued job, a live node)."""
    job = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(callers.key))).json()
    objects = {"/v1/jobs/{id}": job["id"], "/v1/nodes/{id}": callers.node_id, "/static/{name}": "dashboard.css",
               "/v1/models/{slug:path}": "m"}
    before = await fingerprint(conn)
    failures = []
    routes = [(route.path, route.endpoint_info) for route in all_routes()
              if getattr(route, "endpoint_info", None) is not None and route.endpoint_info.body is None]  # fmt: skip
    assert {("POST", "/v1/jobs/{id}/cancel"), ("POST", "/v1/agent/claim"), ("POST", "/v1/nodes/{id}/revoke")} <= {
        (info.method, path) for path, info in routes}  # fmt: skip
    for template, info in routes:
        named = [value for prefix, value in objects.items() if template.startswith(prefix)]
        path = _PATH_PARAM.sub(named[0], template) if named else template
        assert "{" not in path, f"{template}: add an object for its path"
        token = callers.node if info.auth == "node" else callers.key
        try:
            answer = await client.request(info.method, path, headers=bearer(token), content=_oversized())
        except httpx.TransportError as exc:  # the server may close before the client has sent it all
            failures.append(f"{info.method} {template}: no answer ({exc!r})")
            continue
        if outcome(answer) != (413, "payload_too_large"):
            failures.append(f"{info.method} {template}: {answer.status_code} {answer.text[:200]}")
    assert failures == [], "\n".join(failures)
    assert await fingerprint(conn) == before
    still = await client.get(f"/v1/jobs/{job['id']}", headers=bearer(callers.key))
    assert (still.status_code, still.json()["status"]) == (200, "queued")
