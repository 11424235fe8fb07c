"""Claims that name the job kinds they take (``?kind=``): an agent claims only what it has handlers for.

A queue shape is a job's kind and its requirements together (migrations/0029),
so a claimer that takes some kinds never reads the rows of the others.
"""

from __future__ import annotations

import random
import string

import anyio
import httpx
import msgspec
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, until
from umbra.compute import claims, jobs
from umbra.compute.jobs import MAX_REQUIRES_NAMED
from umbra.events.types import Requirements
from umbra.projections import jobs as queue
from umbra.projections.verify import verify

from .queue_support import CPU64, GPU24, add_node, spec, submit
from .test_group_commit import group_commit, in_one_batch
from .test_longpoll import online_node

pytestmark = pytest.mark.anyio


async def claim(conn, org_id, node_id, kinds=None):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60,
                              kinds=None if kinds is None else frozenset(kinds))  # fmt: skip


async def test_a_claim_naming_kinds_takes_the_first_job_of_those_kinds_and_leaves_the_rest_queued(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    render = await submit(conn, org_id, "render", priority=1)
    echo = await submit(conn, org_id, "echo", priority=2)
    later_echo = await submit(conn, org_id, "echo", priority=3)
    assert await claim(conn, org_id, node, {"train"}) is None
    assert (await claim(conn, org_id, node, {"echo", "train"})).job_id == echo.id
    assert (await claim(conn, org_id, node, {"echo"})).job_id == later_echo.id
    assert await claim(conn, org_id, node, {"echo"}) is None
    assert (await queue.load(conn, render.id, org_id)).status == "queued"
    assert (await claim(conn, org_id, node)).job_id == render.id  # naming no kinds takes every kind
    assert await verify(conn) == []


async def test_the_kind_filter_and_eligibility_both_apply(conn, org):
    org_id, _ = org
    cpu_node = await add_node(conn, org_id, "cpu-box", [CPU64])
    await add_node(conn, org_id, "gpu-box", [GPU24])  # so the GPU job waits queued, not blocked
    gpu_job = await submit(conn, org_id, "render", priority=1, requires={"accelerators": ["cuda"]})
    cpu_render = await submit(conn, org_id, "render", priority=2)
    assert (await claim(conn, org_id, cpu_node, {"render"})).job_id == cpu_render.id
    assert await claim(conn, org_id, cpu_node, {"render"}) is None
    assert (await queue.load(conn, gpu_job.id, org_id)).status == "queued"


async def test_queued_shapes_are_kinds_with_their_requirements(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    for kind, requires in (("echo", {}), ("echo", {}), ("echo", {"ram_min_mb": 100}), ("render", {})):
        await submit(conn, org_id, kind, requires=requires)
    listed = [shape for (shape,) in await (await claims.queued_shapes(conn, org_id)).fetchall()]
    decoded = [claims.decode_shape(shape) for shape in listed]
    assert len(decoded) == 3 and all(pair in decoded for pair in (
        ("echo", Requirements()), ("echo", Requirements(ram_min_mb=100)), ("render", Requirements())))


async def test_a_kind_behind_more_queued_shapes_than_are_judged_is_still_found(conn, org):
    """Over MAX_SHAPES shapes, the claim walks the queue in order, skipping shapes it will not take in SQL."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    await jobs.submit(conn, org_id, [spec(f"kind-{i}", priority=1) for i in range(claims.MAX_SHAPES + 6)],
                      actor="t", batch=True)  # fmt: skip
    wanted = await submit(conn, org_id, "wanted", priority=2)
    assert (await claim(conn, org_id, node, {"wanted", "absent"})).job_id == wanted.id
    assert (await claim(conn, org_id, node, {"kind-3"})).job.get("kind") == "kind-3"


def _longest_shape(rng: random.Random) -> tuple[str, list[str]]:
    """A 200-character kind of 3-byte characters and distinct 2-character trust domains filling the rest of
    the shared budget ("local", the node's, among them): random, so nothing compresses the index entry."""
    kind = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(200))
    names, used = ["local"], len(kind.encode()) + 5
    while used + 2 <= MAX_REQUIRES_NAMED:
        name = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(2))
        if name not in names:
            names.append(name)
            used += 2
    return kind, names


async def test_the_kind_and_the_names_in_requires_share_one_budget_so_an_accepted_job_can_always_be_queued(conn, org):
    """Both key jobs_by_shape, whose entries PostgreSQL caps at about 2.7 kB: a job over it could be stored
    only while blocked (blocked rows are not in the index) and would fail every pairing that tried to unblock it."""
    org_id, _ = org
    kind, names = _longest_shape(random.Random(7))
    blocked = await submit(conn, org_id, kind, requires={"trust_domains": names})
    assert (await queue.load(conn, blocked.id, org_id)).status == "blocked"  # no node yet
    await add_node(conn, org_id, "box", [CPU64])  # its re-examination queues the job
    assert (await queue.load(conn, blocked.id, org_id)).status == "queued"
    with pytest.raises(msgspec.ValidationError, match=r"the kind and the names in requires \(models, trust_domains, accelerators\) take 1501 bytes"):
        spec(kind, requires={"trust_domains": [*names, "!!"]})
    with pytest.raises(msgspec.ValidationError, match="1501 bytes"):
        msgspec.convert({"kind": kind, "requires": {"trust_domains": [*names, "!!"]}}, claims.ChildRequest)


@pytest.mark.parametrize("path", ["single", "batch"])
async def test_over_max_shapes_a_claim_naming_a_kind_finds_its_job_behind_pages_of_other_kinds(db_url, conn, org, path):
    """The bounded walk of the queue in claim order skips the kinds no claimer names in SQL: otherwise 21 kinds
    of 100 jobs each in front fill its 20 pages and the claim finds nothing while its job waits."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    ahead = [spec(f"busy-{k:02d}", priority=1) for k in range(claims.MAX_SCAN_PAGES + 1) for _ in range(claims.SCAN_PAGE)]
    await jobs.submit(conn, org_id, ahead, actor="t", batch=True)
    wanted = await submit(conn, org_id, "wanted", priority=2)
    await jobs.submit(conn, org_id, [spec(f"tail-{i:02d}", priority=3) for i in range(claims.MAX_SHAPES)],
                      actor="t", batch=True)  # fmt: skip
    if path == "single":
        got = await claim(conn, org_id, node, {"wanted"})
    else:
        async with group_commit(db_url) as (group, _, tg):
            [got] = await in_one_batch(group, tg, [lambda: group.claim(
                node_id=node, organization_id=org_id, lease_seconds=60, stale_seconds=45, kinds=frozenset({"wanted"}))])
    assert got is not None and got.job_id == wanted.id


async def test_claimers_in_one_batch_each_take_only_their_kinds(db_url, conn, org):
    org_id, _ = org
    a, b, c = [await add_node(conn, org_id, name, [CPU64]) for name in ("a", "b", "c")]
    first = await submit(conn, org_id, "alpha", priority=1)
    second = await submit(conn, org_id, "beta", priority=2)
    third = await submit(conn, org_id, "alpha", priority=3)
    async with group_commit(db_url) as (group, _, tg):
        calls = [lambda n=n, k=k: group.claim(node_id=n, organization_id=org_id, lease_seconds=60, stale_seconds=45,
                                              kinds=k)
                 for n, k in ((a, frozenset({"beta"})), (b, None), (c, frozenset({"alpha"})))]  # fmt: skip
        got = await in_one_batch(group, tg, calls)
    assert [r.job_id for r in got] == [second.id, first.id, third.id]
    assert group.batches == 1 and group.fallbacks == 0
    assert await verify(conn) == []


async def test_two_claims_of_one_node_in_one_batch_keep_their_own_kinds(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    alpha = await submit(conn, org_id, "alpha", priority=1)
    beta = await submit(conn, org_id, "beta", priority=2)
    async with group_commit(db_url) as (group, _, tg):
        calls = [lambda k=k: group.claim(node_id=node, organization_id=org_id, lease_seconds=60, stale_seconds=45,
                                         kinds=frozenset({k}))
                 for k in ("beta", "alpha")]  # fmt: skip
        got = await in_one_batch(group, tg, calls)
    assert [r.job_id for r in got] == [beta.id, alpha.id]


async def test_a_claimer_that_takes_none_of_the_queued_kinds_passes_the_wake_on(db_url, conn, org):
    """Nothing it may take is not "nothing queued": another waiter may take the job, so the long-poll's
    wake token must go on (``None``), not end the chain (``empty``)."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    empty = object()
    async with group_commit(db_url) as (group, _, tg):
        await tg.start(group.run)

        async def ask(kinds):
            return await group.claim(node_id=node, organization_id=org_id, lease_seconds=60, stale_seconds=45,
                                     empty=empty, kinds=kinds)  # fmt: skip

        assert await ask(frozenset({"alpha"})) is empty
        beta = await submit(conn, org_id, "beta")
        assert await ask(frozenset({"alpha"})) is None
        assert (await ask(frozenset({"beta"}))).job_id == beta.id


async def test_a_completion_claims_next_only_a_job_of_the_named_kinds(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    held = await submit(conn, org_id, "alpha", priority=1)
    other = await submit(conn, org_id, "beta", priority=2)
    following = await submit(conn, org_id, "alpha", priority=3)
    assert (await claim(conn, org_id, node, {"alpha"})).job_id == held.id
    async with group_commit(db_url) as (group, _, tg):
        await tg.start(group.run)
        row, claimed = await group.complete_and_claim(organization_id=org_id, node_id=node, job_id=held.id, attempt=1,
                                                      result={}, lease_seconds=60, stale_seconds=45,
                                                      kinds=frozenset({"alpha"}))  # fmt: skip
    assert row.status == "complete" and claimed.job_id == following.id
    assert (await queue.load(conn, other.id, org_id)).status == "queued"


@pytest.fixture
def server(db_url):
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30") as live:
        yield live


async def test_a_long_poll_naming_kinds_is_answered_only_by_a_job_of_one_of_them(conn, org, server):
    org_id, _ = org
    _, renders = await online_node(conn, org_id, "render-box")
    _, echoes = await online_node(conn, org_id, "echo-box")
    hub = server.app.state.waiters
    results: dict[str, httpx.Response] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def poll(name, credential, wait):
            results[name] = await client.post("/v1/agent/claim", params={"wait": wait, "kind": [name, "other"]},
                                              headers=bearer(credential))  # fmt: skip

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll, "render", renders, 3)
            await until(lambda: hub.waiting(org_id) == 1)  # the render box is the oldest waiter
            tg.start_soon(poll, "echo", echoes, 30)
            await until(lambda: hub.waiting(org_id) == 2)
            job = await submit(conn, org_id, "echo")
            await until(lambda: "echo" in results, timeout=10)
            assert "render" not in results
    assert results["echo"].status_code == 200 and results["echo"].json()["job"]["id"] == str(job.id)
    assert results["render"].status_code == 204


@pytest.mark.parametrize("path,also", [("/v1/agent/claim", {"wait": 0}), ("/v1/agent/complete", {"claim_next": 1}),
                                       ("/v1/agent/complete", {})])  # a malformed parameter is refused, used or not
@pytest.mark.parametrize("kinds,why", [([""], "1 to 200"), (["x" * 201], "1 to 200"), (["echo", " \t"], "blank"),
                                       ([f"k{i}" for i in range(101)], "at most 100")])  # fmt: skip
async def test_a_bad_kind_is_refused_naming_the_parameter_and_claims_nothing(conn, org, server, path, also, kinds, why):
    org_id, _ = org
    _, credential = await online_node(conn, org_id, "box")
    job = await submit(conn, org_id, "echo")
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        body = {"results": [{"job_id": str(job.id), "attempt": 1}]} if "complete" in path else None
        answer = await client.post(path, params={**also, "kind": kinds}, json=body, headers=bearer(credential))
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"] == "invalid_request" and answer.json()["field"] == "kind" and why in answer.json()["message"]
    assert (await queue.load(conn, job.id, org_id)).status == "queued"


async def test_a_batch_completion_claims_next_only_the_named_kinds_over_http(conn, org, server):
    org_id, _ = org
    node, credential = await online_node(conn, org_id, "box", devices=(CPU64, GPU24))
    held = await submit(conn, org_id, "alpha", priority=1)
    await submit(conn, org_id, "beta", priority=2)
    nexts = [await submit(conn, org_id, "alpha", priority=3 + i) for i in range(2)]
    assert (await claim(conn, org_id, node, {"alpha"})).job_id == held.id
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        answer = await client.post("/v1/agent/complete", params={"claim_next": 5, "kind": "alpha"},
                                   json={"results": [{"job_id": str(held.id), "attempt": 1, "result": {}}]},
                                   headers=bearer(credential))  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert [c["job"]["id"] for c in answer.json()["next_claims"]] == [str(j.id) for j in nexts]
