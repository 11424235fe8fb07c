"""U+0000 cannot be stored by PostgreSQL: such requests are refused, not 500s, and write nothing."""

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
