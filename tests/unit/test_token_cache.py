"""The verified-token cache of a server that runs for months: what it keeps, and what it lets go.

Entries are kept a minute from their last use, least recently used first out past the cap, never all at
once; wrong-secret counts are kept for the window from a prefix's last guess, the prefix guessed longest
ago first out past the cap, never all at once (that would let every guesser start again).
A token used once must not stay until the cap (about 1 KB each, 100,000 of them), and reaching the cap must
not send every agent in use back to argon2 at the same moment.
"""

from __future__ import annotations

from uuid import uuid4

import pytest

from umbra.compute import auth
from umbra.compute.auth import Principal, VerifiedTokenCache
from umbra.errors import RateLimited


class Clock:
    """``time`` as :mod:`umbra.compute.auth` reads it, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(auth, "time", fake)
    return fake


def principal() -> Principal:
    return Principal(kind="api_key", credential_id=uuid4(), organization_id=uuid4(), scopes=frozenset({"jobs:read"}))


def token(n: int) -> str:
    return f"uk_{n:010x}_secret-{n}"


def test_a_token_used_once_is_let_go_after_its_minute_without_being_presented_again(clock):
    cache = VerifiedTokenCache(ttl_seconds=60)
    for n in range(400):
        cache.put(token(n), principal())
    regular = principal()
    cache.put(token(999), regular)
    clock.now += 61
    cache.put(token(999), regular)  # the server goes on serving its one regular key
    assert cache.get(token(999)) is regular
    assert [cache.get(token(n)) for n in range(400)] == [None] * 400
    assert len(cache._entries) == 1


def test_each_use_keeps_a_token_another_minute(clock):
    cache = VerifiedTokenCache(ttl_seconds=60)
    who = principal()
    cache.put(token(1), who)
    for _ in range(10):  # ten minutes of use, a request every 50 s
        clock.now += 50
        assert cache.get(token(1)) is who
    clock.now += 61
    assert cache.get(token(1)) is None


def test_past_the_cap_the_least_recently_used_go_and_the_tokens_in_use_stay(clock):
    cache = VerifiedTokenCache(ttl_seconds=60, max_entries=300)
    in_use = {n: principal() for n in range(5)}
    for n, who in in_use.items():
        cache.put(token(n), who)
    for n in range(100, 395):  # a crowd of tokens used once, the cache near its cap
        cache.put(token(n), principal())
    for n in in_use:
        assert cache.get(token(n)) is in_use[n]  # used again: the most recent
    for n in range(400, 420):  # past the cap
        cache.put(token(n), principal())
    assert len(cache._entries) == 300
    assert all(cache.get(token(n)) is in_use[n] for n in in_use), "a token in use was evicted with the crowd"
    assert cache.get(token(100)) is None and cache.get(token(419)) is not None


def test_forgetting_a_credential_drops_its_tokens_only(clock):
    cache = VerifiedTokenCache()
    doomed, kept = principal(), principal()
    cache.put(token(1), doomed)
    cache.put(token(2), kept)
    cache.forget_credential(doomed.credential_id)
    assert (cache.get(token(1)), cache.get(token(2))) == (None, kept)


def test_wrong_secret_counts_leave_with_their_window_and_the_cap_drops_the_oldest_only(clock):
    """Other prefixes' wrong secrets never reset the count of the prefix being guessed (below the cap); past
    the cap the prefix guessed longest ago leaves, not every one; past the window every count leaves."""
    cache = VerifiedTokenCache(max_entries=50, max_failures=20, failure_window_seconds=60)
    for _ in range(20):
        cache.note_failure("guessed")
    for n in range(40):  # other prefixes with a wrong secret each, below the cap
        clock.now += 0.1
        cache.note_failure(f"p{n}")
    with pytest.raises(RateLimited):
        cache.refuse_if_guessed("guessed")
    for n in range(40, 240):  # past the cap
        clock.now += 0.1
        cache.note_failure(f"p{n}")
    assert len(cache._failures) == 50 and "p239" in cache._failures and "p0" not in cache._failures
    clock.now += 61
    cache.note_failure("late")
    assert list(cache._failures) == ["late"], "prefixes not guessed within the window are let go"
