"""A payload's and a result's numbers are kept exactly as written, in the log, the views, the API and the CLI.

A number with a fraction or an exponent used to be read as a double: the
submitter's ``0.10000000000000000000000001`` was recorded as ``0.1``, a
19-digit fraction lost its last digits, and ``1e400`` was refused as out of
range, though PostgreSQL's ``jsonb`` holds every one of them exactly.
"""

from __future__ import annotations

import json
from decimal import Decimal

import psycopg
import pytest

from tests.helpers import bearer
from tests.integration.queue_support import http_claim, http_pair

pytestmark = pytest.mark.anyio

#: Numbers a double cannot hold, written as a client might write them.
WRITTEN = (
    b'{"fraction": 0.10000000000000000000000001, "money": 12345678901234567.89, "tiny": 1.5e-7,'
    b' "huge": 1e400, "integer": 123456789012345678901234567890, "nested": [{"x": 2.50}]}'
)
#: The same document as PostgreSQL's jsonb gives it back (exponents written out, a fraction's scale kept).
STORED = {
    "fraction": Decimal("0.10000000000000000000000001"),
    "money": Decimal("12345678901234567.89"),
    "tiny": Decimal("1.5E-7"),
    "huge": Decimal("1e400"),
    "integer": 123456789012345678901234567890,
    "nested": [{"x": Decimal("2.50")}],
}


def exact(text: str | bytes):
    """JSON read with every number exact, to compare with :data:`STORED` (``Decimal`` compares by value)."""
    return json.loads(text, parse_float=Decimal, parse_int=int)


async def _submit(client, key: str, payload: bytes = WRITTEN) -> dict:
    body = b'{"kind": "echo", "requires": {}, "payload": ' + payload + b"}"
    response = await client.post("/v1/jobs", content=body, headers={**bearer(key), "Content-Type": "application/json"})
    assert response.status_code == 201, response.text
    return response.json()


async def test_a_payloads_numbers_are_stored_and_shown_exactly(client, conn, org):
    """The answer, the job, the job's row and its submission event all hold the numbers as written."""
    _, key = org
    submitted = await _submit(client, key)
    assert exact((await client.get(f"/v1/jobs/{submitted['id']}", headers=bearer(key))).text)["payload"] == STORED
    row = await (await conn.execute("SELECT payload::text FROM jobs WHERE id = %s", (submitted["id"],))).fetchone()
    assert exact(row[0]) == STORED
    events = exact((await client.get("/v1/events", params={"after": 0}, headers=bearer(key))).text)["events"]
    assert [e["data"]["payload"] for e in events if e["type"] == "job.submitted"] == [STORED]
    queue = exact((await client.get("/v1/projections/queue", headers=bearer(key))).text)
    assert [j["payload"] for j in queue["jobs"] if j["id"] == submitted["id"]] == [STORED]


async def test_a_number_past_a_doubles_range_is_accepted_not_refused(client, org):
    """``1e400`` is a JSON number PostgreSQL holds; it is not the client's mistake."""
    _, key = org
    submitted = await _submit(client, key, b'{"huge": 1e400, "negative": -1e-400}')
    shown = exact((await client.get(f"/v1/jobs/{submitted['id']}", headers=bearer(key))).text)["payload"]
    assert shown == {"huge": Decimal("1e400"), "negative": Decimal("-1e-400")}


#: Numbers at the edges of what ``numeric`` holds: 131,072 digits before the point, 16,383 after.
EDGES = ("9.99e131071", "1e131072", "-1e131072", "1e-16383", "1.5e-16383", "1e-16384", "0e-16383", "0e-16384",
         "123456.7e131066", "123456.7e131067", "1e2", "-0.0")


async def test_the_numbers_refused_as_unstorable_are_exactly_those_postgresql_refuses(conn):
    """``documents.storable_number`` is asked before anything is written; PostgreSQL is the judge it stands for."""
    from umbra.events.documents import storable_number

    for text in EDGES:
        try:
            await conn.execute("SELECT %s::jsonb", (f"[{text}]",))
            stored = True
        except psycopg.errors.NumericValueOutOfRange:
            stored = False
        assert storable_number(Decimal(text)) is stored, text
    assert {storable_number(Decimal(t)) for t in EDGES} == {True, False}  # the edges hold both


async def test_a_number_postgresql_cannot_store_is_refused_naming_where_it_is_and_writes_nothing(client, conn, org):
    """``1e200000`` reads as a ``Decimal``, but ``jsonb`` cannot hold it: a 422 naming the field (and in a
    batch the item), before anything is written, not the database's refusal of the whole command."""
    _, key = org
    headers = {**bearer(key), "Content-Type": "application/json"}
    single = await client.post("/v1/jobs", content=b'{"kind": "echo", "payload": {"a": [{"b": 1.5e-16383}]}}',
                               headers=headers)  # fmt: skip
    assert single.status_code == 422 and single.json()["field"] == "payload", single.text
    items = [b'{"kind": "echo", "payload": {"i": %d}}' % i for i in range(3)] + [b'{"kind": "echo", "payload": {"x": 1e200000}}']
    batch = await client.post("/v1/jobs/batch", content=b'{"jobs": [' + b", ".join(items) + b"]}", headers=headers)
    assert batch.status_code == 422, batch.text
    assert (batch.json()["error"], batch.json()["index"], batch.json()["field"]) == ("invalid_request", 3, "jobs[3].payload")
    assert (await (await conn.execute("SELECT count(*) FROM jobs")).fetchone())[0] == 0


async def test_a_batchs_payloads_written_by_copy_keep_their_numbers(client, conn, org):
    """A batch large enough to be written by COPY keeps each payload's numbers too."""
    _, key = org
    jobs = b", ".join([b'{"kind": "echo", "payload": {"i": %d.000000000000000000001}}' % i for i in range(400)])
    response = await client.post("/v1/jobs/batch", content=b'{"jobs": [' + jobs + b"]}",
                                 headers={**bearer(key), "Content-Type": "application/json"})  # fmt: skip
    assert response.status_code == 201, response.text
    rows = await (await conn.execute("SELECT payload::text FROM jobs ORDER BY seq")).fetchall()
    assert [exact(text)["i"] for (text,) in rows] == [Decimal(f"{i}.000000000000000000001") for i in range(400)]


async def test_a_results_numbers_are_recorded_exactly_and_the_views_agree_with_the_log(client, org):
    """An agent's result keeps its numbers, and a rebuild from the log finds the views equal to it."""
    _, key = org
    submitted = await _submit(client, key)
    _, credential = await http_pair(client, key)
    job = await http_claim(client, credential)
    assert job["id"] == submitted["id"]
    done = await client.post(f"/v1/agent/jobs/{job['id']}/complete", headers={**bearer(credential), "Content-Type": "application/json"},
                             content=b'{"attempt": %d, "result": {"loss": 0.333333333333333333333333333}}' % job["attempt"])  # fmt: skip
    assert done.status_code == 200, done.text
    shown = exact((await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).text)
    assert shown["result"] == {"loss": Decimal("0.333333333333333333333333333")}
    assert shown["payload"] == STORED
    verified = await client.post("/v1/projections/verify", headers=bearer(key))
    assert verified.json() == {"ok": True, "differences": []}


async def test_the_command_line_prints_the_numbers_the_service_sent(cli, client, live_server, org):
    """``umbra events replay --json`` and ``umbra events tail`` print the payload's numbers as recorded."""
    _, key = org
    submitted = await _submit(client, key)
    status, out, err = await cli("events", "replay", submitted["id"], "--server", live_server.url, "--api-key", key, "--json")
    assert status == 0, err
    assert exact(out)["state"]["payload"] == STORED
    status, out, err = await cli("events", "tail", "--server", live_server.url, "--api-key", key, "--json")
    assert status == 0, err
    events = [exact(line) for line in out.splitlines()]
    assert [e["data"]["payload"] for e in events if e["type"] == "job.submitted"] == [STORED]


#: Numbers jsonb holds and writes back with nothing after the point, around the longest JSON integer the
#: service reads again (4,300 characters, a minus sign counted).
WRITTEN_OUT = ("1e4299", "1e4300", "-1e4298", "-1e4299", "9.9e4299", "1.5e4298", "1.5e4299", "10e4298", "0e5000",
               "-0e5000", "1.0e4299", "1e-5000")


async def test_the_numbers_refused_as_unreadable_are_exactly_those_jsonb_gives_back_too_long_to_read(conn):
    """``documents.readable_number`` stands for the decoder reading a number as ``jsonb`` writes it back (the
    decoder itself: what an earlier release stored past it is read again only by ``documents.decode_stored``)."""
    from umbra.events.documents import decoder, readable_number

    for text in WRITTEN_OUT:
        [(written,)] = await (await conn.execute("SELECT (%s::jsonb)::text", (f"[{text}]",))).fetchall()
        try:
            decoder().decode(written)
            readable = True
        except ValueError:
            readable = False
        assert readable_number(Decimal(text)) is readable, text
    assert {readable_number(Decimal(t)) for t in WRITTEN_OUT} == {True, False}  # the edges hold both


async def test_a_number_jsonb_would_give_back_as_an_integer_too_long_to_read_is_refused_and_writes_nothing(client, conn, org):
    """``1e5000`` is stored, but ``jsonb`` gives it back as 5,001 digits, which the decoder refuses as out of
    range: every read of the job, of its organization's job list and log, and a verification failed (500).
    It is refused (422, naming the field and the item) before anything is written, in a payload and in a
    result; the longest number that reads back is stored, and read back exactly."""
    _, key = org
    headers = {**bearer(key), "Content-Type": "application/json"}
    for payload in (b'{"n": 1e5000}', b'{"a": [{"b": -1e4299}]}'):
        single = await client.post("/v1/jobs", content=b'{"kind": "echo", "payload": %s}' % payload, headers=headers)
        assert (single.status_code, single.json()["field"]) == (422, "payload"), single.text
    items = [b'{"kind": "echo", "payload": {"i": %d}}' % i for i in range(300)] + [b'{"kind": "echo", "payload": {"x": 1.5e4300}}']
    batch = await client.post("/v1/jobs/batch", content=b'{"jobs": [' + b", ".join(items) + b"]}", headers=headers)
    assert (batch.status_code, batch.json().get("index"), batch.json().get("field")) == (422, 300, "jobs[300].payload"), batch.text[:300]
    assert (await (await conn.execute("SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM events)")).fetchone()) == (0, 0)
    submitted = await _submit(client, key, b'{"n": 1e4299, "m": -1e4298, "zero": 0e5000}')
    shown = exact((await client.get(f"/v1/jobs/{submitted['id']}", headers=bearer(key))).text)["payload"]
    assert shown == {"n": Decimal("1e4299"), "m": Decimal("-1e4298"), "zero": 0}
    _, credential = await http_pair(client, key)
    job = await http_claim(client, credential)
    refused = await client.post(f"/v1/agent/jobs/{job['id']}/complete", headers={**bearer(credential), "Content-Type": "application/json"},
                                content=b'{"attempt": %d, "result": {"loss": 1e4300}}' % job["attempt"])  # fmt: skip
    assert (refused.status_code, refused.json()["field"]) == (422, "result"), refused.text
    assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
    verified = await client.post("/v1/projections/verify", headers=bearer(key))
    assert verified.json() == {"ok": True, "differences": []}
