"""The event log as an auditor's record, driven only through the public HTTP API.

An auditor reconstructs every job's history from the log alone: what the API serves, now or as of
any position, must be exactly what the log folds to, and nothing may change without an event saying
so. These tests drive the service as clients do and check that.

Random interleavings (fixed seeds) of submit, batch submit, claim?max=N, renew, complete,
complete?claim_next, POST /v1/agent/complete?claim_next=N, fail (retry or not), children,
cancel (leaves and containers), heartbeats that change memory or devices, drain, retire,
revoke, pairing and sweeper runs with the database clock moved, in two organizations.
Afterwards (and during) the auditor checks that:

* ``verify(conn) == []``: the rows equal a fold of the log;
* ``GET /v1/jobs/{id}/events`` folds (with ``umbra events replay``'s fold) to ``GET /v1/jobs/{id}``;
* ``GET /v1/jobs/{id}?as_of=P`` equals that fold cut at P, for every P of the job's history;
* ``GET /v1/events`` paged from 0 gives every event of the organization once, in the same order
  twice, and nothing of the other organization;
* a refused request (4xx) and a claim that finds nothing (204) record no event and change no row;
* every container whose children have all ended has settled.

Further tests cover the batch COPY path, a tailing reader under concurrent writers, a container's
history after a blocked timeout, JSON values through the log, the fold and the API, and ``verify``
noticing a row whose JSON types differ from the log's.
"""

from __future__ import annotations

import json
import os
import random
from decimal import Decimal
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, AsyncIterator
from uuid import UUID

import anyio
import httpx
import msgspec
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import LiveServer
from tests.helpers import bearer
from umbra.cli_events import replay
from umbra.compute.accounts import create_organization
from umbra.compute.sweeper import sweep_once
from umbra.events import documents
from umbra.projections.verify import verify

from .queue_support import CPU64, GPU24

pytestmark = pytest.mark.anyio

TERMINAL = {"complete", "failed", "cancelled", "partial"}

#: The devices agents report, as JSON (a CPU box; a discrete 24 GB card).
CPU = msgspec.json.decode(msgspec.json.encode(CPU64))
GPU = msgspec.json.decode(msgspec.json.encode(GPU24))

SHAPES = [{}, {}, {"ram_min_mb": 1000}, {"accelerators": ["cuda"]}, {"vram_min_mb": 8000}, {"vram_min_mb": 999_999},
          {"models": ["m1"]}]  # fmt: skip

_TEST_CLOCK = """
CREATE TABLE test_clock (one int PRIMARY KEY DEFAULT 1 CHECK (one = 1), seconds double precision NOT NULL DEFAULT 0);
INSERT INTO test_clock DEFAULT VALUES;
GRANT SELECT ON test_clock TO PUBLIC;
CREATE OR REPLACE FUNCTION umbra_now() RETURNS timestamptz LANGUAGE sql STABLE AS $$
    SELECT now() + coalesce(nullif(current_setting('umbra.clock_offset', true), ''), '0')::interval
                 + make_interval(secs => (SELECT seconds FROM test_clock))
$$;
"""

_FINGERPRINT = """
SELECT (SELECT coalesce(max(position), 0) FROM events), (SELECT count(*) FROM events),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM jobs t),
       (SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) FROM nodes t)
"""


class SharedClock:
    """The database clock of every session of this test's database, moved together, with a sweep after each move.

    ``queue_support.set_clock`` moves one connection's clock only (a session setting); the live server's
    pooled connections would keep the real time, and a lease the test's sweep finds expired would still be
    live to the server. Installed, this test database's ``umbra_now()`` also adds the offset held in the
    one-row table ``test_clock``, which every session reads.
    """

    def __init__(self, db: psycopg.AsyncConnection, settings) -> None:
        self.db, self.settings, self.seconds = db, settings, 0.0

    @staticmethod
    async def install(db: psycopg.AsyncConnection) -> None:
        """Make ``umbra_now()`` read ``test_clock`` in every session (before the server starts)."""
        await db.execute(_TEST_CLOCK)

    async def move(self, seconds: float) -> None:
        self.seconds += seconds
        await self.db.execute("UPDATE test_clock SET seconds = %s", (self.seconds,))
        await sweep_once(self.db, self.settings, reexamine=True)


class World:
    """One organization's view of the system, as its submitter and its agents believe it."""

    def __init__(self, name: str, client: httpx.AsyncClient, db: psycopg.AsyncConnection, org_id: UUID, key: str,
                 rng: random.Random) -> None:  # fmt: skip
        self.name, self.client, self.db, self.org_id, self.key, self.rng = name, client, db, org_id, key, rng
        self.nodes: dict[str, dict[str, Any]] = {}  # node id -> {"cred", "devices", "gone", "name"}
        self.held: dict[str, tuple[str, int]] = {}  # job id -> (node id, attempt) as the holder believes
        self.jobs: list[str] = []
        self.refused = 0
        self.requests = 0
        self.last_write: tuple | None = None
        self.repeats = 0

    async def fingerprint(self) -> tuple:
        return tuple(await (await self.db.execute(_FINGERPRINT)).fetchone())

    async def read(self, path: str, **params: Any) -> Any:
        """``GET path`` with the organization's key: the answer's JSON."""
        return (await self.client.get(path, params=params, headers=bearer(self.key))).json()

    async def call(self, method: str, path: str, token: str | None, **kw: Any) -> httpx.Response:
        """One request; a refused one (4xx) or a claim that found nothing (204) must change nothing."""
        before = await self.fingerprint()
        headers = bearer(token) if token else {}
        node = next((n for n in self.nodes.values() if n["cred"] == token), None)
        response = await self.client.request(method, path, headers=headers, **kw)
        self.requests += 1
        assert response.status_code < 500, (method, path, response.status_code, response.text)
        if response.status_code >= 400 or response.status_code == 204:
            self.refused += response.status_code >= 400
            after = await self.fingerprint()
            assert after == before, ("a refused request wrote", method, path, response.status_code, response.text)
        elif method == "POST":
            # Every event a request caused names it: an auditor goes from an event to its request and back.
            request_id = response.headers["x-request-id"]
            caused = await (await self.db.execute(
                "SELECT position, type, metadata->>'request_id' FROM events WHERE position > %s",
                (before[0],))).fetchall()  # fmt: skip
            for position, type_, recorded_id in caused:
                assert recorded_id == request_id, ("an event does not name its request", path, position, type_)
            self.last_write = (method, path, kw, node)
            if path == "/v1/agent/complete" and not any(r["status"] == 200 for r in response.json()["results"]):
                # No completion recorded, so nothing names the report's claims: sent again, it is a new report
                # and claims again (API.md: the claims are anchored on the first job.completed). Not a repeat.
                self.last_write = None
        return response

    async def repeat_last_write(self) -> None:
        """An agent's report sent again (its answer lost): answered, and nothing recorded again."""
        last, self.last_write = self.last_write, None
        if last is None or last[3] is None or not last[1].startswith("/v1/agent/"):
            return
        if last[1].endswith(("/heartbeat", "/claim", "/renew")):
            return
        method, path, kw, node = last
        before = await self.fingerprint()
        response = await self.client.request(method, path, headers=bearer(node["cred"]), **kw)
        assert response.status_code < 500, response.text
        if response.status_code < 300:
            self.repeats += 1
            if (after := await self.fingerprint()) != before:
                recorded = await (await self.db.execute(
                    "SELECT position, type, data::text, metadata::text FROM events WHERE position > %s ORDER BY position",
                    (before[0],))).fetchall()  # fmt: skip
                raise AssertionError(("a repeated report recorded something", path, kw, response.text, recorded, after))

    # -- nodes ------------------------------------------------------------------------

    async def pair(self, devices: list[dict[str, Any]]) -> str | None:
        name = f"{self.name}-n{len(self.nodes)}-{self.rng.randrange(10**6)}"
        issued = await self.call("POST", "/v1/pairings", self.key, json={"name": name})
        assert issued.status_code == 201, issued.text
        code = issued.json()["code"]
        if self.rng.random() < 0.3:  # refused redemptions first: a wrong code, another name, a name taken
            wrong = f"{(int(code) + 1) % 1_000_000:06d}"
            taken = next((v["name"] for v in self.nodes.values()), None)
            for attempt_code, attempt_name, status in ((wrong, name, 401), (code, name + "x", 409), (code, taken, 409)):
                if attempt_name is None:
                    continue
                r = await self.call("POST", "/v1/pairings/redeem", None, json={
                    "code": attempt_code, "name": attempt_name, "agent_version": "1", "devices": devices})  # fmt: skip
                assert r.status_code in (status, 429), r.text
        redeemed = await self.call("POST", "/v1/pairings/redeem", None, json={
            "code": code, "name": name, "agent_version": "1", "devices": devices})  # fmt: skip
        if redeemed.status_code == 429:  # the pairing rate limit (per source address): fine, no node
            return None
        assert redeemed.status_code == 201, redeemed.text
        node_id = redeemed.json()["node_id"]
        self.nodes[node_id] = {"cred": redeemed.json()["credential"], "devices": devices, "gone": False, "name": name}
        await self.beat(node_id)
        return node_id

    async def beat(self, node_id: str, devices: list[dict[str, Any]] | None = None) -> None:
        node = self.nodes[node_id]
        if devices is not None:
            node["devices"] = devices
        r = await self.call("POST", "/v1/agent/heartbeat", node["cred"],
                            json={"devices": node["devices"], "agent_version": "1"})  # fmt: skip
        assert r.status_code == (401 if node["gone"] else 200), r.text

    def live_nodes(self) -> list[str]:
        return [n for n, v in self.nodes.items() if not v["gone"]]

    def pick_live_node(self) -> str | None:
        """A node not revoked, at random (None if there is none)."""
        nodes = self.live_nodes()
        return self.rng.choice(nodes) if nodes else None
    # -- jobs -------------------------------------------------------------------------

    def job_spec(self) -> dict[str, Any]:
        rng = self.rng
        body: dict[str, Any] = {"kind": rng.choice(["a", "a", "b"]), "payload": {"n": rng.randrange(1000)},
                                "priority": rng.randint(-1, 2), "max_attempts": rng.randint(1, 3),
                                "requires": dict(rng.choice(SHAPES))}  # fmt: skip
        if rng.random() < 0.2:
            body["idempotency_key"] = f"k{rng.randrange(6)}"
        return body

    async def submit(self) -> None:
        body = self.job_spec()
        r = await self.call("POST", "/v1/jobs", self.key, json=body)
        assert r.status_code in (200, 201), r.text
        if r.status_code == 200:  # an idempotency key used before: the first job, nothing recorded
            assert "idempotency_key" in body
        elif r.json()["id"] not in self.jobs:
            self.jobs.append(r.json()["id"])

    async def submit_batch(self) -> None:
        items = [self.job_spec() for _ in range(self.rng.randint(1, 4))]
        for item in items:
            item.pop("idempotency_key", None)
        bad = self.rng.random() < 0.25
        if bad:
            items[self.rng.randrange(len(items))]["max_attempts"] = 0
        r = await self.call("POST", "/v1/jobs/batch", self.key, json={"jobs": items})
        if bad:
            assert r.status_code == 422, r.text
            return
        assert r.status_code == 201, r.text
        self.jobs += [j["id"] for j in r.json()["jobs"]]

    def _took(self, node_id: str, claim: dict[str, Any]) -> None:
        self.held[claim["job"]["id"]] = (node_id, claim["job"]["attempt"])

    async def claim(self) -> None:
        nodes = list(self.nodes)
        if not nodes:
            return
        node_id = self.rng.choice(nodes)
        most = self.rng.choice([1, 1, 2, 3])
        params: list[tuple[str, Any]] = [("wait", 0), ("max", most)]
        if self.rng.random() < 0.2:
            params.append(("kind", "a"))
        r = await self.call("POST", "/v1/agent/claim", self.nodes[node_id]["cred"], params=params)
        if self.nodes[node_id]["gone"]:
            assert r.status_code == 401, r.text
            return
        assert r.status_code in (200, 204), r.text
        if r.status_code == 200:
            for claim in r.json().get("claims") or [r.json()]:
                self._took(node_id, claim)

    def pick_held(self) -> tuple[str, str, int] | None:
        if not self.held:
            return None
        job_id = self.rng.choice(sorted(self.held))
        node_id, attempt = self.held[job_id]
        if self.rng.random() < 0.1:
            attempt = attempt + self.rng.choice([-1, 1])  # a stale or future attempt: refused, nothing written
        if self.rng.random() < 0.05 and len(self.nodes) > 1:
            node_id = self.rng.choice([n for n in self.nodes if n != node_id])  # not the holder
        return job_id, node_id, attempt

    async def renew(self) -> None:
        if (picked := self.pick_held()) is None:
            return
        job_id, node_id, attempt = picked
        await self.call("POST", f"/v1/agent/jobs/{job_id}/renew", self.nodes[node_id]["cred"], json={"attempt": attempt})

    async def complete(self) -> None:
        if (picked := self.pick_held()) is None:
            return
        job_id, node_id, attempt = picked
        claim_next = self.rng.random() < 0.5
        r = await self.call("POST", f"/v1/agent/jobs/{job_id}/complete", self.nodes[node_id]["cred"],
                            params={"claim_next": "true" if claim_next else "false"},
                            json={"attempt": attempt, "result": {"ok": job_id[:4]}})  # fmt: skip
        if r.status_code == 200:
            self.held.pop(job_id, None)
            if claim_next and r.json().get("next_claim"):
                self._took(node_id, r.json()["next_claim"])

    async def complete_many(self) -> None:
        if not self.held or not self.nodes:
            return
        node_id = self.rng.choice(list(self.nodes))
        mine = [j for j, (n, _) in self.held.items() if n == node_id]
        others = [j for j in self.held if j not in mine]
        chosen = self.rng.sample(mine, min(len(mine), self.rng.randint(1, 3)))
        if others and self.rng.random() < 0.2:
            chosen.append(self.rng.choice(others))  # another node's: refused on its own, the others land
        if not chosen:
            return
        results = [{"job_id": j, "attempt": self.held[j][1], "result": {"many": True}} for j in chosen]
        claim_next = self.rng.choice([0, 0, 1, 2])
        r = await self.call("POST", "/v1/agent/complete", self.nodes[node_id]["cred"],
                            params={"claim_next": claim_next}, json={"results": results})  # fmt: skip
        if r.status_code != 200:
            return
        for item in r.json()["results"]:
            if item["status"] == 200:
                self.held.pop(item["job_id"], None)
        for claim in r.json()["next_claims"]:
            self._took(node_id, claim)

    async def fail(self) -> None:
        if (picked := self.pick_held()) is None:
            return
        job_id, node_id, attempt = picked
        r = await self.call("POST", f"/v1/agent/jobs/{job_id}/fail", self.nodes[node_id]["cred"],
                            json={"attempt": attempt, "error": "boom", "retry": self.rng.random() < 0.6})  # fmt: skip
        if r.status_code == 200:
            self.held.pop(job_id, None)

    async def children(self) -> None:
        if (picked := self.pick_held()) is None:
            return
        job_id, node_id, attempt = picked
        kids = []
        for _ in range(self.rng.randint(1, 3)):
            kid: dict[str, Any] = {"kind": self.rng.choice(["a", "b"]), "payload": {}, "requires": dict(self.rng.choice(SHAPES))}
            if self.rng.random() < 0.3:
                kid["priority"] = self.rng.randint(-1, 2)
            kids.append(kid)
        r = await self.call("POST", f"/v1/agent/jobs/{job_id}/children", self.nodes[node_id]["cred"],
                            json={"attempt": attempt, "children": kids})  # fmt: skip
        if r.status_code == 201:
            self.held.pop(job_id, None)
            self.jobs += [c["id"] for c in r.json()["children"]]
    async def cancel(self) -> None:
        if not self.jobs:
            return
        job_id = self.rng.choice(self.jobs)
        r = await self.call("POST", f"/v1/jobs/{job_id}/cancel", self.key)
        assert r.status_code in (200, 409), r.text

    async def heartbeat(self) -> None:
        if (node_id := self.pick_live_node()) is None:
            return
        devices = [dict(d) for d in self.nodes[node_id]["devices"]]
        roll = self.rng.random()
        for d in devices:
            if d["kind"] == "cpu":
                d["ram_free_mb"] = self.rng.choice([60000, 60010, 30000, 2000])  # small moves record nothing
            else:
                d["vram_free_mb"] = self.rng.choice([24000, 23990, 12000, 0])
        if roll < 0.15:  # the device set changes
            devices = [CPU] if len(devices) > 1 else [CPU, GPU]
        await self.beat(node_id, devices)

    async def heartbeat_all(self) -> None:
        for node_id in self.live_nodes():
            await self.beat(node_id)

    async def node_admin(self) -> None:
        if (node_id := self.pick_live_node()) is None:
            return
        verb = self.rng.choice(["drain", "drain", "retire", "revoke"])
        r = await self.call("POST", f"/v1/nodes/{node_id}/{verb}", self.key)
        assert r.status_code in (200, 409), r.text
        if verb == "revoke" and r.status_code == 200:
            self.nodes[node_id]["gone"] = True

    async def model(self) -> None:
        floor = self.rng.choice([2000, 20000, 999_999])
        r = await self.call("PUT", "/v1/models/m1", self.key, json={"vram_min_mb": floor, "ram_min_mb": min(floor, 4000)})
        assert r.status_code == 200, r.text

    async def offline(self) -> None:
        if (node_id := self.pick_live_node()) is not None:
            r = await self.call("POST", "/v1/agent/offline", self.nodes[node_id]["cred"])
            assert r.status_code == 200, r.text


# -- the auditor's checks ----------------------------------------------------------------


def exact_json(response: httpx.Response) -> Any:
    """An answer's JSON with its numbers exact (the service reads a payload's numbers so: see :func:`exact`)."""
    return documents.decode(response.content)


def exact(value: Any) -> Any:
    """``value`` with every float as the decimal it prints as: the fold of the log reads a payload's numbers
    exactly but a placement's score (a typed field) as a float, and the API's answer writes both as numbers."""
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, dict):
        return {k: exact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [exact(v) for v in value]
    return value


async def audit_job(client: httpx.AsyncClient, key: str, job_id: str, *, every_position: bool) -> int:
    """The job's history folds to the job; cut at P it folds to ``as_of=P``. Returns requests made."""
    events = exact_json(await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(key)))["events"]
    assert events and [e["version"] for e in events] == list(range(1, len(events) + 1)), job_id
    positions = [e["position"] for e in events]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    folded = exact(replay(events)[1])
    live = exact_json(await client.get(f"/v1/jobs/{job_id}", headers=bearer(key)))
    assert folded == live, ("events do not fold to the job", job_id, _dict_diff(folded, live))
    requests = 2
    if every_position:
        cuts = sorted({positions[0] - 1, *positions, *(p - 1 for p in positions), positions[-1] + 1})
        for cut in cuts:
            r = await client.get(f"/v1/jobs/{job_id}", params={"as_of": cut}, headers=bearer(key))
            requests += 1
            expected = exact(replay(events, up_to=cut)[1])
            if expected is None:
                assert r.status_code == 404 and r.json()["error"] == "job_not_found", (job_id, cut, r.text)
            else:
                assert r.status_code == 200, r.text
                assert exact_json(r) == expected, ("as_of differs from the fold", job_id, cut, _dict_diff(expected, exact_json(r)))
    return requests


def fold_jobs_up_to(events: list[dict], position: int) -> dict[str, dict]:
    """Every job as the log up to ``position`` folds it (the API's Job objects), by id."""
    streams: dict[str, list[dict]] = {}
    for event in events:
        if event["position"] <= position and event["stream"].startswith("job:"):
            streams.setdefault(event["stream"], []).append(event)
    return {stream[4:]: replay(history)[1] for stream, history in streams.items()}


def _dict_diff(a: dict, b: dict) -> dict:
    """The keys where ``a`` and ``b`` differ, with both values: what an assertion message should show."""
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


async def page_all(client: httpx.AsyncClient, key: str, limit: int) -> list[dict]:
    """The organization's log paged from 0, ``limit`` at a time (each page's ``next`` is its last position)."""
    out: list[dict] = []
    after = 0
    while True:
        page = (await client.get("/v1/events", params={"after": after, "limit": limit}, headers=bearer(key))).json()
        out += page["events"]
        if not page["events"]:
            assert page["next"] == after
            return out
        assert page["next"] == page["events"][-1]["position"]
        after = page["next"]


def audit_claim_names(events: list[dict]) -> None:
    """A completion's metadata names the claims its request made (``next_claim`` / ``next_claims``), and those
    claims are in the log under the same request, by the same node, in the named order."""
    claims_by_request: dict[str, list[dict]] = {}
    for event in events:
        if event["type"] == "job.claimed" and event["metadata"].get("request_id"):
            claims_by_request.setdefault(event["metadata"]["request_id"], []).append(event)
    for event in events:
        meta = event["metadata"]
        if event["type"] != "job.completed" or not ("next_claim" in meta or "next_claims" in meta):
            continue
        named = [meta["next_claim"]] if "next_claim" in meta else meta["next_claims"]
        made = claims_by_request.get(meta["request_id"], [])
        assert [e["stream"][4:] for e in made] == named, (event, made)
        assert all(e["metadata"]["actor"] == meta["actor"] for e in made)


async def audit_log(world: World) -> None:
    """The organization's paged log is stable, ordered, its own and complete; it is the union of its streams'
    histories and what the SSE stream sends from 0."""
    client, key = world.client, world.key
    first = await page_all(client, key, 7)
    second = await page_all(client, key, 1000)
    assert first == second, "paging the log twice gave different answers"
    positions = [e["position"] for e in first]
    assert positions == sorted(set(positions)), "positions repeat or go backwards"
    assert {e["organization_id"] for e in first} == {str(world.org_id)}, "another organization's events"
    stored = [r[0] for r in await (await world.db.execute(
        "SELECT position FROM events WHERE organization_id = %s ORDER BY position", (world.org_id,))).fetchall()]  # fmt: skip
    assert positions == stored, "the paged log is not the organization's log"
    # The streams' histories, put together, are the log: nothing recorded outside a stream's history.
    by_stream: dict[str, list[dict]] = {}
    for event in first:
        by_stream.setdefault(event["stream"], []).append(event)
    for stream, events in by_stream.items():
        kind, object_id = stream.split(":", 1)
        history = (await world.read(f"/v1/{kind}s/{object_id}/events"))["events"]
        assert history == events, stream
    audit_claim_names(first)
    # The SSE stream from 0 gives the same events, in the same order.
    streamed: list[dict] = []
    with anyio.fail_after(20):
        async with client.stream("GET", "/v1/events/stream", params={"after": 0}, headers=bearer(key)) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    streamed.append(json.loads(line[6:]))
                    if len(streamed) == len(first):
                        break
    assert streamed == first, "the SSE stream differs from the paged log"


async def audit_settlement(world: World) -> None:
    """A container whose children have all ended has settled (``partial`` if any did not complete); one with
    open children is running without a lease."""
    jobs = {job_id: await world.read(f"/v1/jobs/{job_id}") for job_id in world.jobs}
    kids: dict[str, list[dict]] = {}
    for job in jobs.values():
        if job["parent_job_id"]:
            kids.setdefault(job["parent_job_id"], []).append(job)
    for parent_id, children in kids.items():
        parent = jobs[parent_id]
        if all(c["status"] in TERMINAL for c in children):
            assert parent["status"] in TERMINAL, ("a parent whose children all ended is still open", parent_id, parent["status"])
            if parent["status"] != "cancelled":
                bad = sum(c["status"] in ("failed", "cancelled", "partial") for c in children)
                assert parent["status"] == ("partial" if bad else "complete"), (parent_id, parent["status"], bad)
        elif parent["status"] not in TERMINAL:
            assert parent["status"] == "running" and parent["lease_owner"] is None, parent


# -- random histories -------------------------------------------------------------------

OPS = ["submit", "submit", "submit_batch", "claim", "claim", "claim", "renew", "complete", "complete", "complete_many",
       "fail", "children", "cancel", "heartbeat", "time", "pair", "node_admin", "model", "offline", "cross"]  # fmt: skip


@asynccontextmanager
async def random_history(db_url: str, conn, seed: int, steps: int) -> AsyncIterator[tuple[World, World, LiveServer]]:
    """Two organizations' worlds after ``steps`` random operations over HTTP (``verify`` checked every tenth
    step), with the live server still up for the checks that follow."""
    rng = random.Random(seed)
    await SharedClock.install(conn)
    org_a, key_a = await create_organization(conn, f"a{seed}")
    org_b, key_b = await create_organization(conn, f"b{seed}")
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="3600") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            a = World("a", client, conn, org_a, key_a, rng)
            b = World("b", client, conn, org_b, key_b, rng)
            clock = SharedClock(conn, server.settings)
            await anyio.sleep(0.3)  # the server's sweeper's first tick at startup
            await a.pair([CPU])
            await a.pair([CPU, GPU])
            await b.pair([CPU])
            for step in range(steps):
                world = a if rng.random() < 0.8 else b
                await random_step(world, b if world is a else a, rng, clock)
                if step % 10 == 9:
                    assert await verify(conn) == [], (seed, step)
            yield a, b, server


async def random_step(world: World, other: World, rng: random.Random, clock: SharedClock) -> None:
    """One random operation of ``world``'s submitter or agents (``other`` is the other organization)."""
    op = rng.choice(OPS)
    if op == "time":
        await clock.move(rng.choice([1, 5, 20, 50, 65, 65, 90_000 if rng.random() < 0.1 else 2]))
        if rng.random() < 0.7:
            for either in sorted((world, other), key=lambda w: w.name):
                await either.heartbeat_all()
    elif op == "pair":
        if len(world.nodes) < 5 and rng.random() < 0.3:
            await world.pair(rng.choice([[CPU], [CPU, GPU]]))
    elif op == "cross":
        # The other organization's credentials touch this one's objects: invisible (404), nothing written.
        if world.jobs and other.nodes:
            job_id = rng.choice(world.jobs)
            r = await other.call("POST", f"/v1/jobs/{job_id}/cancel", other.key)
            assert r.status_code == 404, r.text
            r = await other.call("GET", f"/v1/jobs/{job_id}/events", other.key)
            assert r.status_code == 404, r.text
            cred = other.nodes[rng.choice(list(other.nodes))]["cred"]
            r = await other.call("POST", f"/v1/agent/jobs/{job_id}/complete", cred, json={"attempt": 1, "result": {}})
            assert r.status_code in (401, 404, 409), r.text
        if world.nodes:
            node_id = rng.choice(list(world.nodes))
            r = await other.call("POST", f"/v1/nodes/{node_id}/drain", other.key)
            assert r.status_code == 404, r.text
            r = await other.call("GET", f"/v1/nodes/{node_id}/events", other.key)
            assert r.status_code == 404, r.text
    elif op == "node_admin":
        if rng.random() < 0.15:
            await world.node_admin()
    else:
        world.last_write = None
        await getattr(world, op)()
        if rng.random() < 0.3:
            await world.repeat_last_write()


SEEDS = [int(s) for s in os.environ.get("UMBRA_AUDIT_SEEDS", "1,2,3").split(",")]
STEPS = int(os.environ.get("UMBRA_AUDIT_STEPS", "160"))


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_http_histories_are_explained_by_the_log(db_url, conn, seed):
    """Through the HTTP API only, with the clock moving: the views equal a fresh fold of the log (``verify``),
    every job's history folds to the job and, cut at any position, to ``?as_of``; the organization's paged
    log is complete, duplicate-free, stable and its own; refused requests recorded nothing; containers settle."""
    async with random_history(db_url, conn, seed, STEPS) as (a, b, _):
        assert await verify(conn) == []
        for world in (a, b):
            for job_id in world.jobs:
                await audit_job(world.client, world.key, job_id, every_position=True)
            await audit_log(world)
            await audit_settlement(world)
        counts = dict(await (await conn.execute("SELECT type, count(*) FROM events GROUP BY 1")).fetchall())
        assert counts.get("job.claimed", 0) > 5 and counts.get("job.completed", 0) > 0 and counts.get("node.went_offline", 0) > 0
        assert a.refused > 0 and len(a.jobs) > 10  # the history did reach refusals and jobs
        # Another organization's job is invisible to the history and time-travel routes.
        if b.jobs:
            other = b.jobs[0]
            assert (await a.client.get(f"/v1/jobs/{other}/events", headers=bearer(a.key))).status_code == 404
            assert (await a.client.get(f"/v1/jobs/{other}", params={"as_of": 10**6}, headers=bearer(a.key))).status_code == 404


@pytest.mark.parametrize("seed", [11])
async def test_umbra_events_replay_matches_the_api(db_url, conn, seed, cli):
    """``umbra events replay ID --json`` (and ``--as-of P``) prints the job the API serves (now, and ``?as_of=P``),
    and for a node the stored status the node view shows, after a random HTTP history."""

    async def replayed(object_id: str, *extra: str) -> dict:
        status, out, err = await cli("events", "replay", object_id, "--json", "--server", server.url,
                                     "--api-key", a.key, *extra)  # fmt: skip
        assert status == 0, err
        return json.loads(out)

    async with random_history(db_url, conn, seed, 120) as (a, _, server):
        rng = random.Random(seed)
        for job_id in rng.sample(a.jobs, min(12, len(a.jobs))):
            printed = await replayed(job_id)
            live = await a.read(f"/v1/jobs/{job_id}")
            assert printed["state"] == live, _dict_diff(printed["state"], live)
            history = (await a.read(f"/v1/jobs/{job_id}/events"))["events"]
            assert printed["events"] == history
            cut = rng.choice(history)["position"]
            printed = await replayed(job_id, "--as-of", str(cut))
            then = await a.read(f"/v1/jobs/{job_id}", as_of=cut)
            assert printed["state"] == then, _dict_diff(printed["state"], then)
        for node_id in a.nodes:
            printed = await replayed(node_id)
            node = await a.read(f"/v1/nodes/{node_id}")
            assert (printed["state"]["status"], printed["state"]["name"]) == (node["stored_status"], node["name"])
            assert printed["state"]["position"] == max(e["position"] for e in printed["events"])




ODD = ["back\\slash", "tab\there", "new\nline", "cr\rret", "quote\"s", "\u2028sep\u2029", "\\N", "\\.", "é漢字🙂",
       "\x01ctl\x1f", "\\\\\\t"]  # fmt: skip


@pytest.mark.parametrize("count", [300, 20])
async def test_batch_copy_path_rows_equal_their_events(client, conn, org, count):
    """A batch large enough to travel by COPY (>= 256 events) and a small one (one INSERT): every job's
    answer, its row, its events' fold and ``as_of`` at its submission agree, with strings COPY must escape
    (backslashes, tabs, newlines, ``\\N``, ``\\.``, control and non-BMP characters) in kind, payload,
    lang and idempotency key; and ``verify`` finds nothing."""
    org_id, key = org
    items = []
    for i in range(count):
        odd = ODD[i % len(ODD)]
        items.append({"kind": f"k{odd}", "payload": {odd: [odd, i, 1.5, None, True], "n": {"deep": odd}},
                      "lang": odd, "idempotency_key": f"{odd}-{i}", "priority": i % 5 - 2})  # fmt: skip
    r = await client.post("/v1/jobs/batch", json={"jobs": items}, headers=bearer(key))
    assert r.status_code == 201, r.text
    answered = r.json()["jobs"]
    assert await verify(conn) == []
    for i in list(range(0, count, 7)) + [count - 1]:
        job = answered[i]
        assert (job["kind"], job["payload"], job["lang"], job["idempotency_key"]) == (
            items[i]["kind"], items[i]["payload"], items[i]["lang"], items[i]["idempotency_key"])  # fmt: skip
        live = (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()
        assert live == job, _dict_diff(live, job)
        await audit_job(client, key, job["id"], every_position=True)
    # The same keys again: the first jobs, nothing recorded.
    head = (await (await conn.execute("SELECT max(position) FROM events")).fetchone())[0]
    again = await client.post("/v1/jobs/batch", json={"jobs": items}, headers=bearer(key))
    assert again.status_code in (200, 201), again.text
    assert [j["id"] for j in again.json()["jobs"]] == [j["id"] for j in answered]
    assert (await (await conn.execute("SELECT max(position) FROM events")).fetchone())[0] == head



async def test_a_tailing_reader_misses_nothing_under_concurrent_http_writers(client, conn, org):
    """Agents claiming (max=N) and completing (one by one with claim_next, and in reports), submitters
    submitting single jobs and COPY-sized batches, all at once over HTTP, while a reader tails
    ``GET /v1/events?after=<last seen>``: what the tail collected is exactly the log read afterwards from 0
    (no event skipped, none twice, same order); within a stream time never runs backwards; every queue
    snapshot taken meanwhile is the fold of the log up to the position it names; the views equal the fold."""
    org_id, key = org
    world = World("t", client, conn, org_id, key, random.Random(5))
    creds = []
    for _ in range(4):
        node_id = await world.pair([CPU])
        creds.append((node_id, world.nodes[node_id]["cred"]))
    done = anyio.Event()
    writers_done = anyio.Event()
    tailed: list[dict] = []
    snapshots: list[dict] = []

    async def submitter(i: int) -> None:
        for round_ in range(6):
            if round_ % 3 == 2:
                jobs = [{"kind": "a", "payload": {"i": i, "r": round_, "j": j}} for j in range(300)]
                r = await client.post("/v1/jobs/batch", json={"jobs": jobs}, headers=bearer(key))
            else:
                r = await client.post("/v1/jobs", json={"kind": "a", "payload": {"i": i}}, headers=bearer(key))
            assert r.status_code == 201, r.text
            await anyio.sleep(0.05)

    async def agent(node_id: str, cred: str, style: int) -> None:
        h = bearer(cred)
        held: list[tuple[str, int]] = []
        while not done.is_set():
            if not held:
                r = await client.post("/v1/agent/claim", params={"wait": 1, "max": 3}, headers=h)
                assert r.status_code in (200, 204), r.text
                if r.status_code == 200:
                    held += [(c["job"]["id"], c["job"]["attempt"]) for c in (r.json().get("claims") or [r.json()])]
                continue
            if style == 0:
                job_id, attempt = held.pop(0)
                r = await client.post(f"/v1/agent/jobs/{job_id}/complete", params={"claim_next": "true"},
                                      json={"attempt": attempt, "result": {"by": node_id}}, headers=h)  # fmt: skip
                assert r.status_code == 200, r.text
                if r.json()["next_claim"]:
                    held.append((r.json()["next_claim"]["job"]["id"], r.json()["next_claim"]["job"]["attempt"]))
            else:
                results = [{"job_id": j, "attempt": a, "result": {"by": node_id}} for j, a in held]
                r = await client.post("/v1/agent/complete", params={"claim_next": 2},
                                      json={"results": results}, headers=h)  # fmt: skip
                assert r.status_code == 200, r.text
                assert all(item["status"] == 200 for item in r.json()["results"]), r.text
                held = [(c["job"]["id"], c["job"]["attempt"]) for c in r.json()["next_claims"]]

    async def snapshotter() -> None:
        while not done.is_set():
            r = await client.get("/v1/projections/queue", params={"limit": 1000}, headers=bearer(key))
            assert r.status_code == 200, r.text
            snapshots.append(r.json())
            await anyio.sleep(0.1)

    async def tail_until_writers_done() -> None:
        after = 0
        while True:
            quiet = writers_done.is_set()  # read before the page: a page after the writers ended is the last
            page = await world.read("/v1/events", after=after, limit=257)
            tailed.extend(page["events"])
            after = page["next"]
            if quiet and not page["events"]:
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(tail_until_writers_done)
        tg.start_soon(snapshotter)
        async with anyio.create_task_group() as writers:
            for i, (node_id, cred) in enumerate(creds):
                writers.start_soon(agent, node_id, cred, i % 2)
            async with anyio.create_task_group() as submitters:
                for i in range(3):
                    submitters.start_soon(submitter, i)
            await anyio.sleep(2)
            done.set()
        writers_done.set()
    whole = await page_all(client, key, 1000)
    assert [e["position"] for e in tailed] == [e["position"] for e in whole], "the tail skipped or repeated"
    assert tailed == whole
    audit_claim_names(whole)
    # Within a stream, time never runs backwards (a job is not finished before it started).
    # (Across streams recorded_at may run a few ms behind position: it is each transaction's start.)
    last_at: dict[str, datetime] = {}
    for event in whole:
        at = datetime.fromisoformat(event["recorded_at"].replace("Z", "+00:00"))
        assert event["stream"] not in last_at or at >= last_at[event["stream"]], ("time ran backwards", event)
        last_at[event["stream"]] = at
    assert len(snapshots) >= 5
    for snapshot in snapshots:
        folded = fold_jobs_up_to(whole, snapshot["position"])
        counts = {status: 0 for status in snapshot["counts"]}
        for job in folded.values():
            counts[job["status"]] += 1
        assert snapshot["counts"] == counts, snapshot["position"]
        for job in snapshot["jobs"]:
            assert job == folded[job["id"]], (snapshot["position"], _dict_diff(job, folded[job["id"]]))
    completed = sum(e["type"] == "job.completed" for e in whole)
    assert completed > 20, completed
    assert await verify(conn) == []


async def test_a_containers_history_explains_its_settlement_after_a_blocked_timeout(db_url, conn):
    """A container whose children complete, get cancelled, and stay blocked until their schedule timeout
    (the clock moved past 24 h, the sweeper run): it settles ``partial`` with the count in its detail; the
    settlement is in its own stream, caused by the child's event; every job folds to itself at every
    position; ``verify`` finds nothing. A cancelled container takes its open children with it."""
    org_id, key = await create_organization(conn, "tree")
    await SharedClock.install(conn)
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="3600") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            world = World("t", client, conn, org_id, key, random.Random(1))
            clock = SharedClock(conn, server.settings)
            node_id = await world.pair([CPU])
            cred = world.nodes[node_id]["cred"]

            async def claim(kind: str) -> dict:
                return (await world.call("POST", "/v1/agent/claim", cred, params={"wait": 0, "kind": kind})).json()["job"]

            async def status(job_id: str) -> str:
                return (await world.read(f"/v1/jobs/{job_id}"))["status"]

            trees = []
            for _ in range(2):
                parent = (await world.call("POST", "/v1/jobs", key, json={"kind": "p"})).json()["id"]
                claimed = await claim("p")
                assert claimed["id"] == parent
                kids = [{"kind": "c", "payload": {}, "requires": {}}, {"kind": "c", "payload": {}, "requires": {}},
                        {"kind": "c", "payload": {}, "requires": {"vram_min_mb": 999_999}}]  # fmt: skip
                made = await world.call("POST", f"/v1/agent/jobs/{parent}/children", cred,
                                        json={"attempt": claimed["attempt"], "children": kids})  # fmt: skip
                assert made.status_code == 201, made.text
                trees.append((parent, [c["id"] for c in made.json()["children"]]))
            (p1, (k1a, k1b, k1c)), (p2, (k2a, k2b, k2c)) = trees
            assert [await status(k1a), await status(k1c)] == ["queued", "blocked"]
            # Tree 1: one child completes, one is cancelled, one stays blocked until it times out.
            got = await claim("c")
            assert got["id"] == k1a
            assert (await world.call("POST", f"/v1/agent/jobs/{k1a}/complete", cred,
                                     json={"attempt": got["attempt"], "result": {}})).status_code == 200  # fmt: skip
            assert (await world.call("POST", f"/v1/jobs/{k1b}/cancel", key)).status_code == 200
            assert await status(p1) == "running"
            # Tree 2: the container is cancelled; its open children go with it.
            assert (await world.call("POST", f"/v1/jobs/{p2}/cancel", key)).status_code == 200
            assert [await status(k) for k in (k2a, k2b, k2c)] == ["cancelled"] * 3
            await clock.move(server.settings.blocked_timeout_seconds + 5)
            parent = await world.read(f"/v1/jobs/{p1}")
            assert await status(k1c) == "failed"
            assert parent["status"] == "partial" and parent["result"]["children_failed"] == 2, parent
            settled = (await world.read(f"/v1/jobs/{p1}/events"))["events"][-1]
            assert settled["type"] == "job.settled" and settled["metadata"].get("causation") == f"job:{k1c}", settled
            for job_id in (p1, k1a, k1b, k1c, p2, k2a, k2b, k2c):
                await audit_job(client, key, job_id, every_position=True)
            assert await verify(conn) == []


async def test_verify_reports_a_result_whose_json_type_differs_from_the_log(client, conn, org):
    """``verify`` compares JSON columns as JSON, not as Python values (where ``True == 1``): a row written
    some other way whose ``result`` says ``{"approved": 1}`` where the log recorded ``{"approved": true}``
    is reported, since the API would serve a result the log never held."""
    org_id, key = org
    world = World("v", client, conn, org_id, key, random.Random(0))
    node_id = await world.pair([CPU])
    cred = world.nodes[node_id]["cred"]
    job_id = (await world.call("POST", "/v1/jobs", key, json={"kind": "a"})).json()["id"]
    claimed = (await world.call("POST", "/v1/agent/claim", cred, params={"wait": 0})).json()
    done = await world.call("POST", f"/v1/agent/jobs/{job_id}/complete", cred,
                            json={"attempt": claimed["job"]["attempt"], "result": {"approved": True, "rejected": False}})  # fmt: skip
    assert done.status_code == 200
    assert await verify(conn) == []
    # Another writer changes the row's JSON types (not through the fold).
    await conn.execute("""UPDATE jobs SET result = '{"approved": 1, "rejected": 0}' WHERE id = %s""", (job_id,))
    served = (await world.read(f"/v1/jobs/{job_id}"))["result"]
    assert served == {"approved": 1, "rejected": 0} and served["approved"] is not True  # the view now disagrees
    differences = await verify(conn)
    assert [d["field"] for d in differences] == ["result"], differences


#: Text JSON can carry: UTF-8 (no lone surrogates) without NUL (PostgreSQL's text and jsonb refuse it).
_json_char = st.characters(codec="utf-8", exclude_characters="\x00")
_json_leaves = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
                | st.floats(min_value=-1e12, max_value=1e12) | st.text(alphabet=_json_char, max_size=12))  # fmt: skip
_json = st.recursive(_json_leaves, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(alphabet=_json_char, max_size=6), inner, max_size=3),
                     max_leaves=12)  # fmt: skip

#: The node paired for an organization, kept across hypothesis' examples (they share the test's fixtures).
_NODE_OF: dict[UUID, tuple[World, str]] = {}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None)
@given(payload=st.dictionaries(st.text(alphabet=_json_char, max_size=6), _json, max_size=4), result=_json)
async def test_json_values_survive_the_log_the_fold_and_the_api(client, conn, org, payload, result):
    """Any JSON payload and result (nested, unicode, floats, 64-bit integers) reads back the same from the
    submit answer, the completion answer, ``GET /v1/jobs/{id}``, the fold of its events and ``as_of`` at each
    event, and ``verify`` finds the row equal to the fold.

    Floats stay below 1e12 in magnitude: past that, jsonb keeps the shortest decimal text of a float (e.g.
    ``4.050374054061993e+16`` as ``40503740540619930``), which reads back as an integer: the same JSON number,
    but not an equal Python value."""
    org_id, key = org
    h = bearer(key)
    if org_id not in _NODE_OF:
        world = World("j", client, conn, org_id, key, random.Random(0))
        _NODE_OF[org_id] = (world, await world.pair([CPU]))
    world, node_id = _NODE_OF[org_id]
    await world.beat(node_id)  # the examples may run longer than the stale threshold
    cred = world.nodes[node_id]["cred"]
    submitted = await client.post("/v1/jobs", json={"kind": "j", "payload": payload}, headers=h)
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["id"]
    assert submitted.json()["payload"] == payload
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))
    assert claimed.status_code == 200 and claimed.json()["job"]["id"] == job_id, claimed.text
    done = await client.post(f"/v1/agent/jobs/{job_id}/complete", json={"attempt": claimed.json()["job"]["attempt"],
                                                                        "result": result}, headers=bearer(cred))  # fmt: skip
    assert done.status_code == 200, done.text
    live = await world.read(f"/v1/jobs/{job_id}")
    assert (live["payload"], live["result"]) == (payload, result)
    assert done.json()["result"] == result
    await audit_job(client, key, job_id, every_position=True)
    assert await verify(conn, org_id) == []
