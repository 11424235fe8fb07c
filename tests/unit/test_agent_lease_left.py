"""How much lease an agent believes it has: the server's own measure, read against no clock, less what
the answer can have spent on its way."""

from __future__ import annotations

import json
from datetime import timedelta

import anyio

import httpx
import pytest

from umbra.agent.client import HELD_HEADER, LEASE_LEFT_HEADER, AgentClient, lease_left

EXPIRES = "2026-12-01T12:01:00Z"
BODY = {"lease_expires_at": EXPIRES}


def answered(date: str, **headers: str) -> httpx.Response:
    return httpx.Response(200, headers={"date": date, **headers}, json=BODY)


def arrived_after(round_trip: float, **headers: str) -> httpx.Response:
    """An answer whose request and answer took ``round_trip`` seconds here, there and back."""
    response = httpx.Response(200, headers=headers, json=BODY)
    response.elapsed = timedelta(seconds=round_trip)
    return response


def test_the_lease_left_is_what_the_server_says_whatever_its_date_header():
    """An app server whose clock runs 50 s behind the database's dates its answer 50 s early: read against
    ``lease_expires_at`` (the database's clock), a lease of 60 s would look like 110 s, and the agent would
    renew after it had run out."""
    behind = answered("Tue, 01 Dec 2026 11:59:10 GMT", **{LEASE_LEFT_HEADER: "59.981"})
    assert lease_left(BODY, behind) == pytest.approx(59.981)
    ahead = answered("Tue, 01 Dec 2026 12:05:00 GMT", **{LEASE_LEFT_HEADER: "59.981"})
    assert lease_left(BODY, ahead) == pytest.approx(59.981)  # not 0: no renewal without pause


@pytest.mark.parametrize("said", [None, "", "soon", "-1", "nan", "inf"])
def test_without_a_usable_header_the_lease_is_read_against_the_servers_date(said):
    """A server that does not say (or says nothing usable) is read as before: ``lease_expires_at`` less the
    answer's ``Date``, never this machine's clock."""
    headers = {} if said is None else {LEASE_LEFT_HEADER: said}
    assert lease_left(BODY, answered("Tue, 01 Dec 2026 12:00:15 GMT", **headers)) == pytest.approx(45.0)
    assert lease_left(BODY, answered("Tue, 01 Dec 2026 12:02:00 GMT", **headers)) == 0.0


def test_an_answer_held_on_its_way_leaves_the_lease_less_the_time_it_spent_there():
    """A claim the server answered with 60 s of lease, which reached the agent 41 s after it was sent, of which
    the server held it 1 s: 40 s went on the way, so 20 s are left, at most. Taking the server's 60 s, the agent
    renewed first at 20 s, when the lease had already run out."""
    late = arrived_after(41.0, **{LEASE_LEFT_HEADER: "60.000", HELD_HEADER: "1.000"})
    assert lease_left(BODY, late) == pytest.approx(20.0)
    gone = arrived_after(75.0, **{LEASE_LEFT_HEADER: "60.000", HELD_HEADER: "1.000"})
    assert lease_left(BODY, gone) == 0.0


def test_a_long_polls_wait_is_not_taken_off_the_lease():
    """A long-poll the server held 29.95 s before a job came, answered in a 30 s round trip: only the 0.05 s
    on the way comes off; the wait was before the lease was granted."""
    polled = arrived_after(30.0, **{LEASE_LEFT_HEADER: "59.990", HELD_HEADER: "29.950"})
    assert lease_left(BODY, polled) == pytest.approx(59.94)


@pytest.mark.parametrize("held", [None, "", "soon", "-1", "nan"])
def test_a_server_that_does_not_say_how_long_it_held_the_request_is_taken_at_its_word(held):
    """Without a usable ``Umbra-Held-Seconds`` (a server from before it), the round trip cannot be split into
    wait and way: the lease the server says is taken as it is, as before, not less a long-poll's whole wait."""
    headers = {LEASE_LEFT_HEADER: "59.990"} | ({} if held is None else {HELD_HEADER: held})
    assert lease_left(BODY, arrived_after(30.0, **headers)) == pytest.approx(59.99)


def test_an_answer_not_yet_read_has_no_round_trip_and_loses_nothing():
    """``elapsed`` is known only once the answer is read: before that, nothing is taken off."""
    unread = httpx.Response(200, headers={LEASE_LEFT_HEADER: "12.500", HELD_HEADER: "0.010"}, json=BODY)
    assert lease_left(BODY, unread) == pytest.approx(12.5)


@pytest.mark.anyio
async def test_a_claim_that_took_long_to_arrive_leaves_its_run_a_shorter_lease():
    """Through the client: a claim answer that took 0.6 s to arrive, none of which the server held it, leaves
    the run 2.4 s of a 3 s lease at most, so its renewals start sooner (a third of what is left)."""
    async def slow(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(0.6)
        job = {"id": "00000000-0000-0000-0000-0000000000a1", "kind": "noop", "attempt": 1}
        # A body read from its stream, as from a socket: httpx measures the round trip when it closes it.
        body = httpx.ByteStream(json.dumps({"job": job, "placement": {}, **BODY}).encode())
        return httpx.Response(200, stream=body, headers={"content-type": "application/json",
                                                          LEASE_LEFT_HEADER: "3.000", HELD_HEADER: "0.000"})  # fmt: skip

    async with AgentClient("http://umbra", "un_0_x", transport=httpx.MockTransport(slow)) as client:
        claim = await client.claim(0)
    assert claim is not None and 0 < claim.lease_seconds <= 2.4 + 1e-6, claim
