"""The order in which work runs.

SPEC: priority (default 100) lower runs first, ties by submission order; a claim takes the best eligible job
for the claiming node. These tests check that order on every path a job enters or re-enters the queue
(single and batch submission, retryable failure, expired lease, release, revocation, unblock,
decomposition), on every way it is claimed (single claim, group-commit batch, ``max=N``,
``complete?claim_next``, ``?kind=``, many shapes), and in the views that show it (listing, queue view,
``explain``'s count of jobs ahead).
"""

from __future__ import annotations

import random

import anyio
import psycopg
import pytest

from tests.helpers import bearer
from umbra.compute import batch_commands, claims, jobs
from umbra.compute.batch_commands import Command
from umbra.compute.claims import ChildRequest
from umbra.compute.credentials import revoke_node
from umbra.compute.explain import explain
from umbra.compute.sweeper import sweep_once
from umbra.events.types import Device
from umbra.projections import jobs as queue
from umbra.settings import load_settings

from .queue_support import CPU8, CPU64, GPU24, add_node, http_pair, set_clock, spec, submit
from .test_group_commit import group_commit, in_one_batch

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})
GPU48 = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=49152, vram_free_mb=48000, ram_total_mb=0,
               ram_free_mb=0, accelerators=("cuda",), throughput_factor=10.0)  # fmt: skip


async def claim(conn, org_id, node_id, *, lease_seconds=60, kinds=None):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=lease_seconds, kinds=kinds)


async def claim_all(conn, org_id, node_id, *, kinds=None, most=10_000) -> list:
    """Claim until nothing is left for the node; the claimed job ids in claim order."""
    taken = []
    while len(taken) < most and (got := await claim(conn, org_id, node_id, kinds=kinds)) is not None:
        taken.append(got.job_id)
    return taken


async def claim_order(conn, org_id, where: str = "TRUE", params: tuple = ()) -> list:
    """The organization's due queued jobs in (priority, seq) order, optionally filtered."""
    rows = await (await conn.execute(
        f"SELECT id FROM jobs WHERE organization_id = %s AND status = 'queued'"
        f" AND (not_before IS NULL OR not_before <= umbra_now()) AND ({where}) ORDER BY priority, seq",
        (org_id, *params),
    )).fetchall()  # fmt: skip
    return [r[0] for r in rows]


# -- submission -----------------------------------------------------------------------------------


async def test_singles_and_a_batch_are_claimed_by_priority_then_submission_order(conn, org):
    """Singles and the items of a batch interleave by (priority, submission order); a batch's items are in
    request order among themselves."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    a = await submit(conn, org_id, payload={"n": "a"})
    batch, _ = await jobs.submit(conn, org_id, [spec(priority=p, payload={"n": n}) for p, n in
                                               [(50, "b"), (100, "c"), (50, "d"), (100, "e")]], actor="t", batch=True)  # fmt: skip
    f = await submit(conn, org_id, priority=50, payload={"n": "f"})
    b, c, d, e = (row.id for row in batch)
    assert await claim_all(conn, org_id, node) == [b, d, f.id, a.id, c, e]


async def test_a_large_batch_keeps_request_order_among_equal_priorities(conn, org):
    """A batch large enough to be written by COPY still gives its items submission order in request order."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    rng = random.Random(7)
    prios = [rng.choice([1, 2, 3]) for _ in range(3000)]
    rows, _ = await jobs.submit(conn, org_id, [spec(priority=p, payload={"i": i}) for i, p in enumerate(prios)],
                                actor="t", batch=True)  # fmt: skip
    assert [r.seq for r in rows] == sorted(r.seq for r in rows)
    expected = [rows[i].id for i in sorted(range(len(rows)), key=lambda i: (prios[i], i))]
    assert await claim_order(conn, org_id) == expected
    assert await claim_all(conn, org_id, node, most=40) == expected[:40]


async def test_concurrent_single_submissions_are_claimed_in_commit_order(db_url, conn, org):
    """Many singles submitted concurrently, with batches among them: claim order equals the order of their
    jobs' submission in the log (commit order), per priority."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])

    async def submitter(i):
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            for k in range(10):
                if k % 3 == 0:
                    await jobs.submit(c, org_id, [spec(priority=(i + k + j) % 2, payload={"i": i, "k": k, "j": j})
                                                  for j in range(5)], actor="t", batch=True)  # fmt: skip
                else:
                    await submit(c, org_id, priority=(i + k) % 2, payload={"i": i, "k": k})

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(submitter, i)
    by_log = await (await conn.execute(
        "SELECT j.id FROM events e JOIN jobs j ON e.stream = 'job:' || j.id AND e.type = 'job.submitted'"
        " WHERE j.organization_id = %s ORDER BY j.priority, e.position", (org_id,))).fetchall()  # fmt: skip
    taken = await claim_all(conn, org_id, node)
    assert taken == [r[0] for r in by_log]


async def test_extreme_priorities_order_and_out_of_range_is_refused(client, conn, org):
    """Priorities at the 32-bit bounds, zero and negatives are ordered numerically (lowest first), over HTTP
    too; one past the bounds is refused 422 and writes nothing."""
    org_id, key = org
    values = [100, 2**31 - 1, -(2**31), 0, -1, 1, -(2**31), 2**31 - 1]
    made = []
    for p in values:
        r = await client.post("/v1/jobs", json={"kind": "echo", "priority": p}, headers=bearer(key))
        assert r.status_code == 201, r.text
        assert r.json()["priority"] == p
        made.append(r.json()["id"])
    for p in (2**31, -(2**31) - 1):
        r = await client.post("/v1/jobs", json={"kind": "echo", "priority": p}, headers=bearer(key))
        assert r.status_code == 422, r.text
    _, credential = await http_pair(client, key, "box")
    expected = [made[i] for i in sorted(range(len(values)), key=lambda i: (values[i], i))]
    got = []
    for _ in values:
        r = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
        assert r.status_code == 200, r.text
        got.append(r.json()["job"]["id"])
    assert got == expected
    count = (await (await conn.execute("SELECT count(*) FROM jobs WHERE organization_id = %s", (org_id,))).fetchone())[0]
    assert count == len(values)


# -- re-entering the queue ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["failure", "lease_expired", "released", "revoked", "unblocked"])
async def test_a_job_back_in_the_queue_keeps_its_original_place_among_equal_priorities(conn, org, path):
    """Every path back to the queue (a retryable failure after its backoff, an expired lease after its delay,
    a release, a revocation, an unblock) keeps the job's submission order: it is claimed before equal-priority
    jobs submitted after it, and after those submitted before it; the same on every path."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [GPU48, CPU64] if path == "unblocked" else [CPU64])
    before = await submit(conn, org_id, payload={"n": "before"}, priority=100)
    if path == "unblocked":
        # Nothing could run it yet: a 60 GB job behind the 48 GB GPU.
        job = await submit(conn, org_id, payload={"n": "job"}, requires={"vram_min_mb": 60000, "accelerators": ["cuda"]})
        assert job.status == "blocked"
    else:
        job = await submit(conn, org_id, payload={"n": "job"})
    after = [await submit(conn, org_id, payload={"n": f"after{i}"}) for i in range(3)]
    if path != "unblocked":
        # `before` runs and finishes; then the job itself is claimed.
        first = await claim(conn, org_id, node)
        assert first.job_id == before.id
        await claims.complete(conn, organization_id=org_id, node_id=node, job_id=before.id, attempt=first.attempt,
                              result={})  # fmt: skip
        held = await claim(conn, org_id, node, lease_seconds=30)
        assert held.job_id == job.id
    if path == "failure":
        back = await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=held.attempt,
                                 error="boom", retry=True)  # fmt: skip
        assert back.status == "queued"
        await set_clock(conn, 6)
    elif path == "lease_expired":
        await set_clock(conn, 31)
        assert (await sweep_once(conn, SETTINGS, reexamine=False)).leases_requeued == 1
        await set_clock(conn, 31 + SETTINGS.lease_expired_delay_seconds + 1)
    elif path == "released":
        assert await claims.release(conn, job.id, node, held.attempt)
    elif path == "revoked":
        other = await add_node(conn, org_id, "other", [CPU64])
        await revoke_node(conn, org_id, node, actor="admin")
        node = other
    elif path == "unblocked":
        await add_node(conn, org_id, "big", [GPU48])
        big = await add_node(conn, org_id, "bigger", [Device(kind="gpu_discrete", label="gpu0", vram_total_mb=81920,
                                                             vram_free_mb=80000, accelerators=("cuda",),
                                                             throughput_factor=10.0), CPU64])  # fmt: skip
        row = await queue.load(conn, job.id, org_id)
        assert row.status == "queued"
        node = big
    if path == "unblocked":
        assert await claim_all(conn, org_id, node) == [before.id, job.id, *(a.id for a in after)]
    else:
        assert await claim_all(conn, org_id, node) == [job.id, *(a.id for a in after)]


async def test_a_delayed_job_is_not_claimed_early_and_once_due_is_ordered_by_submission_not_due_time(conn, org):
    """A job whose not_before is in the future is not claimed, whatever its priority; once several are due,
    they are claimed by (priority, submission order), not by when they became due."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    a = await submit(conn, org_id, payload={"n": "a"}, priority=10, max_attempts=5)
    b = await submit(conn, org_id, payload={"n": "b"}, priority=10, max_attempts=5)

    async def fail(job_id):
        got = await claim(conn, org_id, node)
        assert got.job_id == job_id
        return await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job_id, attempt=got.attempt,
                                 error="x", retry=True)  # fmt: skip

    await fail(a.id)  # due at +5
    await set_clock(conn, 6)
    await fail(a.id)  # attempt 2: due at 6 + 10 = 16
    await fail(b.id)  # attempt 1: due at 6 + 5 = 11
    c = await submit(conn, org_id, payload={"n": "c"}, priority=10)  # due now
    low = await submit(conn, org_id, payload={"n": "low"}, priority=500)
    await set_clock(conn, 12)
    async with conn.transaction(force_rollback=True):  # a look without taking them
        assert await claim_all(conn, org_id, node) == [b.id, c.id, low.id]  # a (priority 10) not before +16
    await set_clock(conn, 17)
    assert await claim_all(conn, org_id, node) == [a.id, b.id, c.id, low.id]


async def test_children_inherit_the_parents_priority_and_take_their_place_by_submission(conn, org):
    """Children without a priority take the parent's; among other queued jobs they are ordered by that
    priority and then by when the decomposition made them (after jobs already queued), in the order given."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    parent = await submit(conn, org_id, payload={"n": "parent"}, priority=40)
    same = await submit(conn, org_id, payload={"n": "same"}, priority=40)
    worse = await submit(conn, org_id, payload={"n": "worse"}, priority=50)
    held = await claim(conn, org_id, node)
    assert held.job_id == parent.id
    kids = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=held.attempt,
                                     children=[ChildRequest(kind="echo", payload={"c": 1}),
                                               ChildRequest(kind="echo", payload={"c": 2}, priority=45),
                                               ChildRequest(kind="echo", payload={"c": 3}),
                                               ChildRequest(kind="echo", payload={"c": 4}, priority=-5)])  # fmt: skip
    assert [k.priority for k in kids] == [40, 45, 40, -5]
    later = await submit(conn, org_id, payload={"n": "later"}, priority=40)
    assert await claim_all(conn, org_id, node) == [kids[3].id, same.id, kids[0].id, kids[2].id, later.id, kids[1].id,
                                                   worse.id]  # fmt: skip


# -- ways of claiming ----------------------------------------------------------------------------


async def test_claim_max_n_and_claim_next_return_jobs_in_claim_order(client, conn, org):
    """``claim?max=N`` answers ``claims`` in claim order; ``complete?claim_next=true`` takes the next best
    job; ``/v1/agent/complete?claim_next=N`` answers ``next_claims`` in claim order."""
    org_id, key = org
    prios = [5, 3, 9, 3, 1, 7, 5, 2, 8, 3, 6, 4, 0]
    made = []
    r = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo", "priority": p, "payload": {"i": i}}
                                                           for i, p in enumerate(prios)]}, headers=bearer(key))  # fmt: skip
    assert r.status_code == 201, r.text
    made = [j["id"] for j in r.json()["jobs"]]
    expected = [made[i] for i in sorted(range(len(prios)), key=lambda i: (prios[i], i))]
    _, credential = await http_pair(client, key, "box")
    h = bearer(credential)
    r = await client.post("/v1/agent/claim", params={"wait": 0, "max": 4}, headers=h)
    assert r.status_code == 200, r.text
    first = [c["job"]["id"] for c in r.json()["claims"]]
    assert first == expected[:4] and r.json()["job"]["id"] == expected[0]
    attempts = {c["job"]["id"]: c["job"]["attempt"] for c in r.json()["claims"]}
    r = await client.post(f"/v1/agent/jobs/{first[0]}/complete", params={"claim_next": "true"},
                          json={"attempt": attempts[first[0]], "result": {}}, headers=h)  # fmt: skip
    assert r.status_code == 200, r.text
    nxt = r.json()["next_claim"]["job"]
    assert nxt["id"] == expected[4]
    r = await client.post("/v1/agent/complete", params={"claim_next": 5},
                          json={"results": [{"job_id": j, "attempt": attempts[j], "result": {}} for j in first[1:]]},
                          headers=h)  # fmt: skip
    assert r.status_code == 200, r.text
    assert [c["job"]["id"] for c in r.json()["next_claims"]] == expected[5:10]


async def test_a_kind_filtered_claim_keeps_claim_order_within_its_kinds(db_url, conn, org):
    """A claim naming kinds takes the jobs of those kinds in (priority, seq) order, single and batched."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    rng = random.Random(3)
    specs = [spec(rng.choice(["a", "b", "c"]), priority=rng.choice([1, 2, 3]), payload={"i": i},
                  requires=rng.choice([{}, {"ram_min_mb": 100}, {"ram_min_mb": 200}])) for i in range(120)]  # fmt: skip
    await jobs.submit(conn, org_id, specs, actor="t", batch=True)
    want = await claim_order(conn, org_id, "kind = ANY(%s)", (["a", "c"],))
    got = await claim_all(conn, org_id, node, kinds=frozenset({"a", "c"}), most=20)
    assert got == want[:20]
    async with group_commit(db_url) as (group, _, tg):
        [batch] = await in_one_batch(group, tg, [lambda: group.claim_many(
            node_id=node, organization_id=org_id, count=30, lease_seconds=60, stale_seconds=45, kinds=frozenset({"a", "c"}))])  # fmt: skip
    assert [c.job_id for c in batch] == want[20:50]


def _many_shape_specs(count_shapes: int, seed: int):
    rng = random.Random(seed)
    specs = []
    for i in range(count_shapes):
        for k in range(rng.randint(1, max(3, 1000 // count_shapes))):
            specs.append(spec("echo", requires={"ram_min_mb": 1 + i}, payload={"s": i, "k": k},
                              priority=rng.choice([-(2**31), -3, 0, 1, 2, 100, 2**31 - 1])))  # fmt: skip
    rng.shuffle(specs)
    return specs


@pytest.mark.parametrize("count_shapes", [70, 600])
async def test_many_shapes_still_yield_the_global_order_for_a_node_that_runs_them_all(db_url, conn, org, count_shapes):
    """More than MAX_SHAPES (and more than 500) distinct requirement shapes: a node that can run every one
    claims in the global (priority, seq) order, by the single claim and by a batch of several, also when the
    front of the queue is held by another transaction (the walk, then the shapes listed again)."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    await jobs.submit(conn, org_id, _many_shape_specs(count_shapes, count_shapes), actor="t", batch=True)
    # Statistics as the leading sweeper refreshes them (compute/statistics.py). Without them the shape-heads
    # statement walks jobs_claimable per shape (about 1 s a page at 600 shapes): slow, but the order holds.
    await conn.execute("ANALYZE jobs")
    want = await claim_order(conn, org_id)
    # The scan itself, whole.
    shapes = [s for (s,) in await (await claims.queued_shapes(conn, org_id)).fetchall()]
    assert len(shapes) > claims.MAX_SHAPES
    scan = claims.ClaimableScan(conn, org_id, shapes, lambda shape: True)
    seen = [row[0] async for page in scan.pages() for row in page]
    assert seen == want[: len(seen)] and len(seen) >= min(len(want), 200)
    # The first 250 rows held by another claimer: the next free ones, in order.
    async with await psycopg.AsyncConnection.connect(db_url) as other:
        await other.execute("SELECT 1 FROM jobs WHERE id = ANY(%s) FOR UPDATE", (want[:250],))
        got = await claim_all(conn, org_id, node, most=10)
        assert got == want[250:260]
        async with group_commit(db_url) as (group, _, tg):
            [batch] = await in_one_batch(group, tg, [lambda: group.claim_many(
                node_id=node, organization_id=org_id, count=40, lease_seconds=60, stale_seconds=45)])  # fmt: skip
        assert [c.job_id for c in batch] == want[260:300]
        await other.rollback()
    assert await claim_all(conn, org_id, node, most=30) == want[:30]


@pytest.mark.parametrize("other", ["alone", "batch"])
@pytest.mark.parametrize("differ_by", ["eligibility", "kinds"])
async def test_a_batch_claim_does_not_hold_back_rows_it_does_not_take(db_url, conn, org, differ_by, other):
    """A group-commit batch locks only rows it hands out: a row it read for one claimer but gave to nobody is
    not hidden from a concurrent claimer (the other batch in flight, or a claim run alone), who otherwise
    takes a later job while that one sits queued; an inversion that outlives the race, since the skipped
    job stays queued behind the later one once both commit. Claimers that differ by the devices of their
    node, or by the kinds their agents name, are enough."""
    org_id, _ = org
    if differ_by == "eligibility":
        x = await add_node(conn, org_id, "x", [CPU8])  # runs the small shape only
        y = await add_node(conn, org_id, "y", [CPU64])  # runs both shapes
        z = await add_node(conn, org_id, "z", [CPU8])  # a concurrent claimer of the small shape
        one, two = ("echo", {"ram_min_mb": 1000}), ("echo", {"ram_min_mb": 20000})
        x_kinds = z_kinds = None
    else:
        x, y, z = [await add_node(conn, org_id, name, [CPU64]) for name in "xyz"]
        one, two = ("alpha", {}), ("beta", {})
        x_kinds = z_kinds = frozenset({"alpha"})
    j1 = await submit(conn, org_id, one[0], payload={"n": 1}, requires=one[1])
    j2 = await submit(conn, org_id, two[0], payload={"n": 2}, requires=two[1])
    j3 = await submit(conn, org_id, one[0], payload={"n": 3}, requires=one[1])
    j4 = await submit(conn, org_id, one[0], payload={"n": 4}, requires=one[1])
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as batch_conn:
        commands = [Command(kind="claim", organization_id=org_id, node_id=x, kinds=x_kinds),
                    Command(kind="claim", organization_id=org_id, node_id=y)]  # fmt: skip
        staged, deferred = await batch_commands.stage(batch_conn, commands)  # its transaction stays open
        assert not deferred
        taken = {item.command.node_id: item.state.id for item in staged}
        assert taken == {x: j1.id, y: j2.id}
        # Meanwhile, another claimer of j3's shape: j3 is queued, and nobody is claiming it.
        with anyio.fail_after(10):
            if other == "alone":
                got = await claim(conn, org_id, z, kinds=z_kinds)
            else:  # the other batch in flight
                async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as second:
                    mine = Command(kind="claim", organization_id=org_id, node_id=z, kinds=z_kinds)
                    staged_z, _ = await batch_commands.stage(second, [mine])
                    await batch_commands.write(second, staged_z)
                    batch_commands.answer(staged_z)
                    got = mine.outcome
        await batch_commands.write(batch_conn, staged)
    statuses = dict(await (await conn.execute("SELECT id, status FROM jobs WHERE id = ANY(%s)",
                                              ([j3.id, j4.id],))).fetchall())  # fmt: skip
    assert got is not None and got.job_id == j3.id, (
        f"z took j4 while j3 (better, free, claimed by nobody) was locked by the batch; now j3 is "
        f"{statuses[j3.id]} behind j4 {statuses[j4.id]}")


async def test_two_nodes_in_one_batch_each_take_their_best_job(db_url, conn, org):
    """Claimers of different nodes in one batch: each takes the best job it could run, never a worse one
    while a better one it could run stays queued, whatever their arrival order."""
    org_id, _ = org
    gpu = await add_node(conn, org_id, "gpu", [GPU24, CPU64])
    cpu = await add_node(conn, org_id, "cpu", [CPU64])
    g1 = await submit(conn, org_id, payload={"n": "g1"}, priority=1, requires={"accelerators": ["cuda"], "vram_min_mb": 1000})
    c2 = await submit(conn, org_id, payload={"n": "c2"}, priority=2)
    c3 = await submit(conn, org_id, payload={"n": "c3"}, priority=3, requires={"ram_min_mb": 10})
    c4 = await submit(conn, org_id, payload={"n": "c4"}, priority=4)

    def one(node):
        return lambda: group.claim(node_id=node, organization_id=org_id, lease_seconds=60, stale_seconds=45)

    async with group_commit(db_url) as (group, _, tg):
        a, b = await in_one_batch(group, tg, [one(cpu), one(gpu)])
    assert (a.job_id, b.job_id) == (c2.id, g1.id)
    async with group_commit(db_url) as (group, _, tg):
        a, b = await in_one_batch(group, tg, [one(gpu), one(cpu)])
    assert (a.job_id, b.job_id) == (c3.id, c4.id)


async def test_concurrent_claimers_take_a_prefix_of_the_claim_order(client, conn, org):
    """Many agents of identical nodes claiming at once over HTTP (group commit): once they have all been
    answered, the jobs taken are exactly the first ones in claim order; none later ran while an earlier one
    stayed queued."""
    org_id, key = org
    rng = random.Random(11)
    creds = [(await http_pair(client, key, f"n{i}"))[1] for i in range(6)]
    r = await client.post("/v1/jobs/batch", json={"jobs": [
        {"kind": "echo", "priority": rng.choice([1, 2, 3]), "payload": {"i": i},
         "requires": rng.choice([{}, {"ram_min_mb": 100}, {"ram_min_mb": 200}])} for i in range(200)]},
        headers=bearer(key))  # fmt: skip
    assert r.status_code == 201
    want = await claim_order(conn, org_id)
    assert len(want) == 200
    got: list[str] = []

    async def agent(credential):
        for _ in range(10):
            resp = await client.post("/v1/agent/claim", params={"wait": 0, "max": 2}, headers=bearer(credential))
            assert resp.status_code == 200, resp.text
            got.extend(c["job"]["id"] for c in resp.json()["claims"])

    async with anyio.create_task_group() as tg:
        for credential in creds:
            tg.start_soon(agent, credential)
    assert len(got) == 120 and len(set(got)) == 120
    assert set(got) == {str(j) for j in want[:120]}


# -- views ---------------------------------------------------------------------------------------


async def test_listing_is_submission_order_and_the_queue_view_is_claim_order(client, conn, org):
    """``GET /v1/jobs?status=queued`` lists in submission order; the queue view lists queued jobs by
    priority and age, which for due jobs is the claim order."""
    org_id, key = org
    _, credential = await http_pair(client, key, "box")
    rng = random.Random(5)
    made = []
    for i in range(30):
        r = await client.post("/v1/jobs", json={"kind": "echo", "priority": rng.choice([-1, 0, 7, 100]),
                                               "payload": {"i": i}}, headers=bearer(key))  # fmt: skip
        made.append(r.json()["id"])
    r = await client.get("/v1/jobs", params={"status": "queued"}, headers=bearer(key))
    assert [j["id"] for j in r.json()["jobs"]] == made
    view = await client.get("/v1/projections/queue", headers=bearer(key))
    want = [str(j) for j in await claim_order(conn, org_id)]
    assert len(want) == 30
    assert [j["id"] for j in view.json()["jobs"] if j["status"] == "queued"] == want
    got = []
    for _ in range(30):
        r = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
        got.append(r.json()["job"]["id"])
    assert got == want


async def test_explain_counts_ahead_exactly_the_jobs_claimed_before_it(conn, org):
    """``explain``'s jobs-ahead count of a queued job equals the number of jobs its only node claims before
    it: jobs behind it, delayed ones, and ones the node cannot run are not counted."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU8])
    await add_node(conn, org_id, "g", [GPU24], online=False)  # a GPU box, offline: its jobs stay queued
    ahead_runnable = [await submit(conn, org_id, priority=p, payload={"i": i}) for i, p in enumerate([1, 5, 5])]
    gpu_ahead = await submit(conn, org_id, priority=1, requires={"accelerators": ["cuda"], "vram_min_mb": 100})
    assert gpu_ahead.status == "queued"
    delayed = await submit(conn, org_id, priority=1, payload={"delayed": True})
    await conn.execute("UPDATE jobs SET not_before = umbra_now() + interval '1 hour' WHERE id = %s", (delayed.id,))
    target = await submit(conn, org_id, priority=5, payload={"target": True})
    await submit(conn, org_id, priority=5, payload={"behind": True})
    await submit(conn, org_id, priority=0, requires={"ram_min_mb": 7000}, payload={"too big for n": True})
    explained = await explain(conn, org_id, target.id)
    taken = await claim_all(conn, org_id, node)
    assert explained.ahead == taken.index(target.id)
    assert explained.ahead == len(ahead_runnable)


async def test_explain_ahead_judges_the_node_as_its_claim_does_with_its_running_jobs(conn, org):
    """``explain`` judges a queued job as a claim would (API.md: memory promised to running jobs included),
    so its jobs-ahead count leaves out a job ahead that no longer fits beside the node's running work and
    equals the number of jobs the node really claims before it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    hog = await submit(conn, org_id, priority=0, requires={"ram_min_mb": 50000}, payload={"hog": True})
    assert (await claim(conn, org_id, node)).job_id == hog.id
    await submit(conn, org_id, priority=1, requires={"ram_min_mb": 20000}, payload={"big": True})  # does not fit now
    small = await submit(conn, org_id, priority=1, payload={"small": True})
    target = await submit(conn, org_id, priority=5, payload={"target": True})
    explained = await explain(conn, org_id, target.id)
    taken = await claim_all(conn, org_id, node)
    assert taken == [small.id, target.id]
    assert explained.ahead == taken.index(target.id)


async def test_http_children_default_to_the_parents_priority_and_zero_stays_zero(client, conn, org):
    """Children made over HTTP take the parent's priority unless they give one (0 included, never turned into
    the default), and are claimed in that order with the rest of the queue."""
    org_id, key = org
    _, credential = await http_pair(client, key, "box")
    h = bearer(credential)
    parent = (await client.post("/v1/jobs", json={"kind": "split", "priority": 7}, headers=bearer(key))).json()
    other = (await client.post("/v1/jobs", json={"kind": "echo", "priority": 7}, headers=bearer(key))).json()
    held = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=h)).json()["job"]
    assert held["id"] == parent["id"]
    r = await client.post(f"/v1/agent/jobs/{parent['id']}/children", headers=h, json={
        "attempt": held["attempt"], "children": [{"kind": "echo"}, {"kind": "echo", "priority": 0}, {"kind": "echo"}]})
    assert r.status_code == 201, r.text
    kids = r.json()["children"]
    assert [k["priority"] for k in kids] == [7, 0, 7]
    got = [(await client.post("/v1/agent/claim", params={"wait": 0}, headers=h)).json()["job"]["id"] for _ in range(4)]
    assert got == [kids[1]["id"], other["id"], kids[0]["id"], kids[2]["id"]]


async def test_explain_ahead_counts_only_kinds_the_able_agents_take_and_matches_their_claims(conn, org):
    """With agents that report the kinds they take, ``explain``'s jobs-ahead count leaves out jobs of other
    kinds and equals the number of jobs those agents' kind-filtered claims take before the job."""
    from umbra.compute.heartbeat import heartbeat
    from umbra.domain.heartbeat import HeartbeatReport

    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    await heartbeat(conn, org_id, node, HeartbeatReport(devices=(CPU64,), kinds=("echo",)), event_interval_seconds=300)
    for i, (kind, p) in enumerate([("render", 1), ("echo", 2), ("render", 2), ("echo", 5), ("echo", 9)]):
        await submit(conn, org_id, kind, priority=p, payload={"i": i})
    target = await submit(conn, org_id, "echo", priority=5, payload={"target": True})
    explained = await explain(conn, org_id, target.id)
    taken = await claim_all(conn, org_id, node, kinds=frozenset({"echo"}))
    assert explained.ahead == taken.index(target.id) == 2


async def test_a_parked_long_poll_takes_the_best_job_of_a_batch_that_wakes_it(client, conn, org):
    """A long-poll parked on an empty queue, woken by a batch submission, is answered the batch's best job
    (lowest priority, then first in request order), not its first item."""
    org_id, key = org
    _, credential = await http_pair(client, key, "box")
    answer: dict = {}

    async def poll():
        r = await client.post("/v1/agent/claim", params={"wait": 10}, headers=bearer(credential))
        answer["r"] = r

    async with anyio.create_task_group() as tg:
        tg.start_soon(poll)
        await anyio.sleep(0.5)
        r = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo", "priority": p, "payload": {"i": i}}
                                                               for i, p in enumerate([9, 4, 1, 1, 7])]},
                              headers=bearer(key))  # fmt: skip
        made = [j["id"] for j in r.json()["jobs"]]
    assert answer["r"].status_code == 200, answer["r"].text
    assert answer["r"].json()["job"]["id"] == made[2]


async def test_a_row_a_batch_holds_without_taking_it_is_not_reported_as_taken(db_url, conn, org):
    """A claimer of the other batch in flight that finds its only job locked by a batch that will not take it
    is not told that everything it could run was taken by others (``nothing_left``, which ends the wake
    chain of a long-poll): that job is free once the batch commits, which sends no wake for it."""
    org_id, _ = org
    x = await add_node(conn, org_id, "x", [CPU8])  # runs the small shape only
    y = await add_node(conn, org_id, "y", [CPU64])  # runs both shapes
    z = await add_node(conn, org_id, "z", [CPU64])  # runs both shapes
    small, big = {"ram_min_mb": 1000}, {"ram_min_mb": 20000}
    j1 = await submit(conn, org_id, payload={"n": 1}, requires=small)
    j2 = await submit(conn, org_id, payload={"n": 2}, requires=big)
    j3 = await submit(conn, org_id, payload={"n": 3}, requires=small)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as batch_conn:
        staged, _ = await batch_commands.stage(batch_conn, [Command(kind="claim", organization_id=org_id, node_id=x),
                                                            Command(kind="claim", organization_id=org_id, node_id=y)])  # fmt: skip
        assert {item.state.id for item in staged} == {j1.id, j2.id}
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as second:
            mine = Command(kind="claim", organization_id=org_id, node_id=z)
            staged_z, _ = await batch_commands.stage(second, [mine])
            await batch_commands.write(second, staged_z)
            batch_commands.answer(staged_z)
        await batch_commands.write(batch_conn, staged)
    status = (await (await conn.execute("SELECT status FROM jobs WHERE id = %s", (j3.id,))).fetchone())[0]
    assert mine.outcome is not None or not mine.nothing_left, (
        f"z was told nothing is left; j3 is {status} and free, and nothing will wake z for it")


@pytest.mark.parametrize("shapes", [1, 2], ids=["one-shape", "two-shapes"])
@pytest.mark.parametrize("path", ["single", "batch"])
async def test_a_claim_holds_no_row_but_the_one_it_takes(db_url, conn, org, shapes, path):
    """While a claim's transaction is open, the only queued row it holds is the one it takes (one claimer, one
    job): every other queued row stays claimable by a concurrent claimer, so none of them is skipped."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    requires = [{}, {"ram_min_mb": 10}][:shapes]
    made = [(await submit(conn, org_id, payload={"i": i}, requires=requires[i % shapes])).id for i in range(20)]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as mine:
        if path == "single":
            await mine.execute("BEGIN")
            taken = (await claim(mine, org_id, node)).job_id
        else:
            staged, _ = await batch_commands.stage(mine, [Command(kind="claim", organization_id=org_id, node_id=node)])
            [taken] = [item.state.id for item in staged]
        async with await psycopg.AsyncConnection.connect(db_url) as probe:
            free = [r[0] for r in await (await probe.execute(
                "SELECT id FROM jobs WHERE organization_id = %s AND status = 'queued' ORDER BY seq FOR UPDATE SKIP LOCKED",
                (org_id,))).fetchall()]  # fmt: skip
            await probe.rollback()
        await mine.execute("ROLLBACK")
    assert taken == made[0]
    assert free == made[1:]
