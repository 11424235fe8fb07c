"""How often one credential may ask for something that holds its neighbours back: a bucket per key.

A give-back of an unread claim (``POST /v1/agent/claim/release``) holds its
node's claim guard exclusively until it commits, and the guard is shared by a
64th of the organization's nodes: each of their claims in that moment claims
nothing and looks again 20 ms later, and a ``wait=0`` claim answers 204. An
agent does it once per claim request it gave up on; one that sent them back to
back (a bug, a loop) kept its neighbours' ``wait=0`` claims answering 204 with
work queued. So each node may send :data:`RELEASE_BURST` at once and
:data:`RELEASES_PER_SECOND` after that; past it the request is refused 429
``rate_limited`` with ``Retry-After``, before any work.

Kept in the process's memory: behind a load balancer each process allows its
own share, which still bounds what one node can do to its neighbours.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable, Hashable

from umbra.errors import RateLimited

#: Give-backs of unread claims one node may send at once: a stopping agent gives back every claim request
#: it had in flight, one per slot.
RELEASE_BURST = 20
#: ... and per second after that. An agent gives up a claim request at most once per long-poll.
RELEASES_PER_SECOND = 5.0


class RequestRates:
    """A token bucket per key: ``burst`` requests at once, then ``per_second``.

    Only keys that asked lately take memory: a key's bucket is dropped once
    it has refilled (it would allow a whole burst again anyway), and past
    ``max_keys`` the one that asked longest ago leaves first.
    """

    def __init__(self, per_second: float, burst: int, *, max_keys: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not per_second > 0 or burst < 1:
            raise ValueError("a rate needs a positive refill and a burst of at least one")
        self._per_second = per_second
        self._burst = burst
        self._max_keys = max_keys
        self._clock = clock
        #: Key -> (tokens left, when counted), the key that asked longest ago first.
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

    def take(self, key: Hashable, what: str) -> None:
        """Count one request of ``key``, or refuse it (:class:`RateLimited`, saying ``what`` was asked too often)."""
        now = self._clock()
        self._forget_refilled(now)
        tokens, counted = self._buckets.pop(key, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - counted) * self._per_second)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            retry_after = max(1, math.ceil((1.0 - tokens) / self._per_second))
            raise RateLimited(f"Too many {what} from this credential; try again in {retry_after} s.", retry_after)
        self._buckets[key] = (tokens - 1.0, now)
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)

    def _forget_refilled(self, now: float) -> None:
        refilled_after = self._burst / self._per_second
        while self._buckets:
            _, (_, counted) = next(iter(self._buckets.items()))
            if now - counted < refilled_after:
                break
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)
