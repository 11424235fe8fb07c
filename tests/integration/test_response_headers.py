"""Headers every answer of a kind carries, whichever route gives it.

* An answer to a request that carries a credential (``Authorization``, or a stream's ``?access_token=``)
  is the organization's data, or says something about the credential: ``Cache-Control: no-store``, so
  no browser (the dashboard's) or proxy keeps a copy of it on disk. A route's own ``Cache-Control``
  (an event stream's ``no-cache``) is left as it is.
* A 401 ``unauthenticated`` says how to authenticate (``WWW-Authenticate: Bearer``), as HTTP requires
  of every 401 that asks for credentials.
* A path written with a trailing slash is redirected by its path alone (``Location: /v1/jobs``), never
  to an absolute address the server would build with the scheme it sees (``http`` behind a TLS proxy).
"""

from __future__ import annotations

import pytest

from tests.helpers import bearer

pytestmark = pytest.mark.anyio


async def test_answers_to_a_credential_are_not_stored(client, org):
    _, key = org
    job = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()
    answers = [
        await client.get("/v1/jobs", headers=bearer(key)),
        await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key)),
        await client.get("/v1/events", headers=bearer(key)),
        await client.get("/v1/jobs/00000000-0000-0000-0000-000000000000", headers=bearer(key)),  # a refusal too
        await client.get("/v1/jobs?limit=0", headers=bearer(key)),
        await client.get("/v1/jobs", headers=bearer("uk_0123456789_wrong")),
    ]
    assert [(a.status_code, a.headers.get("cache-control")) for a in answers] == [
        (200, "no-store"), (200, "no-store"), (200, "no-store"), (404, "no-store"), (422, "no-store"), (401, "no-store"),
    ]  # fmt: skip


async def test_answers_without_a_credential_keep_their_own_caching(client):
    assert "cache-control" not in (await client.get("/healthz")).headers
    assert "cache-control" not in (await client.get("/openapi.json")).headers


async def test_a_stream_keeps_its_own_cache_control(client, org):
    _, key = org
    async with client.stream("GET", "/v1/events/stream", params={"access_token": key}) as stream:
        assert stream.status_code == 200
        assert stream.headers["cache-control"] == "no-cache"


@pytest.mark.parametrize("authorization", [None, "Basic dXNlcjpwYXNz", "Bearer uk_0123456789_wrong", "Bearer"])
async def test_a_401_for_a_credential_names_the_scheme(client, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    answer = await client.get("/v1/jobs", headers=headers)
    assert (answer.status_code, answer.json()["error"]) == (401, "unauthenticated")
    assert answer.headers["www-authenticate"] == "Bearer"


async def test_a_wrong_pairing_code_is_no_challenge(client):
    """401 ``pairing_code_invalid`` is about the code in the body: no credential would change it."""
    answer = await client.post("/v1/pairings/redeem", json={"code": "000000", "name": "gpu-box"})
    assert (answer.status_code, answer.json()["error"]) == (401, "pairing_code_invalid")
    assert "www-authenticate" not in answer.headers


@pytest.mark.parametrize(
    "method, path, allowed",
    [
        ("OPTIONS", "/v1/jobs", {"GET", "HEAD", "POST"}),  # two routes share the path: each has its methods
        ("DELETE", "/v1/jobs", {"GET", "HEAD", "POST"}),
        ("GET", "/v1/models/gemma", {"PUT", "DELETE"}),
        ("POST", "/v1/jobs/00000000-0000-0000-0000-000000000000", {"GET", "HEAD"}),
    ],
)
async def test_a_405_allows_every_method_of_the_path(client, method, path, allowed):
    """HTTP's 405 lists the methods the path takes (``Allow``): not only those of the first route whose path matched."""
    answer = await client.request(method, path)
    assert (answer.status_code, answer.json()["error"]) == (405, "method_not_allowed")
    assert {m.strip() for m in answer.headers["allow"].split(",")} == allowed


@pytest.mark.parametrize("path, location", [
    ("/v1/jobs/", "/v1/jobs"),
    ("/v1/jobs/?status=queued&limit=2", "/v1/jobs?status=queued&limit=2"),
    ("/healthz//", "/healthz"),
])  # fmt: skip
async def test_a_trailing_slash_is_redirected_to_a_path_not_an_address(client, path, location):
    """The redirect names the path alone: behind a proxy that ends TLS the server sees ``http``, and an
    absolute address would send the client (its body, its key) there in the clear."""
    answer = await client.get(path, headers={"host": "umbra.example", "x-forwarded-proto": "https"}, follow_redirects=False)
    assert (answer.status_code, answer.headers["location"]) == (307, location)


async def test_a_post_with_a_trailing_slash_keeps_its_body_on_the_same_origin(client, org):
    _, key = org
    answer = await client.post("/v1/jobs/", json={"kind": "echo"}, headers=bearer(key), follow_redirects=True)
    assert answer.status_code == 201 and answer.json()["kind"] == "echo"
    assert str(answer.url).endswith("/v1/jobs")


async def test_an_unknown_path_with_a_trailing_slash_is_not_found(client):
    answer = await client.get("/v1/nowhere/", follow_redirects=False)
    assert (answer.status_code, answer.json()["error"]) == (404, "not_found")
    assert (await client.get("/v1//jobs/", follow_redirects=False)).status_code == 404
