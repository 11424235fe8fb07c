"""`umbra events tail --follow` over a server that restarts: a 5xx or a dropped stream is waited
out and the stream resumed from the last event printed; a refusal of the request itself ends it."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from umbra import cli_events
from umbra.agent.client import ServiceError

pytestmark = pytest.mark.anyio


def _event(position: int) -> bytes:
    event = {"position": position, "stream": "job:00000000-0000-0000-0000-000000000001", "version": position,
             "type": "job.submitted", "data": {}, "recorded_at": "2026-12-01T00:00:00Z"}  # fmt: skip
    return b"id: %d\nevent: job.submitted\ndata: %s\n\n" % (position, json.dumps(event).encode())


async def test_follow_waits_out_a_5xx_resumes_where_it_was_and_stops_at_the_streams_error(capsys):
    seen: list[str | None] = []
    answers = [
        lambda: httpx.Response(200, content=_event(1) + _event(2), headers={"content-type": "text/event-stream"}),
        lambda: httpx.Response(503, json={"error": "database_unavailable", "message": "try again"},
                               headers={"Retry-After": "0"}),  # fmt: skip
        lambda: httpx.Response(200, content=_event(3) + b"event: error\ndata: "
                               + json.dumps({"error": "unauthenticated", "message": "revoked"}).encode() + b"\n\n"),
    ]  # fmt: skip

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("last-event-id"))
        return answers[len(seen) - 1]()

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://umbra") as client:
        with anyio.fail_after(20), pytest.raises(ServiceError) as refused:
            await cli_events._follow(client, 0, True)
    assert refused.value.status == 401 and refused.value.code == "unauthenticated"
    assert seen == ["0", "2", "2"]  # after the first stream ended at 2, both reconnects resume after it
    printed = [json.loads(line)["position"] for line in capsys.readouterr().out.splitlines()]
    assert printed == [1, 2, 3]


async def test_follow_ends_on_a_refused_request():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, json={"error": "forbidden", "message": "This credential lacks the scope events:read."})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://umbra") as client:
        with anyio.fail_after(5), pytest.raises(ServiceError) as refused:
            await cli_events._follow(client, 0, True)
    assert refused.value.status == 403
