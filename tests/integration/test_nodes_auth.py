"""Credentials through compute.auth: verification does not stall the event loop, and a shared prefix decides nothing."""

from __future__ import annotations

import threading

import pytest

from umbra import security
from umbra.compute import accounts, credentials
from umbra.compute.accounts import create_api_key, create_organization
from umbra.compute.auth import NODE_SCOPES, VerifiedTokenCache, authenticate
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.errors import Unauthenticated

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


async def test_credentials_sharing_a_stored_prefix_each_authenticate_as_themselves_only(conn, org, monkeypatch):
    """The prefix only narrows the look-up: two API keys of two organizations, and two node credentials,
    minted with one prefix, each resolve to their own row (organization, scopes, node), and a token with
    that prefix and another secret resolves to none of them."""
    shared = "0" * security.PREFIX_LENGTH
    real = security.new_token

    def colliding(kind: str) -> tuple[str, str]:
        secret = real(kind)[0].split("_", 2)[2]
        return f"{kind}_{shared}_{secret}", shared

    monkeypatch.setattr(accounts, "new_token", colliding)
    monkeypatch.setattr(credentials, "new_token", colliding)
    org_id, _ = org
    other_id, _ = await create_organization(conn, "other")
    readers = await create_api_key(conn, org_id, ["jobs:read"])
    admins = await create_api_key(conn, other_id, ["nodes:admin"])
    nodes = [await redeem_pairing_code(conn, code=(await issue_pairing_code(conn, org_id, name)).code, name=name,
                                       source="10.0.0.1") for name in ("a", "b")]  # fmt: skip
    tokens = [readers, admins, *(n.credential for n in nodes)]
    assert {security.token_prefix(t, t.split("_", 1)[0]) for t in tokens} == {shared}
    expected = [("api_key", org_id, frozenset({"jobs:read"}), None),
                ("api_key", other_id, frozenset({"nodes:admin"}), None),
                *(("node", org_id, frozenset(NODE_SCOPES), n.node_id) for n in nodes)]  # fmt: skip
    for token, want in zip(tokens, expected):
        who = await authenticate(conn, token, VerifiedTokenCache())  # a fresh cache: looked up and verified
        assert (who.kind, who.organization_id, who.scopes, who.node_id) == want
    for token in tokens:
        kind, _, secret = token.split("_", 2)
        forged = f"{kind}_{shared}_{'A' * len(secret)}"
        with pytest.raises(Unauthenticated):
            await authenticate(conn, forged, VerifiedTokenCache())
