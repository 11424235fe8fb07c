"""Tenant isolation, route by route: organization B never reaches organization A.

The cases are generated from the route table (``api.app.all_routes()`` and
each route's ``EndpointInfo``), so a new route is either covered by a rule
here or listed in :data:`NOT_TENANT_SCOPED` with a reason;
:func:`test_every_route_has_a_matrix_entry` fails otherwise.

* A route with an object in its path (``{id}``, ``{slug}``) is called with B's
  credentials against A's object: a credential of the right kind with the
  route's scopes gets exactly what it gets for an id that does not exist (404,
  same code), one without the scopes gets 403, and A's own credential gets
  something other than 404 (so the object was real).
* A ``GET`` route without a path object is a listing: B's answer never holds
  any of A's ids, names or payload markers; A's answer holds at least one.
* The remaining routes name objects in their bodies (a project, an
  idempotency key, a node name) or take their subject from the credential
  (claim, heartbeat); each has an explicit case.

Every refused probe is also checked to have written nothing anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import anyio
import httpx
import pytest

from umbra.api.agent_jobs import ChildrenRequest, CompleteRequest, FailRequest, GiveBackRequest, RenewRequest
from umbra.api.app import all_routes
from umbra.api.jobs import PriorityRequest, RetryRequest
from umbra.api.models import ModelRequest
from umbra.api.nodes import CordonRequest, UncordonRequest
from umbra.compute.accounts import create_api_key, create_organization, create_project
from umbra.compute.auth import API_KEY_SCOPES
from tests.helpers import bearer

from .route_credentials import holding_the_scopes, lacking_the_scopes

pytestmark = pytest.mark.anyio

#: Routes with no tenant-scoped object, and why.
NOT_TENANT_SCOPED = {
    ("GET", "/healthz"): "process liveness; reads nothing of any tenant",
    ("GET", "/readyz"): "database readiness and migration state; no tenant data",
    ("GET", "/openapi.json"): "the API's own description, the same for everyone",
    ("GET", "/"): "the static dashboard page; its data comes from authenticated routes",
    ("GET", "/static/{name}"): "static dashboard assets",
    ("GET", "/metrics"): "unauthenticated process metrics: aggregates by status and route only "
                         "(test_metrics_name_no_tenant checks that no id or name appears)",
    ("POST", "/v1/pairings/redeem"): "unauthenticated: the single-use code alone decides the organization",
}  # fmt: skip

#: A valid body for each request struct an object route may take.
BODIES: dict[type, dict[str, Any]] = {
    RenewRequest: {"attempt": 1},
    CompleteRequest: {"attempt": 1, "result": {"stolen": True}},
    FailRequest: {"attempt": 1, "error": "stolen", "retry": False},
    GiveBackRequest: {"attempt": 1},
    ChildrenRequest: {"attempt": 1, "children": [{"kind": "echo"}]},
    ModelRequest: {"vram_min_mb": 777},
    RetryRequest: {"max_attempts": 2},
    PriorityRequest: {"priority": 1},
    CordonRequest: {"device": "cpu0", "reason": "stolen"},
    UncordonRequest: {"device": "cpu0"},
}

#: Path prefix → the kind of object the route's ``{id}`` names.
OBJECT_KINDS = (("/v1/agent/jobs/{id}", "job"), ("/v1/jobs/{id}", "job"), ("/v1/nodes/{id}", "node"),
                ("/v1/models/{slug", "model"))  # fmt: skip

#: Routes whose subject is named in the body or taken from the credential.
SPECIAL = {
    ("POST", "/v1/jobs"),
    ("POST", "/v1/jobs/batch"),
    ("POST", "/v1/pairings"),
    ("POST", "/v1/agent/claim"),
    ("POST", "/v1/agent/claim/release"),
    ("POST", "/v1/agent/complete"),
    ("POST", "/v1/agent/heartbeat"),
    ("POST", "/v1/agent/offline"),
    ("POST", "/v1/projections/verify"),
}
_PATH_OBJECT = re.compile(r"{[^}]+}")


def route_table() -> list[tuple[tuple[str, str], Any]]:
    out = []
    for route in all_routes():
        info = getattr(route, "endpoint_info", None)
        methods = [info.method] if info else sorted(m for m in route.methods if m != "HEAD")
        out.extend(((method, route.path), info) for method in methods)
    return out


def object_kind(path: str) -> str | None:
    for prefix, kind in OBJECT_KINDS:
        if path.startswith(prefix):
            return kind
    return None


def classify(key: tuple[str, str], info: Any) -> str:
    """``object``, ``listing``, ``special`` or ``exempt``; raises for a route no rule covers."""
    method, path = key
    if key in NOT_TENANT_SCOPED:
        return "exempt"
    if key in SPECIAL:
        return "special"
    if info is None:
        raise AssertionError(f"{method} {path} is not declared with endpoint() and has no matrix entry")
    if _PATH_OBJECT.search(path):
        if object_kind(path) is None:
            raise AssertionError(f"{method} {path}: add its object kind to OBJECT_KINDS")
        if info.body is not None and info.body not in BODIES:
            raise AssertionError(f"{method} {path}: add a valid {info.body.__name__} to BODIES")
        return "object"
    if method == "GET" and info.auth != "none":
        return "listing"
    raise AssertionError(f"{method} {path} has no tenant-matrix entry: add a case or a NOT_TENANT_SCOPED reason")


def test_every_route_has_a_matrix_entry():
    kinds = {key: classify(key, info) for key, info in route_table()}
    assert {k for k, v in kinds.items() if v == "exempt"} == set(NOT_TENANT_SCOPED), "a stale exemption"
    assert {k for k, v in kinds.items() if v == "special"} == SPECIAL, "a stale special case"
    assert sum(v == "object" for v in kinds.values()) >= 10 and sum(v == "listing" for v in kinds.values()) >= 6


def test_an_unlisted_route_fails_the_matrix():
    from umbra.api.routing import endpoint

    async def handler(request):  # pragma: no cover - never called
        raise AssertionError

    new = endpoint("POST", "/v1/widgets", handler, summary="x", auth="api_key", scopes=("jobs:write",))
    with pytest.raises(AssertionError, match="no tenant-matrix entry"):
        classify(("POST", new.path), new.endpoint_info)
    odd = endpoint("GET", "/v1/widgets/{id}", handler, summary="x", auth="api_key", scopes=("jobs:read",))
    with pytest.raises(AssertionError, match="OBJECT_KINDS"):
        classify(("GET", odd.path), odd.endpoint_info)


# -- the world: two organizations, A's objects, B's credentials -------------------------


@dataclass
class World:
    a_key: str
    a_node_token: str
    b_key: str
    b_node_token: str
    #: B keys holding one scope each, for the 403 probes.
    b_scoped: dict[str, str]
    ids: dict[str, str]
    #: Strings that only A's data contains.
    markers: list[str]


async def _pair(client: httpx.AsyncClient, key: str, name: str) -> tuple[str, str]:
    code = (await client.post("/v1/pairings", json={"name": name}, headers=bearer(key))).json()["code"]
    device = {"kind": "cpu", "label": "cpu0", "ram_total_mb": 16384, "ram_free_mb": 16000}
    redeemed = await client.post("/v1/pairings/redeem", json={"code": code, "name": name, "devices": [device]})
    assert redeemed.status_code == 201, redeemed.text
    token = redeemed.json()["credential"]
    beat = await client.post("/v1/agent/heartbeat", json={"devices": [device]}, headers=bearer(token))
    assert beat.status_code == 200, beat.text
    return redeemed.json()["node_id"], token


@pytest.fixture
async def world(conn, live_server) -> World:
    a_org, a_key = await create_organization(conn, "alpha-tenant")
    b_org, b_key = await create_organization(conn, "beta-tenant")
    b_scoped = {scope: await create_api_key(conn, b_org, [scope]) for scope in API_KEY_SCOPES}
    project = await create_project(conn, a_org, "alpha-project")
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        a_node, a_node_token = await _pair(client, a_key, "alpha-node-7f3")
        _, b_node_token = await _pair(client, b_key, "beta-node")
        model = await client.put("/v1/models/alpha-secret-model:7b", json={"vram_min_mb": 1234}, headers=bearer(a_key))
        assert model.status_code == 200, model.text
        job = await client.post("/v1/jobs", headers=bearer(a_key), json={
            "kind": "echo", "payload": {"marker": "alpha-payload-5d1"}, "project_id": str(project),
            "idempotency_key": "alpha-key-1", "priority": 1})  # fmt: skip
        assert job.status_code == 201, job.text
        claimed = await client.post("/v1/agent/claim?wait=5", headers=bearer(a_node_token))
        assert claimed.status_code == 200 and claimed.json()["job"]["id"] == job.json()["id"]
        queued = await client.post("/v1/jobs", headers=bearer(a_key), json={"kind": "echo", "payload": {"n": 2}})
        assert queued.status_code == 201
    ids = {"job": job.json()["id"], "queued_job": queued.json()["id"], "node": a_node, "model": "alpha-secret-model:7b",
           "project": str(project), "org": str(a_org)}  # fmt: skip
    markers = [*ids.values(), "alpha-node-7f3", "alpha-payload-5d1", "alpha-key-1", "alpha-tenant"]
    return World(a_key, a_node_token, b_key, b_node_token, b_scoped, ids, markers)


_FINGERPRINT = """
SELECT (SELECT count(*) FROM events), (SELECT coalesce(max(position), 0) FROM events),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM jobs t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM nodes t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.organization_id, t.slug), '')) FROM models t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM pairing_codes t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM node_credentials t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM api_keys t)
"""


async def fingerprint(conn) -> tuple:
    """Everything a request could write, as counts and digests (liveness timestamps aside)."""
    return tuple(await (await conn.execute(_FINGERPRINT)).fetchone())


def leaked(world: World, body: str, *, asked: str | None = None) -> list[str]:
    """A's markers in ``body``, besides ``asked`` (the id the caller put in the path itself)."""
    if asked is not None:
        body = body.replace(asked, "")
    return [marker for marker in world.markers if marker in body]


def object_path(path: str, world: World, *, missing: bool = False) -> str:
    kind = object_kind(path)
    value = world.ids[kind] if not missing else ("beta-no-such-model" if kind == "model" else str(uuid4()))
    return _PATH_OBJECT.sub(value, path, count=1)


async def _call(client, method: str, path: str, token: str, body: dict | None) -> httpx.Response:
    return await client.request(method, path, headers=bearer(token), json=body)


async def test_object_routes_answer_another_organization_as_if_the_object_did_not_exist(conn, live_server, world):
    cases = [(key, info) for key, info in route_table() if classify(key, info) == "object"]
    failures: list[str] = []
    async with httpx.AsyncClient(base_url=live_server.url, timeout=15) as client:
        for (method, path), info in cases:
            body = BODIES.get(info.body) if info.body else None
            kind = object_kind(path)
            for name, token in holding_the_scopes(info, world.b_key, world.b_node_token, prefix="b_"):
                before = await fingerprint(conn)
                theirs = await _call(client, method, object_path(path, world), token, body)
                after = await fingerprint(conn)
                label = f"{method} {path} as {name}"
                if kind == "model":
                    # Slugs name models within an organization: B's PUT makes B's own model.
                    if theirs.status_code != 200 or leaked(world, theirs.text, asked=world.ids["model"]):
                        failures.append(f"{label}: {theirs.status_code} {theirs.text[:200]}")
                    continue
                missing = await _call(client, method, object_path(path, world, missing=True), token, body)
                if theirs.status_code != 404 or theirs.json().get("error") != missing.json().get("error"):
                    failures.append(f"{label}: {theirs.status_code} {theirs.text[:200]} (missing: {missing.status_code})")
                shown = leaked(world, theirs.text, asked=world.ids[kind])
                if shown:
                    failures.append(f"{label}: body shows {shown}")
                if before != after:
                    failures.append(f"{label}: a refused request wrote something")
            for name, token in lacking_the_scopes(info, world.b_key, world.b_node_token, world.b_scoped, prefix="b_"):
                before = await fingerprint(conn)
                answer = await _call(client, method, object_path(path, world), token, body)
                if answer.status_code != 403 or answer.json()["error"] != "forbidden" or leaked(world, answer.text, asked=world.ids[kind]):
                    failures.append(f"{method} {path} as {name}: {answer.status_code} {answer.text[:200]}")
                if await fingerprint(conn) != before:
                    failures.append(f"{method} {path} as {name}: a refused request wrote something")
        assert failures == [], "\n".join(failures)
        # A's model is untouched by B's PUT of the same slug.
        models = (await client.get("/v1/models", headers=bearer(world.a_key))).json()["models"]
        assert [(m["slug"], m["vram_min_mb"]) for m in models] == [(world.ids["model"], 1234)]
        # Control: A's own credentials reach every one of these objects (reads first, revoke last).
        ordered = sorted(cases, key=lambda c: (c[0][0] != "GET", c[0][1].endswith("/revoke")))
        for (method, path), info in ordered:
            token = world.a_node_token if info.auth == "node" else world.a_key
            body = BODIES.get(info.body) if info.body else None
            answer = await _call(client, method, object_path(path, world), token, body)
            assert answer.status_code not in (401, 403, 404), f"{method} {path} as A: {answer.status_code} {answer.text}"


async def _read(client, path: str, token: str, stream: bool) -> str:
    if not stream:
        answer = await client.get(path, headers=bearer(token))
        assert answer.status_code == 200, f"{path}: {answer.status_code} {answer.text}"
        return answer.text
    text = ""
    async with client.stream("GET", path, headers=bearer(token)) as answer:
        assert answer.status_code == 200, path
        with anyio.move_on_after(0.8):  # the backlog arrives at once; then the stream idles
            async for chunk in answer.aiter_text():
                text += chunk
    return text


async def test_listings_with_another_organizations_credentials_never_show_its_objects(conn, live_server, world):
    cases = [(key, info) for key, info in route_table() if classify(key, info) == "listing"]
    failures: list[str] = []
    async with httpx.AsyncClient(base_url=live_server.url, timeout=15) as client:
        for (_, path), info in cases:
            stream = info.produces == "text/event-stream"
            for name, token in holding_the_scopes(info, world.b_key, world.b_node_token, prefix="b_"):
                text = await _read(client, path, token, stream)
                if leaked(world, text):
                    failures.append(f"GET {path} as {name}: shows {leaked(world, text)}")
            mine = world.a_node_token if info.auth == "node" else world.a_key
            if not leaked(world, await _read(client, path, mine, stream)):
                failures.append(f"GET {path} as A: none of A's objects listed (the probe proves nothing)")
            for name, token in lacking_the_scopes(info, world.b_key, world.b_node_token, world.b_scoped, prefix="b_"):
                answer = await client.get(path, headers=bearer(token))
                if answer.status_code != 403 or leaked(world, answer.text):
                    failures.append(f"GET {path} as {name}: {answer.status_code}")
    assert failures == [], "\n".join(failures)


async def test_body_named_objects_of_another_organization(conn, live_server, world):
    async with httpx.AsyncClient(base_url=live_server.url, timeout=15) as client:
        b = bearer(world.b_key)
        # A's project is B's "no such project", and the refusal writes nothing.
        before = await fingerprint(conn)
        for path, body in (("/v1/jobs", {"kind": "echo", "project_id": world.ids["project"]}),
                           ("/v1/jobs/batch", {"jobs": [{"kind": "echo"}, {"kind": "echo", "project_id": world.ids["project"]}]})):  # fmt: skip
            answer = await client.post(path, json=body, headers=b)
            assert answer.status_code == 404 and answer.json()["error"] == "project_not_found", answer.text
            missing = await client.post(path, json={**body, "project_id": str(uuid4())} if "kind" in body else
                                        {"jobs": [{"kind": "echo", "project_id": str(uuid4())}]}, headers=b)  # fmt: skip
            assert missing.json()["error"] == answer.json()["error"]
        assert await fingerprint(conn) == before
        # B's node (B has no queued job yet) never claims A's queued job.
        claimed = await client.post("/v1/agent/claim?wait=0&max=5", headers=bearer(world.b_node_token))
        assert claimed.status_code == 204, claimed.text
        assert await fingerprint(conn) == before
        # B's node reporting A's job gets "no such job" for it, and its next claims never take A's work.
        a_job = world.ids["queued_job"]
        report = await client.post("/v1/agent/complete?claim_next=5", json={"results": [{"job_id": a_job, "attempt": 1}]},
                                   headers=bearer(world.b_node_token))  # fmt: skip
        assert report.status_code == 200, report.text
        assert [(r["status"], r["error"]) for r in report.json()["results"]] == [(404, "job_not_found")]
        assert report.json()["next_claims"] == [] and leaked(world, report.text, asked=a_job) == []
        assert await fingerprint(conn) == before
        # A's idempotency key means nothing in B: a new job of B's, not A's job.
        # (the batch then finds B's job by it, still 201: API.md gives the batch one answer).
        first = await client.post("/v1/jobs", json={"kind": "echo", "idempotency_key": "alpha-key-1"}, headers=b)
        assert first.status_code == 201 and leaked(world, first.text, asked="alpha-key-1") == [], first.text
        again = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo", "idempotency_key": "alpha-key-1"}]}, headers=b)
        assert again.status_code == 201 and [j["id"] for j in again.json()["jobs"]] == [first.json()["id"]]
        # Node names are per organization: B may pair a node called like A's.
        answer = await client.post("/v1/pairings", json={"name": "alpha-node-7f3"}, headers=b)
        assert answer.status_code == 201 and leaked(world, answer.text.replace("alpha-node-7f3", "")) == []
        # B's heartbeat changes only its own node.
        before_a = await _a_state(conn, world)
        beat = await client.post("/v1/agent/heartbeat", json={"devices": []}, headers=bearer(world.b_node_token))
        assert beat.status_code == 200 and not leaked(world, beat.text)
        # B's node signing off takes only its own node offline.
        signed = await client.post("/v1/agent/offline", headers=bearer(world.b_node_token))
        assert signed.status_code == 200 and signed.json()["status"] == "offline" and not leaked(world, signed.text)
        verified = await client.post("/v1/projections/verify", headers=b)
        assert verified.status_code == 200 and not leaked(world, verified.text)
        assert await _a_state(conn, world) == before_a
        # The same claim by A's node takes A's queued job: the probe could have seen it.
        mine = await client.post("/v1/agent/claim?wait=0", headers=bearer(world.a_node_token))
        assert mine.status_code == 200 and mine.json()["job"]["id"] == world.ids["queued_job"]


async def _a_state(conn, world: World) -> tuple:
    row = await (await conn.execute(
        "SELECT (SELECT count(*) FROM events WHERE organization_id = %s),"
        " (SELECT md5(string_agg(t::text, '|' ORDER BY t.id)) FROM jobs t WHERE organization_id = %s),"
        " (SELECT md5(string_agg(t::text, '|' ORDER BY t.id)) FROM nodes t WHERE organization_id = %s)",
        (world.ids["org"],) * 3)).fetchone()  # fmt: skip
    return tuple(row)


async def test_metrics_name_no_tenant(live_server, world):
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        text = (await client.get("/metrics")).text
    assert "umbra_queue_depth" in text and leaked(world, text) == []
