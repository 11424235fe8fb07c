"""Wrong secrets for one key's prefix sent at once are bounded as those sent one after another are.

API.md: "Over 20 wrong secrets for one key's prefix within a minute: further tokens of that prefix that
this process has not already verified → 429 `rate_limited` ... before any verification (each wrong
secret costs an argon2 check)". The count of wrong secrets was only checked when a request arrived and
only raised once its verification had failed: requests sent together all found the count at zero, and
each of them ran its argon2 verification.
"""

from __future__ import annotations

import threading

import anyio
import pytest

from umbra.compute import auth
from umbra.errors import RateLimited, Unauthenticated
from umbra.security import verify_secret

pytestmark = pytest.mark.anyio

#: Wrong secrets sent at once: more than the limit, fewer than anyio's worker threads.
AT_ONCE = 30


async def test_wrong_secrets_sent_at_once_cost_no_more_verifications_than_the_limit(conn, org, monkeypatch):
    _, key = org
    kind, prefix, _secret = key.split("_", 2)
    verified: list[str] = []
    lock = threading.Lock()
    enough = threading.Event()

    def counting(stored_hash: str, secret: str) -> bool:
        with lock:
            verified.append(secret)
            if len(verified) > auth.MAX_FAILED_VERIFICATIONS:
                enough.set()
        enough.wait(1.0)  # keep the verifications under way together (at most a second)
        return verify_secret(stored_hash, secret)

    monkeypatch.setattr(auth, "verify_secret", counting)
    cache = auth.VerifiedTokenCache()
    answers: list[type] = []

    async def guess(i: int) -> None:
        try:
            await auth.authenticate(conn, f"{kind}_{prefix}_wrong-secret-{i}", cache)
        except (Unauthenticated, RateLimited) as refused:
            answers.append(type(refused))

    async with anyio.create_task_group() as tg:
        for i in range(AT_ONCE):
            tg.start_soon(guess, i)

    assert len(answers) == AT_ONCE
    assert len(verified) <= auth.MAX_FAILED_VERIFICATIONS, f"{len(verified)} argon2 verifications for one prefix"
    assert answers.count(RateLimited) == AT_ONCE - auth.MAX_FAILED_VERIFICATIONS
    # And the key itself, not yet verified by this process, waits out the window as the docs say.
    with pytest.raises(RateLimited):
        await auth.authenticate(conn, key, cache)
