"""What users rely on, held across two real ``umbra serve`` processes on one database.

Operators run several processes behind a load balancer, so one agent's requests land on different
processes. Each test starts two servers (``servers`` from :mod:`tests.integration.test_multiprocess`,
whose safety poll is 30 s away: a prompt wake can only come from a notification) and checks one promise
across them.
"""

from __future__ import annotations

import time

import anyio
import httpx
import msgspec
import pytest

from tests.helpers import bearer, eventually, until
from tests.integration.queue_support import CPU64_JSON, GPU24
from tests.integration.test_multiprocess import (  # noqa: F401
    ServeProcess,
    _long_polls_waiting,
    _sweeper_holders,
    servers,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

GPU_JSON = msgspec.to_builtins(GPU24)  # 24576 MB, 24000 free


async def _two(servers, **env: str) -> tuple[ServeProcess, ServeProcess]:
    a, b = servers(**env), servers(**env)
    await a.ready()
    await b.ready()
    return a, b


async def _pair(client: httpx.AsyncClient, issuer: ServeProcess, agent_side: ServeProcess, key: str, name: str,
                devices: list[dict] | None = None) -> tuple[str, str]:  # fmt: skip
    """A node whose code comes from ``issuer`` and which redeems and beats on ``agent_side`` (its token then
    verified and cached there); returns (node_id, credential)."""
    devices = devices or [CPU64_JSON]
    code = (await client.post(f"{issuer.url}/v1/pairings", json={"name": name}, headers=bearer(key))).json()["code"]
    redeemed = await client.post(f"{agent_side.url}/v1/pairings/redeem",
                                 json={"code": code, "name": name, "agent_version": "t", "devices": devices})  # fmt: skip
    assert redeemed.status_code == 201, redeemed.text
    node_id, credential = redeemed.json()["node_id"], redeemed.json()["credential"]
    beat = await client.post(f"{agent_side.url}/v1/agent/heartbeat", json={"devices": devices, "agent_version": "t"},
                             headers=bearer(credential))  # fmt: skip
    assert beat.status_code == 200 and beat.json()["status"] == "online", beat.text
    return node_id, credential


async def _submit(client: httpx.AsyncClient, server: ServeProcess, key: str, **fields) -> str:
    made = await client.post(f"{server.url}/v1/jobs", json={"kind": "echo", **fields}, headers=bearer(key))
    assert made.status_code == 201, made.text
    return made.json()["id"]


async def _claim_now(client: httpx.AsyncClient, server: ServeProcess, credential: str, **headers: str) -> httpx.Response:
    return await client.post(f"{server.url}/v1/agent/claim", params={"wait": 0}, headers={**bearer(credential), **headers})


async def _events(client: httpx.AsyncClient, server: ServeProcess, key: str, job_id: str) -> list[dict]:
    answer = await client.get(f"{server.url}/v1/jobs/{job_id}/events", headers=bearer(key))
    assert answer.status_code == 200, answer.text
    return answer.json()["events"]


class Parked:
    """A long-poll parked on one process, its answer and how long after ``mark()`` it came."""

    def __init__(self, client: httpx.AsyncClient, server: ServeProcess, credential: str, wait: int = 30,
                 request_id: str | None = None) -> None:  # fmt: skip
        self.client, self.server, self.credential, self.wait = client, server, credential, wait
        self.request_id = request_id
        self.answer: httpx.Response | None = None
        self.at: float | None = None
        self.marked = time.monotonic()

    async def run(self) -> None:
        headers = bearer(self.credential)
        if self.request_id:
            headers["X-Request-ID"] = self.request_id
        self.answer = await self.client.post(f"{self.server.url}/v1/agent/claim", params={"wait": self.wait},
                                             headers=headers)  # fmt: skip
        self.at = time.monotonic()

    def mark(self) -> None:
        self.marked = time.monotonic()

    @property
    def after(self) -> float:
        assert self.at is not None
        return self.at - self.marked


async def _parked(client, server: ServeProcess, n: int) -> None:
    await eventually(lambda: _long_polls_waiting(client, server, n), timeout=10)


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one series in a Prometheus text exposition (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series == want:
            return float(value)
    return 0.0


# -- revocation, drain, retirement through one process, seen by the other ------------------------------------


async def test_a_revocation_through_a_is_refused_by_b_at_once_and_ends_bs_parked_poll(conn, org, servers):
    """B verified and cached the node's token; the node is revoked through A. B's parked long-poll of that node
    answers 401 at once, the job the node held is requeued and wakes another node's long-poll parked on B at
    once, and every further request of the revoked token on B (heartbeat, renew, complete, claim, read) is 401."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        node_id, revoked_cred = await _pair(client, a, b, key, "doomed")
        _, other_cred = await _pair(client, a, b, key, "other")
        job_id = await _submit(client, a, key)
        held = await _claim_now(client, b, revoked_cred)
        assert held.status_code == 200 and held.json()["job"]["id"] == job_id
        attempt = held.json()["job"]["attempt"]
        renewed = await client.post(f"{b.url}/v1/agent/jobs/{job_id}/renew", json={"attempt": attempt},
                                    headers=bearer(revoked_cred))  # fmt: skip
        assert renewed.status_code == 200, renewed.text

        doomed_poll, other_poll = Parked(client, b, revoked_cred), Parked(client, b, other_cred)
        async with anyio.create_task_group() as tg:
            tg.start_soon(doomed_poll.run)
            tg.start_soon(other_poll.run)
            await _parked(client, b, 2)
            await anyio.sleep(0.2)
            doomed_poll.mark()
            other_poll.mark()
            answer = await client.post(f"{a.url}/v1/nodes/{node_id}/revoke", headers=bearer(key))
            assert answer.status_code == 200, answer.text
            await until(lambda: doomed_poll.answer is not None and other_poll.answer is not None, timeout=20)
        assert doomed_poll.answer.status_code == 401 and doomed_poll.after < 5, (doomed_poll.answer.status_code,
                                                                                  doomed_poll.after)  # fmt: skip
        assert other_poll.answer.status_code == 200 and other_poll.after < 5, (other_poll.answer.status_code,
                                                                                other_poll.after)  # fmt: skip
        assert other_poll.answer.json()["job"]["id"] == job_id

        refused = [
            await client.post(f"{b.url}/v1/agent/heartbeat", json={"devices": [CPU64_JSON]}, headers=bearer(revoked_cred)),
            await client.post(f"{b.url}/v1/agent/jobs/{job_id}/renew", json={"attempt": attempt},
                              headers=bearer(revoked_cred)),
            await client.post(f"{b.url}/v1/agent/jobs/{job_id}/complete", json={"attempt": attempt, "result": {}},
                              headers=bearer(revoked_cred)),
            await client.post(f"{b.url}/v1/agent/jobs/{job_id}/complete?claim_next=true",
                              json={"attempt": attempt, "result": {}}, headers=bearer(revoked_cred)),
            await _claim_now(client, b, revoked_cred),
            await client.get(f"{b.url}/v1/nodes/{node_id}", headers=bearer(revoked_cred)),
            await client.post(f"{b.url}/v1/agent/offline", headers=bearer(revoked_cred)),
        ]
        assert [r.status_code for r in refused] == [401] * len(refused), [(r.status_code, r.text[:80]) for r in refused]


async def test_an_api_key_revoked_through_a_is_refused_by_b_for_a_token_b_cached(conn, org, servers):
    """The key is cached by B (its reads and writes went through B); it is revoked (as `umbra admin revoke-key`
    does, on the database) and B refuses it at once: reads, writes, streams opened since."""
    from umbra.compute.accounts import create_api_key, revoke_api_key

    org_id, key = org
    a, b = await _two(servers)
    other_key = await create_api_key(conn, org_id, ["jobs:read", "jobs:write", "events:read"])
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f"{b.url}/v1/jobs", headers=bearer(other_key))).status_code == 200
        await _submit(client, b, other_key)
        key_id = await _key_id(conn, other_key)
        await revoke_api_key(conn, org_id, key_id)
        answers = [
            await client.get(f"{b.url}/v1/jobs", headers=bearer(other_key)),
            await client.post(f"{b.url}/v1/jobs", json={"kind": "echo"}, headers=bearer(other_key)),
            await client.get(f"{b.url}/v1/events/stream", headers=bearer(other_key)),
        ]
        assert [r.status_code for r in answers] == [401, 401, 401]


async def _key_id(conn, token: str):
    prefix = token.split("_")[1]
    row = await (await conn.execute("SELECT id FROM api_keys WHERE prefix = %s", (prefix,))).fetchone()
    return row[0]


async def test_a_drain_or_retirement_through_a_stops_claims_through_b(conn, org, servers):
    """Drained and retired through A: neither node takes a job through B, from a claim sent after the change or
    from a long-poll parked on B before it."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        drained_id, drained = await _pair(client, a, b, key, "drained")
        retired_id, retired = await _pair(client, a, b, key, "retired")
        polls = [Parked(client, b, drained, wait=3), Parked(client, b, retired, wait=3)]
        async with anyio.create_task_group() as tg:
            for poll in polls:
                tg.start_soon(poll.run)
            await _parked(client, b, 2)
            assert (await client.post(f"{a.url}/v1/nodes/{drained_id}/drain", headers=bearer(key))).status_code == 200
            assert (await client.post(f"{a.url}/v1/nodes/{retired_id}/retire", headers=bearer(key))).status_code == 200
            job_id = await _submit(client, a, key)
        assert [p.answer.status_code for p in polls] == [204, 204]
        assert (await _claim_now(client, b, drained)).status_code == 204
        assert (await _claim_now(client, b, retired)).status_code == 204
        job = (await client.get(f"{a.url}/v1/jobs/{job_id}", headers=bearer(key))).json()
        assert job["status"] in ("queued", "blocked") and job["attempt"] == 0, job


# -- wakes across processes ---------------------------------------------------------------------------------


async def test_a_give_back_or_an_unread_claim_released_through_a_wakes_a_long_poll_parked_on_b(conn, org, servers):
    """A job given back (`/release`) and a claim whose answer was never read (`/claim/release`), both through A,
    are taken at once by another node's long-poll parked on B."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        _, first = await _pair(client, a, b, key, "first")
        _, second = await _pair(client, a, b, key, "second")
        job_id = await _submit(client, a, key)
        held = await _claim_now(client, a, first)
        assert held.status_code == 200

        # The give-back through A.
        waiting = Parked(client, b, second, request_id="second-claim-1")
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting.run)
            await _parked(client, b, 1)
            await anyio.sleep(0.2)
            waiting.mark()
            given = await client.post(f"{a.url}/v1/agent/jobs/{job_id}/release", json={"attempt": 1}, headers=bearer(first))
            assert given.status_code == 200, given.text
            await until(lambda: waiting.answer is not None, timeout=40)
        assert waiting.answer.status_code == 200 and waiting.after < 5, (waiting.answer.status_code, waiting.after)
        assert waiting.answer.json()["job"]["id"] == job_id

        # The second node never read that answer: it releases the claim through A, by the request id.
        waiting = Parked(client, b, first)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting.run)
            await _parked(client, b, 1)
            await anyio.sleep(0.2)
            waiting.mark()
            released = await client.post(f"{a.url}/v1/agent/claim/release", json={"request_id": "second-claim-1"},
                                         headers=bearer(second))  # fmt: skip
            assert released.status_code == 200 and released.json()["released"] == [job_id], released.text
            await until(lambda: waiting.answer is not None, timeout=40)
        assert waiting.answer.status_code == 200 and waiting.after < 5, (waiting.answer.status_code, waiting.after)
        assert waiting.answer.json()["job"]["id"] == job_id


async def test_a_claim_request_given_up_through_a_claims_nothing_on_b_late_or_parked(conn, org, servers):
    """An agent gives up on a claim request and asks for its claims back through A while the request itself is
    still on its way to B (a proxy holding it): arriving late on B, it claims nothing; parked on B, it claims
    nothing when a job wakes it. The job is never claimed and given back in between: the agent's next request
    takes it."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        _, node = await _pair(client, a, b, key, "box")
        released = await client.post(f"{a.url}/v1/agent/claim/release", json={"request_id": "late-1"}, headers=bearer(node))
        assert released.status_code == 200 and released.json() == {"released": []}, released.text
        job_id = await _submit(client, a, key, max_attempts=1)
        late = await _claim_now(client, b, node, **{"X-Request-ID": "late-1"})
        assert late.status_code == 204, late.text
        assert [e["type"] for e in await _events(client, b, key, job_id)] == ["job.submitted"]
        fresh = await _claim_now(client, b, node, **{"X-Request-ID": "fresh-1"})
        assert fresh.status_code == 200 and fresh.json()["job"]["id"] == job_id, fresh.text

        waiting = Parked(client, b, node, request_id="parked-1")
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting.run)
            await _parked(client, b, 1)
            released = await client.post(f"{a.url}/v1/agent/claim/release", json={"request_id": "parked-1"},
                                         headers=bearer(node))  # fmt: skip
            assert released.status_code == 200 and released.json() == {"released": []}, released.text
            waiting.mark()
            second = await _submit(client, a, key, max_attempts=1)
            await until(lambda: waiting.answer is not None, timeout=40)
        assert waiting.answer.status_code == 204 and waiting.after < 5, (waiting.answer.status_code, waiting.after)
        assert [e["type"] for e in await _events(client, b, key, second)] == ["job.submitted"]
        fresh = await _claim_now(client, b, node, **{"X-Request-ID": "fresh-2"})
        assert fresh.status_code == 200 and fresh.json()["job"]["id"] == second, fresh.text


@pytest.mark.parametrize("report", ["complete", "fail"])
async def test_a_report_through_a_that_frees_a_gpu_wakes_the_nodes_long_poll_parked_on_b(conn, org, servers, report):
    """A claim answers "as soon as a job this node is eligible for is queued" (API.md), and a job already queued
    that its GPU has no room for now becomes one when the job holding that memory ends. The node runs one
    16 GB job (a contract client: no ``claim_next``) and long-polls B for the next one (16 GB too, which does not
    fit beside it). The running job's report through A frees the card: the parked poll takes the next job at
    once, as it does when a heartbeat frees the memory (test_longpoll), not at the safety poll."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=90) as client:
        _, gpu = await _pair(client, a, b, key, "gpu-box", devices=[GPU_JSON])
        first = await _submit(client, a, key, requires={"vram_min_mb": 16000})
        second = await _submit(client, a, key, requires={"vram_min_mb": 16000})
        held = await _claim_now(client, a, gpu)
        assert held.status_code == 200 and held.json()["job"]["id"] == first
        assert (await _claim_now(client, a, gpu)).status_code == 204  # no room for the second beside it

        waiting = Parked(client, b, gpu, wait=60)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting.run)
            await _parked(client, b, 1)
            await anyio.sleep(0.3)  # its first look found no room
            waiting.mark()
            if report == "complete":
                done = await client.post(f"{a.url}/v1/agent/jobs/{first}/complete", json={"attempt": 1, "result": {}},
                                         headers=bearer(gpu))  # fmt: skip
            else:
                done = await client.post(f"{a.url}/v1/agent/jobs/{first}/fail",
                                         json={"attempt": 1, "error": "boom", "retry": False}, headers=bearer(gpu))  # fmt: skip
            assert done.status_code == 200, done.text
            with anyio.move_on_after(6):
                await until(lambda: waiting.answer is not None, timeout=10)
            tg.cancel_scope.cancel()  # the poll hangs up (a claim it made as it left is released)
        assert waiting.answer is not None, "the card freed through A was not noticed within 6 s (only the safety poll, 30 s here, finds it)"
        assert waiting.answer.status_code == 200 and waiting.answer.json()["job"]["id"] == second


# -- claims from both processes' group commits ------------------------------------------------------------------


async def test_claims_through_both_processes_hand_out_each_job_once_in_priority_order(conn, org, servers):
    """Eight nodes claim at once, each request through A or B in turn (two group commits on one queue): no job
    is claimed twice, and the jobs taken are the best ones (lowest priority number, then submission order);
    each process counts the claims it made, and together they count every ``job.claimed``."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        nodes = [await _pair(client, a if i % 2 else b, b if i % 2 else a, key, f"n{i}") for i in range(8)]
        priorities = [(i * 7) % 5 for i in range(60)]
        batch = await client.post(f"{a.url}/v1/jobs/batch", json={"jobs": [{"kind": "echo", "priority": p}
                                                                           for p in priorities]}, headers=bearer(key))  # fmt: skip
        assert batch.status_code == 201, batch.text
        ids = [job["id"] for job in batch.json()["jobs"]]
        best = [job_id for _, _, job_id in sorted(zip(priorities, range(60), ids))]
        taken: list[str] = []

        async def claimer(index: int, credential: str) -> None:
            for turn in range(5):  # 8 x 5 = 40 of the 60
                server = (a, b)[(index + turn) % 2]
                answer = await client.post(f"{server.url}/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
                assert answer.status_code == 200, (answer.status_code, answer.text)
                taken.append(answer.json()["job"]["id"])

        async with anyio.create_task_group() as tg:
            for index, (_, credential) in enumerate(nodes):
                tg.start_soon(claimer, index, credential)
        assert len(taken) == len(set(taken)) == 40
        assert set(taken) == set(best[:40]), sorted(best.index(j) for j in taken)
        claimed_events = 0
        for job_id in ids:
            claimed_events += sum(e["type"] == "job.claimed" for e in await _events(client, a, key, job_id))
        assert claimed_events == 40
        counted = 0.0
        for server in (a, b):
            text = (await client.get(f"{server.url}/metrics")).text
            counted += sum(_metric(text, "umbra_claims_total", trigger=t) for t in ("immediate", "hint", "poll", "recheck"))
        assert counted == 40


async def test_a_completion_sent_to_a_and_again_to_b_is_answered_as_the_first(conn, org, servers):
    """The agent's completion (with ``claim_next``) reaches A; its answer is lost, and the agent sends it again
    through B, once after the first answered and once while it is still in flight: every answer is the first's
    (the job complete, the same ``next_claim``), nothing is recorded twice. Sent again through B *without*
    ``claim_next`` (the agent is stopping), the claim it never heard of is given back."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        _, cred = await _pair(client, a, b, key, "box")
        first, second, third = [await _submit(client, a, key, payload={"n": n}) for n in range(3)]
        assert (await _claim_now(client, a, cred)).json()["job"]["id"] == first
        body = {"attempt": 1, "result": {"ok": 1}}
        url = "/v1/agent/jobs/{}/complete?claim_next=true"
        answers: list[httpx.Response] = []

        async def send(server: ServeProcess) -> None:
            answers.append(await client.post(server.url + url.format(first), json=body, headers=bearer(cred)))

        async with anyio.create_task_group() as tg:  # the two at once: the repeat may meet the first in flight
            tg.start_soon(send, a)
            tg.start_soon(send, b)
        await send(b)  # and once more after both answered
        assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
        assert {r.json()["status"] for r in answers} == {"complete"}
        nexts = [r.json()["next_claim"] and r.json()["next_claim"]["job"]["id"] for r in answers]
        assert nexts == [second] * 3, nexts
        types = [e["type"] for e in await _events(client, a, key, first)]
        assert types.count("job.completed") == 1
        assert [e["type"] for e in await _events(client, a, key, second)].count("job.claimed") == 1
        assert [e["type"] for e in await _events(client, a, key, third)] == ["job.submitted"]

        # The agent stops: the completion sent again without claim_next gives back the claim it never read.
        again = await client.post(f"{b.url}/v1/agent/jobs/{first}/complete", json=body, headers=bearer(cred))
        assert again.status_code == 200 and again.json()["status"] == "complete"
        last = (await _events(client, a, key, second))[-1]
        assert (last["type"], last["data"].get("reason")) == ("job.released", "not_asked_again")


# -- streams -----------------------------------------------------------------------------------------------------


async def test_an_event_stream_on_b_sees_every_event_written_through_a_and_b_in_order(conn, org, servers):
    """A dashboard's stream on B, while submissions, claims and completions go through both processes: every
    event of the organization arrives once, in position order, exactly as ``GET /v1/events`` lists them."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        _, cred = await _pair(client, a, b, key, "box")
        seen: list[int] = []
        head: list[int] = [0]

        async def stream() -> None:
            async with client.stream("GET", f"{b.url}/v1/events/stream", headers=bearer(key)) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("id: "):
                        seen.append(int(line[4:]))
                        if head[0] and seen[-1] >= head[0]:
                            return

        async def writer(server: ServeProcess, n: int) -> None:
            for i in range(n):
                await _submit(client, server, key, payload={"i": i})
                if i == n // 2:  # a large batch: its positions are taken under the lock, then COPYed
                    batch = await client.post(f"{server.url}/v1/jobs/batch", json={"jobs": [{"kind": "echo"}] * 300},
                                              headers=bearer(key))  # fmt: skip
                    assert batch.status_code == 201

        async def worker() -> None:
            for turn in range(10):
                server = (a, b)[turn % 2]
                claimed = await client.post(f"{server.url}/v1/agent/claim", params={"wait": 2}, headers=bearer(cred))
                if claimed.status_code != 200:
                    continue
                job = claimed.json()["job"]
                await client.post(f"{(b, a)[turn % 2].url}/v1/agent/jobs/{job['id']}/complete",
                                  json={"attempt": job["attempt"], "result": {}}, headers=bearer(cred))  # fmt: skip

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            async with anyio.create_task_group() as writers:
                writers.start_soon(writer, a, 25)
                writers.start_soon(writer, b, 25)
                writers.start_soon(worker)
            listed: list[int] = []
            after = 0
            while True:
                page = (await client.get(f"{a.url}/v1/events", params={"after": after, "limit": 1000},
                                         headers=bearer(key))).json()  # fmt: skip
                if not page["events"]:
                    break
                listed += [e["position"] for e in page["events"]]
                after = page["next"]
            head[0] = listed[-1]
            with anyio.fail_after(20):
                await until(lambda: seen and seen[-1] >= head[0], timeout=20)
            tg.cancel_scope.cancel()
        assert seen == listed, (len(seen), len(listed))
        verified = await client.post(f"{b.url}/v1/projections/verify", headers=bearer(key))
        assert verified.status_code == 200 and verified.json()["ok"], verified.text


async def _holders_are(conn, n: int) -> bool:
    return await _sweeper_holders(conn) == n


class _ShiftedClock:
    """``time`` as :mod:`umbra.compute.auth` sees it, ``offset`` seconds ahead on the monotonic clock."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


async def test_a_verified_holder_in_use_is_spared_the_wrong_secret_limit_past_a_minute(org, live_server, monkeypatch):
    """API.md: past 20 wrong secrets for a prefix within a minute, tokens of that prefix this process has not
    verified are refused 429, and holders whose token it verified go on while they use it. Each use keeps the
    verification another minute: a guesser sending 20 wrong secrets a minute never locks out the holder, also
    after the minute its token was first verified in (with a fixed minute, it did from then on). The process's
    monotonic clock (as the auth module reads it) is moved forward instead of waiting a minute; one process
    is enough."""
    from umbra.compute import auth

    _, key = org
    clock = _ShiftedClock()
    monkeypatch.setattr(auth, "time", clock)
    kind, prefix, secret = key.split("_", 2)
    wrong = f"{kind}_{prefix}_{'x' * len(secret)}"
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200  # verified at t=0
        clock.offset = 50.0  # the holder has used its key all along; a guesser starts
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
        for _ in range(20):
            assert (await client.get("/v1/jobs", headers=bearer(wrong))).status_code == 401
        assert (await client.get("/v1/jobs", headers=bearer(wrong))).status_code == 429
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200  # still spared at t=50
        clock.offset = 61.0  # the holder's next request, a second past its entry's minute
        answer = await client.get("/v1/jobs", headers=bearer(key))
        assert answer.status_code == 200, (answer.status_code, answer.text)


async def _all_events(client: httpx.AsyncClient, server: ServeProcess, key: str) -> list[dict]:
    events, after = [], 0
    while True:
        page = (await client.get(f"{server.url}/v1/events", params={"after": after, "limit": 1000},
                                 headers=bearer(key))).json()  # fmt: skip
        if not page["events"]:
            return events
        events += page["events"]
        after = page["next"]


async def test_an_api_key_revoked_ends_its_stream_open_on_b_at_once(conn, org, servers):
    """README/CLI: a revoked key "fails at once, open streams included". A dashboard's stream is open on B for
    a quiet organization; the key is revoked (`umbra admin revoke-key`, on the database). The revocation asks
    every process to look again (``umbra_recheck``), so the stream sends its `event: error` and ends at once,
    not at its next wake (its safety poll, 30 s away here)."""
    from umbra.compute.accounts import create_api_key, revoke_api_key

    org_id, _ = org
    a, b = await _two(servers)
    dashboard_key = await create_api_key(conn, org_id, ["events:read", "jobs:read"])
    key_id = await _key_id(conn, dashboard_key)
    ended: list[float] = []
    lines: list[str] = []
    async with httpx.AsyncClient(timeout=60) as client:

        async def stream() -> None:
            async with client.stream("GET", f"{b.url}/v1/projections/stream", headers=bearer(dashboard_key)) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    lines.append(line)
            ended.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            await until(lambda: any(line.startswith("event: nodes") for line in lines), timeout=10)
            await anyio.sleep(0.5)
            await revoke_api_key(conn, org_id, key_id)
            revoked_at = time.monotonic()
            with anyio.move_on_after(4):
                await until(lambda: ended, timeout=10)
            tg.cancel_scope.cancel()
        assert ended, "the stream of a revoked key was still open on B 4 s after the revocation"
        assert "event: error" in lines and ended[0] - revoked_at < 3


async def _claims_counted(client: httpx.AsyncClient, *servers_: ServeProcess) -> float:
    total = 0.0
    for server in servers_:
        text = (await client.get(f"{server.url}/metrics")).text
        total += sum(_metric(text, "umbra_claims_total", trigger=t) for t in (
            "immediate", "hint", "poll", "recheck", "completion", "same_claim"))
    return total


@pytest.mark.parametrize("route", ["complete", "complete_many"])
async def test_a_completion_repeated_through_b_is_not_counted_as_another_claim(conn, org, servers, route):
    """``umbra_claims_total`` is "one per job.claimed event". The agent's completion with ``claim_next`` lands on
    A (one claim, counted there); its answer is lost and the agent sends it again through B, which answers with
    the same claim, records nothing and counts nothing: summed over the processes, one claim per
    ``job.claimed``."""
    _, key = org
    a, b = await _two(servers)
    async with httpx.AsyncClient(timeout=60) as client:
        _, cred = await _pair(client, a, b, key, "box")
        first, second = [await _submit(client, a, key, payload={"n": n}) for n in range(2)]
        assert (await _claim_now(client, a, cred)).json()["job"]["id"] == first
        if route == "complete":
            url, body = f"/v1/agent/jobs/{first}/complete?claim_next=true", {"attempt": 1, "result": {}}
        else:
            url, body = "/v1/agent/complete?claim_next=1", {"results": [{"job_id": first, "attempt": 1}]}
        for server in (a, b):
            answer = await client.post(server.url + url, json=body, headers=bearer(cred))
            assert answer.status_code == 200, answer.text
            claimed = answer.json()["next_claim"]["job"] if route == "complete" else answer.json()["next_claims"][0]["job"]
            assert claimed["id"] == second
        events = await _all_events(client, a, key)
        assert sum(e["type"] == "job.claimed" for e in events) == 2
        assert await _claims_counted(client, a, b) == 2
