"""Node credentials through compute.auth: verification does not stall the event loop."""

from __future__ import annotations

import anyio
import pytest

from umbra.compute.auth import VerifiedTokenCache, authenticate
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code

pytestmark = pytest.mark.anyio


async def test_verifying_a_credential_leaves_the_event_loop_free(conn, org):
    code = (await issue_pairing_code(conn, org[0], "gpu-box")).code
    credential = (await redeem_pairing_code(conn, code=code, name="gpu-box", source="10.0.0.1")).credential
    ticks = 0
    done = anyio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            await anyio.sleep(0.002)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.01)
        before = ticks
        who = await authenticate(conn, credential, VerifiedTokenCache())  # one argon2id verification
        during = ticks - before
        done.set()
    assert who.node_id is not None
    # argon2id takes tens of milliseconds; on the loop thread it would allow no tick at all.
    assert during >= 3
