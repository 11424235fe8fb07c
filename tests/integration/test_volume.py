"""Volume and limits, as a large fleet meets them.

* Paging: a listing paged while jobs arrive neither skips nor repeats a job; a cursor taken from another
  organization or another listing reveals nothing of it; a page exactly as long as what is left says
  there is more, and the next one is empty.
* The log over several pages, read and streamed, gives every event once and in order.
* A deep tree whose leaf fails settles every ancestor ``partial``; a wide one (400 children, claimed and
  completed a hundred at a time) settles ``complete``, its settlement last.
* A refused size (a batch, a body, a kind, the names in ``requires``, a device label) writes nothing.
* Unusual text in stored fields (line and paragraph separators, escapes, a BOM, CRLF) is echoed as sent
  by the listing, the log and its stream alike.
"""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from tests.helpers import bearer
from tests.integration.queue_support import CPU64_JSON

pytestmark = pytest.mark.anyio

GPU = {"kind": "gpu_discrete", "label": "gpu0", "vram_total_mb": 81920, "vram_free_mb": 81920, "ram_total_mb": 0,
       "ram_free_mb": 0, "throughput_factor": 4.0, "accelerators": ["cuda"], "resident_models": []}


async def _pair(client, key, name, devices):
    issued = await client.post("/v1/pairings", json={"name": name}, headers=bearer(key))
    redeemed = await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": name,
                                                              "agent_version": "1", "devices": devices})
    credential = redeemed.json()["credential"]
    beat = await client.post("/v1/agent/heartbeat", json={"devices": devices, "agent_version": "1"}, headers=bearer(credential))
    assert beat.status_code == 200, beat.text
    return redeemed.json()["node_id"], credential


async def _page_all(client, key, limit, **params):
    seen, after = [], None
    while True:
        query = {"limit": limit, **params, **({"after": after} if after else {})}
        page = await client.get("/v1/jobs", params=query, headers=bearer(key))
        assert page.status_code == 200, page.text
        body = page.json()
        seen += [j["id"] for j in body["jobs"]]
        if body["next"] is None:
            return seen
        after = body["next"]


# -- paging --------------------------------------------------------------------------------------------------------

async def test_job_paging_neither_skips_nor_repeats_while_jobs_arrive(client, org):
    _, key = org
    first = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "e", "payload": {"i": i}} for i in range(60)]},
                              headers=bearer(key))
    before = [j["id"] for j in first.json()["jobs"]]
    stop = anyio.Event()

    async def submitter():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=30) as other:
            i = 0
            while not stop.is_set():
                if i % 2:
                    await other.post("/v1/jobs", json={"kind": "late"}, headers=bearer(key))
                else:
                    await other.post("/v1/jobs/batch", json={"jobs": [{"kind": "late"}] * 5}, headers=bearer(key))
                i += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(submitter)
        await anyio.sleep(0.05)
        seen = await _page_all(client, key, 7)
        stop.set()
    assert len(seen) == len(set(seen)), "a job was listed twice"
    assert seen[: len(before)] == before, "the jobs there before paging began were not all listed, in order"
    everything = await _page_all(client, key, 1000)
    assert everything[: len(seen)] == seen, "the listing paged out of submission order"


async def test_a_cursor_from_another_organization_or_listing_reveals_nothing_foreign(client, org, conn):
    from umbra.compute.accounts import create_organization

    _, key = org
    _, other_key = await create_organization(conn, "other")
    mine = (await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "a"}] * 3}, headers=bearer(key))).json()["jobs"]
    await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "b"}] * 3}, headers=bearer(other_key))
    theirs = (await client.get("/v1/jobs", params={"limit": 1}, headers=bearer(other_key))).json()
    with_their_cursor = (await client.get("/v1/jobs", params={"after": theirs["next"]}, headers=bearer(key))).json()
    assert {j["organization_id"] for j in with_their_cursor["jobs"]} <= {mine[0]["organization_id"]}
    events_next = (await client.get("/v1/events", params={"limit": 2}, headers=bearer(key))).json()["next"]
    crossed = await client.get("/v1/jobs", params={"after": events_next}, headers=bearer(key))
    assert crossed.status_code in (200, 422)
    assert all(j["organization_id"] == mine[0]["organization_id"] for j in crossed.json().get("jobs", []))


async def test_status_filter_paging_with_limit_equal_to_the_matches(client, org):
    _, key = org
    await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "e"}] * 4}, headers=bearer(key))
    page = (await client.get("/v1/jobs", params={"status": "queued,blocked", "limit": 4}, headers=bearer(key))).json()
    assert len(page["jobs"]) == 4 and page["next"] is not None
    last = (await client.get("/v1/jobs", params={"status": "queued,blocked", "limit": 4, "after": page["next"]},
                             headers=bearer(key))).json()  # fmt: skip
    assert last == {"jobs": [], "next": None}


# -- the log over many events ----------------------------------------------------------------------------------------

async def test_paging_and_streaming_a_log_of_several_pages(client, org):
    _, key = org
    for _ in range(3):
        assert (await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "e"}] * 900}, headers=bearer(key))).status_code == 201
    paged, after = [], 0
    while True:
        page = (await client.get("/v1/events", params={"after": after, "limit": 1000}, headers=bearer(key))).json()
        if not page["events"]:
            assert page["next"] == after
            break
        paged += [e["position"] for e in page["events"]]
        after = page["next"]
    assert len(paged) == 5400 and paged == sorted(set(paged))
    streamed: list[int] = []
    with anyio.fail_after(20):
        async with client.stream("GET", "/v1/events/stream", params={"after": 0}, headers=bearer(key)) as response:
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    streamed.append(int(line[4:]))
                    if len(streamed) == len(paged):
                        break
    assert streamed == paged
    tail = (await client.get("/v1/events", params={"after": paged[1500], "limit": 5}, headers=bearer(key))).json()
    assert [e["position"] for e in tail["events"]] == paged[1501:1506] and tail["next"] == paged[1505]


# -- decomposition trees ----------------------------------------------------------------------------------------------

async def _claim(client, credential):
    claim = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))
    assert claim.status_code == 200, claim.text
    return claim.json()["job"]


async def test_a_deep_tree_settles_partial_to_the_root_and_a_wide_one_complete(client, org):
    _, key = org
    _, node = await _pair(client, key, "box", [CPU64_JSON])
    root = (await client.post("/v1/jobs", json={"kind": "root"}, headers=bearer(key))).json()
    depth = 12
    job = await _claim(client, node)
    chain = [job["id"]]
    for level in range(depth):
        made = await client.post(f"/v1/agent/jobs/{job['id']}/children",
                                 json={"attempt": job["attempt"], "children": [{"kind": f"l{level}"}]}, headers=bearer(node))
        assert made.status_code == 201, made.text
        job = await _claim(client, node)
        assert job["id"] == made.json()["children"][0]["id"]
        chain.append(job["id"])
    failed = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": 1, "error": "x", "retry": False},
                               headers=bearer(node))  # fmt: skip
    assert failed.status_code == 200 and failed.json()["status"] == "failed"
    for ancestor in chain[:-1]:
        status = (await client.get(f"/v1/jobs/{ancestor}", headers=bearer(key))).json()["status"]
        assert status == "partial", (chain.index(ancestor), status)
    assert chain[0] == root["id"]

    wide = (await client.post("/v1/jobs", json={"kind": "wide"}, headers=bearer(key))).json()
    parent = await _claim(client, node)
    assert parent["id"] == wide["id"]
    n = 400
    made = await client.post(f"/v1/agent/jobs/{parent['id']}/children",
                             json={"attempt": 1, "children": [{"kind": "c", "payload": {"i": i}} for i in range(n)]},
                             headers=bearer(node))  # fmt: skip
    assert made.status_code == 201 and len(made.json()["children"]) == n
    done = 0
    while done < n:
        claim = await client.post("/v1/agent/claim", params={"wait": 0, "max": 100}, headers=bearer(node))
        assert claim.status_code == 200, claim.text
        claims = claim.json().get("claims") or [claim.json()]
        results = [{"job_id": c["job"]["id"], "attempt": c["job"]["attempt"], "result": {}} for c in claims]
        answer = await client.post("/v1/agent/complete", json={"results": results}, headers=bearer(node))
        assert answer.status_code == 200 and all(r["status"] == 200 for r in answer.json()["results"])
        done += len(results)
    settled = (await client.get(f"/v1/jobs/{wide['id']}", headers=bearer(key))).json()
    assert settled["status"] == "complete", settled
    history = (await client.get(f"/v1/jobs/{wide['id']}/events", headers=bearer(key))).json()["events"]
    assert history[-1]["type"] == "job.settled"


# -- sizes and text --------------------------------------------------------------------------------------------------

async def _written(conn):
    row = await (await conn.execute("SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM jobs)")).fetchone()
    return tuple(row)


async def test_refused_sizes_write_nothing(client, org, conn):
    _, key = org
    _, node = await _pair(client, key, "box", [CPU64_JSON])
    before = await _written(conn)
    too_many = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "e"}] * 10_001}, headers=bearer(key))
    assert too_many.status_code == 422 and too_many.json()["error"] == "invalid_request"
    huge = {"kind": "e", "payload": {"blob": "x" * (1024 * 1024)}}
    assert (await client.post("/v1/jobs", json=huge, headers=bearer(key))).status_code == 413
    long_kind = await client.post("/v1/jobs", json={"kind": "k" * 201}, headers=bearer(key))
    assert long_kind.status_code == 422 and long_kind.json()["field"] == "kind"
    named = await client.post("/v1/jobs", json={"kind": "k", "requires": {"models": [f"m{i:03}" for i in range(400)]}},
                              headers=bearer(key))  # fmt: skip
    assert named.status_code == 422
    labels = await client.post("/v1/agent/heartbeat", json={"devices": [dict(CPU64_JSON, label="l" * 201)]}, headers=bearer(node))
    assert labels.status_code == 422
    assert await _written(conn) == before


async def test_stored_odd_text_does_not_break_listings_or_the_stream(client, org):
    _, key = org
    odd = ["\u2028\u2029", "e\u0301", "\x1b[2J", " ", "\ufeffbom", "a\r\nb", "\U0001f600" * 50]
    for kind in odd:
        r = await client.post("/v1/jobs", json={"kind": kind, "payload": {kind: kind}}, headers=bearer(key))
        assert r.status_code in (201, 422), r.text
    listed = await client.get("/v1/jobs", headers=bearer(key))
    assert listed.status_code == 200
    kinds = [j["kind"] for j in listed.json()["jobs"]]
    assert kinds == [k for k in odd if k in kinds]
    events = (await client.get("/v1/events", headers=bearer(key))).json()["events"]
    got = []
    with anyio.fail_after(10):
        async with client.stream("GET", "/v1/events/stream", params={"after": 0}, headers=bearer(key)) as response:
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                while b"\n\n" in buffer:
                    message, buffer = buffer.split(b"\n\n", 1)
                    data = [line[6:] for line in message.split(b"\n") if line.startswith(b"data: ")]
                    if data:
                        got.append(json.loads(b"\n".join(data)))
                if len(got) >= len(events):
                    break
    assert [(e["position"], e["data"]) for e in got] == [(e["position"], e["data"]) for e in events]
