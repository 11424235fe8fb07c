"""How much lease an agent believes it has: the server's own measure, read against no clock."""

from __future__ import annotations

import httpx
import pytest

from umbra.agent.client import LEASE_LEFT_HEADER, lease_left

EXPIRES = "2026-12-01T12:01:00Z"
BODY = {"lease_expires_at": EXPIRES}


def answered(date: str, **headers: str) -> httpx.Response:
    return httpx.Response(200, headers={"date": date, **headers}, json=BODY)


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
