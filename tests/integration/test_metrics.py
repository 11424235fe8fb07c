"""``/metrics`` and the request middleware: ids, access log without secrets, body limit."""

from __future__ import annotations

import io
import json
import logging
import uuid

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request

from tests.integration.test_outages import samples

from umbra.api.errors import HANDLERS
from umbra.api.http import MAX_BODY_BYTES, json_response
from umbra.api.middleware import RequestContext
from umbra.api.routing import endpoint
from umbra.events import store
from umbra.events.types import JOB_STATUSES, NodeDraining
from umbra.logs import JsonFormatter

pytestmark = pytest.mark.anyio


async def test_metrics_expose_queue_depth_log_head_and_process_instruments(conn, org, live_server):
    org_id, key = org
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        before = samples((await client.get("/metrics")).text)
        for _ in range(3):
            await store.append(conn, store.node_stream(uuid.uuid4()), 0, [NodeDraining()], organization_id=org_id)
        await client.get("/v1/events", headers={"Authorization": f"Bearer {key}"})
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    after = samples(response.text)
    for status in JOB_STATUSES:
        assert after[("umbra_queue_depth", (("status", status),))] == 0
    assert after[("umbra_log_head_position", ())] == before[("umbra_log_head_position", ())] + 3
    assert ("umbra_long_polls_waiting", ()) in after
    for family in ("umbra_claim_wait_seconds", "umbra_wake_latency_seconds", "umbra_claims_total"):
        assert f"# TYPE {family.removesuffix('_total')}" in response.text
    assert "umbra_sweeper_actions" in response.text and "umbra_events_appended_total" in response.text
    served = after[("umbra_http_requests_total", (("method", "GET"), ("route", "/v1/events"), ("status", "200")))]
    assert served >= 1


async def test_a_scrape_reads_the_queue_depth_without_reading_the_jobs_table(conn, db_url, org, live_server):
    """The depth comes from the counts kept with the jobs (``job_counts``), not from counting ``jobs``, which
    keeps every terminal job: at 6 million rows that count outlasted the scrape's bound at every scrape
    (``umbra_database_up 0``, the depth left at zeros). With ``jobs`` locked against every reader, the scrape
    still reads the database, and the depth is the jobs'."""
    from .queue_support import CPU64, add_node, submit

    org_id, _ = org
    await add_node(conn, org_id, "n", [CPU64])
    for kind in ("a", "b"):
        await submit(conn, org_id, kind)
    await submit(conn, org_id, "gpu", requires={"accelerators": ["rocm"]})  # blocked
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        async with httpx.AsyncClient(base_url=live_server.url) as client:
            scraped = samples((await client.get("/metrics")).text)
        await holder.rollback()
    assert scraped[("umbra_database_up", ())] == 1
    depth = {status: scraped[("umbra_queue_depth", (("status", status),))] for status in JOB_STATUSES}
    assert depth == {**{status: 0 for status in JOB_STATUSES}, "queued": 2, "blocked": 1}


async def test_group_commit_batches_are_counted(org, live_server):
    from tests.integration.test_nodes_api import CPU, pair

    _, key = org
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        _, credential = await pair(client, key, devices=(CPU,))
        agent = {"Authorization": f"Bearer {credential}"}
        await client.post("/v1/agent/heartbeat", json={"devices": [CPU]}, headers=agent)
        await client.post("/v1/jobs", json={"kind": "echo"}, headers={"Authorization": f"Bearer {key}"})
        before = samples((await client.get("/metrics")).text)
        job = (await client.post("/v1/agent/claim?wait=0", headers=agent)).json()["job"]
        done = await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": job["attempt"]}, headers=agent)
        assert done.status_code == 200
        after = samples((await client.get("/metrics")).text)

    def grew(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert grew("umbra_group_commit_batch_commands_count") == 2  # the claim's batch and the completion's
    assert grew("umbra_group_commit_batch_commands_sum") == 2
    assert grew("umbra_group_commit_batch_seconds_count") == 2 and grew("umbra_group_commit_batch_seconds_sum") > 0
    assert ("umbra_group_commit_fallbacks_total", ()) in after


async def test_request_id_is_echoed_or_minted(live_server):
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        kept = await client.get("/healthz", headers={"X-Request-ID": "trace-42.a"})
        minted = await client.get("/healthz")
        replaced = await client.get("/healthz", headers={"X-Request-ID": "bad id\twith spaces"})
    assert kept.headers["x-request-id"] == "trace-42.a"
    assert len(minted.headers["x-request-id"]) == 32
    assert replaced.headers["x-request-id"] != "bad id\twith spaces"


async def test_access_log_has_the_request_and_never_the_token(org, live_server):
    _, key = org
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("umbra.api.middleware")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async with httpx.AsyncClient(base_url=live_server.url) as client:
            await client.get(
                "/v1/events", params={"after": 0}, headers={"Authorization": f"Bearer {key}", "X-Request-ID": "rid-1"}
            )
            await client.get("/v1/events", headers={"Authorization": "Bearer uk_guess_wrongsecret"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    text = stream.getvalue()
    assert key not in text and "wrongsecret" not in text and "Bearer" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    ok = next(line for line in lines if line["request_id"] == "rid-1")
    assert ok["method"] == "GET" and ok["path"] == "/v1/events" and ok["status"] == 200
    assert ok["route"] == "/v1/events" and ok["duration_ms"] >= 0 and ok["action"] == "http_request"
    assert ok["organization_id"] is not None
    assert any(line["status"] == 401 and line["credential_id"] is None for line in lines)


async def test_declared_oversize_body_is_refused_before_the_app_runs(live_server):
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        response = await client.post("/v1/projections/verify", content=b"x" * (MAX_BODY_BYTES + 1))
        unknown_route = await client.post("/nowhere", content=b"x" * (MAX_BODY_BYTES + 1))
    for r in (response, unknown_route):
        assert r.status_code == 413
        assert r.json()["error"] == "payload_too_large"


async def test_chunked_oversize_body_is_refused_as_it_arrives():
    reached: list[int] = []

    async def echo(request: Request):
        body = await request.body()  # not read_body: the middleware alone must stop it
        reached.append(len(body))
        return json_response({"size": len(body)})

    routes = [endpoint("POST", "/echo", echo, summary="echo", auth="none")]
    app = Starlette(
        routes=routes,
        exception_handlers=HANDLERS,
        middleware=[Middleware(RequestContext, route_templates={echo: "/echo"})],
    )

    async def chunks(total: int):
        sent = 0
        while sent < total:
            piece = min(64 * 1024, total - sent)
            sent += piece
            yield b"y" * piece

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        small = await client.post("/echo", content=chunks(1000))
        large = await client.post("/echo", content=chunks(MAX_BODY_BYTES + 10))
    assert small.status_code == 200 and small.json() == {"size": 1000}
    assert large.status_code == 413 and large.json()["error"] == "payload_too_large"
    assert reached == [1000]



async def test_an_unexpected_error_is_answered_500_and_not_raised_to_the_server():
    """Starlette's outermost handler answers and then re-raises, and uvicorn drops the connection for it:
    the keep-alive client lost the answer. The request middleware answers such errors itself."""

    async def broken(request: Request):
        raise RuntimeError("the database went away")

    routes = [endpoint("GET", "/broken", broken, summary="broken", auth="none")]
    app = Starlette(routes=routes, exception_handlers=HANDLERS,
                    middleware=[Middleware(RequestContext, route_templates={broken: "/broken"})])  # fmt: skip
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        answer = await client.get("/broken", headers={"X-Request-ID": "rid-broken"})
    assert answer.status_code == 500 and answer.json()["error"] == "internal"
    assert answer.headers["X-Request-ID"] == "rid-broken" and "database" not in answer.text
