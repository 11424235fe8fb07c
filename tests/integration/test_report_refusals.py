"""Refusals of an agent's reports: a result the database cannot store refuses a report of several results
(``POST /v1/agent/complete``) before anything lands, naming it; a decomposition's invalid body is 422 before
the job its path names is looked up."""

from __future__ import annotations

from uuid import uuid4

import pytest

from tests.helpers import bearer

from .test_repeated_reports import claim, claim_several, paired, submit

pytestmark = pytest.mark.anyio


async def test_a_number_the_database_cannot_store_refuses_the_report_naming_its_result_before_anything_lands(
        client, conn, org):  # fmt: skip
    """Rule: a refused request writes nothing, and a refused item of a list is named by its index (docs/API.md).

    ``1e200000`` decodes (free-form numbers are kept as ``Decimal``) but PostgreSQL's ``numeric`` cannot hold
    it. It was found only by the database: the report's batch rolled back and its completions ran one by
    one, A's landing and B's raising the driver's ``DataError`` for the whole request, 422 while A was
    recorded complete, so the agent, told its report was refused, could not know A landed. Now the body is
    refused as a NUL or a document too deep is, naming the result, and nothing lands."""
    org_id, _ = org
    _, credential = await paired(conn, org_id, "a")
    a, b = await submit(conn, org_id), await submit(conn, org_id)
    held = await claim_several(client, credential, 2)
    body = ('{"results": [{"job_id": "%s", "attempt": %d, "result": {"ok": 1}}, '
            '{"job_id": "%s", "attempt": %d, "result": {"x": [1e200000]}}]}'
            % (a.id, held[str(a.id)], b.id, held[str(b.id)]))  # fmt: skip
    answer = await client.post("/v1/agent/complete", content=body.encode(),
                               headers={**bearer(credential), "Content-Type": "application/json"})  # fmt: skip
    assert answer.status_code == 422, answer.text
    assert (answer.json()["error"], answer.json()["index"], answer.json()["field"]) == (
        "invalid_request", 1, "results[1].result"), answer.json()
    statuses = dict(await (await conn.execute("SELECT id::text, status FROM jobs")).fetchall())
    assert statuses == {str(a.id): "running", str(b.id): "running"}


async def test_a_result_that_is_one_unstorable_number_is_refused_as_one_inside_a_document_is(client, conn, org):
    """A result may be any JSON value, a bare number too: ``1e200000`` alone is refused as ``{"x": 1e200000}``
    is, naming it, before anything lands."""
    org_id, _ = org
    _, credential = await paired(conn, org_id, "a")
    job = await submit(conn, org_id)
    attempt = await claim(client, credential, job.id)
    headers = {**bearer(credential), "Content-Type": "application/json"}
    single = await client.post(f"/v1/agent/jobs/{job.id}/complete", headers=headers,
                               content=b'{"attempt": %d, "result": 1e200000}' % attempt)  # fmt: skip
    assert (single.status_code, single.json().get("field")) == (422, "result"), single.text
    report = await client.post("/v1/agent/complete", headers=headers, content=(
        b'{"results": [{"job_id": "%s", "attempt": %d, "result": -1e-20000}]}' % (str(job.id).encode(), attempt)))
    assert (report.status_code, report.json().get("index")) == (422, 0), report.text
    assert (await (await conn.execute("SELECT status FROM jobs")).fetchone())[0] == "running"


async def children_total(conn) -> int:
    return (await (await conn.execute("SELECT count(*) FROM jobs WHERE parent_job_id IS NOT NULL")).fetchone())[0]


@pytest.mark.parametrize("children", [
    [{"kind": "x", "depends_on": [0]}],  # a child depending on itself
    [{"kind": "x", "idempotency_key": "k"}, {"kind": "y", "idempotency_key": "k"}],  # one key twice
], ids=["self-dependency", "repeated-key"])
async def test_an_invalid_decomposition_is_422_before_the_job_is_looked_up(client, conn, org, children):
    """Rule (docs/API.md, "Where this server pins the contract down"): the path id's form, the query and the
    body come first; the object the id names is looked up last. "A well-formed id of no object sent with an
    invalid body is therefore 422, not 404."

    ``children`` checked a child's ``depends_on`` and repeated keys only after it had locked the job and
    checked its holder: the same invalid body was 404 ``job_not_found`` for an id of no job and 409
    ``job_not_claimed_by_this_node`` for a job another node holds, and 422 only for the holder."""
    org_id, _ = org
    _, holder = await paired(conn, org_id, "a")
    _, other = await paired(conn, org_id, "b")
    job = await submit(conn, org_id)
    attempt = await claim(client, holder, job.id)
    body = {"attempt": attempt, "children": children}
    answers = [await client.post(f"/v1/agent/jobs/{job_id}/children", headers=bearer(credential), json=body)
               for job_id, credential in ((job.id, holder), (uuid4(), holder), (job.id, other))]  # fmt: skip
    assert [(a.status_code, a.json()["error"]) for a in answers] == [(422, "invalid_request")] * 3, [a.text for a in answers]
    assert await children_total(conn) == 0
