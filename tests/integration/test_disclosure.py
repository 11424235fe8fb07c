"""What a caller learns from a refusal: the credential comes first, and no answer leaks internals
or another's data (driver errors, job ids a node may not read, a revoked credential's request)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer
from umbra.compute.accounts import revoke_api_key

from .test_outages import terminate_server_sessions

pytestmark = pytest.mark.anyio

DEVICES = [{"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000}]


async def _pair(client: httpx.AsyncClient, key: str, name: str) -> dict:
    code = (await client.post("/v1/pairings", json={"name": name}, headers=bearer(key))).json()["code"]
    redeemed = await client.post("/v1/pairings/redeem", json={"code": code, "name": name, "devices": DEVICES})
    assert redeemed.status_code == 201, redeemed.text
    body = redeemed.json()
    beat = await client.post("/v1/agent/heartbeat", json={"devices": DEVICES}, headers=bearer(body["credential"]))
    assert beat.status_code == 200, beat.text
    return body


async def test_readyz_database_unavailable_message_leaks_no_driver_internals(db_url, live_server, client):
    """Rule: error messages never leak internals (the 503 database_unavailable answers say only "try again").

    /readyz is unauthenticated and answers ``database_unavailable`` with ``str(exc)[:200]`` of whatever
    the pool or the driver raised (api/health.py)."""
    assert (await client.get("/readyz")).status_code == 200
    seen = []
    for _ in range(5):
        await terminate_server_sessions(db_url)
        answer = await client.get("/readyz")
        if answer.status_code == 503:
            seen.append(answer.json())
    assert seen, "no outage was observed by /readyz"
    for body in seen:
        assert body["error"] == "database_unavailable"
        message = body["message"].lower()
        for internal in ("terminating connection", "server closed", "consuming input", "administrator command",
                         "connection", "sqlstate", "psycopg"):  # fmt: skip
            assert internal not in message, f"/readyz echoes the driver's error to an unauthenticated caller: {body}"


@pytest.mark.parametrize("path", ["/v1/events/stream", "/v1/projections/stream"])
async def test_a_malformed_access_token_is_401_not_a_database_refusal(org, live_server, client, path):
    """Rule: unknown or malformed tokens get 401 (credential first), with a clear error.

    A NUL in the token's prefix reaches the prefix look-up's parameter; psycopg refuses it client-side
    (DataError) and the data_error handler answers 422 invalid_request "a value in the request cannot be
    stored" to a caller that sent no valid credential."""
    answer = await client.get(path, params={"access_token": "uk_\x00123456789_abcdef"})
    assert answer.status_code == 401, (answer.status_code, answer.text)
    assert answer.json()["error"] == "unauthenticated"


async def test_a_node_cannot_learn_jobs_it_never_held_through_child_idempotency_keys(org, live_server, client):
    """Rule: node credentials reach only their node, its jobs and the registry.

    ``GET /v1/jobs/{id}`` hides every job the node never held (404). But decomposing a held job with a
    child ``idempotency_key`` that a submitter already used answers 422 "already used by job <id>"
    (compute/claims.py _add_children): an oracle for the organization's idempotency keys that also hands
    the node the id of a job it may not read."""
    _, key = org
    hidden = await client.post("/v1/jobs", headers=bearer(key), json={
        "kind": "invoice", "payload": {"customer": "acme"}, "idempotency_key": "invoice-2026-0042",
        "requires": {"vram_min_mb": 10_000_000}})  # fmt: skip  (blocked: no node will ever claim it)
    assert hidden.status_code == 201, hidden.text
    hidden_id = hidden.json()["id"]
    node = await _pair(client, key, "splitter")
    cred = node["credential"]
    assert (await client.get(f"/v1/jobs/{hidden_id}", headers=bearer(cred))).status_code == 404  # the node may not see it
    held = await client.post("/v1/jobs", headers=bearer(key), json={"kind": "split", "payload": {}})
    assert held.status_code == 201, held.text
    claim = await client.post("/v1/agent/claim", params={"wait": 5}, headers=bearer(cred))
    assert claim.status_code == 200, claim.text
    job = claim.json()["job"]
    probe = await client.post(f"/v1/agent/jobs/{job['id']}/children", headers=bearer(cred), json={
        "attempt": job["attempt"], "children": [{"kind": "part", "idempotency_key": "invoice-2026-0042"}]})  # fmt: skip
    assert hidden_id not in probe.text, f"the node learned the id of a job it never held: {probe.text}"
    assert probe.status_code == 422 and probe.json()["field"] == "children[0].idempotency_key"


def _sample(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


async def test_metrics_need_the_token_umbra_metrics_token_names(db_url):
    """The scrape carries database-wide aggregates (every organization's queue depth): with
    UMBRA_METRICS_TOKEN set, only a scraper holding it reads them."""
    with LiveServer(db_url, UMBRA_METRICS_TOKEN="scrape-secret-1") as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            anonymous = await client.get("/metrics")
            wrong = await client.get("/metrics", headers=bearer("scrape-secret-2"))
            right = await client.get("/metrics", headers=bearer("scrape-secret-1"))
    assert anonymous.status_code == wrong.status_code == 401 and wrong.json()["error"] == "unauthenticated"
    assert "umbra_queue_depth" not in anonymous.text + wrong.text
    assert right.status_code == 200 and _sample(right.text, "umbra_database_up") == 1
    assert _sample(right.text, "umbra_queue_depth", {"status": "queued"}) == 0


async def test_a_revoked_cached_node_credential_gets_401_before_any_validation(conn, org, live_server, client):
    """Rule: a revoked credential fails at once everywhere (the agent's batched hot path included); docs/API.md:
    "no, unknown or revoked token -> 401" comes before the path, the query and the body are looked at.

    The hot path (claim, renew, complete) takes a cached token without asking the database
    (``revocation_deferred``, api/http.py batch_principal) and leaves revocation to the batch, so the
    request is validated first. Revoked from the shell (``umbra admin revoke``) or by another server
    process, whose cache this process never hears of, the credential still gets 422 and 404 answers."""
    from umbra.compute.credentials import revoke_node

    org_id, key = org
    node = await _pair(client, key, "hot-path")
    cred = node["credential"]
    assert (await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))).status_code == 204  # cached
    await revoke_node(conn, org_id, uuid.UUID(node["node_id"]), actor="cli")  # what `umbra admin revoke` runs
    probes = {
        "claim ?wait=999": await client.post("/v1/agent/claim", params={"wait": 999}, headers=bearer(cred)),
        "renew bad id": await client.post("/v1/agent/jobs/not-a-uuid/renew", json={"attempt": 1}, headers=bearer(cred)),
        "renew bad body": await client.post(f"/v1/agent/jobs/{uuid.uuid4()}/renew", json={"attempt": 0},
                                            headers=bearer(cred)),  # fmt: skip
        "complete bad body": await client.post("/v1/agent/complete", json={"results": []}, headers=bearer(cred)),
    }
    answers = {name: (r.status_code, r.json().get("error")) for name, r in probes.items()}
    assert all(status == 401 for status, _ in answers.values()), f"a revoked credential was answered on its request: {answers}"


async def test_a_revoked_api_key_on_an_agent_route_is_401_before_its_missing_scope(client, conn, org):
    """The credential comes first: a revoked key is 401 before the missing scope's 403, on the agent
    routes too, whose cached credentials are checked by their batch (or, for a refusal, before it)."""
    org_id, api_key = org
    headers = bearer(api_key)
    first = await client.post("/v1/agent/claim?wait=0", headers=headers)
    assert first.status_code == 403  # an API key has no compute scope; its verification is now cached
    key_id = (await (await conn.execute("SELECT id FROM api_keys WHERE organization_id = %s", (org_id,))).fetchone())[0]
    await revoke_api_key(conn, org_id, key_id)  # as `umbra admin revoke-key` (another process) does
    answers = {}
    for path in ("/v1/agent/claim?wait=0", "/v1/agent/complete"):
        again = await client.post(path, headers=headers, json={"results": []})
        answers[path] = (again.status_code, again.json().get("error"))
    # (asked only now: a route that authenticates with a query drops the cached verification)
    assert (await client.get("/v1/jobs", headers=headers)).status_code == 401  # revoked, as other routes say
    assert all(status == 401 for status, _ in answers.values()), f"a revoked API key was answered {answers}"


async def test_wrong_secrets_for_one_key_are_refused_429_before_any_verification_past_the_limit(org, live_server, client):
    """Each wrong secret for a prefix that exists costs an argon2 verification (and on some routes a pooled
    connection meanwhile): past the limit, tokens of that prefix not already verified are refused at once,
    while the key's verified holders go on."""
    from umbra.compute.auth import MAX_FAILED_VERIFICATIONS

    _, key = org
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200  # verified: now cached
    prefix = "_".join(key.split("_")[:2])
    for i in range(MAX_FAILED_VERIFICATIONS):
        wrong = await client.get("/v1/jobs", headers=bearer(f"{prefix}_wrong-secret-{i}"))
        assert wrong.status_code == 401 and wrong.json()["error"] == "unauthenticated"
    refused = await client.get("/v1/jobs", headers=bearer(f"{prefix}_one-more-guess"))
    assert refused.status_code == 429 and refused.json()["error"] == "rate_limited"
    # The window runs from the first wrong secret, moments ago: nearly all of the minute is left.
    assert 45 <= int(refused.headers["Retry-After"]) <= 61
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200  # its verified holder goes on
    other_org_key_prefix = "uk_0123456789"  # a prefix with no key behind it costs nothing and is not counted
    for _ in range(3):
        assert (await client.get("/v1/jobs", headers=bearer(f"{other_org_key_prefix}_x"))).status_code == 401
