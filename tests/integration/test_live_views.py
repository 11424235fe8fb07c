"""What a dashboard watching the queue live sees, over time.

Projection snapshots and their SSE stream, the event log paged and streamed (Last-Event-ID resumption),
and the dashboard page, under concurrent submits, claims, completions, cancels, heartbeats, a node going
stale and a retirement. Every pushed view is compared with a fold of the log up to the position it is
tagged with.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import httpx
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually
from tests.integration.queue_support import CPU64_JSON, http_pair
from tests.integration.test_sse import SseReader
from tests.integration.test_sse_projections import next_view
from umbra.compute.accounts import create_api_key, create_organization
from umbra.events import store
from umbra.projections import jobs as job_rows
from umbra.projections import nodes as node_rows
from umbra.api.projections import MOST_CHANGED
from umbra.events import documents

pytestmark = pytest.mark.anyio

OPEN_ORDER = {"running": 0, "blocked": 1, "queued": 2}


# -- folds of the log up to a position ---------------------------------------------------------------


async def _log_upto(conn, org_id: uuid.UUID, position: int) -> list[store.RecordedEvent]:
    out: list[store.RecordedEvent] = []
    after = 0
    while True:
        batch = await store.read_log(conn, after=after, limit=5000, organization_id=org_id)
        for r in batch:
            if r.position > position:
                return out
            out.append(r)
        if len(batch) < 5000:
            return out
        after = batch[-1].position


async def _folded_jobs(conn, org_id, position) -> dict[uuid.UUID, Any]:
    rows: dict[uuid.UUID, Any] = {}
    for r in await _log_upto(conn, org_id, position):
        if r.stream.startswith("job:"):
            jid = job_rows.job_id_of(r.stream)
            rows[jid] = job_rows.fold(rows.get(jid), r, job_id=jid)
    return rows


async def _folded_nodes(conn, org_id, position) -> dict[str, Any]:
    states: dict[str, Any] = {}
    for r in await _log_upto(conn, org_id, position):
        if r.stream.startswith("node:"):
            states[r.stream] = node_rows.fold(states.get(r.stream), r)
    return {str(s.id): s for s in states.values()}


def _as_json(value: Any) -> Any:
    return json.loads(documents.encode(value))


async def _expected_queue(conn, org_id, position, limit=200) -> dict[str, Any]:
    rows = await _folded_jobs(conn, org_id, position)
    counts: dict[str, int] = {}
    for row in rows.values():
        counts[row.status] = counts.get(row.status, 0) + 1
    open_rows = sorted((r for r in rows.values() if r.status in OPEN_ORDER),
                       key=lambda r: (OPEN_ORDER[r.status], r.priority, r.seq))  # fmt: skip
    return {"counts": counts, "jobs": [_as_json(job_rows.to_json(r)) for r in open_rows[:limit]],
            "truncated": len(open_rows) > limit}  # fmt: skip


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


async def _check_queue_view(conn, org_id, view: dict, limit: int = 200) -> None:
    expected = await _expected_queue(conn, org_id, view["position"], limit)
    assert _nonzero(view["counts"]) == expected["counts"], (view["position"], view["counts"], expected["counts"])
    got_ids = [j["id"] for j in view["jobs"]]
    want_ids = [j["id"] for j in expected["jobs"]]
    assert got_ids == want_ids, f"at position {view['position']}: listed {got_ids} but the log says {want_ids}"
    for got, want in zip(view["jobs"], expected["jobs"]):
        assert got == want, f"at position {view['position']}: job {got['id']} differs: {got} != {want}"
    assert view.get("truncated", False) == expected["truncated"]


async def _check_nodes_view(conn, org_id, view: dict) -> None:
    folded = await _folded_nodes(conn, org_id, view["position"])
    assert sorted(n["id"] for n in view["nodes"]) == sorted(folded), view["position"]
    for node in view["nodes"]:
        state = folded[node["id"]]
        assert node["stored_status"] == state.status, (view["position"], node, state)
        assert node["name"] == state.name
        assert node["updated_at"] == _as_json(state.updated_at), (view["position"], node["updated_at"], state.updated_at)


# -- concurrent workload -------------------------------------------------------------------------------


async def _workload(client: httpx.AsyncClient, key: str, nodes: list[tuple[str, str]], *, jobs: int = 30) -> None:
    """Submits (single and batch), claims, completions, failures, cancels, heartbeats, then a retirement."""
    headers = bearer(key)
    submitted: list[str] = []
    submitted_all = anyio.Event()

    async def submitter() -> None:
        for i in range(jobs):
            r = await client.post("/v1/jobs", json={"kind": "echo", "payload": {"i": i}, "priority": 100 + (i % 3)},
                                  headers=headers)  # fmt: skip
            assert r.status_code == 201, r.text
            submitted.append(r.json()["id"])
            if i % 10 == 5:
                r = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo", "payload": {"b": k}} for k in range(12)]},
                                      headers=headers)  # fmt: skip
                assert r.status_code == 201, r.text
                submitted.extend(j["id"] for j in r.json()["jobs"])
        submitted_all.set()

    async def worker(credential: str, n: int) -> None:
        """Handles up to ``n`` jobs, a decomposition among its first four however slowly the submitter goes
        (it stops at an empty queue only once the submitter is done and it has decomposed; 20 s at most)."""
        k = -1
        with anyio.move_on_after(20):
            while k + 1 < n:
                r = await client.post("/v1/agent/claim", params={"wait": 1}, headers=bearer(credential))
                if r.status_code == 204:
                    if submitted_all.is_set() and k >= 3:
                        return
                    continue
                assert r.status_code == 200, r.text
                k += 1
                await handle(credential, r.json()["job"], k)

    async def handle(credential: str, job: dict, k: int) -> None:
        if k % 7 == 3 and job["parent_job_id"] is None:
            r = await client.post(f"/v1/agent/jobs/{job['id']}/children", json={"attempt": job["attempt"], "children": [
                {"kind": "echo", "payload": {"child": c}, "requires": {}} for c in range(2)]}, headers=bearer(credential))  # fmt: skip
            assert r.status_code in (201, 409), r.text
            return
        if k % 5 == 4:
            r = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": job["attempt"], "error": "x", "retry": True},
                                  headers=bearer(credential))  # fmt: skip
        else:
            r = await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": job["attempt"], "result": {"k": k}},
                                  headers=bearer(credential))  # fmt: skip
        assert r.status_code in (200, 409), r.text

    async def chained_worker(credential: str, n: int) -> None:
        """claim?max=3, then completions that claim the next ones in the same transaction (as `umbra agent`)."""
        held: list[dict] = []
        for k in range(n):
            if not held:
                r = await client.post("/v1/agent/claim", params={"wait": 0, "max": 3}, headers=bearer(credential))
                if r.status_code == 204:
                    await anyio.sleep(0.02)
                    continue
                assert r.status_code == 200, r.text
                held = [c["job"] for c in r.json().get("claims", [r.json()])]
            if k % 2:
                job = held.pop(0)
                r = await client.post(f"/v1/agent/jobs/{job['id']}/complete", params={"claim_next": "true"},
                                      json={"attempt": job["attempt"], "result": {}}, headers=bearer(credential))  # fmt: skip
                assert r.status_code in (200, 409), r.text
                if r.status_code == 200 and r.json().get("next_claim"):
                    held.append(r.json()["next_claim"]["job"])
            else:
                results = [{"job_id": j["id"], "attempt": j["attempt"], "result": {}} for j in held]
                r = await client.post("/v1/agent/complete", params={"claim_next": 2}, json={"results": results},
                                      headers=bearer(credential))  # fmt: skip
                assert r.status_code == 200, r.text
                held = [c["job"] for c in r.json()["next_claims"]]
        for job in held:
            await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": job["attempt"], "result": {}},
                              headers=bearer(credential))  # fmt: skip

    async def canceller() -> None:
        for k in range(12):
            await anyio.sleep(0.03)
            if submitted:
                target = submitted[(k * 7) % len(submitted)]
                r = await client.post(f"/v1/jobs/{target}/cancel", headers=headers)
                assert r.status_code in (200, 409), r.text

    async def beater(credential: str) -> None:
        for k in range(6):
            device = {**CPU64_JSON, "ram_free_mb": 20000 + 9000 * (k % 3)}
            r = await client.post("/v1/agent/heartbeat", json={"devices": [device], "agent_version": "1"},
                                  headers=bearer(credential))  # fmt: skip
            assert r.status_code == 200, r.text
            await anyio.sleep(0.05)

    async with anyio.create_task_group() as tg:
        tg.start_soon(submitter)
        tg.start_soon(canceller)
        for i, (_, credential) in enumerate(nodes):
            tg.start_soon(chained_worker if i % 2 == 0 else worker, credential, 25)
            tg.start_soon(beater, credential)
    r = await client.post(f"/v1/nodes/{nodes[-1][0]}/retire", headers=headers)
    assert r.status_code == 200, r.text


# -- tests -----------------------------------------------------------------------------------------------


async def test_every_pushed_view_equals_the_log_folded_to_its_position_under_concurrent_changes(conn, org, live_server):
    """Each queue and nodes message of /v1/projections/stream, pushed while jobs are submitted, claimed,
    completed, failed and cancelled and nodes beat and retire, equals the fold of the organization's log up
    to the position it is tagged with; positions never go backwards on the stream; counts match."""
    org_id, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        nodes = [await http_pair(client, key, "box-a"), await http_pair(client, key, "box-b")]
        messages = await _streamed_during(client, key, conn, org_id, _workload(client, key, nodes))
        await _check_messages(conn, org_id, client, key, messages)


async def _streamed_during(client: httpx.AsyncClient, key: str, conn, org_id, work) -> list[dict]:
    """The projection stream's messages from its opening until it has caught up with the log after ``work``."""
    messages: list[dict] = []
    async with client.stream("GET", "/v1/projections/stream", headers=bearer(key)) as response:
        assert response.status_code == 200
        reader = SseReader(response)

        async def collect() -> None:
            while True:
                messages.append(await reader.next_message())

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect)
            await work
            head = await store.head_position(conn, org_id)

            async def caught_up() -> bool:
                return any(json.loads(m["data"])["position"] >= head for m in messages)

            try:
                await eventually(caught_up, timeout=10)
            except AssertionError:
                raise AssertionError(f"head {head}; streamed {[(m.get('event'), json.loads(m['data'])['position']) for m in messages][-8:]}")
            tg.cancel_scope.cancel()
    return messages


async def _check_messages(conn, org_id, client, key, messages) -> None:
    assert len(messages) > 5
    types = {r.type for r in await _log_upto(conn, org_id, 2**62)}
    assert {"job.claimed", "job.completed", "job.decomposed", "node.retired"} <= types, types
    last: dict[str, int] = {}
    overall = 0
    for m in messages:
        view = json.loads(m["data"])
        assert view["position"] >= last.get(m["event"], 0), f"{m['event']} went back: {last} -> {view['position']}"
        assert view["position"] >= overall, "positions went backwards across the stream"
        last[m["event"]] = overall = view["position"]
        if m["event"] == "queue":
            await _check_queue_view(conn, org_id, view)
            for job in view["jobs"][:3]:  # the job as of the view's position is the listed one
                r = await client.get(f"/v1/jobs/{job['id']}", params={"as_of": view["position"]}, headers=bearer(key))
                assert r.status_code == 200 and r.json() == job, (view["position"], r.text, job)
        elif m["event"] == "nodes":
            await _check_nodes_view(conn, org_id, view)


async def _batch(client, key: str, n: int, tag: str) -> None:
    r = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo", "payload": {tag: i}} for i in range(n)]},
                          headers=bearer(key))  # fmt: skip
    assert r.status_code == 201, r.text


async def test_event_stream_resumed_with_last_event_id_during_large_bursts_has_no_gap_or_duplicate(conn, org, live_server):
    """A slow client of /v1/events/stream that drops the connection several times and reconnects with
    Last-Event-ID, while batches of thousands of events (the COPY path) and single submits are appended
    concurrently, receives every event of its organization exactly once, in log order."""
    org_id, key = org
    other_id, other_key = await create_organization(conn, "other")
    received: list[int] = []
    last_id: str | None = None
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:

        async def writers() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_batch, client, key, 1200, "a")
                tg.start_soon(_batch, client, other_key, 600, "o")
                for i in range(20):
                    tg.start_soon(_batch, client, key, 1 + i % 3, f"s{i}")
                tg.start_soon(_batch, client, key, 1000, "b")

        async with anyio.create_task_group() as tg:
            tg.start_soon(writers)
            for session in range(6):
                headers = bearer(key) if last_id is None else {**bearer(key), "Last-Event-ID": last_id}
                async with client.stream("GET", "/v1/events/stream", headers=headers) as response:
                    assert response.status_code == 200
                    reader = SseReader(response)
                    with anyio.move_on_after(3):
                        for _ in range(300 + 120 * session):
                            m = await reader.next_message()
                            received.append(int(m["id"]))
                            last_id = m["id"]
                            if len(received) % 200 == 0:
                                await anyio.sleep(0.01)  # a slow reader
        # Drain what is left.
        total = len(await _log_upto(conn, org_id, 2**62))
        async with client.stream("GET", "/v1/events/stream", headers={**bearer(key), "Last-Event-ID": last_id}) as response:
            reader = SseReader(response)
            with anyio.move_on_after(15):
                while len(received) < total:
                    received.append(int((await reader.next_message())["id"]))
    logged = [r.position for r in await _log_upto(conn, org_id, 2**62)]
    assert len(logged) == total >= 2239
    assert len(received) == len(set(received)), "duplicates after a Last-Event-ID resume"
    assert received == logged


async def test_paging_events_while_appending_yields_each_exactly_once(conn, org, client):
    """GET /v1/events?after=P, paged by `next` while batches are appended concurrently, yields the log exactly
    once in order; `next` equals `after` on an empty page."""
    org_id, key = org
    got: list[int] = []
    after = 0
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(_batch, client, key, 600, f"p{i}")
        for _ in range(40):
            r = await client.get("/v1/events", params={"after": after, "limit": 137}, headers=bearer(key))
            assert r.status_code == 200
            page = r.json()
            got.extend(e["position"] for e in page["events"])
            after = page["next"]
            await anyio.sleep(0.01)
    while True:
        r = await client.get("/v1/events", params={"after": after, "limit": 1000}, headers=bearer(key))
        page = r.json()
        if not page["events"]:
            assert page["next"] == after
            break
        got.extend(e["position"] for e in page["events"])
        after = page["next"]
    logged = [r.position for r in await _log_upto(conn, org_id, 2**62)]
    assert got == logged and len(got) == 4800  # job.submitted + job.blocked (no node can run them)


async def test_snapshots_taken_during_concurrent_changes_equal_the_log_at_their_position(conn, org, live_server):
    """GET /v1/projections/queue (with several limits) and /v1/projections/nodes, read while the workload
    runs, each equal the fold of the log up to the position they report; counts cover every status."""
    org_id, key = org
    snapshots: list[tuple[str, int, dict]] = []
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        nodes = [await http_pair(client, key, "box-a"), await http_pair(client, key, "box-b")]
        stop = anyio.Event()

        async def poll() -> None:
            k = 0
            while not stop.is_set():
                limit = (200, 3, 0)[k % 3]
                q = await client.get("/v1/projections/queue", params={"limit": limit}, headers=bearer(key))
                n = await client.get("/v1/projections/nodes", headers=bearer(key))
                assert q.status_code == 200 and n.status_code == 200
                snapshots.append(("queue", limit, q.json()))
                snapshots.append(("nodes", 0, n.json()))
                if k % 4 == 0:  # verify, under the same concurrent writes, finds the views equal to the log
                    v = await client.post("/v1/projections/verify", headers=bearer(key))
                    assert v.status_code == 200 and v.json() == {"ok": True, "differences": []}, v.text[:500]
                k += 1
                await anyio.sleep(0.02)

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            await _workload(client, key, nodes, jobs=20)
            stop.set()
    assert len(snapshots) >= 6
    from umbra.events.types import JOB_STATUSES

    for kind, limit, view in snapshots:
        if kind == "queue":
            assert set(view["counts"]) >= set(JOB_STATUSES)
            open_count = sum(view["counts"][s] for s in OPEN_ORDER)
            assert len(view["jobs"]) == min(limit, open_count)
            assert view["truncated"] == (open_count > limit)
            await _check_queue_view(conn, org_id, view, limit)
        else:
            await _check_nodes_view(conn, org_id, view)


async def test_bad_parameters_get_the_documented_error_shape(org, client):
    """Bad query parameters of the event and projection routes → 422 invalid_request naming the parameter
    (Last-Event-ID too), with the {error, message} shape; nothing is streamed."""
    _, key = org
    h = bearer(key)
    cases = [
        ("/v1/events", {"after": "-1"}, {}, "after"),
        ("/v1/events", {"after": "abc"}, {}, "after"),
        ("/v1/events", {"after": "1.5"}, {}, "after"),
        ("/v1/events", {"limit": "0"}, {}, "limit"),
        ("/v1/events", {"limit": "1001"}, {}, "limit"),
        ("/v1/events", {"after": ["1", "2"]}, {}, "after"),
        ("/v1/events/stream", {"after": "-1"}, {}, "after"),
        ("/v1/events/stream", {"after": "abc"}, {}, "after"),
        ("/v1/events/stream", {}, {"Last-Event-ID": "garbage"}, "Last-Event-ID"),
        ("/v1/events/stream", {}, {"Last-Event-ID": "-1"}, "Last-Event-ID"),
        ("/v1/events/stream", {}, {"Last-Event-ID": "99999999999999999999999"}, "Last-Event-ID"),
        ("/v1/projections/stream", {"views": "unknown"}, {}, "views"),
        ("/v1/projections/stream", {"views": "queue,nodes,jobs"}, {}, "views"),
        ("/v1/projections/queue", {"limit": "-1"}, {}, "limit"),
        ("/v1/projections/queue", {"limit": "abc"}, {}, "limit"),
        ("/v1/projections/queue", {"limit": "1001"}, {}, "limit"),
    ]
    for path, params, headers, field in cases:
        with anyio.fail_after(10):
            r = await client.get(path, params=params, headers={**h, **headers})
        assert r.status_code == 422, (path, params, headers, r.status_code, r.text[:200])
        body = r.json()
        assert body["error"] == "invalid_request" and isinstance(body["message"], str) and body["message"], body
        assert body.get("field") == field, (path, params, body)
    for path in ("/v1/events", "/v1/events/stream", "/v1/projections/stream", "/v1/projections/queue", "/v1/projections/nodes"):
        r = await client.get(path, params={"after": "abc", "views": "bogus"}, headers={"Authorization": "Bearer uk_nope"})
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated", (path, r.text)


async def test_position_boundaries_of_after_and_last_event_id(conn, org, client, live_server):
    """after=P and Last-Event-ID: P give exactly the events with position > P; after=head gives an empty page
    whose next is head; a Last-Event-ID past the head waits without sending anything old."""
    org_id, key = org
    await _batch(client, key, 5, "x")
    log = [r.position for r in await _log_upto(conn, org_id, 2**62)]
    for i, p in enumerate(log):
        page = (await client.get("/v1/events", params={"after": p, "limit": 1000}, headers=bearer(key))).json()
        assert [e["position"] for e in page["events"]] == log[i + 1:]
        assert page["next"] == (log[-1] if i + 1 < len(log) else p)
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as streams:
        async with streams.stream("GET", "/v1/events/stream", params={"after": 0},
                                  headers={**bearer(key), "Last-Event-ID": str(log[3])}) as response:  # fmt: skip
            got = await SseReader(response).take(len(log) - 4)
        assert [int(m["id"]) for m in got] == log[4:]
        async with streams.stream("GET", "/v1/events/stream", headers={**bearer(key), "Last-Event-ID": str(log[-1])}) as response:
            reader = SseReader(response)
            await _batch(client, key, 1, "y")
            new = await reader.take(1)
        assert int(new[0]["id"]) > log[-1]
        # EventSource sends an empty Last-Event-ID when it has none: the `after` parameter stands.
        async with streams.stream("GET", "/v1/events/stream", params={"after": log[-2]},
                                  headers={**bearer(key), "Last-Event-ID": ""}) as response:  # fmt: skip
            first = await SseReader(response).take(1)
        assert int(first[0]["id"]) == log[-1]


async def test_streams_and_views_show_nothing_of_another_organization(conn, org, live_server):
    """While another organization submits jobs, pairs a node and its node beats, this organization's event
    stream, projection stream and snapshots show none of it, and its projection stream pushes nothing for it."""
    org_id, key = org
    other_id, other_key = await create_organization(conn, "other")
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        mine = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()["id"]
        async with client.stream("GET", "/v1/projections/stream", headers=bearer(key)) as views, \
                client.stream("GET", "/v1/events/stream", headers=bearer(key)) as events:  # fmt: skip
            view_reader, event_reader = SseReader(views), SseReader(events)
            first = [await view_reader.next_message(), await view_reader.next_message()]
            own = await event_reader.take(2)
            # The other organization is busy.
            theirs = (await client.post("/v1/jobs", json={"kind": "secret"}, headers=bearer(other_key))).json()["id"]
            await _batch(client, other_key, 300, "o")
            node_id, credential = await http_pair(client, other_key, "their-box")
            job = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))).json()["job"]
            await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": job["attempt"], "result": {}},
                              headers=bearer(credential))  # fmt: skip
            leaked: list[dict] = []
            with anyio.move_on_after(2.5):  # past a couple of safety polls
                async with anyio.create_task_group() as tg:
                    async def watch(reader):
                        while True:
                            leaked.append(await reader.next_message())
                    tg.start_soon(watch, view_reader)
                    tg.start_soon(watch, event_reader)
        queue = (await client.get("/v1/projections/queue", headers=bearer(key))).json()
        nodes = (await client.get("/v1/projections/nodes", headers=bearer(key))).json()
    assert leaked == [], f"another organization's activity reached this organization's streams: {leaked[:3]}"
    for m in first + own:
        assert theirs not in m["data"] and str(other_id) not in m["data"] and node_id not in m["data"]
    assert [j["id"] for j in queue["jobs"]] == [mine] and sum(queue["counts"].values()) == 1
    assert nodes["nodes"] == []
    assert queue["position"] == nodes["position"] == await store.head_position(conn, org_id)


@pytest.fixture
def fast_stale_server(db_url):
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="0.2", UMBRA_HEARTBEAT_INTERVAL_SECONDS="1",
                    UMBRA_HEARTBEAT_STALE_SECONDS="2") as server:  # fmt: skip
        yield server


async def test_a_node_going_stale_is_pushed_and_then_its_went_offline_event(conn, org, fast_stale_server):
    """A node that stops beating is pushed as offline once silent past the stale threshold (database clock),
    and the sweeper's node.went_offline is pushed too; each nodes message equals the log at its position."""
    org_id, key = org
    async with httpx.AsyncClient(base_url=fast_stale_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/projections/stream", params={"views": "nodes"}, headers=bearer(key)) as response:
            reader = SseReader(response)
            await next_view(reader, "nodes")
            node_id, _ = await http_pair(client, key, "quiet")
            seen: list[dict] = []
            with anyio.fail_after(10):
                while True:
                    view = await next_view(reader, "nodes")
                    seen.append(view)
                    node = next(n for n in view["nodes"] if n["id"] == node_id)
                    if node["stored_status"] == "offline":
                        break
    statuses = [next(n for n in v["nodes"] if n["id"] == node_id)["status"] for v in seen]
    assert "online" in statuses and statuses[-1] == "offline"
    for view in seen:
        await _check_nodes_view(conn, org_id, view)
    went = [r for r in await _log_upto(conn, org_id, 2**62) if r.type == "node.went_offline"]
    assert len(went) == 1 and seen[-1]["position"] >= went[0].position


async def test_changed_names_the_jobs_that_moved_and_says_when_there_were_more(conn, org, live_server):
    """A queue message's `changed` names the jobs that moved since the previous message, oldest move first, up to
    MOST_CHANGED; when more moved (a batch of 1,500 submitted at once) it says so (`changed_truncated`), so a
    client knows to refresh every row rather than believe the others did not move."""
    org_id, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/projections/stream", params={"views": "queue"}, headers=bearer(key)) as response:
            reader = SseReader(response)
            await next_view(reader, "queue")
            r = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo"} for _ in range(1500)]}, headers=bearer(key))
            ids = [j["id"] for j in r.json()["jobs"]]
            head = await store.head_position(conn, org_id)
            messages = []
            with anyio.fail_after(10):
                while not messages or messages[-1]["position"] < head:
                    messages.append(await next_view(reader, "queue"))
    named = [job_id for m in messages for job_id in m["changed"]]
    assert set(named) <= set(ids) and len(named) == len(set(named))
    assert all(len(m["changed"]) <= MOST_CHANGED for m in messages)
    truncated = [m for m in messages if m["changed_truncated"]]
    assert truncated, "1,500 moved, yet no message said its list was cut short"
    assert all(len(m["changed"]) == MOST_CHANGED for m in truncated)
    if len(messages) == 1:  # the batch's one commit: its oldest moves are named
        assert named == ids[:MOST_CHANGED]


async def test_a_revoked_key_ends_a_stream_that_is_sending_a_large_backlog(conn, org, live_server):
    """A slow client reading a backlog of thousands of events: once its key is revoked the stream's last
    message is `event: error` (401 body) and it ends, within one read's page of events (1,000) of what was
    sent when the revocation committed, rather than at the end of the backlog. What was sent is not known
    here: the sockets' buffers hold a few thousand messages, as many as the kernel lets them grow to, so the
    backlog is three times that and the check is that a page of it was never sent."""
    from umbra.api.events import MAX_PAGE

    org_id, _ = org
    key = await create_api_key(conn, org_id, ["events:read", "jobs:write"])
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        await _batch(client, key, 5000, "r")
        (backlog,) = await (await conn.execute("SELECT count(*) FROM events WHERE organization_id = %s", (org_id,))).fetchone()
        async with client.stream("GET", "/v1/events/stream", headers=bearer(key)) as response:
            reader = SseReader(response)
            await reader.take(10)
            from umbra.compute.accounts import list_api_keys, revoke_api_key

            for k in await list_api_keys(conn, org_id):
                await revoke_api_key(conn, org_id, uuid.UUID(str(k["id"])))
            after = 0
            with anyio.fail_after(10):
                while True:
                    try:
                        m = await reader.next_message()
                    except EOFError:
                        raise AssertionError("stream ended without an error message")
                    if m.get("event") == "error":
                        assert json.loads(m["data"])["error"] == "unauthenticated"
                        break
                    after += 1
            with anyio.fail_after(5), pytest.raises(EOFError):
                await reader.next_message()
    assert 10 + after <= backlog - MAX_PAGE, (after, backlog)


async def test_dashboard_page_and_assets(client):
    """GET / serves the dashboard HTML with a same-origin CSP; its script reads the projections with the key
    in a header; unknown assets are 404."""
    page = await client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    js = await client.get("/static/dashboard.js")
    assert js.status_code == 200 and "/v1/projections/stream" in js.text and "access_token" not in js.text
    assert (await client.get("/static/secret.txt")).status_code == 404
    assert (await client.get("/static/dashboard.html")).status_code == 404


@pytest.fixture
def quiet_server(db_url):
    """A server whose safety poll is too slow to matter: only hints deliver quickly."""
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="0.2", UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        yield server


async def test_every_command_that_moves_the_log_wakes_the_projection_stream_at_once(conn, org, quiet_server):
    """Dashboards see changes within milliseconds (SPEC): with the safety poll out of the way, each command
    that appends (submit, batch, claim, claim_next completion, renew, fail, children, cancel, heartbeat,
    drain, retire, revoke, sign-off, pairing) is pushed by its hint within 3 s, tagged with the new head."""
    import time

    org_id, key = org
    h = bearer(key)
    async with httpx.AsyncClient(base_url=quiet_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/projections/stream", headers=h) as response:
            reader = SseReader(response)
            await reader.take(2)
            slow: list[tuple[str, float]] = []

            async def pushed(label: str, action) -> Any:
                started = time.monotonic()
                result = await action()
                head = await store.head_position(conn, org_id)
                with anyio.move_on_after(6):
                    while True:
                        view = json.loads((await reader.next_message())["data"])
                        if view["position"] >= head:
                            break
                took = time.monotonic() - started
                if took > 3:
                    slow.append((label, round(took, 1)))
                return result

            async def post(path, body=None, params=None, cred=key, expect=(200, 201)):
                r = await client.post(path, json=body, params=params, headers=bearer(cred))
                assert r.status_code in expect, (path, r.status_code, r.text)
                return r.json() if r.content else None

            node_id, cred = await pushed("pair+heartbeat", lambda: http_pair(client, key, "box"))
            await pushed("submit", lambda: post("/v1/jobs", {"kind": "echo", "payload": {}}))
            await pushed("batch", lambda: post("/v1/jobs/batch", {"jobs": [{"kind": "echo"} for _ in range(300)]}))
            claim = await pushed("claim", lambda: post("/v1/agent/claim", params={"wait": 0}, cred=cred))
            job = claim["job"]
            await pushed("renew", lambda: post(f"/v1/agent/jobs/{job['id']}/renew", {"attempt": job["attempt"]}, cred=cred))
            done = await pushed("complete+claim_next", lambda: post(f"/v1/agent/jobs/{job['id']}/complete",
                                {"attempt": job["attempt"], "result": {}}, params={"claim_next": "true"}, cred=cred))  # fmt: skip
            job = done["next_claim"]["job"]
            await pushed("fail", lambda: post(f"/v1/agent/jobs/{job['id']}/fail", {"attempt": job["attempt"], "error": "x", "retry": False}, cred=cred))
            job = (await pushed("claim2", lambda: post("/v1/agent/claim", params={"wait": 0}, cred=cred)))["job"]
            await pushed("children", lambda: post(f"/v1/agent/jobs/{job['id']}/children", {"attempt": job["attempt"],
                         "children": [{"kind": "echo", "payload": {}, "requires": {}}]}, cred=cred))  # fmt: skip
            queued = (await client.get("/v1/jobs", params={"status": "queued", "limit": 1}, headers=h)).json()["jobs"][0]
            await pushed("cancel", lambda: post(f"/v1/jobs/{queued['id']}/cancel"))
            device = {**CPU64_JSON, "ram_free_mb": 1000}
            await pushed("heartbeat", lambda: post("/v1/agent/heartbeat", {"devices": [device], "agent_version": "2"}, cred=cred))
            await pushed("sign-off", lambda: post("/v1/agent/offline", cred=cred))
            await pushed("drain", lambda: post(f"/v1/nodes/{node_id}/drain"))
            other_id, _ = await http_pair(client, key, "box-2")
            await pushed("retire", lambda: post(f"/v1/nodes/{node_id}/retire"))
            await pushed("revoke", lambda: post(f"/v1/nodes/{other_id}/revoke"))
            await pushed("model", lambda: client.put("/v1/models/big:1b", json={"vram_min_mb": 10**7}, headers=h))
    assert slow == [], f"pushed only by the safety poll, not by a hint: {slow}"


@pytest.fixture
def short_lease_server(db_url):
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="0.2", UMBRA_LEASE_SECONDS="1", UMBRA_LEASE_EXPIRED_DELAY_SECONDS="0",
                    UMBRA_HEARTBEAT_INTERVAL_SECONDS="1", UMBRA_HEARTBEAT_STALE_SECONDS="2") as server:  # fmt: skip
        yield server


async def test_time_driven_changes_are_pushed_and_equal_the_log(conn, org, short_lease_server):
    """Leases running out (the sweeper's job.lease_expired / requeue) and a node going silent are pushed on
    the projection stream; every message equals the log folded to its position."""
    org_id, key = org
    messages: list[dict] = []
    async with httpx.AsyncClient(base_url=short_lease_server.url, timeout=30) as client:
        node_id, cred = await http_pair(client, key, "flaky")
        await _batch(client, key, 4, "t")
        async with client.stream("GET", "/v1/projections/stream", headers=bearer(key)) as response:
            reader = SseReader(response)
            latest: dict[str, dict] = {}
            for _ in range(3):
                r = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))
                assert r.status_code == 200, r.text
            with anyio.fail_after(15):
                while True:
                    m = await reader.next_message()
                    messages.append(m)
                    latest[m["event"]] = json.loads(m["data"])
                    if "queue" in latest and "nodes" in latest and latest["queue"]["counts"]["running"] == 0 \
                            and latest["nodes"]["nodes"][0]["stored_status"] == "offline":  # fmt: skip
                        break
        types = [r.type for r in await _log_upto(conn, org_id, 2**62)]
        assert "job.lease_expired" in types and "node.went_offline" in types, types
        await _check_messages_light(conn, org_id, messages)


async def _check_messages_light(conn, org_id, messages) -> None:
    overall = 0
    for m in messages:
        view = json.loads(m["data"])
        assert view["position"] >= overall
        overall = view["position"]
        if m["event"] == "queue":
            await _check_queue_view(conn, org_id, view)
        elif m["event"] == "nodes":
            await _check_nodes_view(conn, org_id, view)


async def test_staleness_is_judged_by_the_database_clock(db_url, conn, org):
    """A node last heard from at the database's time T reads offline on the stream and the snapshot as soon
    as the database's clock is past T + threshold, whatever the app server's clock says."""
    from psycopg import conninfo, sql

    from tests.integration.queue_support import CPU64, add_node

    org_id, key = org
    await add_node(conn, org_id, "lonely", [CPU64])
    dbname = conninfo.conninfo_to_dict(db_url)["dbname"]
    await conn.execute(sql.SQL("ALTER DATABASE {} SET umbra.clock_offset = '120 seconds'").format(sql.Identifier(dbname)))
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="30") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            snapshot = (await client.get("/v1/projections/nodes", headers=bearer(key))).json()
            async with client.stream("GET", "/v1/projections/stream", params={"views": "nodes"}, headers=bearer(key)) as response:
                first = await next_view(SseReader(response), "nodes")
    assert [n["status"] for n in snapshot["nodes"]] == ["offline"]
    assert [n["status"] for n in first["nodes"]] == ["offline"]


async def test_scopes_of_the_views_and_streams(conn, org, live_server):
    """A key without a read scope is refused (403 forbidden, the error shape) on every view, stream and page of
    the log; jobs:read or events:read reads the views and their stream."""
    org_id, _ = org
    writer = await create_api_key(conn, org_id, ["jobs:write"])
    reader_key = await create_api_key(conn, org_id, ["jobs:read"])
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        for path in ("/v1/events", "/v1/events/stream", "/v1/projections/queue", "/v1/projections/nodes", "/v1/projections/stream"):
            r = await client.get(path, headers=bearer(writer))
            assert r.status_code == 403 and r.json()["error"] == "forbidden", (path, r.text)
        for path in ("/v1/projections/queue", "/v1/projections/nodes"):
            assert (await client.get(path, headers=bearer(reader_key))).status_code == 200
        async with client.stream("GET", "/v1/projections/stream", headers=bearer(reader_key)) as response:
            assert response.status_code == 200
            assert {m["event"] for m in await SseReader(response).take(2)} == {"queue", "nodes"}


async def test_a_key_that_reads_the_nodes_view_may_subscribe_to_it(conn, org, live_server):
    """A nodes:admin key reads the nodes view as a snapshot, so it may stream that view too (the dashboard,
    given such a key, loads the snapshot and then subscribes); the queue view's stream stays refused to it."""
    org_id, _ = org
    admin = await create_api_key(conn, org_id, ["nodes:admin"])
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        snapshot = await client.get("/v1/projections/nodes", headers=bearer(admin))
        assert snapshot.status_code == 200
        async with client.stream("GET", "/v1/projections/stream", params={"views": "nodes"}, headers=bearer(admin)) as response:
            status = response.status_code
        refused = await client.get("/v1/projections/stream", params={"views": "queue,nodes"}, headers=bearer(admin))
    assert status == 200, f"nodes snapshot 200 but its stream {status}"
    assert refused.status_code == 403 and refused.json()["error"] == "forbidden"


async def test_views_equal_the_log_under_four_agents_chaining_claims(conn, org, live_server):
    """Four agents claiming several jobs at once and completing them with claim_next (the group commit's
    two in-flight batches), while jobs are submitted and cancelled: every pushed queue and nodes view equals
    the log folded to its position."""
    org_id, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        nodes = [await http_pair(client, key, f"box-{i}") for i in range(4)]
        await _batch(client, key, 150, "pre")
        messages = await _streamed_during(client, key, conn, org_id, _workload(client, key, nodes, jobs=15))
    await _check_messages_light(conn, org_id, messages)


async def _open_streams(client) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("umbra_sse_streams{"))


async def test_streams_a_client_hangs_up_are_closed_promptly(org, live_server):
    """Dashboards that go away (a closed tab, a dropped reconnect) leave no stream open behind them: the
    open-streams gauge is back where it was within a few seconds of the clients hanging up."""
    _, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        with anyio.fail_after(5):
            before = await _open_streams(client)
        for path in ("/v1/projections/stream", "/v1/events/stream") * 3:
            async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as one:
                async with one.stream("GET", path, headers=bearer(key)) as response:
                    assert response.status_code == 200
                    if path == "/v1/projections/stream":  # the event log of this organization is empty
                        with anyio.fail_after(5):
                            await SseReader(response).next_message()
        opened = await _open_streams(client)

        async def closed() -> bool:
            return await _open_streams(client) <= before

        with anyio.fail_after(10):
            try:
                await eventually(closed, timeout=5)
            except AssertionError:
                raise AssertionError(f"{await _open_streams(client) - before:g} streams still open 5 s after their clients "
                                     f"hung up (just after: {opened - before:g})")
