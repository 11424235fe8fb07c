"""A credential revoked while its request is open does not act: not while a body arrives, nor in a long-poll.

A route that reads a body reads it with no connection held, however slowly
the client sends it, and checks the credential again once it has arrived; a
parked long-poll is woken by its node's revocation and refused.
"""

from __future__ import annotations

import time

import anyio
import httpx
import psycopg
import pytest

from tests.helpers import bearer, eventually, waiting_on_a_lock
from umbra.compute import jobs as compute_jobs
from umbra.compute import pairing as compute_pairing
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


async def _count(conn, sql: str, *params) -> int:
    return (await (await conn.execute(sql, params)).fetchone())[0]


async def test_a_key_revoked_while_an_invalid_body_arrives_is_refused_401_not_422(conn, org, client):
    """The credential comes first: a key revoked while its body arrived is 401 even when the body is invalid,
    not 422 naming the field."""
    org_id, key = org
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200  # cached

    async def revoke():
        await revoke_api_key(conn, org_id, await _key_id(conn, org_id))

    answer = await _slow_post(client, "/v1/jobs", key, b'{"kind": ', b"5}", revoke)
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 401  # revoked for good
    assert answer.status_code == 401, f"revoked key answered {answer.status_code} {answer.text}"


async def test_a_key_revoked_while_its_pairing_code_is_hashed_issues_no_code(conn, org, client, db_url, monkeypatch):
    """The code is hashed (argon2id, ~70 ms) before the transaction that stores it, which checks the key: a
    revocation that commits while the code is hashed issues no code (one would mint a node credential in the
    organization after the key's revocation)."""
    org_id, key = org
    assert (await client.get("/v1/nodes", headers=bearer(key))).status_code == 200
    key_id = await _key_id(conn, org_id)
    original = compute_pairing._code_hash

    async def hash_while_the_key_is_revoked(code, salt):
        # An administrator's revocation commits while the server hashes the code.
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
            await revoke_api_key(other, org_id, key_id)
        return await original(code, salt)

    monkeypatch.setattr(compute_pairing, "_code_hash", hash_while_the_key_is_revoked)
    answer = await client.post("/v1/pairings", json={"name": "backdoor"}, headers=bearer(key))
    monkeypatch.setattr(compute_pairing, "_code_hash", original)
    revoked_at = await _count(conn, "SELECT count(*) FROM api_keys WHERE id = %s AND revoked_at IS NOT NULL", key_id)
    codes = await _count(conn, "SELECT count(*) FROM pairing_codes WHERE organization_id = %s", org_id)
    assert revoked_at == 1
    assert (answer.status_code, codes) == (401, 0), f"answered {answer.status_code}; codes issued: {codes}"


async def test_a_key_revoked_while_its_keyed_submission_waits_submits_nothing(conn, org, client, db_url):
    """A keyed submission waits for its idempotency lock (another submission holds it) while its key is
    revoked: the key is checked again in the command's transaction once the command is done, so nothing is
    written and the answer is 401."""
    org_id, key = org
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
    key_id = await _key_id(conn, org_id)
    answer: dict = {}

    async def submit():
        answer["r"] = await client.post("/v1/jobs", json={"kind": "echo", "idempotency_key": "k1"}, headers=bearer(key))

    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as holder:
        async with anyio.create_task_group() as tg:
            async with holder.transaction():
                await compute_jobs.lock_idempotency_keys(holder, org_id, ["k1"])  # another keyed submission in flight
                tg.start_soon(submit)
                await eventually(lambda: waiting_on_a_lock(conn), timeout=10)
                await revoke_api_key(conn, org_id, key_id)  # committed (autocommit) before the submission writes
    jobs = await _count(conn, "SELECT count(*) FROM jobs WHERE organization_id = %s", org_id)
    assert (answer["r"].status_code, jobs) == (401, 0), f"revoked key answered {answer['r'].status_code}; jobs: {jobs}"
