"""Fuzzing the live API from its own OpenAPI document (schemathesis).

Every operation in ``/openapi.json`` gets schema-conforming and
schema-violating requests (schemathesis' positive and negative modes, a
bounded number per operation) with a valid credential of the kind the
operation takes: an all-scopes API key, or a node credential. Two promises are
checked on every request:

* no 5xx: whatever arrives, the answer is a response with an error code, never
  a server error;
* a refused request (4xx) writes nothing: the log, the jobs, nodes, models,
  pairing codes, credentials and node liveness are the same after it. Only the
  pairing rate limit's attempt times (``pairing_attempt_times``) are meant to move on a
  refused redemption, so they are left out.

Twenty examples per operation keep the suite fast; ``UMBRA_FUZZ_EXAMPLES``
asks for more (400 each take about five minutes on two cores, and reach
inputs and states the short run rarely does).

The server runs once for the module with long leases and no staleness, so
the sweeper (which legitimately writes on its own) stays idle while requests
are compared. Long-polls are asked for ``wait=0`` (a valid value) so a claim
returns at once, and event streams are opened and closed.
"""

from __future__ import annotations

import copy
import os
import uuid

import httpx
import msgspec
import psycopg
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from psycopg import conninfo, sql
from schemathesis.config import SchemathesisConfig

from tests.conftest import LiveServer
from umbra.api.app import all_routes
from umbra.api.openapi import build_document, openapi_path

#: The document exactly as the server serves it (JSON, so tuples are lists).
#: schemathesis' strategies draw from the ``random`` module, which hypothesis deprecates; that is its
#: business, not a defect of this API, so that one warning is not turned into an error here.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")

DOCUMENT = msgspec.json.decode(msgspec.json.encode(build_document(all_routes())))
CONFIG = SchemathesisConfig.from_dict({"generation": {"mode": "all"}, "phases": {"coverage": {"enabled": False}}})
schema = schemathesis.openapi.from_dict(copy.deepcopy(DOCUMENT), config=CONFIG)  # it annotates what it is given

#: How the operation authenticates, from the route table (``x-umbra-auth``).
AUTH = {(info.method, openapi_path(info.path)): info.auth
        for route in all_routes() if (info := getattr(route, "endpoint_info", None))}  # fmt: skip
STREAMS = {(info.method, openapi_path(info.path))
           for route in all_routes() if (info := getattr(route, "endpoint_info", None)) and info.produces == "text/event-stream"}  # fmt: skip

_FINGERPRINTED = ("event count", "last position", "jobs", "nodes", "node_liveness", "models", "pairing_codes",
                  "node_credentials", "api_keys")
_FINGERPRINT = """
SELECT (SELECT count(*) FROM events), (SELECT coalesce(max(position), 0) FROM events),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM jobs t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM nodes t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.node_id), '')) FROM node_liveness t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.organization_id, t.slug), '')) FROM models t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM pairing_codes t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM node_credentials t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM api_keys t)
"""


class Target:
    def __init__(self, server: LiveServer, db: psycopg.Connection, api_key: str, node_id: str, node_token: str) -> None:
        self.server, self.db, self.api_key, self.node_id, self.node_token = server, db, api_key, node_id, node_token

    def fingerprint(self) -> tuple:
        return tuple(self.db.execute(_FINGERPRINT).fetchone())

    def what_changed(self, before: tuple) -> str:
        """The parts of the fingerprint that moved, and the events appended since ``before``: a failure says who wrote."""
        after = self.fingerprint()
        moved = [name for name, a, b in zip(_FINGERPRINTED, before, after) if a != b]
        events = self.db.execute(
            "SELECT position, stream, type, metadata::text FROM events WHERE position > %s ORDER BY position", (before[1],)
        ).fetchall()
        return f"changed: {', '.join(moved)}; events since: {events}"


@pytest.fixture(scope="module")
def target(pg_server_url, template_db):
    """One live server for the module, on its own database with an organization and a paired node."""
    name = f"umbra_fuzz_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template_db)))
    url = conninfo.make_conninfo(pg_server_url, dbname=name)
    env = {"UMBRA_LEASE_SECONDS": "3600", "UMBRA_HEARTBEAT_STALE_SECONDS": "86400", "UMBRA_SWEEP_INTERVAL_SECONDS": "0.5"}
    try:
        with LiveServer(url, **env) as server, psycopg.connect(url, autocommit=True) as db:
            yield _populate(server, db)
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _populate(server: LiveServer, db: psycopg.Connection) -> Target:
    import anyio

    from umbra.compute.accounts import create_organization

    async def organization():
        async with await psycopg.AsyncConnection.connect(server.settings.database_url, autocommit=True) as c:
            return await create_organization(c, "fuzz")

    _, key = anyio.run(organization)
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=server.url) as client:
        code = client.post("/v1/pairings", json={"name": "fuzz-node"}, headers=auth).json()["code"]
        device = {"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000}
        redeemed = client.post("/v1/pairings/redeem", json={"code": code, "name": "fuzz-node", "devices": [device]}).json()
        token = redeemed["credential"]
        assert client.post("/v1/agent/heartbeat", json={"devices": [device]}, headers={"Authorization": f"Bearer {token}"}).status_code == 200
        for i in range(3):
            assert client.post("/v1/jobs", json={"kind": "echo", "payload": {"i": i}}, headers=auth).status_code == 201
    return Target(server, db, key, redeemed["node_id"], token)


def _bounded_wait(case) -> None:
    """A claim's or a job read's ``wait`` within 0..60 becomes 0, so the fuzz never parks on a long-poll.

    An empty ``wait=`` is the default (a claim's 30 s), as an absent one is.
    """
    query = dict(case.query or {})
    raw = query.get("wait")
    if raw is None or raw == "" or (isinstance(raw, (int, str)) and str(raw).isdigit() and int(raw) <= 60):
        query["wait"] = 0
    case.query = query


def _real_ids(case, target: Target) -> None:
    """Point about half the generated ``{id}``s at real jobs (and node reads at the real node).

    Random UUIDs only ever reach the "not found" answer; real ids reach the
    commands' own refusals (not the holder, terminal, attempt mismatch...).
    The choice follows the generated id, so it is reproducible.
    """
    params = case.path_parameters or {}
    generated = str(params.get("id", ""))
    if not generated or generated[0] not in "01234567":
        return
    if case.path.startswith("/v1/nodes/"):
        if case.path == "/v1/nodes/{id}":  # drain/retire/revoke of the one node would end the run's credential
            case.path_parameters = {**params, "id": target.node_id}
        return
    ids = [row[0] for row in target.db.execute("SELECT id::text FROM jobs ORDER BY seq").fetchall()]
    if ids:
        case.path_parameters = {**params, "id": ids[int(generated[0], 16) % len(ids)]}


def test_the_live_document_is_the_one_fuzzed(target):
    assert httpx.get(f"{target.server.url}/openapi.json").json() == DOCUMENT


def test_every_path_template_names_its_parameters():
    import re

    for path, item in DOCUMENT["paths"].items():
        for operation in item.values():
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert set(re.findall(r"{([^}]+)}", path)) == declared, path


@schema.parametrize()
@settings(max_examples=int(os.environ.get("UMBRA_FUZZ_EXAMPLES", "20")), deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_refusals_write_nothing(case, target):
    key = (case.method.upper(), case.path)
    # A method the path does not declare (negative mode tries them) authenticates like the path's others.
    auth = AUTH.get(key) or next(a for (_, path), a in AUTH.items() if path == case.path)
    headers = dict(case.headers or {})
    if auth != "none":
        headers["Authorization"] = f"Bearer {target.node_token if auth == 'node' else target.api_key}"
    case.headers = headers
    if key in (("POST", "/v1/agent/claim"), ("GET", "/v1/jobs/{id}")):
        _bounded_wait(case)
    _real_ids(case, target)
    before = target.fingerprint()
    # requests (what schemathesis sends with), streaming so an event stream is opened and closed, not read.
    with requests.request(**case.as_transport_kwargs(base_url=target.server.url), timeout=30, stream=True) as response:
        status = response.status_code
        text = "" if key in STREAMS and status == 200 else response.text[:300]
    assert status < 500, f"{case.method} {case.formatted_path}: {status} {text}"
    if 400 <= status < 500:
        assert target.fingerprint() == before, (
            f"{case.method} {case.formatted_path} was refused ({status}) but wrote: {target.what_changed(before)}"
        )
