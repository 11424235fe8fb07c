"""Node credentials through compute.auth: verification does not stall the event loop."""

from __future__ import annotations

import threading

import pytest

from umbra.compute.auth import VerifiedTokenCache, authenticate
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code

pytestmark = pytest.mark.anyio


async def test_verifying_a_credential_leaves_the_event_loop_free(conn, org, monkeypatch):
    """argon2id takes tens of milliseconds: on the event loop's thread it would stall every request."""
    from umbra.compute import auth

    code = (await issue_pairing_code(conn, org[0], "gpu-box")).code
    credential = (await redeem_pairing_code(conn, code=code, name="gpu-box", source="10.0.0.1")).credential
    verified_on: list[int] = []
    real = auth.verify_secret

    def recording(*args):
        verified_on.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(auth, "verify_secret", recording)
    who = await authenticate(conn, credential, VerifiedTokenCache())
    assert who.node_id is not None
    assert verified_on and threading.get_ident() not in verified_on
