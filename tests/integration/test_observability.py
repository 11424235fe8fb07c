"""An operator's view: /metrics, /healthz, /readyz and the server's logs, checked against a live server and real processes."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
import uuid

import anyio
import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import conninfo

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually
from tests.integration.queue_support import CPU64_JSON, http_claim, http_pair
from tests.integration.test_outages import metric_sum, pair_node, samples, serve  # noqa: F401  (fixtures)
from umbra.compute.accounts import create_organization
from umbra.events.types import JOB_STATUSES

pytestmark = pytest.mark.anyio


async def _scrape(client: httpx.AsyncClient, **headers: str) -> dict:
    response = await client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    return samples(response.text)


UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


# -- queue depth --------------------------------------------------------------------------------------


async def test_queue_depth_equals_the_queue_views_of_every_organization(conn, org, live_server):
    """umbra_queue_depth{status} is the sum, over every organization, of GET /v1/projections/queue's counts
    after a mix of submissions, claims, completions, failures (final and retried) and cancels; and the
    exposition names no organization, node or job (it is unauthenticated by default)."""
    org_a, key_a = org
    org_b, key_b = await create_organization(conn, "globex")
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        node_a, cred_a = await http_pair(client, key_a, "box-a")
        node_b, cred_b = await http_pair(client, key_b, "box-b")
        ids_a = [(await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key_a))).json()["id"] for _ in range(5)]
        ids_b = [(await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key_b))).json()["id"] for _ in range(4)]
        # org A: complete one, fail one for good, keep one running, cancel one, one stays queued
        job = await http_claim(client, cred_a)
        assert (await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": job["attempt"], "result": {}},
                                  headers=bearer(cred_a))).status_code == 200
        job = await http_claim(client, cred_a)
        assert (await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": job["attempt"], "error": "x",
                                  "retry": False}, headers=bearer(cred_a))).status_code == 200
        running = await http_claim(client, cred_a)
        queued_a = [i for i in ids_a if i not in (running["id"],)]
        cancel_a = (await client.post(f"/v1/jobs/{ids_a[-1]}/cancel", headers=bearer(key_a)))
        assert cancel_a.status_code in (200, 409), cancel_a.text
        # org B: a retried failure (queued again), a cancel, a running one
        job = await http_claim(client, cred_b)
        assert (await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": job["attempt"], "error": "y",
                                  "retry": True}, headers=bearer(cred_b))).status_code == 200
        assert (await client.post(f"/v1/jobs/{ids_b[-1]}/cancel", headers=bearer(key_b))).status_code == 200
        await http_claim(client, cred_b)
        expected = {status: 0 for status in JOB_STATUSES}
        for key in (key_a, key_b):
            view = (await client.get("/v1/projections/queue", headers=bearer(key))).json()
            for status, n in view["counts"].items():
                expected[status] = expected.get(status, 0) + n
        response = await client.get("/metrics")
        after = samples(response.text)
    depth = {status: after[("umbra_queue_depth", (("status", status),))] for status in JOB_STATUSES}
    assert depth == expected
    rows = dict(await (await conn.execute("SELECT status, count(*) FROM jobs GROUP BY status")).fetchall())
    assert {s: depth[s] for s in depth if depth[s]} == rows
    assert sum(depth.values()) == 9 and depth["complete"] == 1 and depth["failed"] == 1 and depth["running"] == 2
    for secret_ish in (str(org_a), str(org_b), node_a, node_b, *ids_a, *ids_b, *queued_a):
        assert secret_ish not in response.text


async def test_metrics_is_open_by_default_and_needs_the_token_when_one_is_set(db_url, org):
    """Unset UMBRA_METRICS_TOKEN: /metrics answers anyone (README documents it). Set: no token, a wrong
    one, or an organization's API key are 401 `unauthenticated`; the right bearer token is 200."""
    _, key = org
    with LiveServer(db_url) as open_server:
        async with httpx.AsyncClient(base_url=open_server.url) as client:
            assert (await client.get("/metrics")).status_code == 200
    with LiveServer(db_url, UMBRA_METRICS_TOKEN="scrape-token-123") as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            refused = [await client.get("/metrics"), await client.get("/metrics", headers=bearer("nope")),
                       await client.get("/metrics", headers=bearer(key)),
                       await client.get("/metrics", headers={"Authorization": "scrape-token-123"})]  # fmt: skip
            ok = await client.get("/metrics", headers=bearer("scrape-token-123"))
    for r in refused:
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated", r.text
    assert ok.status_code == 200 and "umbra_queue_depth" in ok.text


async def test_http_request_labels_are_route_templates_not_paths(api, live_server):
    """umbra_http_requests_total is labelled by route template: a job id or an unknown path never becomes a
    label value (bounded cardinality, and nothing about a tenant's objects reaches an unauthenticated scrape)."""
    job_id = str(uuid.uuid4())
    junk = f"/nowhere/{uuid.uuid4()}"
    assert (await api.get(f"/v1/jobs/{job_id}")).status_code == 404
    assert (await api.get(junk)).status_code == 404
    text = (await api.get("/metrics")).text
    values = samples(text)
    assert job_id not in text and junk not in text
    assert metric_sum(values, "umbra_http_requests_total", route="/v1/jobs/{id}", status="404") >= 1
    assert metric_sum(values, "umbra_http_requests_total", route="unmatched", status="404") >= 1
    assert not UUID_RE.search(text)


# -- counters ------------------------------------------------------------------------------------------


async def test_sweeper_counters_count_each_requeue_failure_and_offline_once(db_url, conn, org):
    """umbra_sweeper_actions_total{action} moves by exactly the number of leases requeued, leases failed and
    nodes marked offline, as the log records them; umbra_events_appended_total by the log's growth; the
    claims counter by the claims made."""
    _, key = org
    env = {"UMBRA_SWEEP_INTERVAL_SECONDS": "0.2", "UMBRA_LEASE_SECONDS": "1", "UMBRA_LEASE_EXPIRED_DELAY_SECONDS": "30",
           "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1", "UMBRA_HEARTBEAT_STALE_SECONDS": "2"}
    with LiveServer(db_url, **env) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            before = await _scrape(client)
            head = (await (await conn.execute("SELECT coalesce(max(position), 0) FROM events")).fetchone())[0]
            _, cred = await http_pair(client, key, "sweepme")
            for attempts in (3, 1, 3):
                r = await client.post("/v1/jobs", json={"kind": "echo", "max_attempts": attempts, "priority": 10 - attempts},
                                      headers=bearer(key))  # fmt: skip
                assert r.status_code == 201
            claimed = await client.post("/v1/agent/claim", params={"wait": 0, "max": 3}, headers=bearer(cred))
            assert claimed.status_code == 200 and len(claimed.json()["claims"]) == 3

            async def settled():
                row = await (await conn.execute(
                    "SELECT (SELECT count(*) FROM jobs WHERE status = 'running'),"
                    " (SELECT count(*) FROM nodes WHERE status = 'offline')")).fetchone()  # fmt: skip
                return row == (0, 1)

            await eventually(settled, timeout=15, interval=0.1)
            await anyio.sleep(0.5)  # a tick after: nothing more to count
            after = await _scrape(client)
    log = dict(await (await conn.execute(
        "SELECT type, count(*) FROM events WHERE position > %s GROUP BY type", (head,))).fetchall())  # fmt: skip
    statuses = dict(await (await conn.execute("SELECT status, count(*) FROM jobs GROUP BY status")).fetchall())
    head_after = (await (await conn.execute("SELECT coalesce(max(position), 0) FROM events")).fetchone())[0]

    def grew(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert statuses == {"queued": 2, "failed": 1}
    assert grew("umbra_sweeper_actions_total", action="lease_requeued") == 2
    assert grew("umbra_sweeper_actions_total", action="lease_failed") == 1
    assert grew("umbra_sweeper_actions_total", action="node_went_offline") == log.get("node.went_offline") == 1
    assert grew("umbra_claims_total") == 3
    assert grew("umbra_events_appended_total") == head_after - head
    for (name, labels), value in before.items():  # counters never go down
        if name.endswith("_total") or name.endswith("_count") or name.endswith("_bucket"):
            assert after.get((name, labels), 0) >= value, (name, labels)


async def test_claims_given_back_are_counted_by_reason(client, live_server, org):
    """umbra_claims_given_back_total{reason} moves by one for each way a claim goes back without a report:
    a stopping agent's give-back, a claim request whose answer was never read, a revocation's lease end;
    the other reasons stay where they were."""
    _, key = org
    before = await _scrape(client)
    node_id, cred = await http_pair(client, key, "giving-back")
    for _ in range(3):
        assert (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).status_code == 201
    first = await client.post("/v1/agent/claim", params={"wait": 0}, headers={**bearer(cred), "X-Request-ID": "claim-a"})
    held = first.json()["job"]
    assert (await client.post(f"/v1/agent/jobs/{held['id']}/release", json={"attempt": held["attempt"]},
                              headers=bearer(cred))).status_code == 200  # fmt: skip
    assert (await client.post("/v1/agent/claim", params={"wait": 0}, headers={**bearer(cred), "X-Request-ID": "claim-b"})).status_code == 200
    unread = await client.post("/v1/agent/claim/release", json={"request_id": "claim-b"}, headers=bearer(cred))
    assert len(unread.json()["released"]) == 1
    assert (await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))).status_code == 200
    assert (await client.post(f"/v1/nodes/{node_id}/revoke", headers=bearer(key))).status_code == 200
    after = await _scrape(client)

    def grew(reason: str) -> float:
        return (metric_sum(after, "umbra_claims_given_back_total", reason=reason)
                - metric_sum(before, "umbra_claims_given_back_total", reason=reason))  # fmt: skip

    assert {reason: grew(reason) for reason in ("agent_stopping", "answer_unread", "node_revoked", "client_gone",
                                                 "not_asked_again")} == {  # fmt: skip
        "agent_stopping": 1, "answer_unread": 1, "node_revoked": 1, "client_gone": 0, "not_asked_again": 0}


# -- gauges --------------------------------------------------------------------------------------------


async def _gauge(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    return metric_sum(await _scrape(client), name, **labels)


async def test_long_polls_waiting_returns_to_zero_after_timeouts_cancels_and_abrupt_closes(api, org, live_server):
    """umbra_long_polls_waiting counts parked claims and falls back to 0 when they time out, when the client
    cancels its request, and when its socket is closed abruptly (RST); the abandoned ones are observed as
    client_gone in umbra_claim_wait_seconds."""
    _, key = org
    _, cred = await http_pair(api, key, "poller")
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as scraper:
        assert await _gauge(scraper, "umbra_long_polls_waiting") == 0
        gone_before = metric_sum(await _scrape(scraper), "umbra_claim_wait_seconds_count", outcome="client_gone")
        # 1. a timeout
        assert (await api.post("/v1/agent/claim", params={"wait": 1}, headers=bearer(cred))).status_code == 204
        assert await _gauge(scraper, "umbra_long_polls_waiting") == 0

        # 2. three cancelled requests
        async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as agent:
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(lambda: agent.post("/v1/agent/claim", params={"wait": 30}, headers=bearer(cred)))
                await eventually(lambda: _gauge_is(scraper, 3), timeout=10)
                tg.cancel_scope.cancel()
        await eventually(lambda: _gauge_is(scraper, 0), timeout=10)

        # 3. two raw sockets closed with a reset
        socks = []
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", live_server.port))
            s.sendall(f"POST /v1/agent/claim?wait=30 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cred}\r\n"
                      "Content-Length: 0\r\n\r\n".encode())  # fmt: skip
            socks.append(s)
        await eventually(lambda: _gauge_is(scraper, 2), timeout=10)
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        await eventually(lambda: _gauge_is(scraper, 0), timeout=10)
        gone_after = metric_sum(await _scrape(scraper), "umbra_claim_wait_seconds_count", outcome="client_gone")
    assert gone_after - gone_before == 5


async def _gauge_is(client, value) -> bool:
    return await _gauge(client, "umbra_long_polls_waiting") == value


async def test_sse_streams_gauge_returns_to_zero_after_an_abrupt_close(org, live_server):
    """umbra_sse_streams{stream} rises for an open event stream and falls back when the client's socket is
    reset mid-stream."""
    _, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as scraper:
        assert await _gauge(scraper, "umbra_sse_streams") == 0
        socks = []
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", live_server.port))
            s.sendall(f"GET /v1/events/stream?after=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
            s.settimeout(5)
            assert b"200" in s.recv(4096)
            socks.append(s)

        async def streams(n):
            return await _gauge(scraper, "umbra_sse_streams") == n

        await eventually(lambda: streams(2), timeout=10)
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        await eventually(lambda: streams(0), timeout=15)


# -- histograms and exposition ---------------------------------------------------------------------------


async def test_exposition_parses_and_histograms_are_well_formed(api, org, live_server):
    """The exposition parses with prometheus_client's parser; every histogram has strictly increasing
    finite bounds ending in +Inf, cumulative buckets, +Inf == _count; claim wait's buckets reach the 60 s
    longest wait, and the wake-latency histogram observed a hint-woken claim (a small value)."""
    _, key = org
    _, cred = await http_pair(api, key, "histo")
    got = {}

    async def poll():
        got["r"] = await api.post("/v1/agent/claim", params={"wait": 10}, headers=bearer(cred))

    async with anyio.create_task_group() as tg:
        tg.start_soon(poll)
        await eventually(lambda: _gauge_is(api, 1), timeout=10)
        assert (await api.post("/v1/jobs", json={"kind": "echo"})).status_code == 201
    assert got["r"].status_code == 200
    text = (await api.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    histograms = [f for f in families.values() if f.type == "histogram"]
    assert {"umbra_claim_wait_seconds", "umbra_wake_latency_seconds"} <= {f.name for f in histograms}
    for family in histograms:
        series: dict[tuple, list[tuple[float, float]]] = {}
        counts: dict[tuple, float] = {}
        for s in family.samples:
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            if s.name.endswith("_bucket"):
                series.setdefault(rest, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                counts[rest] = s.value
        for rest, buckets in series.items():
            bounds = [b for b, _ in buckets]
            assert bounds == sorted(set(bounds)) and bounds[-1] == float("inf"), (family.name, bounds)
            values = [v for _, v in buckets]
            assert values == sorted(values), family.name
            assert values[-1] == counts[rest], family.name
    wait_bounds = {float(s.labels["le"]) for s in families["umbra_claim_wait_seconds"].samples if "le" in s.labels}
    assert max(b for b in wait_bounds if b != float("inf")) >= 60
    values = samples(text)
    assert values[("umbra_wake_latency_seconds_count", ())] >= 1
    assert values[("umbra_claims_total", (("trigger", "hint"),))] >= 1


# -- health ----------------------------------------------------------------------------------------------


async def test_readyz_follows_pending_migrations(conn, live_server):
    """/readyz is 200 with the schema current, 503 `migrations_pending` once a migration is missing from
    schema_migrations, and 200 again once it is back; /healthz stays 200 throughout."""
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        assert (await client.get("/readyz")).status_code == 200
        version, name = await (await conn.execute(
            "SELECT version, name FROM schema_migrations ORDER BY version DESC LIMIT 1")).fetchone()  # fmt: skip
        await conn.execute("DELETE FROM schema_migrations WHERE version = %s", (version,))
        try:
            pending = await client.get("/readyz")
            health = await client.get("/healthz")
        finally:
            await conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, name))
        back = await client.get("/readyz")
    assert pending.status_code == 503 and pending.json()["error"] == "migrations_pending", pending.text
    assert health.status_code == 200
    assert back.status_code == 200


async def test_readyz_is_503_while_the_database_is_unreachable_and_200_after(db_url, pg_proxy):
    """/readyz answers 503 `database_unavailable` promptly while the database host is cut off, and 200 again
    once it is back; /healthz stays 200 (the process is up)."""
    with LiveServer(pg_proxy.url(db_url), UMBRA_SWEEP_INTERVAL_SECONDS="0.2") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            assert (await client.get("/readyz")).status_code == 200
            pg_proxy.cut()
            started = time.monotonic()
            down = await client.get("/readyz")
            took = time.monotonic() - started
            health = await client.get("/healthz")
            pg_proxy.restore()

            async def ready():
                return (await client.get("/readyz")).status_code == 200

            await eventually(ready, timeout=15, interval=0.2)
    assert down.status_code == 503 and down.json()["error"] == "database_unavailable" and took < 5
    assert health.status_code == 200


async def test_readyz_answers_503_while_the_database_takes_its_query_and_never_answers(db_url, pg_proxy):
    """A database that takes the readiness check's query and never answers (a stalled server, a network that
    drops packets silently) is not ready: /readyz answers 503 `database_unavailable` within its own bound
    rather than waiting with the query (for ever behind the proxy; for the operating system's TCP timeout on
    a real network), and /healthz stays 200."""
    with LiveServer(pg_proxy.url(db_url), UMBRA_SWEEP_INTERVAL_SECONDS="0.2") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            assert (await client.get("/readyz")).status_code == 200
            pg_proxy.freeze()  # the pool's open connections: nothing passes, nothing closes
            down = await client.get("/readyz")  # a ReadTimeout here: the probe waited with its query
            health = await client.get("/healthz")
    assert down.status_code == 503 and down.json()["error"] == "database_unavailable", down.text
    assert health.status_code == 200


# -- logs ------------------------------------------------------------------------------------------------

PASSWORD = "pw-Sup3rS3cret-7781"


def _url_with_password(url: str) -> str:
    return conninfo.make_conninfo(url, password=PASSWORD)


async def test_server_log_carries_request_fields_and_no_secret_on_error_paths(serve, org, db_url, pg_proxy, conn):  # noqa: F811
    """A real `umbra serve` (DEBUG) whose database URL carries a password, driven through a refused key, a
    wrong secret on a real prefix, malformed Authorization headers, a wrong and a mismatched pairing code,
    a token in the query string, a malformed HTTP request, an unexpected error (500 with a traceback) and a
    database outage (readiness, requests, listener): access lines carry path, status, duration, request id
    and the caller's organization; the 500's traceback is logged with its request id; no API key, node
    credential, pairing code or database password appears anywhere in the output."""
    org_id, key = org
    server = serve(_url_with_password(pg_proxy.url(db_url)))
    await server.ready()
    prefix = key.split("_")[1]
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        node = await pair_node(client, server.url, key, "logged")
        code = (await client.post("/v1/pairings", json={"name": "other"}, headers=bearer(key))).json()["code"]
        assert (await client.get("/v1/jobs", headers={**bearer(key), "X-Request-ID": "rid-ok"})).status_code == 200
        wrong = f"uk_{prefix}_WrongSecretValue0001"
        for headers in (bearer(wrong), bearer("uk_zz_MalformedSecret0002"), {"Authorization": "Basic dXNlcjpNeVBhc3MwMDAz"},
                        {"Authorization": "Bearer"}, {"Authorization": "bearer  nk_MalformedNodeSecret0004 extra"},
                        bearer(f"nk_{prefix}_NodeGuess0005")):  # fmt: skip
            r = await client.get("/v1/jobs", headers=headers)
            assert r.status_code == 401, r.text
        assert (await client.post("/v1/pairings/redeem", json={"code": "000000", "name": "x", "devices": [CPU64_JSON]})).status_code == 401
        mismatched = await client.post("/v1/pairings/redeem", json={"code": code, "name": "wrong-name", "devices": [CPU64_JSON]})
        assert mismatched.status_code == 409
        assert (await client.get(f"/v1/jobs?access_token={key}", headers=bearer(key))).status_code == 200
        assert (await client.post("/v1/agent/heartbeat", json={"devices": [CPU64_JSON]},
                                  headers=bearer(node["credential"]))).status_code == 200  # fmt: skip
        with socket.create_connection(("127.0.0.1", server.port)) as s:  # a malformed request carrying a token
            s.sendall(f"GET /v1/jobs?access_token={key} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nBroken header\r\n\r\n".encode())
            s.settimeout(5)
            with contextlib.suppress(OSError):
                s.recv(4096)
        await conn.execute("ALTER TABLE models RENAME TO models_away")
        try:
            broken = await client.get("/v1/models", headers={**bearer(key), "X-Request-ID": "rid-500"})
        finally:
            await conn.execute("ALTER TABLE models_away RENAME TO models")
        assert broken.status_code == 500, broken.text
        await _outage(client, server, pg_proxy, key)
    await anyio.to_thread.run_sync(server.signal_and_wait)
    text = server.log
    records = server.records()
    leaks = [s for s in (key, key.split("_", 2)[2], node["credential"], node["credential"].split("_", 2)[2], PASSWORD,
                         "WrongSecretValue0001", "MalformedSecret0002", "dXNlcjpNeVBhc3MwMDAz", "MalformedNodeSecret0004",
                         "NodeGuess0005") if s in text]  # fmt: skip
    codes = [c for c in (code, node["code"]) if re.search(rf"(?<![0-9]){c}(?![0-9])", text)]
    ok = next(r for r in records if r.get("request_id") == "rid-ok" and r.get("action") == "http_request")
    assert ok["path"] == "/v1/jobs" and ok["status"] == 200 and ok["duration_ms"] >= 0 and ok["method"] == "GET"
    assert ok["organization_id"] == str(org_id) and ok["credential_id"]
    failed = [r for r in records if r.get("request_id") == "rid-500"]
    assert any(r.get("action") == "unhandled_error" and "Traceback" in r.get("exc", "") for r in failed), failed
    assert any(r.get("action") == "http_request" and r.get("status") == 500 for r in failed), failed
    assert any(r.get("action") == "not_ready" for r in records)
    assert not leaks and not codes, (leaks, codes)


async def _outage(client: httpx.AsyncClient, server, pg_proxy, key: str) -> None:  # noqa: F811
    """The database unreachable for two seconds, while the server is asked for readiness and for jobs (503
    both), then back, and the server ready again."""
    pg_proxy.cut()
    await anyio.sleep(0.5)
    assert (await client.get("/readyz")).status_code == 503
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 503
    await anyio.sleep(1.5)
    pg_proxy.restore()
    await server.ready()


async def test_server_output_stays_one_json_object_per_line_through_a_database_outage(serve, org, db_url, pg_proxy):  # noqa: F811
    """Every line `umbra serve` writes is one JSON object, also while the database is unreachable (when an
    operator reads the log most): the connection pool's own warnings included."""
    _, key = org
    server = serve(pg_proxy.url(db_url))
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
        await _outage(client, server, pg_proxy, key)
    await anyio.to_thread.run_sync(server.signal_and_wait)
    bad_lines = []
    for line in server.log.splitlines():
        if not line.strip():
            continue
        try:
            if not isinstance(json.loads(line), dict):
                bad_lines.append(line)
        except ValueError:
            bad_lines.append(line)
    assert not bad_lines, f"{len(bad_lines)} non-JSON line(s) in the server's output, e.g. {bad_lines[:4]}"


async def _rst(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


async def test_claims_counter_matches_the_logs_claims_when_the_agent_hangs_up_mid_command(api, org, live_server, db_url, conn):
    """A claim that commits after its agent hung up is released at once (job.released), on both paths that
    claim (the long-poll, and a completion's claim_next). umbra_claims_total counts claims as the log does
    (one per job.claimed event), whichever path made them."""
    from tests.helpers import waiting_on_a_lock
    from umbra.events.store import LOG_LOCK_KEY

    _, key = org
    _, cred = await http_pair(api, key, "leaver")
    for _ in range(3):
        assert (await api.post("/v1/jobs", json={"kind": "echo"})).status_code == 201
    first = await http_claim(api, cred)
    before = await _scrape(api)
    head = (await (await conn.execute("SELECT coalesce(max(position), 0) FROM events")).fetchone())[0]

    async def hung_up(request: bytes) -> None:
        async with await psycopg.AsyncConnection.connect(db_url) as holder:
            await holder.execute("SELECT pg_advisory_xact_lock(%s)", (LOG_LOCK_KEY,))
            sock = socket.create_connection(("127.0.0.1", live_server.port))
            sock.sendall(request)
            await eventually(lambda: waiting_on_a_lock(conn, "advisory"), timeout=10)
            await _rst(sock)
            await anyio.sleep(0.5)
            await holder.rollback()

    auth = f"Authorization: Bearer {cred}\r\nHost: x\r\n"
    await hung_up(f"POST /v1/agent/claim?wait=10 HTTP/1.1\r\n{auth}Content-Length: 0\r\n\r\n".encode())
    body = json.dumps({"attempt": first["attempt"], "result": {}}).encode()
    await hung_up(f"POST /v1/agent/jobs/{first['id']}/complete?claim_next=true HTTP/1.1\r\n{auth}"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip

    async def released_twice():
        row = await (await conn.execute("SELECT count(*) FROM events WHERE type = 'job.released' AND position > %s",
                                        (head,))).fetchone()  # fmt: skip
        return row[0] == 2

    await eventually(released_twice, timeout=10)
    after = await _scrape(api)
    claimed = (await (await conn.execute("SELECT count(*) FROM events WHERE type = 'job.claimed' AND position > %s",
                                         (head,))).fetchone())[0]  # fmt: skip
    counted = metric_sum(after, "umbra_claims_total") - metric_sum(before, "umbra_claims_total")
    assert claimed == 2
    by_trigger = {t: metric_sum(after, "umbra_claims_total", trigger=t) - metric_sum(before, "umbra_claims_total", trigger=t)
                  for t in ("immediate", "hint", "poll", "recheck", "completion", "same_claim")}  # fmt: skip
    assert counted == claimed, f"umbra_claims_total moved by {counted} ({by_trigger}); the log has {claimed} job.claimed events"


@contextlib.contextmanager
def _captured_umbra_logs():
    import io
    import logging

    from umbra.logs import JsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("umbra")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    records: list[dict] = []
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        records.extend(json.loads(line) for line in stream.getvalue().splitlines() if line.strip())


async def _lease_and_node_expire(db_url: str, conn, key: str) -> tuple[str, str, list[dict]]:
    env = {"UMBRA_SWEEP_INTERVAL_SECONDS": "0.2", "UMBRA_LEASE_SECONDS": "1", "UMBRA_LEASE_EXPIRED_DELAY_SECONDS": "30",
           "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1", "UMBRA_HEARTBEAT_STALE_SECONDS": "2"}
    with _captured_umbra_logs() as records:
        with LiveServer(db_url, **env) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                node_id, cred = await http_pair(client, key, "fades")
                assert (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).status_code == 201
                job = await http_claim(client, cred)

                async def settled():
                    row = await (await conn.execute(
                        "SELECT (SELECT count(*) FROM jobs WHERE status = 'running'),"
                        " (SELECT count(*) FROM nodes WHERE status = 'offline')")).fetchone()  # fmt: skip
                    return row == (0, 1)

                await eventually(settled, timeout=15, interval=0.1)
                await anyio.sleep(0.3)
    return node_id, job["id"], records


async def test_sweeper_logs_name_the_job_whose_lease_expired(db_url, conn, org):
    """The sweeper's record of an expired lease names the job (job_id) and its new status."""
    _, key = org
    _, job_id, records = await _lease_and_node_expire(db_url, conn, key)
    swept = [r for r in records if r.get("action") == "lease_swept"]
    assert any(r.get("job_id") == job_id and r.get("status") == "queued" for r in swept), swept


async def test_sweeper_logs_name_the_node_it_marked_offline(db_url, conn, org):
    """When the sweeper marks a silent node offline, its log names which node (node_id), as the records of
    other node changes ("node changed") and of expired leases (job_id) do."""
    _, key = org
    node_id, _, records = await _lease_and_node_expire(db_url, conn, key)
    offline = [r for r in records if r.get("action") == "node.went_offline"]
    assert [r["node_id"] for r in offline] == [node_id], [r.get("action") for r in records]
    assert offline[0]["organization_id"] == str(org[0])
