"""The per-key token bucket that bounds how often one node may hold its neighbours back (``api.rates``)."""

from __future__ import annotations

import pytest

from umbra.api.rates import RequestRates
from umbra.errors import RateLimited


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refused(rates: RequestRates, key) -> RateLimited:
    with pytest.raises(RateLimited) as caught:
        rates.take(key, "give-backs")
    return caught.value


def test_a_burst_is_allowed_then_refused_with_when_to_come_back():
    clock = Clock()
    rates = RequestRates(per_second=2.0, burst=3, clock=clock)
    for _ in range(3):
        rates.take("a", "give-backs")
    refusal = refused(rates, "a")
    assert refusal.status == 429 and refusal.code == "rate_limited" and refusal.retry_after == 1
    assert "give-backs" in refusal.message


def test_each_key_has_its_own_bucket():
    clock = Clock()
    rates = RequestRates(per_second=1.0, burst=2, clock=clock)
    rates.take("a", "x")
    rates.take("a", "x")
    refused(rates, "a")
    rates.take("b", "x")
    rates.take("b", "x")


def test_the_bucket_refills_at_its_rate_and_no_further_than_the_burst():
    clock = Clock()
    rates = RequestRates(per_second=4.0, burst=2, clock=clock)
    rates.take("a", "x")
    rates.take("a", "x")
    clock.now += 0.2  # 0.8 of a token
    refused(rates, "a")
    clock.now += 0.05  # refusals take nothing: 1.0 now
    rates.take("a", "x")
    refused(rates, "a")
    clock.now += 3600  # a long silence gives back a burst, not more
    rates.take("a", "x")
    rates.take("a", "x")
    refused(rates, "a")


def test_retry_after_is_the_whole_seconds_until_a_token_is_back():
    clock = Clock()
    rates = RequestRates(per_second=0.25, burst=1, clock=clock)
    rates.take("a", "x")
    assert refused(rates, "a").retry_after == 4
    clock.now += 2.5
    assert refused(rates, "a").retry_after == 2


def test_keys_that_refilled_take_no_memory_and_the_oldest_leave_past_the_cap():
    clock = Clock()
    rates = RequestRates(per_second=10.0, burst=5, max_keys=3, clock=clock)
    for key in range(3):
        rates.take(key, "x")
    assert len(rates) == 3
    rates.take(3, "x")  # past the cap: key 0, the one that asked longest ago, leaves
    assert len(rates) == 3
    clock.now += 0.5  # every bucket full again (5 tokens at 10 a second)
    rates.take("late", "x")
    assert len(rates) == 1


def test_a_key_whose_bucket_is_low_is_not_forgotten_when_others_ask():
    clock = Clock()
    rates = RequestRates(per_second=1.0, burst=2, clock=clock)
    rates.take("a", "x")
    rates.take("a", "x")
    clock.now += 0.5
    rates.take("other", "x")  # prunes the buckets that refilled: not "a"'s
    refused(rates, "a")  # 0.5 of a token
    clock.now += 0.5
    rates.take("a", "x")


def test_a_rate_needs_a_refill_and_a_burst():
    with pytest.raises(ValueError):
        RequestRates(per_second=0, burst=1)
    with pytest.raises(ValueError):
        RequestRates(per_second=1, burst=0)
