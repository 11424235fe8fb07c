"""A credential revoked while its request is open does not act: not while a body arrives, nor in a long-poll.

A route that reads a body reads it with no connection held, however slowly
the client sends it, and checks the credential again once it has arrived; a
parked long-poll is woken by its node's revocation and refused.
"""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from tests.helpers import bearer
from umbra.compute.accounts import revoke_api_key

from .test_disclosure import _pair

pytestmark = pytest.mark.anyio


async def _key_id(conn, org_id):
    return (await (await conn.execute("SELECT id FROM api_keys WHERE organization_id = %s", (org_id,))).fetchone())[0]


async def _slow_post(client: httpx.AsyncClient, path: str, token: str, head: bytes, tail: bytes, revoke) -> httpx.Response:
    """POST whose body's first part is sent, then ``revoke()`` runs (and commits), then the rest is sent."""
    go_on = anyio.Event()

    async def body():
        yield head
        await go_on.wait()
        yield tail

    answer: dict = {}

    async def send():
        answer["r"] = await client.post(path, content=body(), headers={**bearer(token), "content-type": "application/json"})

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await anyio.sleep(1.5)  # the handler has authenticated (and checked revocation) by now
        await revoke()
        go_on.set()
    return answer["r"]


async def test_a_key_revoked_while_its_body_arrives_issues_no_pairing_code(conn, org, client):
    """A key revoked (``umbra admin revoke-key``) while its request's body arrived issues no pairing code: one
    would mint a node credential in the organization after the key's revocation."""
    org_id, key = org
    assert (await client.get("/v1/nodes", headers=bearer(key))).status_code == 200  # the key works, and is cached

    async def revoke():
        await revoke_api_key(conn, org_id, await _key_id(conn, org_id))

    answer = await _slow_post(client, "/v1/pairings", key, b'{"name": ', b'"backdoor"}', revoke)
    assert (await client.get("/v1/nodes", headers=bearer(key))).status_code == 401  # revoked for good
    if answer.status_code == 201:
        redeemed = await client.post("/v1/pairings/redeem", json={"code": answer.json()["code"], "name": "backdoor"})
        pytest.fail(f"a revoked key issued a pairing code after its revocation; redeeming it gave {redeemed.status_code} "
                    f"{sorted(redeemed.json())}")
    assert answer.status_code == 401, answer.text


async def test_a_key_revoked_while_its_body_arrives_submits_nothing(conn, org, client):
    org_id, key = org
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200

    async def revoke():
        await revoke_api_key(conn, org_id, await _key_id(conn, org_id))

    answer = await _slow_post(client, "/v1/jobs", key, b'{"kind": ', b'"after-revocation"}', revoke)
    jobs = (await (await conn.execute("SELECT count(*) FROM jobs WHERE organization_id = %s", (org_id,))).fetchone())[0]
    assert (answer.status_code, jobs) == (401, 0), f"revoked key answered {answer.status_code}; jobs written: {jobs}"


async def test_a_node_revoked_while_its_failure_report_arrives_records_nothing(conn, org, client):
    org_id, key = org
    node = await _pair(client, key, "gone")
    cred = node["credential"]
    assert (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).status_code == 201
    claim = await client.post("/v1/agent/claim", params={"wait": 5}, headers=bearer(cred))
    assert claim.status_code == 200, claim.text
    job = claim.json()["job"]

    async def revoke():
        r = await client.post(f"/v1/nodes/{node['node_id']}/revoke", headers=bearer(key))
        assert r.status_code == 200, r.text

    answer = await _slow_post(client, f"/v1/agent/jobs/{job['id']}/fail", cred,
                              b'{"attempt": %d, ' % job["attempt"], b'"error": "x", "retry": false}', revoke)
    types = [t for (t,) in await (await conn.execute(
        "SELECT type FROM events WHERE stream = %s ORDER BY version", (f"job:{job['id']}",))).fetchall()]
    assert answer.status_code == 401 and "job.failed" not in types, (answer.status_code, types)


async def test_a_long_poll_parked_when_its_node_is_revoked_is_refused_at_once(conn, org, client):
    """A long-poll parked when its node's credentials are revoked answers 401 at once, not 204 ("nothing yet,
    ask again") at its deadline, up to a minute later."""
    org_id, key = org
    node = await _pair(client, key, "parked")
    cred = node["credential"]
    answer: dict = {}

    async def poll():
        answer["r"] = await client.post("/v1/agent/claim", params={"wait": 30}, headers=bearer(cred))
        answer["after"] = time.monotonic() - revoked_at

    async with anyio.create_task_group() as tg:
        tg.start_soon(poll)
        await anyio.sleep(1.0)
        revoked_at = time.monotonic()
        revoked = await client.post(f"/v1/nodes/{node['node_id']}/revoke", headers=bearer(key))
        assert revoked.status_code == 200, revoked.text
    assert (await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(cred))).status_code == 401
    assert answer["r"].status_code == 401, f"parked long-poll of a revoked node answered {answer['r'].status_code}"
    assert answer["after"] < 10, f"answered {answer['after']:.1f} s after the revocation"
