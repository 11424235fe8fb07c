"""Every time the service writes is RFC 3339 UTC, whatever the database's own time zone.

Debian's and Ubuntu's initdb set the cluster's TimeZone to the machine's zone,
so a database outside UTC is the ordinary deployment. Pooled connections read
times in UTC; the sweeper's and the CLI's own connections did not, so the
events the sweeper appends (``job.lease_expired``'s ``not_before``,
``node.went_offline``'s ``last_seen_at``) and ``umbra admin pairing-code``
carried the database's offset. An agent's own ``agent_started_at`` went into
the log with the offset the agent sent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import anyio
import httpx
import psycopg
import pytest
from psycopg import conninfo, sql

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually
from tests.integration.queue_support import CPU64_JSON, http_pair

pytestmark = pytest.mark.anyio

RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z$")
#: A key that names a time.
TIME_KEY = re.compile(r"(_at|^not_before)$")


@pytest.fixture
def local_time_db(db_url):
    """This test's database with a non-UTC default TimeZone, as initdb leaves it on a machine in India."""
    name = conninfo.conninfo_to_dict(db_url)["dbname"]
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(sql.SQL("ALTER DATABASE {} SET timezone = 'Asia/Kolkata'").format(sql.Identifier(name)))
    return db_url


async def _org(db_url):
    from umbra.compute.accounts import create_organization

    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        return await create_organization(c, "acme")


async def test_sweeper_events_carry_utc_timestamps_in_a_database_whose_timezone_is_not_utc(local_time_db):
    _, key = await _org(local_time_db)
    with LiveServer(local_time_db, UMBRA_SWEEP_INTERVAL_SECONDS="0.2", UMBRA_LEASE_SECONDS="1",
                    UMBRA_LEASE_EXPIRED_DELAY_SECONDS="5", UMBRA_HEARTBEAT_STALE_SECONDS="2",
                    UMBRA_HEARTBEAT_INTERVAL_SECONDS="1") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            issued = await client.post("/v1/pairings", json={"name": "box"}, headers=bearer(key))
            redeemed = (await client.post("/v1/pairings/redeem", json={
                "code": issued.json()["code"], "name": "box", "agent_version": "1", "devices": [CPU64_JSON]})).json()
            node = bearer(redeemed["credential"])
            assert (await client.post("/v1/agent/heartbeat", json={"devices": [CPU64_JSON], "agent_version": "1"},
                                      headers=node)).status_code == 200
            job = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()
            claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)
            assert claimed.status_code == 200 and claimed.json()["job"]["id"] == job["id"]

            # The holder goes silent: the sweeper expires the lease and marks the node offline.
            async def swept():
                events = (await client.get("/v1/events", params={"limit": 1000}, headers=bearer(key))).json()["events"]
                by_type = {e["type"]: e for e in events}
                return by_type if {"job.lease_expired", "node.went_offline"} <= set(by_type) else None

            by_type = await eventually(swept, timeout=20)
    not_before = by_type["job.lease_expired"]["data"]["not_before"]
    last_seen = by_type["node.went_offline"]["data"]["last_seen_at"]
    assert (not_before.endswith("Z"), last_seen.endswith("Z")) == (True, True), (
        f"sweeper events not in UTC: job.lease_expired not_before={not_before}, "
        f"node.went_offline last_seen_at={last_seen}")


async def test_cli_pairing_code_prints_expires_at_in_utc_in_a_database_whose_timezone_is_not_utc(local_time_db):
    """``umbra admin pairing-code --json`` prints ``expires_at`` in UTC, as the HTTP route does."""
    org_id, _ = await _org(local_time_db)
    done = subprocess.run([sys.executable, "-m", "umbra.cli", "admin", "pairing-code", "--org", str(org_id), "--name", "box", "--json"],
                          env={**os.environ, "UMBRA_DATABASE_URL": local_time_db}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    expires_at = json.loads(done.stdout)["expires_at"]
    assert expires_at.endswith("Z"), f"pairing-code expires_at is not UTC: {expires_at}"


async def test_a_heartbeats_agent_started_at_is_recorded_in_utc(client, org):
    """The agent's ``agent_started_at`` is recorded in ``node.heartbeat`` in UTC, whatever offset it was sent with."""
    _, key = org
    _, credential = await http_pair(client, key)
    beat = await client.post("/v1/agent/heartbeat", headers=bearer(credential), json={
        "devices": [CPU64_JSON], "agent_version": "1", "agent_started_at": "2026-01-01T10:00:00+02:00"})
    assert beat.status_code == 200, beat.text
    events = (await client.get("/v1/events", params={"limit": 1000}, headers=bearer(key))).json()["events"]
    started = [e["data"]["agent_started_at"] for e in events if e["type"] == "node.heartbeat" and e["data"].get("agent_started_at")]
    assert started == ["2026-01-01T08:00:00Z"], started


async def test_a_submissions_not_before_is_recorded_in_utc(client, org):
    """A ``not_before`` sent with an offset goes into the log in UTC (``job.submitted``'s ``not_before``, the
    ``until`` of the ``job.blocked`` it waits with), as the Job object shows it: not with the offset it was
    sent with."""
    _, key = org
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).replace(microsecond=0)
    sent = later.astimezone(timezone(timedelta(hours=5, minutes=30))).isoformat()
    response = await client.post("/v1/jobs", json={"kind": "echo", "not_before": sent}, headers=bearer(key))
    assert response.status_code == 201, response.text
    job = response.json()
    utc = later.isoformat().replace("+00:00", "Z")
    assert (job["status"], job["not_before"]) == ("blocked", utc)
    events = (await client.get(f"/v1/jobs/{job['id']}/events", headers=bearer(key))).json()["events"]
    recorded = {e["type"]: e["data"] for e in events}
    assert (recorded["job.submitted"]["not_before"], recorded["job.blocked"]["until"]) == (utc, utc)


@pytest.mark.parametrize("started", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:30:00-01:00"])
async def test_an_agent_started_at_out_of_range_in_utc_is_refused_422(client, org, started):
    """In UTC these leave datetime's years 1 to 9999: refused naming the field, not a server error."""
    _, key = org
    _, credential = await http_pair(client, key)
    response = await client.post("/v1/agent/heartbeat", headers=bearer(credential), json={"agent_started_at": started})
    assert response.status_code == 422, f"{response.status_code} {response.text[:200]}"
    assert response.json()["error"] == "invalid_request"


def times_in(value, path="$"):
    """Every (path, value) under a key that names a time."""
    if isinstance(value, dict):
        for k, v in value.items():
            if TIME_KEY.search(k) and v is not None:
                yield f"{path}.{k}", v
            yield from times_in(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from times_in(v, f"{path}[{i}]")


async def test_every_time_in_every_answer_is_rfc3339_utc_with_z(local_time_db):
    """Job, claim, renewal, Node, pairing, Event (data included), the log page, projections and both SSE
    streams write times as RFC 3339 UTC with ``Z``, in a database whose own time zone is not UTC."""
    _, key = await _org(local_time_db)
    answers: list[tuple[str, object]] = []
    with LiveServer(local_time_db, UMBRA_SWEEP_INTERVAL_SECONDS="0.2") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            api = bearer(key)
            issued = await client.post("/v1/pairings", json={"name": "box"}, headers=api)
            answers.append(("pairing", issued.json()))
            redeemed = await client.post("/v1/pairings/redeem", json={
                "code": issued.json()["code"], "name": "box", "agent_version": "1", "devices": [CPU64_JSON]})
            node = bearer(redeemed.json()["credential"])
            node_id = redeemed.json()["node_id"]
            hb = await client.post("/v1/agent/heartbeat", json={"devices": [CPU64_JSON], "agent_version": "1",
                                                                "agent_started_at": "2026-01-01T10:00:00+05:30"},
                                   headers=node)  # fmt: skip
            assert hb.status_code == 200, hb.text
            job = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=api)).json()
            answers.append(("submit", job))
            got = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)
            answers.append(("claim", got.json()))
            renewed = await client.post(f"/v1/agent/jobs/{job['id']}/renew", json={"attempt": 1}, headers=node)
            answers.append(("renew", renewed.json()))
            failed = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": 1, "error": "x", "retry": True},
                                       headers=node)  # fmt: skip
            answers.append(("fail", failed.json()))
            assert failed.json()["not_before"] is not None
            for path in (f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/events", f"/v1/nodes/{node_id}", "/v1/nodes",
                         f"/v1/nodes/{node_id}/events", "/v1/events", "/v1/projections/queue", "/v1/projections/nodes",
                         f"/v1/jobs/{job['id']}/explain"):  # fmt: skip
                r = await client.get(path, headers=api)
                assert r.status_code == 200, (path, r.text)
                answers.append((path, r.json()))
            logged = len(next(a for p, a in answers if p == "/v1/events")["events"])
            for path, params in (("/v1/events/stream", {"after": 0}), ("/v1/projections/stream", {"views": "queue,nodes"})):
                data = []
                with anyio.fail_after(10):
                    async with client.stream("GET", path, params=params, headers=api) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                data.append(json.loads(line[6:]))
                                if len(data) >= (logged if "events" in path else 1):
                                    break
                answers.append((path, data))
    node_answer = next(a for p, a in answers if p == f"/v1/nodes/{node_id}")
    assert node_answer["agent_started_at"] == "2026-01-01T04:30:00Z"
    seen = [(name, where, value) for name, answer in answers for where, value in times_in(answer)]
    assert len(seen) > 40
    bad = [(name, where, value) for name, where, value in seen if not (isinstance(value, str) and RFC3339_UTC.match(value))]
    assert bad == []
