"""The event log as a resumable Server-Sent-Events stream."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid

import anyio
import httpx
import psycopg
import pytest

from tests.conftest import LiveServer, free_port
from tests.helpers import bearer, until
from umbra.api import sse
from umbra.cli_events import _follow
from umbra.compute.accounts import create_organization
from umbra.events import store
from umbra.events.types import JobSubmitted, NodeDraining

pytestmark = pytest.mark.anyio


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class SseReader:
    """Parses an SSE response into (id, event, data-json) messages and comment lines."""

    def __init__(self, response: httpx.Response) -> None:
        self.lines = response.aiter_lines()
        self.comments: list[str] = []

    async def next_message(self) -> dict:
        fields: dict = {}
        async for line in self.lines:
            if line == "":
                if "data" in fields:
                    return fields
                continue
            if line.startswith(":"):
                self.comments.append(line)
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
        raise EOFError("stream ended")

    async def take(self, n: int, timeout: float = 10) -> list[dict]:
        with anyio.fail_after(timeout):
            return [await self.next_message() for _ in range(n)]


async def _append(conn, org_id: uuid.UUID, n: int, *, notify: bool = True) -> list[int]:
    positions = []
    for i in range(n):
        async with conn.transaction():
            recorded = await store.append(
                conn,
                store.job_stream(uuid.uuid4()),
                0,
                [JobSubmitted(kind="echo", priority=100, max_attempts=3, payload={"i": i})],
                organization_id=org_id,
            )
            if notify:
                await store.publish(conn, [(org_id, recorded[-1].position, 0)])
        positions.append(recorded[-1].position)
    return positions


@pytest.fixture
def quiet_server(db_url):
    """A server whose safety poll is too slow to matter: only hints deliver quickly."""
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as server:
        yield server


async def test_stream_replays_then_follows_live_only_own_organization(conn, org, quiet_server):
    org_id, key = org
    other, _ = await create_organization(conn, "other")
    before = await _append(conn, org_id, 3)
    await store.append(conn, store.node_stream(uuid.uuid4()), 0, [NodeDraining()], organization_id=other)
    async with httpx.AsyncClient(base_url=quiet_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/events/stream", headers=_auth(key)) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            reader = SseReader(response)
            replayed = await reader.take(3)
            started = time.monotonic()
            live = await _append(conn, org_id, 2)
            await _append(conn, other, 1)
            followed = await reader.take(2, timeout=5)
            assert time.monotonic() - started < 5  # woken by the hint, not the 30 s poll
    assert [int(m["id"]) for m in replayed + followed] == before + live
    assert {m["event"] for m in replayed + followed} == {"job.submitted"}
    import json

    data = json.loads(followed[0]["data"])
    assert data["position"] == live[0] and data["organization_id"] == str(org_id)


async def test_resume_with_last_event_id_has_no_gap_and_no_duplicate(conn, org, live_server):
    org_id, key = org
    first = await _append(conn, org_id, 5)
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/events/stream", params={"after": 0}, headers=_auth(key)) as response:
            got = await SseReader(response).take(3)
        last_id = got[-1]["id"]
        # Written while the client was away, some without any notification at all.
        more = await _append(conn, org_id, 3, notify=False) + await _append(conn, org_id, 2)
        headers = {**_auth(key), "Last-Event-ID": last_id}
        # Last-Event-ID wins over after=0.
        async with client.stream("GET", "/v1/events/stream", params={"after": 0}, headers=headers) as response:
            resumed = await SseReader(response).take(7)
    ids = [int(m["id"]) for m in got + resumed]
    assert ids == first + more
    assert len(set(ids)) == len(ids)


async def test_events_from_concurrent_writers_arrive_in_commit_order_without_gaps(db_url, org, live_server):
    org_id, key = org
    writers, per_writer = 4, 15

    async def writer(w: int) -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            await _append(c, org_id, per_writer)

    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/events/stream", headers=_auth(key)) as response:
            reader = SseReader(response)
            async with anyio.create_task_group() as tg:
                for w in range(writers):
                    tg.start_soon(writer, w)
            streamed = [int(m["id"]) for m in await reader.take(writers * per_writer, timeout=20)]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        logged = [r.position for r in await store.read_log(c, organization_id=org_id)]
    assert streamed == logged


async def test_bad_cursor_is_refused_before_streaming(org, live_server):
    _, key = org
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        bad_header = await client.get("/v1/events/stream", headers={**_auth(key), "Last-Event-ID": "abc"})
        bad_after = await client.get("/v1/events/stream", params={"after": "-3"}, headers=_auth(key))
    assert bad_header.status_code == 422 and bad_header.json()["field"] == "Last-Event-ID"
    assert bad_after.status_code == 422 and bad_after.json()["field"] == "after"


async def test_idle_stream_sends_ping_comments(org, live_server, monkeypatch):
    _, key = org
    monkeypatch.setattr(sse, "PING_SECONDS", 0.2)
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/events/stream", headers=_auth(key)) as response:
            reader = SseReader(response)
            with anyio.fail_after(10):
                async for line in reader.lines:
                    if line == ": ping":
                        break


async def test_stream_survives_a_listener_reconnect(conn, org, live_server):
    org_id, key = org
    listener = live_server.app.state.services.listener
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/events/stream", headers=_auth(key)) as response:
            reader = SseReader(response)
            await _append(conn, org_id, 1)
            await reader.take(1)
            old_pid = listener.backend_pid
            await conn.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
            await until(lambda: listener.reconnects >= 1 and listener.connected.is_set())
            await _append(conn, org_id, 2)
            assert len(await reader.take(2)) == 2


def test_server_shutdown_ends_open_streams(db_url):
    """A dashboard left connected must not hold a graceful shutdown open."""
    from umbra.api.app import create_app
    from umbra.api.server import Server, config
    from umbra.settings import load_settings

    async def make_org():
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            return await create_organization(c, "acme")

    _, key = anyio.run(make_org)
    app = create_app(load_settings({"UMBRA_DATABASE_URL": db_url}), db_url)
    port = free_port()
    server = Server(config(app, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    ended = threading.Event()

    def client():
        with httpx.stream("GET", f"http://127.0.0.1:{port}/v1/events/stream", headers=_auth(key), timeout=60) as r:
            for _ in r.iter_lines():
                pass
        ended.set()

    reader = threading.Thread(target=client, daemon=True)
    reader.start()
    while not app.state.log_watch._signals:  # the stream is open and waiting
        time.sleep(0.02)
    server.should_exit = True
    thread.join(timeout=5)
    assert not thread.is_alive(), "server still waiting for the stream"
    assert ended.wait(5)


# -- a stream outlives its request: revocation and database outages ---------------------------


async def _revoke_keys(conn, org_id: uuid.UUID) -> None:
    from umbra.compute.accounts import revoke_api_key

    for (key_id,) in await (await conn.execute("SELECT id FROM api_keys WHERE organization_id = %s", (org_id,))).fetchall():
        await revoke_api_key(conn, org_id, key_id)


async def _last_word(reader: SseReader) -> dict:
    """Messages until the stream's ``error`` message (returned), failing on any event sent before it."""
    with anyio.fail_after(10):
        while True:
            (msg,) = await reader.take(1)
            if msg.get("event") == "error":
                return msg
            raise AssertionError(f"a message was streamed to a revoked key: {msg}")


async def test_an_open_event_stream_ends_when_its_key_is_revoked(conn, org, live_server):
    """SPEC: a revoked credential fails at once. A stream authenticated once, when it opened: it checks
    again before every read, and its last message is the 401's body."""
    org_id, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/events/stream", headers=_auth(key)) as response:
            reader = SseReader(response)
            first = await _append(conn, org_id, 1)
            assert [int(m["id"]) for m in await reader.take(1)] == first
            await _revoke_keys(conn, org_id)
            await _append(conn, org_id, 2)
            last = await _last_word(reader)
            assert json.loads(last["data"])["error"] == "unauthenticated"
            with pytest.raises(EOFError):
                await reader.take(1)
        reconnect = await client.get("/v1/events/stream", headers={**_auth(key), "Last-Event-ID": str(first[0])})
        assert reconnect.status_code == 401


async def test_an_open_projection_stream_ends_when_its_key_is_revoked(conn, org, live_server):
    from .queue_support import submit

    org_id, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        async with client.stream("GET", "/v1/projections/stream", params={"views": "queue"}, headers=_auth(key)) as response:
            reader = SseReader(response)
            await reader.take(1)
            await _revoke_keys(conn, org_id)
            job = await submit(conn, org_id, payload={"secret": "after revocation"})
            await store.publish(conn, [(org_id, job.position, 0)])
            assert json.loads((await _last_word(reader))["data"])["error"] == "unauthenticated"


async def test_an_open_stream_waits_out_a_database_outage_and_resumes_without_a_gap(conn, org, db_url):
    """The database refuses connections for longer than the stream's poll: the stream's reads fail meanwhile.
    It stays open and, once the database is back, sends what was appended, nothing skipped."""
    org_id, key = org
    dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="0.2") as server:
        listener = server.app.state.services.listener
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async with client.stream("GET", "/v1/events/stream", headers=_auth(key)) as response:
                reader = SseReader(response)
                before = await _append(conn, org_id, 1)
                assert [int(m["id"]) for m in await reader.take(1)] == before
                maintenance = psycopg.conninfo.make_conninfo(db_url, dbname="postgres")
                async with await psycopg.AsyncConnection.connect(maintenance, autocommit=True) as admin:
                    await admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
                    try:
                        await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (dbname,))
                        await anyio.sleep(1.5)  # the stream polls every ~0.2 s meanwhile, and each read fails
                        during = await client.get("/v1/events", headers=_auth(key))
                    finally:
                        await admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')
                assert during.status_code == 503 and during.json()["error"] == "database_unavailable"
                assert during.headers["Retry-After"] == "1"
                await until(lambda: listener.reconnects >= 1 and listener.connected.is_set())
                async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as again:
                    after = await _append(again, org_id, 2)
                assert [int(m["id"]) for m in await reader.take(2)] == after


async def test_tail_follow_prints_every_event_even_when_a_payload_holds_a_unicode_line_separator(
    conn, org, client, live_server, capsys
):
    """`umbra events tail --follow` prints every event, one whose payload holds U+2028 or U+0085 included:
    JSON may carry them, and a client that ends lines where ``str.splitlines`` does (httpx's ``aiter_lines``)
    tore the ``data:`` line in two, and the CLI died on it, again on every restart from before it."""
    org_id, key = org
    for payload in ({"note": "first"}, {"note": "line\u2028separator\u0085next"}, {"note": "last"}):
        response = await client.post("/v1/jobs", json={"kind": "echo", "payload": payload}, headers=bearer(key))
        assert response.status_code == 201, response.text
    logged = [r.position for r in await store.read_log(conn, organization_id=org_id)]
    capsys.readouterr()
    failure: BaseException | None = None
    async with httpx.AsyncClient(base_url=live_server.url, headers=bearer(key), timeout=httpx.Timeout(10, read=None)) as http:
        with anyio.move_on_after(4):
            try:
                await _follow(http, 0, True)
            except Exception as exc:  # noqa: BLE001 - what the CLI would die of
                failure = exc
    printed = [json.loads(line)["position"] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert failure is None, f"tail --follow died: {failure!r}"
    assert printed == logged


async def test_event_stream_refuses_a_malformed_after_even_when_last_event_id_is_sent(org, live_server):
    """A malformed ``after`` is 422 naming it, also when ``Last-Event-ID`` (which wins) is sent."""
    _, key = org
    async with httpx.AsyncClient(base_url=live_server.url, timeout=10) as http:
        async with http.stream(
            "GET", "/v1/events/stream", params={"after": "abc"}, headers={**bearer(key), "Last-Event-ID": "3"}
        ) as response:
            status = response.status_code
            body = (await response.aread()) if status != 200 else b""
    assert status == 422, "a malformed `after` was accepted and a stream opened"
    assert b'"field":"after"' in body


async def test_one_transaction_sends_at_most_one_notification_on_the_log_channel(conn, db_url):
    """At most one notification per transaction, however many organizations it touched: past what one
    payload can name, it names none (``EVERYTHING``) and every listener re-checks."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")
        async with conn.transaction():
            await store.publish(conn, [(uuid.uuid4(), 1000 + i, 0) for i in range(200)])
        received = [note async for note in listener.notifies(timeout=2.0)]
    sizes = [len(note.payload.encode()) for note in received]
    assert len(received) == 1, f"one transaction sent {len(received)} notifications of {sizes} bytes"
    assert received[0].payload == store.EVERYTHING


async def test_a_stream_whose_read_outlasts_its_bound_is_not_told_its_credential_was_revoked(conn, org, db_url, pg_proxy,
                                                                                            monkeypatch):
    """The network drops a stream's pooled connection mid-read (or the database takes that long): the read
    is given up at its bound, which says nothing of the credential. The stream stays open and, read again
    on another connection, sends what was appended, rather than a last ``unauthenticated`` message."""
    monkeypatch.setattr(sse, "READ_SHIELD_SECONDS", 1.0)
    org_id, key = org
    with LiveServer(pg_proxy.url(db_url), UMBRA_POLL_FALLBACK_SECONDS="0.2") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async with client.stream("GET", "/v1/events/stream", headers=_auth(key)) as response:
                reader = SseReader(response)
                before = await _append(conn, org_id, 1)
                assert [int(m["id"]) for m in await reader.take(1)] == before
                pg_proxy.freeze()  # nothing passes on the open connections, nothing closes them
                after = await _append(conn, org_id, 2)
                messages: list[dict] = []
                with anyio.fail_after(30), contextlib.suppress(EOFError):
                    while len(messages) < 2:
                        messages.append(await reader.next_message())
                assert [(m.get("event"), m.get("id")) for m in messages] == [("job.submitted", str(p)) for p in after]
