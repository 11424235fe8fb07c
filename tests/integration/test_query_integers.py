"""Integer query parameters are ASCII digits: anything else is refused 422, naming the parameter.

Python's ``int()`` also reads digit-group underscores (``1_0`` → 10) and every
script's decimal digits (Arabic-Indic ``٣`` → 3): read that way, a cursor or a
limit silently became another number instead of a refusal.
"""

from __future__ import annotations

import pytest

from tests.helpers import bearer

pytestmark = pytest.mark.anyio

CASES = [
    ("/v1/events", "after", "1_0"),
    ("/v1/events", "limit", "\u0663"),  # ARABIC-INDIC DIGIT THREE
    ("/v1/jobs", "limit", "1_0"),
    ("/v1/jobs", "after", "\u0665"),  # ARABIC-INDIC DIGIT FIVE
    ("/v1/projections/queue", "limit", "2_0"),
]


@pytest.mark.parametrize(("path", "name", "value"), CASES)
async def test_a_non_integer_query_value_is_refused_naming_the_parameter(client, org, path, name, value):
    _, key = org
    response = await client.get(path, params={name: value}, headers=bearer(key))
    assert response.status_code == 422, f"{path}?{name}={value!r} answered {response.status_code}: {response.text[:200]}"
    assert response.json()["error"] == "invalid_request" and response.json()["field"] == name


async def test_an_as_of_that_is_not_an_integer_is_refused(client, org):
    _, key = org
    job = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()
    response = await client.get(f"/v1/jobs/{job['id']}", params={"as_of": "1_000"}, headers=bearer(key))
    assert response.status_code == 422, response.text[:200]
    assert response.json()["field"] == "as_of"


@pytest.mark.parametrize(("text", "value"), [("10", 10), (" 7 ", 7), ("+3", 3), ("-2", -2), ("0", 0),
                                             ("1_0", None), ("\u0663", None), ("", None), ("1.5", None),
                                             ("0x1f", None), ("\u00b2", None), ("- 1", None), ("1" * 5000, None)])  # fmt: skip
def test_an_integer_is_ascii_digits_with_an_optional_sign(text, value):
    from umbra.api.params import integer

    assert integer(text) == value


async def test_a_huge_integer_is_refused_422_not_500(client, org):
    """Python refuses to read more than 4,300 digits (ValueError): such a value is a refusal, not a server error."""
    _, key = org
    huge = "1" * 5000
    response = await client.get("/v1/jobs", params={"limit": huge}, headers=bearer(key))
    assert (response.status_code, response.json()["field"]) == (422, "limit"), response.text[:200]
    async with client.stream("GET", "/v1/events/stream", headers={**bearer(key), "Last-Event-ID": huge}) as streamed:
        assert streamed.status_code == 422


@pytest.mark.parametrize(("path", "name"), [("/v1/events", "after"), ("/v1/events", "limit"), ("/v1/jobs", "limit"),
                                            ("/v1/jobs", "after"), ("/v1/projections/queue", "limit")])  # fmt: skip
async def test_a_single_valued_parameter_given_twice_is_refused_naming_it(client, org, path, name):
    """Read as its last value, ``?limit=5&limit=500`` paged 500 at a time with no error."""
    _, key = org
    response = await client.get(path, params=[(name, "5"), (name, "500")], headers=bearer(key))
    assert response.status_code == 422, f"{path} answered {response.status_code}: {response.text[:200]}"
    assert response.json()["error"] == "invalid_request" and response.json()["field"] == name


async def test_a_status_filter_may_be_repeated_as_a_list(client, org):
    """``?status=blocked&status=cancelled`` is what HTTP libraries send for a list: read whole, as the comma-separated
    form is, not as its last item."""
    _, key = org
    blocked = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()  # no node could run it
    cancelled = (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).json()
    assert (await client.post(f"/v1/jobs/{cancelled['id']}/cancel", headers=bearer(key))).status_code == 200
    listed = await client.get("/v1/jobs", params=[("status", "blocked"), ("status", "cancelled")], headers=bearer(key))
    assert listed.status_code == 200 and [j["id"] for j in listed.json()["jobs"]] == [blocked["id"], cancelled["id"]]
    running_only = await client.get("/v1/jobs", params=[("status", "running"), ("status", "cancelled")], headers=bearer(key))
    assert [j["id"] for j in running_only.json()["jobs"]] == [cancelled["id"]]
