"""Submitting jobs: defaults, bounds, idempotency per organization, projects, batches, payloads kept as sent,
blocking. The ``client`` tests go through the routes of a live server."""

from __future__ import annotations

import anyio
import psycopg
import pytest

from umbra.compute import jobs
from umbra.compute.accounts import create_organization, create_project
from umbra.errors import NotFound
from umbra.events import store
from umbra.projections import jobs as queue
from tests.helpers import bearer

from .queue_support import CPU8, GPU24, add_node, beat, register_model, spec, submit

pytestmark = pytest.mark.anyio


async def footprint(conn) -> tuple[int, int]:
    row = await (await conn.execute(
        "SELECT (SELECT count(*) FROM events WHERE type = 'job.submitted'), (SELECT count(*) FROM jobs)")).fetchone()
    return tuple(row)


async def test_defaults_and_priority_zero_stays_zero(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "box", [GPU24])
    default = await submit(conn, org_id)
    urgent = await submit(conn, org_id, priority=0, max_attempts=1, payload={"x": [1, 2]}, lang="de")
    assert (default.priority, default.max_attempts, default.status) == (100, 3, "queued")
    assert (urgent.priority, urgent.max_attempts, urgent.payload, urgent.lang) == (0, 1, {"x": [1, 2]}, "de")
    [submitted] = await store.read_stream(conn, store.job_stream(urgent.id))
    assert submitted.type == "job.submitted" and submitted.event.priority == 0


async def test_the_same_idempotency_key_returns_the_first_job_and_appends_nothing(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "box", [GPU24])
    first, created = await jobs.submit(conn, org_id, [spec(idempotency_key="k1")], actor="t", batch=False)
    assert created == 1
    head = await store.head_position(conn)
    again, created = await jobs.submit(conn, org_id, [spec("other-kind", idempotency_key="k1")], actor="t", batch=False)
    assert (created, again[0].id, again[0].kind) == (0, first[0].id, "echo")
    assert await store.head_position(conn) == head


async def test_idempotency_keys_are_scoped_to_the_organization(conn, org):
    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    mine = await submit(conn, org_id, idempotency_key="shared")
    theirs = await submit(conn, other_id, idempotency_key="shared")
    assert mine.id != theirs.id and theirs.organization_id == other_id


async def test_racing_submissions_with_one_key_make_one_job(db_url, org):
    org_id, _ = org
    ids = []

    async def one():
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            rows, _ = await jobs.submit(c, org_id, [spec(idempotency_key="race")], actor="t", batch=False)
            ids.append(rows[0].id)

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(one)
    assert len(set(ids)) == 1 and len(ids) == 8
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        assert await footprint(c) == (1, 1)


async def test_racing_large_batches_with_the_same_keys_make_each_job_once(db_url, org):
    """Batches written by COPY: the losers wait on the keys' locks, then find the winner's jobs."""
    org_id, _ = org
    size = store.COPY_MIN_EVENTS + 10
    results = []

    async def one():
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            specs = [spec(idempotency_key=f"race-{i}") for i in range(size)]
            results.append(await jobs.submit(c, org_id, specs, actor="t", batch=True))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
    assert sorted(created for _, created in results) == [0, 0, size]
    assert len({tuple(r.id for r in rows) for rows, _ in results}) == 1
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        assert await footprint(c) == (size, size)


async def test_racing_batches_with_overlapping_keys_make_each_job_once_and_never_fail(db_url, org):
    """Each batch shares some keys with others: every batch is answered, each key names one job."""
    import random

    org_id, _ = org
    rng = random.Random(7)
    batches = [rng.sample(range(60), 15) for _ in range(48)]
    answers: list[tuple[list[int], list]] = []

    async def worker(mine: list[list[int]]) -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            for keys in mine:
                rows, _ = await jobs.submit(c, org_id, [spec(idempotency_key=f"k{k}") for k in keys], actor="t", batch=True)
                answers.append((keys, rows))

    async with anyio.create_task_group() as tg:
        for w in range(8):
            tg.start_soon(worker, batches[w::8])
    assert len(answers) == len(batches)
    ids: dict[int, set] = {}
    for keys, rows in answers:
        for key, row in zip(keys, rows):
            ids.setdefault(key, set()).add(row.id)
    assert all(len(v) == 1 for v in ids.values())
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        assert await footprint(c) == (len(ids), len(ids))


async def test_a_key_is_per_organization_not_per_project(client, org, conn):
    """One key in two projects of one organization names one job: the repeat answers 200 with the first job
    (its project, not the repeat's) and writes nothing."""
    org_id, key = org
    first_project = await create_project(conn, org_id, "one")
    second_project = await create_project(conn, org_id, "two")
    first = await client.post("/v1/jobs", json={"kind": "k", "project_id": str(first_project), "idempotency_key": "x"},
                              headers=bearer(key))  # fmt: skip
    assert first.status_code == 201, first.text
    head = await store.head_position(conn)
    again = await client.post("/v1/jobs", json={"kind": "k", "project_id": str(second_project), "idempotency_key": "x"},
                              headers=bearer(key))  # fmt: skip
    assert again.status_code == 200, again.text
    assert (again.json()["id"], again.json()["project_id"]) == (first.json()["id"], str(first_project))
    assert (await footprint(conn), await store.head_position(conn)) == ((1, 1), head)


async def test_the_same_key_in_two_organizations_makes_two_jobs_each_found_only_by_its_own(client, org, conn):
    """Keys are independent per organization over HTTP: both first submissions are 201, each repeat (single or
    batch) finds its own organization's job, and neither organization can read the other's."""
    _, key = org
    _, other_key = await create_organization(conn, "other")
    mine = await client.post("/v1/jobs", json={"kind": "k", "payload": {"who": "me"}, "idempotency_key": "s"}, headers=bearer(key))
    theirs = await client.post("/v1/jobs", json={"kind": "k", "payload": {"who": "them"}, "idempotency_key": "s"},
                               headers=bearer(other_key))  # fmt: skip
    assert (mine.status_code, theirs.status_code) == (201, 201)
    assert mine.json()["id"] != theirs.json()["id"]
    again_theirs = await client.post("/v1/jobs", json={"kind": "k", "idempotency_key": "s"}, headers=bearer(other_key))
    again_mine = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "k", "idempotency_key": "s"}]}, headers=bearer(key))
    assert (again_theirs.status_code, again_theirs.json()["payload"]) == (200, {"who": "them"})
    assert again_mine.json()["jobs"][0]["id"] == mine.json()["id"]
    assert (await client.get(f"/v1/jobs/{mine.json()['id']}", headers=bearer(other_key))).status_code == 404
    assert await footprint(conn) == (2, 2)


async def test_one_key_twice_in_one_batch_is_one_job_answered_at_both_places(client, org, conn):
    """The second occurrence of a key within a batch is answered with the first's job (its own body is not
    used), and the batch makes one job for it."""
    _, key = org
    batch = [{"kind": "k", "payload": {"i": 0}, "idempotency_key": "dup"}, {"kind": "k", "payload": {"i": 1}},
             {"kind": "other", "payload": {"i": 2}, "idempotency_key": "dup"}]  # fmt: skip
    answer = await client.post("/v1/jobs/batch", json={"jobs": batch}, headers=bearer(key))
    assert answer.status_code == 201, answer.text
    jobs = answer.json()["jobs"]
    assert len(jobs) == 3 and jobs[0]["id"] == jobs[2]["id"] and jobs[1]["id"] != jobs[0]["id"]
    assert (jobs[2]["payload"], jobs[2]["kind"]) == ({"i": 0}, "k")
    assert await footprint(conn) == (2, 2)


async def test_a_batch_mixing_known_and_new_keys_makes_only_the_new_ones_in_request_order(client, org, conn):
    """A batch of known, new, repeated and absent keys: known ones answer their job, a repeated new one the
    first occurrence's, and only the new jobs are made, in request order."""
    _, key = org
    known = (await client.post("/v1/jobs", json={"kind": "k", "idempotency_key": "known"}, headers=bearer(key))).json()
    batch = [{"kind": "k", "idempotency_key": "new-1"}, {"kind": "k", "idempotency_key": "known"}, {"kind": "k"},
             {"kind": "k", "idempotency_key": "new-1"}, {"kind": "k", "idempotency_key": "new-2"}]  # fmt: skip
    answer = await client.post("/v1/jobs/batch", json={"jobs": batch}, headers=bearer(key))
    assert answer.status_code == 201, answer.text
    jobs = answer.json()["jobs"]
    assert jobs[1]["id"] == known["id"] and jobs[0]["id"] == jobs[3]["id"]
    assert len({j["id"] for j in jobs}) == 4
    assert [j["idempotency_key"] for j in jobs] == ["new-1", "known", None, "new-1", "new-2"]
    assert await footprint(conn) == (4, 4)
    listed = (await client.get("/v1/jobs", params={"limit": 100}, headers=bearer(key))).json()["jobs"]  # submission order
    assert [j["id"] for j in listed] == [known["id"], jobs[0]["id"], jobs[2]["id"], jobs[4]["id"]]


async def test_many_concurrent_singles_and_batches_with_one_key_make_one_job(client, org, conn):
    """24 single submissions and 6 batches naming the same key at once: every answer is a success naming the
    same job, at most one single submission is 201, and one job exists for the key."""
    _, key = org
    singles: list = []
    batches: list = []

    async def single(i: int) -> None:
        singles.append(await client.post("/v1/jobs", json={"kind": "k", "payload": {"i": i}, "idempotency_key": "hot"},
                                         headers=bearer(key)))  # fmt: skip

    async def batch(i: int) -> None:
        body = {"jobs": [{"kind": "k", "idempotency_key": f"b{i}-{j}"} for j in range(20)]
                + [{"kind": "k", "idempotency_key": "hot"}]}  # fmt: skip
        batches.append(await client.post("/v1/jobs/batch", json=body, headers=bearer(key)))

    async with anyio.create_task_group() as tg:
        for i in range(24):
            tg.start_soon(single, i)
            if i % 4 == 0:
                tg.start_soon(batch, i // 4)
    assert all(r.status_code in (200, 201) for r in singles), [(r.status_code, r.text[:200]) for r in singles]
    assert all(r.status_code == 201 for r in batches), [(r.status_code, r.text[:200]) for r in batches]
    ids = {r.json()["id"] for r in singles} | {r.json()["jobs"][-1]["id"] for r in batches}
    assert len(ids) == 1
    assert sum(r.status_code == 201 for r in singles) <= 1
    assert await footprint(conn) == (1 + 6 * 20, 1 + 6 * 20)


async def test_a_project_must_exist_in_the_submitters_own_tenant(conn, org):
    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    mine = await create_project(conn, org_id, "book")
    theirs = await create_project(conn, other_id, "their book")
    assert (await submit(conn, org_id, project_id=str(mine))).project_id == mine
    before = await footprint(conn)
    for project in (theirs, "00000000-0000-4000-8000-000000000000"):
        with pytest.raises(NotFound) as refused:
            await submit(conn, org_id, project_id=str(project))
        assert refused.value.code == "project_not_found"
    assert await footprint(conn) == before


async def test_the_project_is_looked_up_in_the_submitters_schema_by_name_whatever_the_search_path(conn, org):
    """The check names the submitter's tenant schema itself: a session whose ``search_path`` leads to
    another tenant's ``projects`` neither finds that tenant's project nor misses its own."""
    from umbra.compute.accounts import tenant_schema

    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    mine = await create_project(conn, org_id, "book")
    theirs = await create_project(conn, other_id, "their book")
    assert tenant_schema(other_id) == f"tenant_{other_id.hex}"
    await conn.execute(f"SET search_path = {tenant_schema(other_id)}, public")
    before = await footprint(conn)
    with pytest.raises(NotFound) as refused:
        await submit(conn, org_id, project_id=str(theirs))
    assert refused.value.code == "project_not_found" and await footprint(conn) == before
    assert (await submit(conn, org_id, project_id=str(mine))).project_id == mine


async def test_a_batch_is_one_append_in_request_order_and_all_or_nothing(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "box", [GPU24])
    project = await create_project(conn, org_id, "p")
    specs = [spec(payload={"i": i}, project_id=str(project), idempotency_key=f"k{i % 900}") for i in range(1000)]
    head = await store.head_position(conn)
    rows, created = await jobs.submit(conn, org_id, specs, actor="t", batch=True)
    assert created == 900 and [r.payload["i"] for r in rows[:900]] == list(range(900))
    assert [r.id for r in rows[900:]] == [r.id for r in rows[:100]]  # a repeated key in one batch is one job
    positions = sorted(r.position for r in rows[:900])
    assert positions == list(range(positions[0], positions[0] + 900)) and positions[0] > head
    before = await footprint(conn)
    bad = [spec(payload={"i": i}) for i in range(5)] + [spec(project_id="00000000-0000-4000-8000-000000000000")]
    with pytest.raises(NotFound) as refused:
        await jobs.submit(conn, org_id, bad, actor="t", batch=True)
    assert refused.value.extra == {"index": 5}
    assert await footprint(conn) == before


async def test_a_large_batch_stores_exactly_the_rows_it_returns(conn, org):
    """Above the COPY threshold: awkward text survives, and the live rows are the fold of the log."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [GPU24])
    awkward = "tab\there, new\nline, CR\r, back\\slash \\N, \\u0000, é, 😀"
    specs = [
        spec(kind=awkward, payload={"s": awkward, "i": i}, lang=awkward[:60], idempotency_key=f"{awkward}{i}",
             requires={"vram_min_mb": 1000} if i % 2 else {"vram_min_mb": 10**6})
        for i in range(store.COPY_MIN_EVENTS + 50)
    ]  # fmt: skip
    rows, created = await jobs.submit(conn, org_id, specs, actor=awkward, batch=True)
    assert created == len(specs) and {r.status for r in rows} == {"queued", "blocked"}
    live = await queue.live(conn, org_id)
    assert [live[r.id] for r in rows] == rows
    assert queue.diff(await queue.rebuild(conn, org_id), live) == []
    again, created = await jobs.submit(conn, org_id, specs, actor=awkward, batch=True)
    assert created == 0 and again == rows


async def test_out_of_bounds_fields_are_refused_naming_the_field_and_write_nothing(client, org, conn):
    """priority is a 32-bit integer, max_attempts 1..100, lang 1..64 characters, idempotency_key 1..200: the
    bounds are accepted, anything outside is a 422 naming the field and writes nothing; a float, a bool or a
    string is refused rather than coerced."""
    _, key = org
    for body in ({"kind": "k", "priority": -(2**31)}, {"kind": "k", "priority": 2**31 - 1},
                 {"kind": "k", "max_attempts": 1}, {"kind": "k", "max_attempts": 100},
                 {"kind": "k", "lang": "x" * 64}, {"kind": "k", "idempotency_key": "x" * 200}):  # fmt: skip
        assert (await client.post("/v1/jobs", json=body, headers=bearer(key))).status_code == 201, body
    before = (await footprint(conn), await store.head_position(conn))
    for body, field in (({"kind": "k", "priority": 2**31}, "priority"), ({"kind": "k", "priority": -(2**31) - 1}, "priority"),
                        ({"kind": "k", "priority": 1.5}, "priority"), ({"kind": "k", "priority": True}, "priority"),
                        ({"kind": "k", "max_attempts": 101}, "max_attempts"), ({"kind": "k", "max_attempts": 0}, "max_attempts"),
                        ({"kind": "k", "max_attempts": -1}, "max_attempts"), ({"kind": "k", "lang": ""}, "lang"),
                        ({"kind": "k", "lang": "x" * 65}, "lang"), ({"kind": "k", "idempotency_key": ""}, "idempotency_key"),
                        ({"kind": "k", "idempotency_key": "x" * 201}, "idempotency_key")):  # fmt: skip
        refused = await client.post("/v1/jobs", json=body, headers=bearer(key))
        assert (refused.status_code, refused.json()["error"], refused.json().get("field")) == (422, "invalid_request", field), (body, refused.text)
    assert (await footprint(conn), await store.head_position(conn)) == before


async def test_integers_past_64_bits_in_a_payload_are_stored_and_read_back_exactly(client, org):
    """A payload is opaque: integers of any size (a 128-bit id) come back as sent, in the job and its event."""
    _, key = org
    answer = await client.post("/v1/jobs", content=b'{"kind":"k","payload":{"big":340282366920938463463374607431768211457,'
                                                   b'"neg":-9223372036854775809}}',
                               headers={**bearer(key), "content-type": "application/json"})  # fmt: skip
    assert answer.status_code == 201, answer.text
    expected = {"big": 340282366920938463463374607431768211457, "neg": -9223372036854775809}
    assert (await client.get(f"/v1/jobs/{answer.json()['id']}", headers=bearer(key))).json()["payload"] == expected
    events = (await client.get(f"/v1/jobs/{answer.json()['id']}/events", headers=bearer(key))).json()["events"]
    assert events[0]["data"]["payload"] == expected


async def test_a_body_over_one_mebibyte_is_413_and_one_just_under_is_stored(client, org, conn):
    """The 1 MiB body limit: a payload just under it is stored whole; just over is 413 and writes nothing."""
    _, key = org
    filler = "x" * (1024 * 1024 - 200)
    fits = await client.post("/v1/jobs", json={"kind": "k", "payload": {"f": filler}}, headers=bearer(key))
    assert fits.status_code == 201, fits.text[:200]
    assert len((await client.get(f"/v1/jobs/{fits.json()['id']}", headers=bearer(key))).json()["payload"]["f"]) == len(filler)
    before = (await footprint(conn), await store.head_position(conn))
    big = await client.post("/v1/jobs", json={"kind": "k", "payload": {"f": filler + "y" * 400}}, headers=bearer(key))
    assert big.status_code == 413
    assert (await footprint(conn), await store.head_position(conn)) == before


async def test_a_job_nothing_could_run_is_blocked_with_the_shortfall_and_unblocked_by_a_bigger_node(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "small", [GPU24, CPU8])
    job = await submit(conn, org_id, requires={"vram_min_mb": 40000})
    assert job.status == "blocked"
    assert job.blocked_reason == ("no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (small/gpu0); "
                                  "needs 40000 MB RAM, largest is 8192 MB (small/cpu)")  # fmt: skip
    runnable = await submit(conn, org_id, requires={"vram_min_mb": 20000})
    assert runnable.status == "queued"
    big = GPU24.__class__(kind="gpu_discrete", label="h100", vram_total_mb=81920, vram_free_mb=80000, accelerators=("cuda",))
    await add_node(conn, org_id, "big", [big], online=False)  # pairing alone re-examines: offline nodes count
    row = await queue.load(conn, job.id, org_id)
    assert (row.status, row.blocked_reason) == ("queued", None)
    types = [r.type for r in await store.read_stream(conn, store.job_stream(job.id))]
    assert types == ["job.submitted", "job.blocked", "job.unblocked"]


async def test_an_unregistered_model_blocks_until_it_is_registered(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "box", [GPU24])
    job = await submit(conn, org_id, requires={"models": ["gemma4:26b"]})
    assert (job.status, job.blocked_reason) == ("blocked", "model_not_registered: gemma4:26b")
    await register_model(conn, org_id, "gemma4:26b", vram_min_mb=30000)  # registered, but too big for the fleet
    row = await queue.load(conn, job.id, org_id)
    assert row.status == "blocked" and row.blocked_reason.startswith("no_eligible_device: needs 30000 MB VRAM")
    assert row.blocked_at == (await store.read_stream(conn, store.job_stream(job.id)))[1].recorded_at
    await register_model(conn, org_id, "gemma4:26b", vram_min_mb=16000)
    assert (await queue.load(conn, job.id, org_id)).status == "queued"


async def test_a_heartbeat_with_new_devices_unblocks(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU8])
    job = await submit(conn, org_id, requires={"accelerators": ["cuda"]})
    assert job.status == "blocked"
    await beat(conn, org_id, node, [CPU8, GPU24])
    assert (await queue.load(conn, job.id, org_id)).status == "queued"


async def test_an_empty_fleet_blocks_and_the_first_pairing_unblocks(conn, org):
    org_id, _ = org
    job = await submit(conn, org_id)
    assert (job.status, job.blocked_reason) == ("blocked", "no_eligible_device: no active node with devices is registered")
    await add_node(conn, org_id, "first", [CPU8], online=False)
    assert (await queue.load(conn, job.id, org_id)).status == "queued"


async def test_submitting_notifies_once_with_the_claimable_count(db_url, conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "box", [GPU24])
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")
        specs = [spec() for _ in range(5)] + [spec(requires={"vram_min_mb": 10**6})]
        rows, _ = await jobs.submit(conn, org_id, specs, actor="t", batch=True)
        notes = [n async for n in listener.notifies(timeout=1.0)]
    assert [store.parse_hints(n.payload) for n in notes] == [[(org_id, max(r.position for r in rows), 5)]]


async def test_reexamining_when_nothing_changed_for_blocked_jobs_writes_nothing(conn, org):
    from umbra.compute.blocked import Reexamined, reexamine_waiting_jobs

    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU8])
    await jobs.submit(conn, org_id, [spec(requires={"accelerators": ["cuda"]}) for _ in range(50)], actor="t", batch=True)
    head = await store.head_position(conn)
    assert await reexamine_waiting_jobs(conn, org_id) == Reexamined(unblocked=0, blocked=0)
    assert await store.head_position(conn) == head
    await add_node(conn, org_id, "gpu", [GPU24], online=False)
    assert (await (await conn.execute("SELECT count(*) FROM jobs WHERE status = 'queued'")).fetchone())[0] == 50
