"""Which clock decides: leases, retry backoff, the blocked timeout and node staleness at their exact
boundaries, all by the database's clock; and the lease an agent is told it has left, by the server's own.

Exact boundaries are tested by pinning ``umbra_now()`` inside one outer transaction (``now()`` is the
transaction's start, so an offset computed from it in that transaction makes ``umbra_now()`` equal the
target exactly); the commands' own transactions then run as savepoints of it.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import anyio
import httpx
import psycopg
import pytest
from psycopg import conninfo, sql

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually
from umbra.compute import claims
from umbra.compute.nodes import mark_stale_page, node_view
from umbra.compute.sweeper import sweep_once
from umbra.events import store
from umbra.projections import jobs as queue

from .queue_support import CPU8, CPU64, add_node, beat, http_pair, set_clock, submit
from .test_agent import CPU as AGENT_CPU
from .test_agent import job_events, job_in, running_agent
from .test_agent import pair as pair_agent
from .test_agent import submit as submit_over_http
from .test_sweeper import SETTINGS, claim

pytestmark = pytest.mark.anyio

#: The header of a claim's or a renewal's answer saying the seconds of lease it leaves.
LEASE_LEFT = "Umbra-Lease-Seconds"
#: Beside it: the seconds the server held the request before measuring it.
HELD = "Umbra-Held-Seconds"


async def pin_clock(conn, at: datetime) -> None:
    """Inside a transaction: make ``umbra_now()`` equal ``at`` exactly, for the rest of the transaction."""
    await conn.execute("SELECT set_config('umbra.clock_offset', (%s::timestamptz - now())::text, true)", (at,))
    assert (await (await conn.execute("SELECT umbra_now()")).fetchone())[0] == at


# -- leases ---------------------------------------------------------------------------------------


async def test_a_lease_is_expired_only_strictly_after_its_expiry_and_the_sweeper_agrees_with_fencing(conn, org):
    """At exactly ``lease_expires_at`` the lease still holds (the sweeper leaves it, a renewal is accepted
    and extends it from the database clock); one microsecond past it, unrenewed, the sweeper requeues it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, node, lease_seconds=30)
    expiry = got.row.lease_expires_at
    async with conn.transaction():
        await pin_clock(conn, expiry)
        assert (await sweep_once(conn, SETTINGS, reexamine=False)).leases_requeued == 0
        renewed = await claims.renew(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=got.attempt,
                                     lease_seconds=30)  # fmt: skip
        assert renewed.lease_expires_at == expiry + timedelta(seconds=30)
    second = renewed.lease_expires_at
    async with conn.transaction():
        await pin_clock(conn, second)
        assert (await sweep_once(conn, SETTINGS, reexamine=False)).leases_requeued == 0
    async with conn.transaction():
        await pin_clock(conn, second + timedelta(microseconds=1))
        report = await sweep_once(conn, SETTINGS, reexamine=False)
        assert report.leases_requeued == 1
    row = await queue.load(conn, job.id, org_id)
    assert (row.status, row.lease_owner, row.attempt) == ("queued", None, 1)


async def test_a_renewal_of_a_lapsed_but_unswept_lease_is_accepted_and_the_sweeper_then_leaves_it(conn, org):
    """Past expiry but before the sweep, nobody else holds the job: the holder's renewal (and later
    completion) lands, the lease counts from the renewal's database time, and the sweep finds nothing."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, node, lease_seconds=10)
    await set_clock(conn, 25)  # 15 s past the lease; no sweep ran
    renewed = await claims.renew(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=got.attempt,
                                 lease_seconds=10)  # fmt: skip
    [*_, last] = await store.read_stream(conn, store.job_stream(job.id))
    assert last.type == "job.lease_renewed" and renewed.lease_expires_at == last.recorded_at + timedelta(seconds=10)
    assert (await sweep_once(conn, SETTINGS, reexamine=False)).leases_requeued == 0
    await set_clock(conn, 34)
    assert (await sweep_once(conn, SETTINGS, reexamine=False)).leases_requeued == 0
    done = await claims.complete(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=got.attempt, result=1)
    assert done.status == "complete"


async def test_after_the_sweep_the_old_holder_is_refused_even_before_anyone_reclaims(conn, org):
    """Once the sweeper requeued the job (not yet claimed again), the old holder's renewal, completion and
    failure are refused 409 and change nothing."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, node, lease_seconds=5)
    await set_clock(conn, 6)
    assert (await sweep_once(conn, SETTINGS, reexamine=False)).leases_requeued == 1
    head, row = await store.head_position(conn), await queue.load(conn, job.id, org_id)
    common = {"organization_id": org_id, "node_id": node, "job_id": job.id, "attempt": got.attempt}
    for call in (claims.renew(conn, lease_seconds=5, **common), claims.complete(conn, result=1, **common),
                 claims.fail(conn, error="x", retry=True, **common)):  # fmt: skip
        with pytest.raises(Exception) as caught:
            await call
        assert getattr(caught.value, "code", None) == "job_not_claimed_by_this_node"
    assert await store.head_position(conn) == head and await queue.load(conn, job.id, org_id) == row


async def test_lapsed_lease_renewed_and_completed_over_http_before_the_sweeper_runs(db_url, org):
    """Through the group commit too: a 1 s lease left 1.5 s without renewal (the sweeper's next tick is an
    hour away) is renewed 200, and the completion lands; nobody else could have it meanwhile."""
    _, key = org
    env = {"UMBRA_LEASE_SECONDS": "1", "UMBRA_SWEEP_INTERVAL_SECONDS": "3600"}
    with LiveServer(db_url, **env) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            node = bearer((await http_pair(client, key))[1])
            job = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()
            got = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)
            assert got.status_code == 200, got.text
            attempt = got.json()["job"]["attempt"]
            await anyio.sleep(1.5)
            renewed = await client.post(f"/v1/agent/jobs/{job['id']}/renew", json={"attempt": attempt}, headers=node)
            assert renewed.status_code == 200, renewed.text
            granted, extended = (datetime.fromisoformat(r.json()["lease_expires_at"]) for r in (got, renewed))
            assert extended > granted + timedelta(seconds=1)
            done = await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": attempt, "result": 1},
                                     headers=node)  # fmt: skip
            assert done.status_code == 200 and done.json()["status"] == "complete", done.text


# -- backoff --------------------------------------------------------------------------------------


async def test_one_hundred_retryable_failures_back_off_by_the_formula_from_the_database_clock(conn, org):
    """max_attempts=100: each retryable failure requeues with not_before = its event's recorded_at +
    min(5·2^(a−1), 600) s, the job is not claimable a microsecond before, and the 100th failure fails it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id, max_attempts=100)
    offset = 0.0
    for attempt in range(1, 101):
        got = await claim(conn, org_id, node)
        assert got is not None and got.attempt == attempt
        failed = await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=attempt,
                                   error=f"e{attempt}", retry=True)  # fmt: skip
        if attempt == 100:
            assert (failed.status, failed.error) == ("failed", "e100")
            [*_, last] = await store.read_stream(conn, store.job_stream(job.id))
            assert last.type == "job.failed" and last.event.reason == "attempts_exhausted"
            break
        [*_, last] = await store.read_stream(conn, store.job_stream(job.id))
        assert last.type == "job.requeued"
        assert failed.not_before == last.recorded_at + timedelta(seconds=min(5 * 2 ** (attempt - 1), 600))
        if attempt in (1, 8, 99):
            async with conn.transaction():
                await pin_clock(conn, failed.not_before - timedelta(microseconds=1))
                await beat(conn, org_id, node, [CPU64])
                assert await claim(conn, org_id, node) is None
                await pin_clock(conn, failed.not_before)
                assert await claim(conn, org_id, node) is not None
                raise psycopg.Rollback()
        offset += min(5 * 2 ** (attempt - 1), 600) + 1
        await set_clock(conn, offset)
        await beat(conn, org_id, node, [CPU64])


# -- blocked timeout ------------------------------------------------------------------------------


async def test_a_blocked_job_whose_shortfall_changes_still_times_out_from_when_it_was_first_blocked(conn, org):
    """A new blocking reason keeps ``blocked_at``; the timeout counts from the first block, and the failure
    carries the current reason."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id, requires={"ram_min_mb": 100_000})
    assert job.status == "blocked"
    first_reason, blocked_at = job.blocked_reason, job.blocked_at
    settings = dataclasses.replace(SETTINGS, blocked_timeout_seconds=600)
    await set_clock(conn, 300)
    await beat(conn, org_id, node, [CPU8])  # the largest RAM shrinks: a new shortfall
    row = await queue.load(conn, job.id, org_id)
    assert row.status == "blocked" and row.blocked_at == blocked_at
    assert row.blocked_reason != first_reason, "the reason should follow the fleet"
    async with conn.transaction():
        await pin_clock(conn, blocked_at + timedelta(seconds=600) - timedelta(microseconds=1))
        assert (await sweep_once(conn, settings, reexamine=False)).blocked_failed == 0
    await set_clock(conn, 601)
    assert (await sweep_once(conn, settings, reexamine=False)).blocked_failed == 1
    failed = await queue.load(conn, job.id, org_id)
    assert (failed.status, failed.error) == ("failed", row.blocked_reason)


# -- node staleness -------------------------------------------------------------------------------


async def test_a_node_is_online_at_exactly_the_stale_threshold_and_offline_just_past_it_for_reads_claims_and_sweeper(conn, org):
    """Reads, claims and the sweeper share one threshold: silence of exactly 45 s is online (the sweeper
    leaves it, a claim may take work); 45 s + 1 µs is offline everywhere, and the sweeper records it."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    await submit(conn, org_id)
    [(seen,)] = await (await conn.execute("SELECT last_seen_at FROM node_liveness WHERE node_id = %s", (node,))).fetchall()
    threshold = seen + timedelta(seconds=SETTINGS.heartbeat_stale_seconds)
    async with conn.transaction():
        await pin_clock(conn, threshold)
        assert (await node_view(conn, node, organization_id=org_id)).status == "online"
        assert (await mark_stale_page(conn, stale_seconds=SETTINGS.heartbeat_stale_seconds))[0] == []
        async with conn.transaction():
            assert await claim(conn, org_id, node) is not None
            raise psycopg.Rollback()
    async with conn.transaction():
        await pin_clock(conn, threshold + timedelta(microseconds=1))
        assert (await node_view(conn, node, organization_id=org_id)).status == "offline"
        assert await claim(conn, org_id, node) is None
        assert (await mark_stale_page(conn, stale_seconds=SETTINGS.heartbeat_stale_seconds))[0] == [node]
    types = [r.type for r in await store.read_stream(conn, store.node_stream(node))]
    assert types[-1] == "node.went_offline"


# -- the lease left, as the agent is told it ------------------------------------------------------


async def test_every_answer_that_grants_a_lease_says_the_lease_left_and_no_other_does(client, live_server, org):
    """A claim's answer, a completion's that claims the next job (``claim_next=true``), a report's that
    claims (``claim_next=2``) and a renewal's each carry ``Umbra-Lease-Seconds``: the lease left when the
    answer was sent, between 0 and the configured lease and close to it. An answer that claims nothing
    carries none. The claim's body stays the contract's: exactly job, lease_expires_at and placement."""
    _, key = org
    lease = live_server.settings.lease_seconds
    node = bearer((await http_pair(client, key))[1])
    for i in range(4):
        submitted = await client.post("/v1/jobs", json={"kind": "echo", "payload": {"i": i}}, headers=bearer(key))
        assert submitted.status_code == 201, submitted.text
    claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)
    assert claimed.status_code == 200, claimed.text
    assert set(claimed.json()) == {"job", "lease_expires_at", "placement"}
    first = claimed.json()["job"]["id"]
    renewed = await client.post(f"/v1/agent/jobs/{first}/renew", json={"attempt": 1}, headers=node)
    chained = await client.post(f"/v1/agent/jobs/{first}/complete", params={"claim_next": "true"}, json={"attempt": 1},
                                headers=node)  # fmt: skip
    second = chained.json()["next_claim"]["job"]["id"]
    reported = await client.post("/v1/agent/complete", params={"claim_next": "2"},
                                 json={"results": [{"job_id": second, "attempt": 1}]}, headers=node)  # fmt: skip
    third, fourth = (c["job"]["id"] for c in reported.json()["next_claims"])
    for answer in (claimed, renewed, chained, reported):
        assert answer.status_code == 200, answer.text
        assert lease - 5 < float(answer.headers[LEASE_LEFT]) <= lease, (answer.url, answer.headers[LEASE_LEFT])
        assert 0 <= float(answer.headers[HELD]) <= answer.elapsed.total_seconds(), (answer.url, answer.headers[HELD])

    # The queue is empty now: every answer below claims nothing.
    none_claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node)
    none_chained = await client.post(f"/v1/agent/jobs/{third}/complete", params={"claim_next": "true"},
                                     json={"attempt": 1}, headers=node)  # fmt: skip
    none_reported = await client.post("/v1/agent/complete", params={"claim_next": "2"},
                                      json={"results": [{"job_id": fourth, "attempt": 1}]}, headers=node)  # fmt: skip
    assert [a.status_code for a in (none_claimed, none_chained, none_reported)] == [204, 200, 200]
    assert none_chained.json()["next_claim"] is None and none_reported.json()["next_claims"] == []
    assert [LEASE_LEFT in a.headers for a in (none_claimed, none_chained, none_reported)] == [False] * 3
    assert [HELD in a.headers for a in (none_claimed, none_chained, none_reported)] == [False] * 3


async def test_a_long_polls_answer_says_it_was_held_through_its_wait(client, org):
    """A long-poll that waited about a second for a job says so (``Umbra-Held-Seconds`` of about a second,
    never more than the round trip): the agent takes off its lease only the rest of the round trip, the time
    on the way, and not the wait, which came before the lease was granted."""
    _, key = org
    node = bearer((await http_pair(client, key))[1])
    async with anyio.create_task_group() as tg:
        answers: list[httpx.Response] = []

        async def poll() -> None:
            answers.append(await client.post("/v1/agent/claim", params={"wait": 10}, headers=node))

        tg.start_soon(poll)
        await anyio.sleep(1.0)
        submitted = await client.post("/v1/jobs", json={"kind": "echo", "payload": {}}, headers=bearer(key))
        assert submitted.status_code == 201, submitted.text
    (claimed,) = answers
    assert claimed.status_code == 200, claimed.text
    held = float(claimed.headers[HELD])
    assert 0.9 <= held <= claimed.elapsed.total_seconds(), (held, claimed.elapsed)


def skew_database_clock(db_url: str, seconds: int) -> None:
    """Every new session's umbra_now() runs ``seconds`` ahead of the app server's wall clock: as if the
    application server's clock were that far behind the database's."""
    name = conninfo.conninfo_to_dict(db_url)["dbname"]
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(sql.SQL("ALTER DATABASE {} SET umbra.clock_offset = {}").format(
            sql.Identifier(name), sql.Literal(f"{seconds} seconds")))


async def run_sleep_job(db_url: str, key: str, seconds: float) -> tuple[dict, list[str]]:
    """One ``sleep`` job of ``seconds`` run by a real agent against a live server with a 3 s lease and a sweeper
    ticking every 0.2 s: the job as it ended, and the types of its events (:func:`run_sleep_job_events` for the
    events themselves)."""
    done, events = await run_sleep_job_events(db_url, key, seconds)
    return done, [e["type"] for e in events]


async def run_sleep_job_events(db_url: str, key: str, seconds: float) -> tuple[dict, list[dict]]:
    """:func:`run_sleep_job`, with the job's events as the API gives them."""
    env = {"UMBRA_LEASE_SECONDS": "3", "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1", "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2"}
    with LiveServer(db_url, **env) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=bearer(key), timeout=30) as api:
            paired = await pair_agent(server, api, "box", devices=(AGENT_CPU,))
            job = await submit_over_http(api, "sleep", {"seconds": seconds})
            async with running_agent(server, paired["credential"], devices=(AGENT_CPU,)):
                done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=40)
            return done, await job_events(api, job["id"])


async def test_an_agent_keeps_its_lease_when_the_app_servers_clock_is_behind_the_databases(db_url, org):
    """The lease ends by the database's clock, but the agent counts on the lease the server says is left
    (``Umbra-Lease-Seconds``, measured on the server's own monotonic clock), never ``lease_expires_at`` read
    against the app server's clock: with that clock 10 s behind the database's, the agent still renews its
    3 s lease in time, and a 5 s job completes at its first attempt with no lease expired."""
    skew_database_clock(db_url, 10)
    done, history = await run_sleep_job(db_url, org[1], 5)
    assert "job.lease_expired" not in history, history
    assert (done["status"], done["attempt"]) == ("complete", 1), (done["status"], done["error"], history)


async def test_an_agent_does_not_renew_in_a_tight_loop_when_the_app_servers_clock_is_ahead_of_the_databases(db_url, org):
    """With the app server's clock 10 s ahead of the database's, the lease the server says is left is still
    the whole lease, not none: the agent renews a 3 s lease at its ordinary pace through a 2.5 s job (a few
    renewals at most), never in a tight loop."""
    skew_database_clock(db_url, -10)
    done, history = await run_sleep_job(db_url, org[1], 2.5)
    assert done["status"] == "complete"
    assert history.count("job.lease_renewed") <= 4, history


async def test_control_with_no_skew_the_same_agent_keeps_its_lease_on_a_5_s_job(db_url, org):
    """Control for the two tests above: with the app server's and the database's clocks agreeing, the
    same agent renews a 3 s lease through a 5 s job, which completes at its first attempt, at the pace the
    lease asks for: each renewal about a third of the lease after the one before, never so late that the
    lease ran out in between, never in a tight loop."""
    done, events = await run_sleep_job_events(db_url, org[1], 5)
    history = [e["type"] for e in events]
    assert (done["status"], done["attempt"]) == ("complete", 1) and "job.lease_expired" not in history
    # Renewing every third of a 3 s lease through a 5 s job is about four renewals: none would have let the
    # lease run out at 3 s, and more than six would be a tighter pace than the lease asks for.
    assert 1 <= history.count("job.lease_renewed") <= 6
    held = [_utc(e["recorded_at"]) for e in events if e["type"] in ("job.claimed", "job.lease_renewed", "job.completed")]
    gaps = [(later - earlier).total_seconds() for earlier, later in zip(held, held[1:])]
    assert all(gap < 3 for gap in gaps), gaps  # the lease (3 s) never ran out between two of them
    renewals = gaps[:-1]  # the last gap ends at the completion, whenever the job finished
    assert renewals and all(gap >= 0.5 for gap in renewals), gaps  # a third of the lease is 1 s


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
