"""Text PostgreSQL cannot store (U+0000, a lone UTF-16 surrogate) is refused as the client's mistake, not a 500,
and nothing is written."""

from __future__ import annotations

import pytest

from tests.helpers import bearer

pytestmark = pytest.mark.anyio


async def _counts(conn) -> tuple:
    row = await (await conn.execute(
        "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM jobs), (SELECT count(*) FROM models)")).fetchone()
    return tuple(row)


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("PUT", "/v1/models/m", b'{"vram_min_mb": 1, "kind": "llm\\u0000"}'),
        ("POST", "/v1/jobs/batch", b'{"jobs": [{"kind": "echo", "payload": {}, "requires": {}, "idempotency_key": "k\\u0000"}]}'),
        ("POST", "/v1/jobs", b'{"kind": "echo", "payload": {"a\\u0000": 1}, "requires": {}}'),
        # large enough to be written by COPY
        ("POST", "/v1/jobs/batch", b'{"jobs": [' + b'{"kind": "echo"}, ' * 400 + b'{"kind": "echo", "payload": {"s": "\\u0000"}}]}'),
    ],
)
async def test_nul_in_a_body_is_refused_and_writes_nothing(client, conn, org, method, path, body):
    _, key = org
    before = await _counts(conn)
    response = await client.request(method, path, content=body, headers={**bearer(key), "Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_request"
    assert await _counts(conn) == before


async def test_an_escaped_backslash_before_u0000_is_ordinary_text(client, org):
    _, key = org
    response = await client.post("/v1/jobs", content=b'{"kind": "echo", "payload": {"s": "\\\\u0000"}, "requires": {}}',
                                 headers={**bearer(key), "Content-Type": "application/json"})
    assert response.status_code == 201, response.text
    assert response.json()["payload"] == {"s": "\\u0000"}


async def test_nul_in_a_path_is_refused(client, org):
    _, key = org
    response = await client.put("/v1/models/a%00b", json={"vram_min_mb": 1}, headers=bearer(key))
    assert response.status_code in (404, 422), response.text


@pytest.mark.parametrize("field", ["payload", "kind", "idempotency_key", "lang"])
async def test_a_lone_surrogate_is_refused_as_an_invalid_request_not_a_server_error(client, conn, org, field):
    """JSON may spell ``\\ud800`` (a lone UTF-16 surrogate), which is no character: UTF-8, and so PostgreSQL,
    cannot carry it. A single submission or a batch carrying one is refused ``invalid_request``, and nothing is
    written."""
    _, key = org
    value = b'"a\\ud800b"'
    body = {
        "payload": b'{"kind":"k","payload":{"s":' + value + b"}}",
        "kind": b'{"kind":' + value + b"}",
        "idempotency_key": b'{"kind":"k","idempotency_key":' + value + b"}",
        "lang": b'{"kind":"k","lang":' + value + b"}",
    }[field]
    before = await _counts(conn)
    for path, raw in (("/v1/jobs", body), ("/v1/jobs/batch", b'{"jobs":[' + body + b"]}")):
        answer = await client.post(path, content=raw, headers={**bearer(key), "Content-Type": "application/json"})
        assert answer.status_code in (400, 422), (path, answer.status_code, answer.text[:300])
        assert answer.json()["error"] == "invalid_request"
    assert await _counts(conn) == before


@pytest.mark.parametrize("method,path,credential", [("GET", "/v1/jobs", "key"), ("POST", "/v1/agent/claim?wait=0", "node")])
async def test_nul_in_a_kind_of_the_query_is_refused_naming_it(client, conn, org, method, path, credential):
    """``?kind=`` names a job kind, which PostgreSQL's text cannot hold with a NUL: the listing met the
    database's refusal (its generic 422, naming no parameter), a claim looked for a kind no job can have."""
    from tests.integration.test_nodes_api import pair

    _, key = org
    _, node = await pair(client, key)
    before = await _counts(conn)
    answer = await client.request(method, path, params={"kind": "a\x00b"}, headers=bearer(key if credential == "key" else node))
    assert answer.status_code == 422, answer.text
    assert (answer.json()["error"], answer.json()["field"]) == ("invalid_request", "kind")
    assert await _counts(conn) == before
