"""The log: optimistic concurrency, immutability, and gap-free commit order."""

from __future__ import annotations

import random
import uuid

import anyio
import msgspec
import psycopg
import pytest

from tests.helpers import lock_held_for_a_second
from umbra.db import PreparedStatement, begin_with, commit_with, run_together
from umbra.errors import ConcurrencyConflict
from umbra.events import store
from umbra.events.types import JobCancelled, JobSubmitted, NodeDraining

pytestmark = pytest.mark.anyio

CLOCK = PreparedStatement("test_clock", "SELECT umbra_now()")


@pytest.fixture(params=["insert", "copy"])
def append_path(request, monkeypatch):
    """Run a test through both append paths: the INSERT statement and, forced for every size, COPY."""
    if request.param == "copy":
        monkeypatch.setattr(store, "COPY_MIN_EVENTS", 1)
    return request.param


def _submitted(i: int = 0) -> JobSubmitted:
    return JobSubmitted(kind="echo", priority=100, max_attempts=3, payload={"i": i})


async def test_append_and_read_stream_round_trip(conn, org, append_path):
    org_id, _ = org
    stream = store.job_stream(uuid.uuid4())
    async with conn.transaction():
        recorded = await store.append(conn, stream, 0, [_submitted(), JobCancelled(by="me")], organization_id=org_id)
    assert [r.version for r in recorded] == [1, 2]
    assert recorded[0].position < recorded[1].position
    read = await store.read_stream(conn, stream)
    assert [r.event for r in read] == [_submitted(), JobCancelled(by="me")]
    assert read[0].type == "job.submitted"
    assert read[1].recorded_at == recorded[1].recorded_at


async def test_two_appends_at_the_same_expected_version_one_wins(db_url, org, append_path):
    org_id, _ = org
    stream = store.job_stream(uuid.uuid4())
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        await store.append(c, stream, 0, [_submitted()], organization_id=org_id)
    results: list[str] = []

    async def writer(tag: str):
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            try:
                async with c.transaction():
                    await store.append(c, stream, 1, [JobCancelled(by=tag)], organization_id=org_id)
                    await anyio.sleep(0.05)
                results.append("won")
            except ConcurrencyConflict:
                results.append("conflict")

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer, "a")
        tg.start_soon(writer, "b")
    assert sorted(results) == ["conflict", "won"]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        assert [r.version for r in await store.read_stream(c, stream)] == [1, 2]


async def test_append_refuses_a_version_gap(conn, org, append_path):
    org_id, _ = org
    stream = store.job_stream(uuid.uuid4())
    await store.append(conn, stream, 0, [_submitted()], organization_id=org_id)
    with pytest.raises(ConcurrencyConflict):
        async with conn.transaction():
            await store.append(conn, stream, 3, [JobCancelled()], organization_id=org_id)
    assert len(await store.read_stream(conn, stream)) == 1


async def test_append_refuses_a_taken_first_version(conn, org, append_path):
    """A new stream's version 1 must not exist yet: the unique index refuses it, as a conflict."""
    org_id, _ = org
    stream = store.job_stream(uuid.uuid4())
    await store.append(conn, stream, 0, [_submitted()], organization_id=org_id)
    other = store.job_stream(uuid.uuid4())
    with pytest.raises(ConcurrencyConflict):
        async with conn.transaction():
            await store.append_many(conn, [
                store.PendingAppend(other, 0, [_submitted()], org_id),
                store.PendingAppend(stream, 0, [_submitted()], org_id),
            ])  # fmt: skip
    assert len(await store.read_stream(conn, stream)) == 1
    assert await store.read_stream(conn, other) == []


async def test_an_event_is_never_recorded_before_the_event_it_follows(db_url, org, append_path):
    """Within a stream, time never runs backwards, whichever transaction began first.

    An append is recorded at its transaction's clock, read when it began; one that began
    before the stream's last event committed would have stamped its event before that one
    (a job cancelled before it was submitted). It takes the later of the two. A new
    stream in the same batch keeps its transaction's clock (through COPY, a batch's events
    share one time, the latest).
    """
    org_id, _ = org
    stream, fresh = store.job_stream(uuid.uuid4()), store.job_stream(uuid.uuid4())
    async with (await psycopg.AsyncConnection.connect(db_url) as early,
                await psycopg.AsyncConnection.connect(db_url, autocommit=True) as late):  # fmt: skip
        [(began,)] = await (await early.execute("SELECT umbra_now()")).fetchall()  # early's transaction, and its clock, begin
        await anyio.sleep(0.01)
        [first] = await store.append(late, stream, 0, [_submitted()], organization_id=org_id)
        assert first.recorded_at > began
        recorded = await store.append_many(early, [store.PendingAppend(stream, 1, [JobCancelled(by="early")], org_id),
                                                   store.PendingAppend(fresh, 0, [_submitted(1)], org_id)])  # fmt: skip
        await early.commit()
        followed, new = recorded
        assert followed.recorded_at == first.recorded_at
        assert new.recorded_at == (began if append_path == "insert" else first.recorded_at)
        read = {r.stream: r for r in [*await store.read_stream(late, stream), *await store.read_stream(late, fresh)]}
        assert [read[stream].recorded_at, read[fresh].recorded_at] == [followed.recorded_at, new.recorded_at]
        assert read[stream] == followed


async def test_an_append_sent_with_the_commit_records_at_the_given_time_and_returns_positions(conn, org):
    """``append_statement``: folded before appending, so the events' time is given and only positions come back."""
    org_id, _ = org
    first, second = store.job_stream(uuid.uuid4()), store.job_stream(uuid.uuid4())
    await store.append(conn, first, 0, [_submitted()], organization_id=org_id)
    [(now,)] = await begin_with(conn, [(CLOCK, {})])
    batch = [store.PendingAppend(first, 1, [JobCancelled(by="a")], org_id, {"actor": "t"}),
             store.PendingAppend(second, 0, [_submitted(1), JobCancelled(by="b")], org_id)]  # fmt: skip
    append, before = store.append_statement(batch, recorded_at=now[0])
    assert [(e.stream, e.version, e.position) for e in before] == [(first, 2, 0), (second, 1, 0), (second, 2, 0)]
    [returned] = await commit_with(conn, [append])
    positions = store.appended(before, returned)
    assert positions == sorted(positions)
    recorded = [msgspec.structs.replace(event, position=position) for event, position in zip(before, positions)]
    read = {(r.stream, r.version): r for r in [*await store.read_stream(conn, first), *await store.read_stream(conn, second)]}
    for event in recorded:
        assert read[event.stream, event.version] == event  # position, time, event and metadata as stored


async def test_an_append_sent_with_the_commit_fails_it_for_a_stream_not_at_its_expected_version(conn, org):
    """Nothing of the message commits: not the other streams' events, not the statements sent after it."""
    org_id, _ = org
    stream, other = store.job_stream(uuid.uuid4()), store.job_stream(uuid.uuid4())
    await store.append(conn, stream, 0, [_submitted()], organization_id=org_id)
    for expected in (0, 2):  # behind (version 1 taken) and ahead (a gap)
        [(now,)] = await begin_with(conn, [(CLOCK, {})])
        batch = [store.PendingAppend(other, 0, [_submitted()], org_id),
                 store.PendingAppend(stream, expected, [JobCancelled()], org_id)]  # fmt: skip
        with pytest.raises((psycopg.errors.NotNullViolation, psycopg.errors.UniqueViolation)):
            append, _recorded = store.append_statement(batch, recorded_at=now[0])
            await commit_with(conn, [append, (CLOCK, {})])
        await conn.rollback()
        assert len(await store.read_stream(conn, stream)) == 1 and await store.read_stream(conn, other) == []


async def test_large_append_keeps_batch_order_and_stores_what_it_returns(conn, org):
    """An append above the COPY threshold: positions follow the batch, and a read returns the same events."""
    org_id, _ = org
    streams = [store.job_stream(uuid.uuid4()) for _ in range(store.COPY_MIN_EVENTS)]
    tricky = JobSubmitted(kind="tab\there", priority=1, max_attempts=1, payload={"s": "back\\slash \n \r \\N é"})
    batch = [store.PendingAppend(s, 0, [tricky, JobCancelled(by="x")], org_id, {"actor": "a\tb"}) for s in streams]
    async with conn.transaction():
        recorded = await store.append_many(conn, batch)
    positions = [r.position for r in recorded]
    assert positions == sorted(positions) and len(set(positions)) == len(positions) == 2 * len(streams)
    assert [(r.stream, r.version) for r in recorded] == [(s, v) for s in streams for v in (1, 2)]
    read = await store.read_log(conn, after=positions[0] - 1, limit=len(positions))
    assert [(r.position, r.stream, r.version, r.event, r.metadata, r.recorded_at) for r in read] == [
        (r.position, r.stream, r.version, r.event, dict(r.metadata), r.recorded_at) for r in recorded
    ]
    async with conn.transaction():
        more = await store.append_many(conn, [store.PendingAppend(s, 2, [JobCancelled()] * 1, org_id) for s in streams])
    assert [r.version for r in more] == [3] * len(streams)


async def test_a_lazily_appended_batch_is_checked_as_it_streams(conn, org):
    """``appending(..., events=n)``: only new streams, and exactly the events announced, or nothing is written."""
    org_id, _ = org
    n = store.COPY_MIN_EVENTS
    old = store.job_stream(uuid.uuid4())
    await store.append(conn, old, 0, [_submitted()], organization_id=org_id)
    head = await store.head_position(conn)

    def items(count: int, last_stream: str | None = None):
        for i in range(count):
            stream = last_stream if last_stream and i == count - 1 else store.job_stream(uuid.uuid4())
            yield store.PendingAppend(stream, 1 if stream == old else 0, [_submitted(i)], org_id)

    for batch, announced in ((items(n - 1), n), (items(n + 1), n), (items(n, old), n)):
        with pytest.raises(ValueError):
            async with conn.transaction():
                async with store.appending(conn, batch, events=announced):
                    pass
    assert await store.head_position(conn) == head
    async with conn.transaction():
        async with store.appending(conn, items(n), events=n) as recorded:
            assert [r.version for r in recorded] == [1] * n
    assert len(await store.read_log(conn, after=head)) == n


async def test_events_cannot_be_updated_or_deleted(conn, org):
    org_id, _ = org
    await store.append(conn, store.node_stream(uuid.uuid4()), 0, [NodeDraining()], organization_id=org_id)
    for statement in ("UPDATE events SET type = 'x'", "DELETE FROM events", "TRUNCATE events"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(statement)
    assert await store.head_position(conn) >= 1


async def test_read_log_filters_by_organization(conn):
    from umbra.compute.accounts import create_organization

    a, _ = await create_organization(conn, "a")
    b, _ = await create_organization(conn, "b")
    await store.append(conn, store.job_stream(uuid.uuid4()), 0, [_submitted(1)], organization_id=a)
    await store.append(conn, store.job_stream(uuid.uuid4()), 0, [_submitted(2)], organization_id=b)
    only_a = await store.read_log(conn, organization_id=a)
    assert [r.organization_id for r in only_a] == [a]
    assert len(await store.read_log(conn)) == 2


_GROUP_CLOCK = PreparedStatement("test_group_clock", "SELECT umbra_now()")


async def _group_append(c: psycopg.AsyncConnection, org_id, events, rng: random.Random) -> None:
    """One append as the group commit sends it: the batch's clock read with its BEGIN, the append with COMMIT."""
    [(now,)] = await begin_with(c, [(_GROUP_CLOCK, {})], generic_plans=True, family=(store.APPEND_AT,))
    if rng.random() < 0.3:
        await anyio.sleep(rng.uniform(0, 0.003))
    append, _ = store.append_statement([store.PendingAppend(store.job_stream(uuid.uuid4()), 0, events, org_id)],
                                       recorded_at=now[0])  # fmt: skip
    await commit_with(c, [append])


async def _tail_while_writing(db_url: str, org_id, *, writers: int, per_writer: int,
                              group_commit: bool = False) -> tuple[list[int], list[int]]:  # fmt: skip
    """Run concurrent writers with random transaction lengths while tailing; with ``group_commit``, every other
    writer appends as the group commit does.

    Returns (positions seen by the tailer in order, positions of a final full read).
    """
    done = anyio.Event()
    seen: list[int] = []

    async def writer(seed: int):
        rng = random.Random(seed)
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            for i in range(per_writer):
                if group_commit and seed % 2:
                    await _group_append(c, org_id, [_submitted(i) for _ in range(rng.randint(1, 3))], rng)
                    continue
                async with c.transaction():
                    events = [_submitted(i) for _ in range(rng.randint(1, 3))]
                    await store.append(c, store.job_stream(uuid.uuid4()), 0, events, organization_id=org_id)
                    # hold the transaction open after allocating positions
                    if rng.random() < 0.3:
                        await anyio.sleep(rng.uniform(0, 0.004))
                if rng.random() < 0.05:
                    # an aborted append burns positions: a permanent hole
                    try:
                        async with c.transaction():
                            await store.append(c, store.job_stream(uuid.uuid4()), 0, [_submitted()], organization_id=org_id)
                            raise RuntimeError("rollback")
                    except RuntimeError:
                        pass

    async def tailer():
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            cursor = 0
            while True:
                finished = done.is_set()
                batch = await store.read_log(c, after=cursor, limit=500)
                for r in batch:
                    seen.append(r.position)
                    cursor = r.position
                if finished and not batch:
                    return
                if not batch:
                    await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tailer)
        async with anyio.create_task_group() as wg:
            for w in range(writers):
                wg.start_soon(writer, w)
        done.set()
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        full = [r.position for r in await store.read_log(c, limit=1_000_000)]
    return seen, full


async def test_tailing_reader_sees_every_event_exactly_once_in_commit_order(db_url, org, append_path):
    org_id, _ = org
    seen, full = await _tail_while_writing(db_url, org_id, writers=10, per_writer=150)
    assert len(full) >= 10 * 150
    assert seen == full, f"tailer missed {len(set(full) - set(seen))} events"


async def test_tailing_reader_sees_every_event_of_group_commit_appends_exactly_once_in_commit_order(db_url, org):
    """The group commit's append (``append_statement`` sent with ``COMMIT``) keeps positions in commit order too,
    racing the other append path."""
    org_id, _ = org
    seen, full = await _tail_while_writing(db_url, org_id, writers=10, per_writer=150, group_commit=True)
    assert len(full) >= 10 * 150
    assert seen == full, f"tailer missed {len(set(full) - set(seen))} events"


async def test_gap_test_detects_a_missing_ordering_guard(db_url, org, append_path, monkeypatch):
    """Without the append lock, the same workload makes the tailer skip events.

    This proves the test above can fail: concurrent transactions allocate
    positions out of commit order, and a ``position > P`` cursor skips the
    late committer. (The race is probabilistic; a few rounds make it certain.)
    """
    org_id, _ = org
    monkeypatch.setattr(store, "ORDERING_GUARD", False)
    for _ in range(5):
        seen, full = await _tail_while_writing(db_url, org_id, writers=10, per_writer=100)
        if seen != full:
            assert set(full) - set(seen), "the unguarded tailer lost events"
            return
    pytest.fail("five rounds without the ordering guard never lost an event; the gap test is too weak")


async def test_an_append_waits_for_the_ordering_lock_past_the_connections_lock_timeout(db_url, org, append_path):
    """A pooled connection bounds its lock waits (``lock_timeout``, for rows held elsewhere), but the log's
    ordering lock is only ever held by appends, one after another: under a burst of large submissions the
    queue for it may be longer than that bound, and an append is never refused for it. Rows locked after
    the append in the same transaction are still the connection's business; before it, the bound holds."""
    org_id, _ = org
    async with lock_held_for_a_second(db_url, "SELECT pg_advisory_xact_lock(%s)", (store.LOG_LOCK_KEY,)) as (appender, _):
        with anyio.fail_after(10):
            recorded = await store.append(appender, f"job:{uuid.uuid4()}", 0, [_submitted()], organization_id=org_id)
            await appender.commit()
    assert recorded[0].position > 0


async def test_the_batch_append_waits_past_the_bound_with_a_generic_plan_and_sets_it_back(db_url, org):
    """The group commit's append (a statement prepared once per connection, run with a generic plan)
    waits for the ordering lock past a 300 ms bound, and the bound is back once it holds it: the plan
    keeps the setting's subquery before the lock, whatever the planner guesses."""
    org_id, _ = org
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as holder, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as writer:  # fmt: skip
        for _ in range(6):  # past the plan cache's custom-plan tries, though a generic plan is forced anyway
            await writer.execute("BEGIN")
            await writer.execute("SELECT set_config('plan_cache_mode', 'force_generic_plan', true), "
                                 "set_config('lock_timeout', '300ms', true)")  # fmt: skip
            await holder.execute("BEGIN")
            await holder.execute("SELECT pg_advisory_xact_lock(%s)", (store.LOG_LOCK_KEY,))
            now = (await (await writer.execute("SELECT umbra_now()")).fetchone())[0]
            statement, _ = store.append_statement([store.PendingAppend(f"job:{uuid.uuid4()}", 0, [_submitted()], org_id)],
                                                  recorded_at=now)  # fmt: skip
            async with anyio.create_task_group() as tg:

                async def release() -> None:
                    await anyio.sleep(0.6)
                    await holder.execute("COMMIT")

                tg.start_soon(release)
                with anyio.fail_after(10):
                    [positions] = await run_together(writer, [statement])
            bound = (await (await writer.execute("SELECT current_setting('lock_timeout')")).fetchone())[0]
            await writer.execute("COMMIT")
            assert len(positions) == 1 and bound == "300ms"
