"""A job's ``max_runtime_s`` is part of its shape, the key of the queue's index (``jobs_by_shape``), whose
entries PostgreSQL caps at about 2.7 kB: the limit's digits share the budget of the kind and the names, so an
accepted job can always be queued."""

from __future__ import annotations

import json
import random
import string

import pytest

from tests.helpers import bearer

from .test_repeated_reports import paired

pytestmark = pytest.mark.anyio


async def test_a_runtime_limit_too_long_for_the_queues_index_is_refused_not_left_to_break_the_registry(client, conn, org):
    """Rule: bad input gets a clear 422 and writes nothing (API.md); a request never answers 500.

    The kind and the names in ``requires`` share a 1,500-byte budget so that a job's shape always fits the
    index (test_claim_kinds), but ``max_runtime_s`` (any size, up to the decoder's 4,300 digits) is in the
    same key and was not counted. A job naming an unregistered model is stored ``blocked`` (blocked rows are
    not in the index), answered 201; registering the model re-examines it, and queuing it fails on the index
    ("index row size ... exceeds btree version 4 maximum 2704"): ``PUT /v1/models/m`` answered 500, and so
    would every later change that re-examines the organization's waiting jobs (the registry, drains,
    cordons), for as long as the job waits."""
    org_id, key = org
    await paired(conn, org_id, "box")
    rng = random.Random(11)  # random, so nothing compresses the index entry
    kind = "".join(rng.choice(string.ascii_lowercase) for _ in range(200))
    domains = ["local", *("".join(rng.choice(string.ascii_lowercase) for _ in range(100)) for _ in range(9))]
    limit = "9" + "".join(rng.choice(string.digits) for _ in range(3999))
    body = json.dumps({"kind": kind, "requires": {"models": ["m"], "trust_domains": domains, "max_runtime_s": 1}})
    body = body.replace('"max_runtime_s": 1', f'"max_runtime_s": {limit}')
    submitted = await client.post("/v1/jobs", content=body.encode(),
                                  headers={**bearer(key), "Content-Type": "application/json"})  # fmt: skip
    registered = await client.put("/v1/models/m", json={"vram_min_mb": 0}, headers=bearer(key))
    assert (submitted.status_code, registered.status_code) == (422, 200), (submitted.text[:200], registered.text[:200])
    assert submitted.json()["error"] == "invalid_request"
    assert (await (await conn.execute("SELECT count(*) FROM jobs")).fetchone())[0] == 0
