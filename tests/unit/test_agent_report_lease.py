"""A report is retried while the lease could still hold, and a failing renewal is sent again at the
lease's pace: the lease the last renewal granted, not the part of the first lease that was left when the
claim's answer arrived.

A claim whose answer took long on its way leaves its run a short lease (the claim's
``Umbra-Lease-Seconds`` less the time on the way); the first renewal, a third of it later, brings the
full lease back. A completion that meets a server restarting (a proxy's 502 for a few seconds) must be
sent again for as long as that renewed lease holds: given up after the few seconds the claim had left,
the computed result is thrown away and the job waits out its lease to run again.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import anyio
import httpx
import pytest

from tests.unit.test_agent_job_run import JOB, completed, run_until_an_outcome, server

pytestmark = pytest.mark.anyio


#: Long enough that its first renewal (a third of the claim's 1.2 s in) comes before it ends, however
#: loaded the machine.
LONGER = {**JOB, "payload": {"seconds": 2.5}}


def claimed_once(job: dict, lease_expires_at: str, *, lease_seconds: str):
    """A claim answer: ``job`` the first time, with ``lease_seconds`` of lease left on arrival; 204 after."""

    def claim(request: httpx.Request, n: int) -> httpx.Response:
        if n > 1:
            return httpx.Response(204)
        return httpx.Response(200, json={"job": job, "placement": {}, "lease_expires_at": lease_expires_at},
                              headers={"Umbra-Lease-Seconds": lease_seconds})  # fmt: skip

    return claim


async def test_a_completion_is_retried_for_as_long_as_the_renewed_lease_holds():
    """The claim arrived with 1.2 s of lease left; every renewal grants 30 s. The 2.5 s job's completion
    is answered by a proxy's 502 for 2 s: it is sent again until it lands, the lease holding 28 s more."""
    later = (datetime.now(timezone.utc) + timedelta(seconds=30)).isoformat()

    claim = claimed_once(LONGER, later, lease_seconds="1.200")

    def renew(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(200, json={"lease_expires_at": later, "attempt": 1}, headers={"Umbra-Lease-Seconds": "30.000"})

    first: list[float] = []

    def complete(request: httpx.Request, n: int) -> httpx.Response:
        first.append(anyio.current_time())
        if first[-1] - first[0] < 2.0:
            return httpx.Response(502, text="Bad Gateway", headers={"content-type": "text/plain"})
        return completed(request, n)

    handler, said = server(claim=claim, renew=renew, complete=complete)
    agent = await run_until_an_outcome(handler)
    assert said.count(f"/v1/agent/jobs/{JOB['id']}/renew") >= 1, said
    assert [o.status for o in agent.outcomes] == ["complete"], (agent.outcomes, said)


async def test_a_failing_renewal_is_sent_again_at_the_pace_of_the_renewed_lease_not_the_claims():
    """The claim arrived with 0.3 s of lease left; its first renewal grants 6 s, and every renewal after it
    meets a proxy's 502 until the job ends. Sent again at the pace of a 0.3 s lease (every 0.2 s, the
    floor), a server restarting behind its proxy got five a second of each running job; at the pace of the
    6 s lease the renewed lease allows, the retries back off from 0.2 s towards a sixth of it."""
    later = (datetime.now(timezone.utc) + timedelta(seconds=30)).isoformat()
    run = {**JOB, "payload": {"seconds": 5.0}}

    claim = claimed_once(run, later, lease_seconds="0.300")

    def renew(request: httpx.Request, n: int) -> httpx.Response:
        if n == 1:
            return httpx.Response(200, json={"lease_expires_at": later, "attempt": 1}, headers={"Umbra-Lease-Seconds": "6.000"})
        return httpx.Response(502, text="Bad Gateway", headers={"content-type": "text/plain"})

    handler, said = server(claim=claim, renew=renew)
    agent = await run_until_an_outcome(handler)
    assert [o.status for o in agent.outcomes] == ["complete"], (agent.outcomes, said)
    refused = said.count(f"/v1/agent/jobs/{JOB['id']}/renew") - 1
    # The second renewal is due 2 s in, so about 3 s of refusals: 0.1-0.2, 0.2-0.4, 0.4-0.8 and then
    # 0.5-1 s apart is 5 to 8 of them; every 0.2 s would be about 15.
    assert 1 <= refused <= 9, said
