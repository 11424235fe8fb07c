"""The log is kept for ever: events as earlier releases wrote them, and as a newer release writes them during a
rolling upgrade, must still be read, folded, rebuilt and verified by this one.

Each test writes the events table as the other release left it (rows inserted directly, the JSON that release's
encoder wrote) and the views beside it as that release, and the migrations since, left them; then reads them
through every path that pages over the log: the event API, a job's and a node's history, ``as_of`` and verify.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any
from uuid import UUID

import httpx
import msgspec
import pytest

from umbra.events import documents, store
from umbra.events.types import JobSubmitted, NodeCreated, Placement
from umbra.projections import jobs as queue
from umbra.projections import nodes as node_view

pytestmark = pytest.mark.anyio


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _append_as_stored(conn, org_id: UUID, stream: str, version: int, data: dict[str, Any] | str) -> int:
    """One event row as a release wrote it (``data`` as its encoder wrote the JSON); its position."""
    text = data if isinstance(data, str) else json.dumps(data)
    tag = json.loads(text)["type"]
    cursor = await conn.execute(
        "INSERT INTO events (stream, version, type, organization_id, data) VALUES (%s, %s, %s, %s, %s::jsonb)"
        " RETURNING position", (stream, version, tag, org_id, text))  # fmt: skip
    return (await cursor.fetchone())[0]


async def _read_everything(client: httpx.AsyncClient, job_id: UUID | None = None, node_id: UUID | None = None):
    """Every read that pages over the log, answered (status codes and bodies)."""
    page = await client.get("/v1/events", params={"after": 0, "limit": 1000})
    assert page.status_code == 200, page.text
    answers = {"page": documents.decode(page.content)}
    if job_id is not None:
        answers["job_events"] = await client.get(f"/v1/jobs/{job_id}/events")
        answers["as_of"] = await client.get(f"/v1/jobs/{job_id}", params={"as_of": answers["page"]["next"]})
    if node_id is not None:
        answers["node_events"] = await client.get(f"/v1/nodes/{node_id}/events")
    async with client.stream("GET", "/v1/events/stream", params={"after": 0}) as stream:
        ids: list[int] = []
        async for line in stream.aiter_lines():
            if line.startswith("id:"):
                ids.append(int(line.split(":", 1)[1]))
            if len(ids) == len(answers["page"]["events"]):
                break
    answers["stream_ids"] = ids
    answers["verify"] = await client.post("/v1/projections/verify")
    return answers


# -- a newer release's events (a rolling upgrade) -------------------------------------------------------


async def test_a_job_whose_submission_a_newer_release_wrote_in_a_later_version_is_reported_by_verify_not_a_500(
    conn, org, live_server
):
    """A newer release that changes ``job.submitted`` incompatibly writes ``job.submitted.v2`` (the versioning
    ARCHITECTURE.md describes); this server reads it as an UnknownEvent. Its folds skip it, yet the job's
    stream then opens with nothing they can start from: rebuild raised, so verify and ``as_of`` answered 500."""
    from tests.integration.queue_support import submit

    org_id, key = org
    readable = await submit(conn, org_id)
    job_id = uuid.uuid4()
    stream = store.job_stream(job_id)
    submitted_v2 = {"type": "job.submitted.v2", "kind": "echo", "priority": 100, "max_attempts": 3,
                    "budget": {"gpu_seconds": 60}}  # fmt: skip
    first = await _append_as_stored(conn, org_id, stream, 1, submitted_v2)
    await _append_as_stored(conn, org_id, stream, 2, {"type": "job.cancelled", "by": "ops", "reason": None})
    # The newer release's row for it (as its own fold wrote it).
    [recorded] = await store.read_stream(conn, stream, up_to_position=first)
    row = queue.fold(None, store.RecordedEvent(recorded.position, stream, 1, org_id,
                                               JobSubmitted(kind="echo", priority=100, max_attempts=3), {},
                                               recorded.recorded_at))  # fmt: skip
    await queue.write_rows(conn, [row])
    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key), timeout=10) as client:
        answers = await _read_everything(client, job_id=job_id)
        readable_now = await client.get(f"/v1/jobs/{readable.id}", params={"as_of": answers["page"]["next"]})
    assert answers["job_events"].status_code == 200
    assert [e["type"] for e in answers["job_events"].json()["events"]] == ["job.submitted.v2", "job.cancelled"]
    assert answers["job_events"].json()["events"][0]["data"] == submitted_v2  # shown as stored
    assert answers["stream_ids"] == [e["position"] for e in answers["page"]["events"]]
    # Folded, the job has nothing this server can start it from: not there as of any position.
    assert answers["as_of"].status_code == 404 and answers["as_of"].json()["error"] == "job_not_found"
    assert "job.submitted.v2, which a newer release wrote" in answers["as_of"].json()["message"]  # not "no job"
    assert readable_now.status_code == 200 and readable_now.json()["id"] == str(readable.id)
    assert answers["verify"].status_code == 200, answers["verify"].text
    assert answers["verify"].json()["differences"] == [
        {"view": "queue", "id": str(job_id), "field": None, "rebuilt": False, "live": True}]


async def test_a_node_whose_creation_a_newer_release_wrote_in_a_later_version_is_reported_by_verify_not_a_500(
    conn, org, live_server
):
    """The same for a node stream opening with ``node.created.v2``: the node rebuild raised."""
    org_id, key = org
    node_id = uuid.uuid4()
    stream = store.node_stream(node_id)
    first = await _append_as_stored(conn, org_id, stream, 1, {"type": "node.created.v2", "name": "box", "zone": "eu-1"})
    await _append_as_stored(conn, org_id, stream, 2, {"type": "node.draining", "by": "ops"})
    [recorded] = await store.read_stream(conn, stream, up_to_position=first)
    state = node_view.fold(None, store.RecordedEvent(recorded.position, stream, 1, org_id, NodeCreated(name="box"), {},
                                                     recorded.recorded_at))  # fmt: skip
    await node_view.write(conn, state)
    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key), timeout=10) as client:
        answers = await _read_everything(client, node_id=node_id)
    assert answers["node_events"].status_code == 200
    assert [e["type"] for e in answers["node_events"].json()["events"]] == ["node.created.v2", "node.draining"]
    assert answers["verify"].status_code == 200, answers["verify"].text
    assert answers["verify"].json()["differences"] == [
        {"view": "nodes", "id": str(node_id), "field": None, "rebuilt": False, "live": True}]


async def _sse_events(client: httpx.AsyncClient, count: int) -> list[dict[str, Any]]:
    """The first ``count`` events of the organization's SSE stream, each message's ``data`` as the service's clients read it."""
    events: list[dict[str, Any]] = []
    async with client.stream("GET", "/v1/events/stream", params={"after": 0}) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data:"):
                events.append(documents.decode(line.split(":", 1)[1]))
            if len(events) == count:
                return events
    raise AssertionError(f"the stream ended after {len(events)} of {count} events")


async def test_fields_a_newer_release_added_to_known_event_types_are_shown_as_stored(conn, org, live_server):
    """A newer release may add a field to a type this one knows (a compatible change: same tag). The event API
    decoded each stored event into this release's struct and encoded that, so the field was dropped from every
    read of the log (the page, the SSE stream, a job's and a node's history): an auditor reading the log through
    this server did not see what the newer release recorded. Every event is shown as stored: its type as recorded
    and every field of its data, numbers as ``jsonb`` gives them back (``2.50`` keeps its zero). An event of a
    type this release does not know at all was shown as stored already; it still is. The folds read what they
    know of the same events as before."""
    from umbra.events.types import encode_event

    org_id, key = org
    job_id, node_id = uuid.uuid4(), uuid.uuid4()
    job, node = store.job_stream(job_id), store.node_stream(node_id)
    submitted = msgspec.json.decode(encode_event(JobSubmitted(kind="echo", priority=100, max_attempts=3, payload={"i": 1})))
    written = [  # (stream, the data as the newer release's encoder wrote it)
        (job, json.dumps({**submitted, "budget": {"gpu_seconds": 60}})[:-1] + ', "rate": 2.50}'),
        (job, {"type": "job.annotated", "note": "a type this release does not know"}),
        (job, {"type": "job.cancelled", "by": "ops", "reason": None, "ticket": "OPS-7"}),
        (node, {"type": "node.created", "name": "box", "trust_domain": "local", "locality": None, "transport": None,
                "zone": "eu-1"}),
        (node, {"type": "node.draining", "by": "ops", "until": "2030-01-01T00:00:00Z"}),
    ]  # fmt: skip
    versions: dict[str, int] = {}
    for stream, data in written:
        versions[stream] = versions.get(stream, 0) + 1
        await _append_as_stored(conn, org_id, stream, versions[stream], data)
    stored = [(stream, documents.decode(data if isinstance(data, str) else json.dumps(data))) for stream, data in written]
    assert "budget" in stored[0][1] and str(stored[0][1]["rate"]) == "2.50"
    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key), timeout=10) as client:
        page = await client.get("/v1/events", params={"after": 0, "limit": 1000})
        job_history = await client.get(f"/v1/jobs/{job_id}/events")
        node_history = await client.get(f"/v1/nodes/{node_id}/events")
        streamed = await _sse_events(client, len(written))
        as_of = await client.get(f"/v1/jobs/{job_id}", params={"as_of": documents.decode(page.content)["next"]})
    answers = {"page": page, "job history": job_history, "node history": node_history}
    assert {name: answer.status_code for name, answer in answers.items()} == dict.fromkeys(answers, 200)
    shown = {name: documents.decode(answer.content)["events"] for name, answer in answers.items()}
    shown["stream"] = streamed
    expected = {"page": stored, "job history": stored[:3], "node history": stored[3:], "stream": stored}
    for name, events in shown.items():
        assert [(e["stream"], e["data"]) for e in events] == expected[name], name
        assert [e["type"] for e in events] == [data["type"] for _, data in expected[name]], name
        assert all({"position", "stream", "version", "type", "data", "recorded_at"} <= set(e) for e in events), name
        assert all(str(e["data"]["rate"]) == "2.50" for e in events if "rate" in e["data"]), name
    assert b'"rate":2.50' in page.content and b'"rate":2.50' in job_history.content
    assert as_of.status_code == 200 and as_of.json()["status"] == "cancelled" and as_of.json()["payload"] == {"i": 1}


# -- an earlier release's events ---------------------------------------------------------------------------


async def test_a_number_an_earlier_release_stored_that_jsonb_writes_out_longer_than_the_decoder_reads_is_still_read(
    conn, org, live_server
):
    """From 099cdf8 (free-form numbers kept exactly) until 1aa1404 (such numbers refused 422) a payload or a result
    could hold ``1e5000``: kept as ``numeric``, which ``jsonb`` writes out in full, 5,001 digits, past the longest
    integer msgspec reads. 1aa1404 refuses new ones; those already in the log failed every read that met them: the
    log's pages (for ever, at that position, the SSE stream too), the job's history, ``as_of``, the job and verify."""
    from decimal import Decimal

    from umbra.events.store import RecordedEvent

    org_id, key = org
    job_id = uuid.uuid4()
    stream = store.job_stream(job_id)
    huge = Decimal("1e5000")
    submitted = JobSubmitted(kind="echo", priority=100, max_attempts=3, payload={"n": huge, "small": 1})
    # Written as that release wrote it: the number as msgspec wrote it, the row beside it by the same fold.
    from umbra.events.types import encode_event

    position = await _append_as_stored(conn, org_id, stream, 1, encode_event(submitted).decode())
    [recorded_at] = (await (await conn.execute("SELECT recorded_at FROM events WHERE position = %s", (position,))).fetchone())
    await queue.write_rows(conn, [queue.fold(None, RecordedEvent(position, stream, 1, org_id, submitted, {}, recorded_at))])
    stored = (await (await conn.execute("SELECT data->'payload'->>'n' FROM events WHERE position = %s", (position,))).fetchone())[0]
    assert len(stored) == 5001  # what jsonb gives back
    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key), timeout=10) as client:
        answers = await _read_everything(client, job_id=job_id)
        job = await client.get(f"/v1/jobs/{job_id}")
        listed = await client.get("/v1/jobs")
    read = documents.decode  # as the service's own clients read it: Python's json refuses integers this long
    assert answers["job_events"].status_code == 200
    event = read(answers["job_events"].content)["events"][0]
    assert event["type"] == "job.submitted" and event["data"]["payload"] == {"n": huge, "small": 1}
    assert answers["stream_ids"] == [e["position"] for e in answers["page"]["events"]] and answers["stream_ids"][0] == position
    assert answers["as_of"].status_code == 200 and read(answers["as_of"].content)["payload"]["n"] == huge
    assert job.status_code == 200 and read(job.content)["payload"] == {"n": huge, "small": 1}
    assert listed.status_code == 200 and [j["id"] for j in read(listed.content)["jobs"]] == [str(job_id)]
    assert answers["verify"].status_code == 200 and answers["verify"].json()["differences"] == []


async def test_a_failure_sent_again_after_a_newer_release_recorded_the_claim_is_refused_not_a_500(conn, org):
    """A newer release's claim on a device kind this server does not know (``job.claimed`` with ``device_kind``
    ``npu``) is read as an UnknownEvent. A failure its holder sends again (the first answer lost) makes this server
    look up which node's claim that attempt was: reading ``attempt`` off the unreadable claim raised
    AttributeError, a 500 every time the agent tried again. This server cannot tell whose claim it was, so the
    report is refused as any report from a node not holding the job is."""
    from datetime import datetime, timedelta, timezone

    from umbra.compute import claims
    from umbra.domain.jobs import NotHolder
    from umbra.events.store import RecordedEvent
    from umbra.events.types import encode_event

    org_id, _ = org
    node_id, job_id = uuid.uuid4(), uuid.uuid4()
    stream = store.job_stream(job_id)
    submitted = JobSubmitted(kind="echo", priority=100, max_attempts=3)
    first = await _append_as_stored(conn, org_id, stream, 1, encode_event(submitted).decode())
    later = (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat()
    await _append_as_stored(conn, org_id, stream, 2, {
        "type": "job.claimed", "attempt": 1, "node_id": str(node_id), "lease_expires_at": later,
        "placement": {"node_id": str(node_id), "device_id": "npu0", "device_kind": "npu", "reason": "fits"}})
    last = await _append_as_stored(conn, org_id, stream, 3, {"type": "job.requeued", "attempt": 1, "error": "oom",
                                                              "not_before": later})  # fmt: skip
    [recorded_at] = (await (await conn.execute("SELECT recorded_at FROM events WHERE position = %s", (first,))).fetchone())
    row = queue.fold(None, RecordedEvent(first, stream, 1, org_id, submitted, {}, recorded_at))
    # The newer release's row: requeued after its first run.
    await queue.write_rows(conn, [queue.replace(row, attempt=1, error="oom", version=3, position=last)])
    with pytest.raises(NotHolder):
        await claims.fail(conn, organization_id=org_id, node_id=node_id, job_id=job_id, attempt=1, error="oom", retry=True)


def _placement(node_id: UUID) -> dict[str, Any]:
    # Placement as the first release wrote it: every field, defaults included.
    return {"node_id": str(node_id), "device_id": "cpu", "device_kind": "cpu", "reason": "fits", "via": "ram",
            "resident": False, "would_evict": [], "score": 1.0, "estimated_seconds": None}  # fmt: skip


def _submitted_v1(**changes: Any) -> dict[str, Any]:
    # job.submitted as the first release wrote it: no depends_on, no not_before.
    return {"type": "job.submitted", "kind": "echo", "priority": 100, "max_attempts": 2, "requires": {},
            "payload": {"i": 1}, "project_id": None, "lang": None, "parent_job_id": None, "idempotency_key": None,
            "requested_by": "test", **changes}  # fmt: skip


async def test_histories_as_the_first_release_wrote_them_fold_as_it_showed_them_and_verify_clean(conn, org, live_server):
    """Every job and node event type as the first release wrote it (without the fields added since: a renewal's
    progress, an ended lease's cause, a set-aside's waiting_on and until, a retry's uncharged and not_before, a
    heartbeat's kinds), with the views as that release's fold and the migrations since (0028, 0036, 0040) left
    them: today's fold shows what that release showed, where no migration brought the meaning on, and verify
    finds the views equal to the log."""
    from umbra.domain.jobs import LEASE_EXPIRED_ERROR
    from umbra.migrate import available_migrations

    org_id, key = org
    node = uuid.uuid4()
    soon = "2026-01-01T00:05:00Z"
    histories: dict[str, list[dict[str, Any]]] = {
        # expired once, then out of attempts
        "expired_then_failed": [
            _submitted_v1(),
            {"type": "job.claimed", "attempt": 1, "node_id": str(node), "placement": _placement(node), "lease_expires_at": soon},
            {"type": "job.lease_renewed", "attempt": 1, "lease_expires_at": soon},
            {"type": "job.lease_expired", "attempt": 1, "node_id": str(node), "requeued": True, "not_before": soon},
            {"type": "job.claimed", "attempt": 2, "node_id": str(node), "placement": _placement(node), "lease_expires_at": soon},
            {"type": "job.failed", "attempt": 2, "error": "boom", "reason": "attempts_exhausted"},
        ],
        # set aside, released, cancelled while queued
        "blocked_then_cancelled": [
            _submitted_v1(requires={"vram_min_mb": 1}),
            {"type": "job.blocked", "reason": "no device has 1 MB of VRAM"},
            {"type": "job.unblocked", "reason": "eligible_device_available"},
            {"type": "job.cancelled", "by": "ops", "reason": None},
        ],
        "cancelled_while_running": [
            _submitted_v1(),
            {"type": "job.claimed", "attempt": 1, "node_id": str(node), "placement": _placement(node), "lease_expires_at": soon},
            {"type": "job.cancelled", "by": "ops", "reason": "not needed"},
        ],
        "retried": [
            _submitted_v1(),
            {"type": "job.claimed", "attempt": 1, "node_id": str(node), "placement": _placement(node), "lease_expires_at": soon},
            {"type": "job.failed", "attempt": 1, "error": "bad input", "reason": "not_retryable"},
            {"type": "job.retried", "attempt": 1, "max_attempts": 3, "by": "ops"},
        ],
        "released_then_completed": [
            _submitted_v1(),
            {"type": "job.claimed", "attempt": 1, "node_id": str(node), "placement": _placement(node), "lease_expires_at": soon},
            {"type": "job.released", "attempt": 1, "reason": "client_gone"},
            {"type": "job.claimed", "attempt": 2, "node_id": str(node), "placement": _placement(node), "lease_expires_at": soon},
            {"type": "job.completed", "attempt": 2, "result": {"ok": True, "ratio": 0.5}},
        ],
        "container": [
            _submitted_v1(kind="split"),
            {"type": "job.claimed", "attempt": 1, "node_id": str(node), "placement": _placement(node), "lease_expires_at": soon},
            {"type": "job.decomposed", "attempt": 1, "children": [str(uuid.uuid4())]},
            {"type": "job.settled", "outcome": "partial", "detail": "1 of 1 children failed", "children_total": 1,
             "children_failed": 1},
        ],
    }
    job_ids = {name: uuid.uuid4() for name in histories}
    positions: dict[str, list[int]] = {}
    for name, events in histories.items():
        for version, data in enumerate(events, start=1):
            positions.setdefault(name, []).append(
                await _append_as_stored(conn, org_id, store.job_stream(job_ids[name]), version, data))
    node_events = [
        {"type": "node.created", "name": "box", "trust_domain": "local", "locality": None, "transport": None},
        {"type": "node.paired", "credential_id": str(uuid.uuid4()), "agent_version": "0.1.0",
         "devices": [{"kind": "cpu", "label": "cpu", "vram_total_mb": 0, "vram_free_mb": 0, "ram_total_mb": 8192,
                      "ram_free_mb": 6000, "compute_units": None, "throughput_factor": 1.0, "accelerators": [],
                      "resident_models": []}]},
        {"type": "node.heartbeat", "agent_version": "0.1.0", "devices": [], "agent_started_at": soon},
        {"type": "node.went_offline", "last_seen_at": soon},
        {"type": "node.heartbeat", "agent_version": "0.1.0", "devices": [], "agent_started_at": None},
        {"type": "node.revoked", "credential_id": None, "by": "ops"},
    ]  # fmt: skip
    for version, data in enumerate(node_events, start=1):
        await _append_as_stored(conn, org_id, store.node_stream(node), version, data)

    # Today's fold of those events, as the API and verify's rebuild see them.
    rebuilt = {name: queue.fold_stream(await store.read_stream(conn, store.job_stream(job_id)))
               for name, job_id in job_ids.items()}  # fmt: skip
    assert {name: row.status for name, row in rebuilt.items()} == {
        "expired_then_failed": "failed", "blocked_then_cancelled": "cancelled", "cancelled_while_running": "cancelled",
        "retried": "queued", "released_then_completed": "complete", "container": "partial"}  # fmt: skip
    assert rebuilt["expired_then_failed"].attempt == 2 and rebuilt["expired_then_failed"].error == "boom"
    assert rebuilt["released_then_completed"].error is None and rebuilt["released_then_completed"].attempt == 2
    assert (rebuilt["retried"].max_attempts, rebuilt["retried"].not_before, rebuilt["retried"].error) == (3, None, "bad input")
    for row in rebuilt.values():  # nothing of what came later is read into them
        assert (row.progress, row.depends_on, row.awaiting_dependencies, row.waiting_until) == (None, None, False, None)
    assert [row.ended_under_holder for row in rebuilt.values()] == [False, False, True, False, False, False]

    # The views as the first release's fold wrote them: the columns added since at their migrations' defaults,
    # a container still placed where it was split, a revoked node offline; then those migrations' own updates.
    first_release_rows = [queue.replace(row, ended_under_holder=False) for row in rebuilt.values()]
    split_at = msgspec.convert(_placement(node), Placement)
    first_release_rows[-1] = queue.replace(first_release_rows[-1], placement=split_at)
    await queue.write_rows(conn, first_release_rows)
    node_state = None
    for recorded in await store.read_stream(conn, store.node_stream(node)):
        node_state = node_view.fold(node_state, recorded)
    assert node_state is not None and node_state.status == "retired" and node_state.kinds is None
    await node_view.write(conn, dataclasses.replace(node_state, status="offline"))
    for migration in available_migrations():
        if migration.version in (28, 36, 40):
            for statement in migration.sql.split(";\n"):  # their updates of the views (0040 also adds a column)
                code = "\n".join(line for line in statement.splitlines() if not line.startswith("--")).strip()
                if code.startswith("UPDATE"):
                    await conn.execute(code)

    async with httpx.AsyncClient(base_url=live_server.url, headers=_auth(key), timeout=10) as client:
        answers = await _read_everything(client, job_id=job_ids["expired_then_failed"], node_id=node)
        as_of_each = [await client.get(f"/v1/jobs/{job_id}", params={"as_of": answers["page"]["next"]})
                      for job_id in job_ids.values()]  # fmt: skip
        live = [await client.get(f"/v1/jobs/{job_id}") for job_id in job_ids.values()]
        expired = await client.get(f"/v1/jobs/{job_ids['expired_then_failed']}",
                                   params={"as_of": positions["expired_then_failed"][3]})  # fmt: skip
    assert answers["job_events"].status_code == 200 and answers["node_events"].status_code == 200
    assert answers["stream_ids"] == [e["position"] for e in answers["page"]["events"]]
    assert [a.status_code for a in as_of_each + live] == [200] * 2 * len(job_ids)
    assert [a.json() for a in as_of_each] == [queue.to_json(row) for row in rebuilt.values()]
    # An ended lease without a cause reads as the first release showed it: expired, back in the queue.
    assert (expired.json()["status"], expired.json()["error"], expired.json()["lease_owner"]) == (
        "queued", LEASE_EXPIRED_ERROR, None)
    assert answers["verify"].status_code == 200 and answers["verify"].json()["differences"] == []


async def test_an_empty_kinds_list_a_release_folded_as_no_kind_is_every_kind_as_today_s_fold_reads_it(conn, org):
    """0431969 folded a heartbeat's ``"kinds": []`` onto the node as an empty list (its API.md: "the job kinds
    the agent takes"; explain then said no agent there took any kind); 1821af5 made an empty list say every kind,
    folded to NULL, but left the rows that release wrote: verify named every such node for good (one that beat
    again was mended by that beat; a retired or silent one never is), and explain passed over its agent for
    every kind. 0049 brings those rows in line with today's fold."""
    from tests.integration.queue_support import CPU64, add_node
    from umbra.compute import nodes as node_commands
    from umbra.migrate import available_migrations
    from umbra.projections.verify import verify

    org_id, _ = org
    node_id = await add_node(conn, org_id, "box", [CPU64])
    version = (await (await conn.execute("SELECT version FROM nodes WHERE id = %s", (node_id,))).fetchone())[0]
    # The heartbeat as that release recorded it, and its row as that release's fold left it.
    beat = {"type": "node.heartbeat", "agent_version": None, "devices": [msgspec.to_builtins(CPU64)],
            "agent_started_at": None, "kinds": []}  # fmt: skip
    position = await _append_as_stored(conn, org_id, store.node_stream(node_id), version + 1, beat)
    await conn.execute("UPDATE nodes SET kinds = '{}', version = version + 1, position = %s,"
                       " updated_at = (SELECT recorded_at FROM events WHERE position = %s),"
                       " last_heartbeat_at = (SELECT recorded_at FROM events WHERE position = %s) WHERE id = %s",
                       (position, position, position, node_id))  # fmt: skip
    await node_commands.retire_node(conn, org_id, node_id, actor="ops")  # it never beats again to mend its row
    assert [(d["id"], d["field"]) for d in await verify(conn, org_id)] == [(str(node_id), "kinds")]
    [migration] = [m for m in available_migrations() if m.version == 49]
    await conn.execute(migration.sql)
    assert await verify(conn, org_id) == []
    assert (await (await conn.execute("SELECT kinds FROM nodes WHERE id = %s", (node_id,))).fetchone())[0] is None


# -- the CLI's replay of a newer release's stream ---------------------------------------------------------


@pytest.mark.parametrize("kind, opening", [
    ("job", {"type": "job.submitted.v2", "kind": "echo", "priority": 100, "max_attempts": 3, "budget": {"gpu_seconds": 60}}),
    ("node", {"type": "node.created.v2", "name": "box", "zone": "eu-1"}),
])  # fmt: skip
async def test_replay_of_a_stream_a_newer_release_opened_says_so_in_one_line(conn, org, live_server, cli, kind, opening):
    """``umbra events replay`` folds the history the API gives it; one opening with a newer release's type
    (``job.submitted.v2``) has nothing this release can start a state from. The fold raised, and the command
    said ``ValueError: ... does not start with job.submitted``; the server's folds skip such a stream and
    verify names it, and so does replay: one line naming the stream and why, a failure's exit status."""
    org_id, key = org
    object_id = uuid.uuid4()
    stream = f"{kind}:{object_id}"
    await _append_as_stored(conn, org_id, stream, 1, opening)
    later = {"type": "job.cancelled", "by": "ops", "reason": None} if kind == "job" else {"type": "node.draining", "by": "ops"}
    await _append_as_stored(conn, org_id, stream, 2, later)
    for json_flag in ((), ("--json",)):
        status, out, err = await cli("events", "replay", str(object_id), "--server", live_server.url, "--api-key", key,
                                     *json_flag)  # fmt: skip
        assert status == 1 and out == ""
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("umbra: ") and stream in err and opening["type"] in err and "newer release" in err, err
