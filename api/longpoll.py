"""The waiter hub: thousands of parked long-polls, no database connection each.

A long-poll registers a :class:`Waiter` keyed by its organization and holds no
connection while it waits. The process's single LISTEN connection delivers
hints ``(organization, position, claimable)``; :meth:`WaiterHub.on_hint` hands
out at most ``claimable`` *wake tokens* to that organization's idle waiters,
oldest first, so one new job wakes one agent, not all of them.

A token is passed on, never lost: a waiter that wakes and cannot claim (the job
needs a GPU it lacks) hands its token to the next waiter that has not tried it,
so an agent that cannot run a job never starves one that can; the chain ends
when every waiter of the organization has tried. A waiter that leaves while
holding a token passes it on too. An attempt that answers :data:`NOTHING_QUEUED`
(no claimable job was left: none queued, or every one it could run was just
taken by other claimers) ends the chain at once: the work the token announced
is taken, and walking ten thousand waiters to learn that would cost ten
thousand claim transactions.

Notifications can be lost (the listener reconnects; a not_before delay expires
with no event at all), so :meth:`WaiterHub.safety_poll` runs once per process
every ``poll_fallback_seconds`` (jittered): one indexed query finds the
organizations that have a claimable-looking job, and each gets one *poll*
token. A poll token that leads to a claim spawns another (there may be more
work), so a round costs at most one attempt per waiter plus one per job. After a
listener reconnect, or a notification naming no organization (``*``: more moved
than one can name), every waiter re-checks once; after an ``umbra_recheck``
(a node's credentials revoked), every waiter of that organization.

A waiter clears its wake flag *before* each attempt, so a hint that arrives
while it is claiming makes it try again rather than being lost.

Commits made by this same process wake its waiters the same way as anyone
else's: the NOTIFY sent by a pooled connection comes back through the LISTEN
connection. One path means one behaviour to test, and ``bench/wake_latency.py``
measures the round trip (a fraction of a millisecond next to the claim
transaction it triggers).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from typing import Awaitable, Callable, TypeVar
from uuid import UUID

import anyio
from psycopg_pool import AsyncConnectionPool

from umbra import jitter, metrics

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Organizations with at least one queued job whose not_before has passed.
_CLAIMABLE_ORGS = """
SELECT DISTINCT organization_id FROM jobs
WHERE status = 'queued' AND organization_id = ANY(%s)
  AND (not_before IS NULL OR not_before <= umbra_now())
"""


class _NothingQueued:
    """What an attempt returns when no claimable job was left for it but ones others just took."""

    def __repr__(self) -> str:
        return "NOTHING_QUEUED"


#: An attempt's answer meaning "no job, and none waiting for anyone else": the wake token dies here.
NOTHING_QUEUED = _NothingQueued()


class _LookAgainSoon:
    """What an attempt returns when something committing kept it from looking (a change holding the claim
    guard, another claim holding the node's memory lock)."""

    def __repr__(self) -> str:
        return "LOOK_AGAIN_SOON"


#: An attempt's answer meaning "could not look yet": the waiter passes its token on and tries
#: again after :data:`LOOK_AGAIN_SECONDS` (longer if stopped again) of its own accord, for what stopped it (a
#: heartbeat, a drain, a registry update, another claim for the node) sends no notification that would wake it.
LOOK_AGAIN_SOON = _LookAgainSoon()


class LookAgainIn:
    """An attempt's answer when it took nothing but passed over jobs it leaves, for now, to nodes that hold
    their models (model affinity across nodes): the wake goes on to them, and this waiter looks again in
    ``seconds`` of its own accord, when the first of those jobs has waited the affinity and is its to take
    (nothing notifies that moment)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"LookAgainIn({self.seconds:.3f})"


#: Added to a :class:`LookAgainIn`'s wait: the job's wait is measured by the database's clock, and the waiter
#: that looks a moment too early passes it over again.
LOOK_AGAIN_MARGIN_SECONDS = 0.05

#: How long a waiter stopped by a committing change first waits before it looks again: such changes
#: are single short transactions. Each further stop doubles it (jittered), up to the safety poll's
#: interval: a long change (a registry update re-examining many blocked jobs) holds the organization's
#: guard, and every waiter of the organization looking every 20 ms would flood the batches.
LOOK_AGAIN_SECONDS = 0.02


class WakeToken:
    """One unit of "there may be work": carried from waiter to waiter until used."""

    __slots__ = ("kind", "created", "tried", "attempts")

    def __init__(self, kind: str) -> None:
        #: "hint" (a notification), "poll" (the safety poll) or "recheck" (a reconnect, ``*``, ``umbra_recheck``).
        self.kind = kind
        self.created = time.monotonic()
        self.tried: set[int] = set()
        self.attempts = 0


class Waiter:
    __slots__ = ("id", "organization_id", "_wake", "token")

    def __init__(self, waiter_id: int, organization_id: UUID) -> None:
        self.id = waiter_id
        self.organization_id = organization_id
        self._wake = anyio.Event()
        self.token: WakeToken | None = None

    @property
    def pending(self) -> bool:
        return self._wake.is_set()

    def wake(self, token: WakeToken | None) -> None:
        self.token = token
        self._wake.set()

    def take(self) -> WakeToken | None:
        """Clear the wake flag and return the token this waiter now holds, if any."""
        token, self.token = self.token, None
        if self._wake.is_set():
            self._wake = anyio.Event()
        return token

    async def wait(self, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await self._wake.wait()


class WaiterHub:
    """Fans log hints out to parked long-polls, waking only as many as there is work."""

    def __init__(self, *, poll_seconds: float) -> None:
        self.poll_seconds = poll_seconds
        self._ids = itertools.count(1)
        self.stopped = False
        # organization -> waiters in arrival order (oldest first).
        self._waiters: dict[UUID, OrderedDict[int, Waiter]] = {}

    # -- listener callbacks (synchronous: they run in the listener's task) -----

    def on_hint(self, organization_id: UUID, position: int, claimable: int) -> None:
        for _ in range(max(0, claimable)):
            if not self._hand_token(organization_id, WakeToken("hint")):
                break

    def on_recheck(self, organization_id: UUID) -> None:
        """A change some parked claims of the organization must see (a node's credentials revoked): each
        tries again (a revoked one is then refused), the others go back to waiting."""
        for waiter in self._waiters.get(organization_id, {}).values():
            if not waiter.pending:
                waiter.wake(WakeToken("recheck"))

    def on_reconnect(self) -> None:
        """Notifications sent while disconnected are gone: every waiter re-checks."""
        metrics.LISTENER_RECONNECTS.inc()
        self.recheck_all()

    def recheck_all(self) -> None:
        """Every idle waiter tries again: after a reconnect, or a notification naming no organization."""
        for organization_id in list(self._waiters):
            self.on_recheck(organization_id)

    def stop(self) -> None:
        """The server is stopping: parked long-polls answer 204 now, so agents move on."""
        self.stopped = True
        for waiters in self._waiters.values():
            for waiter in waiters.values():
                waiter.wake(None)

    # -- bookkeeping -------------------------------------------------------------

    def waiting(self, organization_id: UUID | None = None) -> int:
        if organization_id is not None:
            return len(self._waiters.get(organization_id, ()))
        return sum(len(w) for w in self._waiters.values())

    def _register(self, organization_id: UUID) -> Waiter:
        waiter = Waiter(next(self._ids), organization_id)
        self._waiters.setdefault(organization_id, OrderedDict())[waiter.id] = waiter
        metrics.LONG_POLLS_WAITING.inc()
        return waiter

    def _unregister(self, waiter: Waiter) -> None:
        waiters = self._waiters.get(waiter.organization_id)
        if waiters is not None and waiters.pop(waiter.id, None) is not None:
            metrics.LONG_POLLS_WAITING.dec()
            if not waiters:
                del self._waiters[waiter.organization_id]
        token = waiter.take()
        if token is not None:
            self._pass_on(token, waiter)

    def _hand_token(self, organization_id: UUID, token: WakeToken) -> bool:
        """Give ``token`` to the oldest idle waiter that has not tried it."""
        for waiter in self._waiters.get(organization_id, {}).values():
            if not waiter.pending and waiter.id not in token.tried:
                waiter.wake(token)
                return True
        return False

    def _pass_on(self, token: WakeToken, holder: Waiter) -> None:
        if token.kind == "recheck":
            return
        token.tried.add(holder.id)
        if not self._hand_token(holder.organization_id, token):
            metrics.ATTEMPTS_PER_WAKE.observe(max(1, token.attempts))

    # -- the long-poll -------------------------------------------------------------

    async def wait_for(
        self,
        organization_id: UUID,
        attempt: Callable[[], Awaitable[T | None]],
        *,
        timeout: float,
    ) -> T | None:
        """Run ``attempt`` now and after every wake until it returns a value or time runs out.

        ``attempt`` returns a value, ``None`` (nothing this waiter can take: the
        wake is passed on), :data:`NOTHING_QUEUED` (nothing for anyone: the
        wake ends here), :data:`LOOK_AGAIN_SOON` (the wake is passed on, and
        this waiter tries again shortly even if nothing wakes it) or a
        :class:`LookAgainIn` (the wake is passed on, and this waiter tries again
        after its seconds even if nothing wakes it); in each case the waiter
        goes back to waiting.

        ``attempt`` opens (and returns) its own pooled connection; nothing is held
        between attempts. Each attempt is shielded from cancellation, so a
        cancelled long-poll (the client left) never abandons a half-finished
        claim: the caller sees the result and can release it.
        """
        deadline = time.monotonic() + timeout
        stops = 0  # attempts in a row stopped by a committing change
        waiter = self._register(organization_id)
        try:
            while True:
                token = waiter.take()
                try:
                    with anyio.CancelScope(shield=True):
                        result = await attempt()
                except BaseException:
                    metrics.CLAIM_ATTEMPTS.inc()  # refused or failed (revoked, given up by its agent, the database away)
                    if token is not None:  # a waiter that could not try the wake passes it on
                        self._pass_on(token, waiter)
                    raise
                metrics.CLAIM_ATTEMPTS.inc()
                if token is not None:
                    token.attempts += 1
                if result is NOTHING_QUEUED:
                    if token is not None:
                        metrics.ATTEMPTS_PER_WAKE.observe(token.attempts)
                elif result is not None and result is not LOOK_AGAIN_SOON and not isinstance(result, LookAgainIn):
                    self._used(waiter, token)
                    return result  # type: ignore[return-value]
                elif token is not None:
                    self._pass_on(token, waiter)
                stops = stops + 1 if result is LOOK_AGAIN_SOON else 0
                if result is LOOK_AGAIN_SOON:
                    pause: float | None = min(LOOK_AGAIN_SECONDS * 2 ** (stops - 1), self.poll_seconds) * jitter.uniform(0.75, 1.25)
                elif isinstance(result, LookAgainIn):
                    pause = result.seconds + LOOK_AGAIN_MARGIN_SECONDS
                else:
                    pause = None
                remaining = deadline - time.monotonic()
                if remaining > 0 and not self.stopped:
                    await waiter.wait(remaining if pause is None else min(remaining, pause))
                if self.stopped or not (waiter.pending or pause is not None and time.monotonic() < deadline):
                    return None
        finally:
            self._unregister(waiter)

    def _used(self, waiter: Waiter, token: WakeToken | None) -> None:
        trigger = token.kind if token is not None else "immediate"
        metrics.CLAIMS.labels(trigger=trigger).inc()
        if token is None:
            return
        metrics.ATTEMPTS_PER_WAKE.observe(token.attempts)
        if token.kind == "hint":
            metrics.WAKE_LATENCY.observe(time.monotonic() - token.created)
        elif token.kind == "poll":
            # The poll found work; there may be more, so keep the round going.
            follow = WakeToken("poll")
            follow.tried = token.tried
            self._hand_token(waiter.organization_id, follow)

    # -- the safety poll -------------------------------------------------------------

    async def safety_poll(self, pool: AsyncConnectionPool) -> None:
        """Every ``poll_seconds`` (±50 %), wake one waiter per organization that may have work."""
        while True:
            await anyio.sleep(self.poll_seconds * jitter.uniform(0.5, 1.5))
            orgs = [org for org, waiters in self._waiters.items() if waiters]
            if not orgs:
                continue
            try:
                async with pool.connection() as conn:
                    rows = await (await conn.execute(_CLAIMABLE_ORGS, (orgs,))).fetchall()
            except Exception as exc:  # the poll is a safety net; never let it die
                log.warning("safety poll failed", extra={"action": "safety_poll_failed", "error": str(exc)[:200]})
                continue
            for (org,) in rows:
                self._hand_token(org, WakeToken("poll"))
