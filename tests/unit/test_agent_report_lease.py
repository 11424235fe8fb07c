"""A report is retried while the lease could still hold: the lease the last renewal granted, not the
part of the first lease that was left when the claim's answer arrived.

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


async def test_a_completion_is_retried_for_as_long_as_the_renewed_lease_holds():
    """The claim arrived with 1.2 s of lease left; every renewal grants 30 s. The 2.5 s job's completion
    is answered by a proxy's 502 for 2 s: it is sent again until it lands, the lease holding 28 s more."""
    later = (datetime.now(timezone.utc) + timedelta(seconds=30)).isoformat()

    def claim(request: httpx.Request, n: int) -> httpx.Response:
        if n > 1:
            return httpx.Response(204)
        return httpx.Response(200, json={"job": LONGER, "placement": {}, "lease_expires_at": later},
                              headers={"Umbra-Lease-Seconds": "1.200"})  # fmt: skip

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
