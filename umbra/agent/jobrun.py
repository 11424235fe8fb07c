"""One claimed job on this agent: the handler, its lease renewal, and the report.

The handler runs in a cancel scope with a renewal task beside it (every third
of the lease, as the server's clock measures it). Three things can end the
scope early, and each is reported differently:

* the server says the job is no longer ours (cancelled, or the lease was lost
  and the job re-claimed): nothing is reported, the server would refuse it;
* the agent is stopping and the grace period ran out: the job is given back
  (``POST /v1/agent/jobs/{id}/release``), queued again at once for another
  node and not charged against its attempts (up to a point: see
  :class:`umbra.domain.jobs.UnchargedEnds`); a server without that route gets
  the retryable failure it knows;
* the job's ``max_runtime_s`` passed: the job is failed for good (even
  during a stop's grace period: another node would only hit it again).

Reports are retried on transport errors and on answers that pass (see
:func:`refused_for_good`) while the lease could still hold, no sooner than a
``Retry-After`` says; after that the sweeper's lease expiry is the recovery
path. The server answers a repeated report as it answered the first. A result or
children the server refuses as invalid or too large (422, 413) cannot be
delivered by retrying, nor by running the job again: the job is failed for
good with the server's reason, instead of being left to its lease and run
again. Failure messages are cut to what the server accepts.

A completion asks for the node's next job in the same request when
``claim_next`` says so at that moment (the agent is not stopping): the
runner then goes straight on to it, and long-polls only when the queue has
nothing for this node. A retry asks as the first attempt did: if the first's
answer was lost on the way, the server answers the repeat with the claim it
already made (while that claim stands untouched), so the agent runs it instead
of leaving it leased to a node that does not know of it. A retry sent once the
agent is stopping does not ask: the server then gives back the claim the lost
answer named (``job.released``, not charged). Every attempt of one completion
carries the same ``X-Request-ID``: if none of their answers is ever read, the
agent gives back what they claimed by that id (``POST /v1/agent/claim/release``).
"""

from __future__ import annotations

import logging
import random
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import anyio
import httpx
import msgspec

from umbra import jitter
from umbra.domain.jobs import STOPPED_ERROR

from .client import HTTP_ERROR, AgentClient, Claim, ServiceError, storable_text
from .handlers import Decompose, HandlerRegistry, Interrupted, PermanentError, is_retryable

log = logging.getLogger(__name__)

#: Server answers meaning "this job is no longer yours": stop, report nothing.
LOST_CODES = frozenset({"job_cancelled", "job_not_claimed_by_this_node", "job_not_found", "not_found"})
#: 4xx answers that sending the same request again may turn into a 200: a timeout, a write that met
#: another (409 concurrency_conflict), too early, too many requests.
TRANSIENT_REFUSALS = frozenset({408, 409, 425, 429})
#: Refusals of a result or children that no retry, and no rerun, could change.
UNDELIVERABLE_CODES = frozenset({"invalid_request", "payload_too_large"})
RUNTIME_MESSAGE = "The job exceeded its max_runtime_s."
#: How long a run whose program was stopped from outside waits for the agent's own stop, signalled at the
#: same moment by a service manager, before it is retried rather than given back (:class:`Interrupted`).
INTERRUPTED_STOP_SECONDS = 1.0
#: How long giving back an unread claim may take at most (its request times out sooner).
RELEASE_SECONDS = 5.0
#: ... and with the server's ``rate_limited`` refusals waited out: a node may send 20 give-backs at once and
#: 5 a second after that (``umbra.api.rates``), and a stopping agent sends one per slot, so 90 slots' worth
#: are through within this.
RELEASE_RATE_LIMITED_SECONDS = 15.0
#: Longest failure message sent; the server accepts 10,000 characters.
MAX_ERROR_CHARS = 4000
#: Doublings :func:`backoff_delay` counts at most (``2.0 ** 1024`` overflows a float).
MAX_DOUBLINGS = 1000
#: Progress refusals in a row after which a run sends no more of it (a server that takes none).
PROGRESS_REFUSALS = 3


def backoff_delay(failures: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Delay before retry number ``failures`` (≥ 1): half fixed, half random.

    The random half spreads a fleet's retries; the fixed half keeps any single
    agent from hammering a server that is down.

    The doublings stop counting long after any real cap is reached: ``2 ** n``
    becomes a float in the product and overflows from the 1025th failure, so an
    agent (or ``umbra events tail --follow``) facing a server down for hours
    would die of its own back-off instead of riding the outage out.
    """
    doublings = min(max(0, failures - 1), MAX_DOUBLINGS)
    ceiling = min(cap, base * 2.0**doublings)  # a product past the float range is inf, which the cap absorbs
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def refused_for_good(exc: ServiceError) -> bool:
    """A refusal that sending the same request again will not turn into a 200.

    Only the server's own refusals (a body with its error code) are final: a
    4xx page without one comes from something in between (a proxy answering
    404 while the server behind it restarts), and a 5xx or one of the
    :data:`TRANSIENT_REFUSALS` passes. A 409 saying the job is no longer this
    node's (:data:`LOST_CODES`) is final whatever its status: no retry gives
    the job back. The heartbeat, the claim, the renewal and the reports all
    decide by this, so a proxy's page never ends a job that a claim would
    have waited out.
    """
    if exc.code in LOST_CODES:
        return True
    return exc.status < 500 and exc.status not in TRANSIENT_REFUSALS and exc.code != HTTP_ERROR


def retry_delay(error: Exception, failures: int, base: float, cap: float) -> float:
    """:func:`backoff_delay`, but no sooner than the ``Retry-After`` of a refusal that said one."""
    delay = backoff_delay(failures, base, cap)
    if isinstance(error, ServiceError) and error.retry_after:
        delay = max(delay, error.retry_after)
    return delay


@dataclass(frozen=True)
class Outcome:
    """What happened to one job on this agent (kept for logs and tests)."""

    job_id: str
    kind: str
    status: str  # "complete", "failed", "retrying", "released", "decomposed", "lost", "unreported"
    detail: Any = None
    #: The node's next job, claimed with this one's completion.
    next_claim: Claim | None = None


@dataclass(frozen=True)
class _Children:
    """A handler's :class:`Decompose`, as the JSON the server is sent."""

    json: list[Any]


def deliverable(result: Any) -> Any:
    """What a handler returned, checked before anything is sent: the result, or its children as JSON.

    Raises :class:`PermanentError` (the job fails for good, saying why) for what the server could
    not store as returned: a value JSON cannot carry, a NaN or an infinity (msgspec would send
    ``null``, and the stored result would differ from the handler's without a word), children
    that are not :class:`~umbra.agent.handlers.Child`.
    """
    if isinstance(result, Decompose):
        try:
            children = [child.to_json() for child in result.children]
        except AttributeError:
            raise PermanentError("The handler decomposed the job into something other than Child objects.") from None
        _check_storable(children, "children")
        return _Children(children)
    _check_storable(result, "result")
    return result


def _check_storable(value: Any, what: str) -> None:
    try:
        msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise PermanentError(f"The handler's {what} cannot be sent as JSON: {exc}") from None
    if not _finite(msgspec.to_builtins(value)):  # structs and dataclasses as the JSON they become
        raise PermanentError(f"The handler's {what} holds a NaN or an infinity, which JSON cannot carry.")


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


async def give_back_unread(client: AgentClient, request_id: str) -> None:
    """Give back what the request sent as ``request_id`` claimed, its answer never read
    (``POST /v1/agent/claim/release``). Best effort, within :data:`RELEASE_SECONDS`, whatever this task's
    cancellation: a server that cannot be reached leaves the job to its lease.

    A ``rate_limited`` refusal is sent again after its ``Retry-After`` (spread over a second, so the slots
    refused together do not come back together), within :data:`RELEASE_RATE_LIMITED_SECONDS`: a stopping
    agent of more slots than the server takes give-backs at once would otherwise leave a job that one of
    the refused requests claimed leased to it until the lease ran out."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_RATE_LIMITED_SECONDS) as patience:
        while True:
            try:
                with anyio.fail_after(RELEASE_SECONDS):
                    released = await client.release_unread(request_id)
                break
            except ServiceError as exc:
                if exc.code != "rate_limited":
                    return _release_failed(exc)
                await anyio.sleep((exc.retry_after or 1.0) + jitter.uniform(0.0, 1.0))
            except Exception as exc:  # noqa: BLE001 - best effort: the lease recovers the job
                return _release_failed(exc)
        if released:
            log.info("unread claim given back", extra={"action": "claim_released_unread", "job_ids": released})
    if patience.cancelled_caught:
        _release_failed(TimeoutError("still refused as rate limited"))


def _release_failed(exc: Exception) -> None:
    log.warning("could not give back an unread claim", extra={"action": "claim_release_failed", "error": describe(exc)})


class JobRun:
    def __init__(
        self,
        client: AgentClient,
        registry: HandlerRegistry,
        claim: Claim,
        *,
        on_rejected: Callable[[ServiceError], None],
        backoff: tuple[float, float] = (0.5, 30.0),
        claim_next: Callable[[], bool] = lambda: False,
        kinds: Sequence[str] = (),
        progress_seconds: float = 5.0,
    ) -> None:
        self.client = client
        self._progress_seconds = progress_seconds
        #: The kinds the claim of the next job names (the agent's: ``Agent.kinds``).
        self._kinds = kinds
        self._claim_next = claim_next
        self.registry = registry
        self.claim = claim
        self._on_rejected = on_rejected
        self._backoff = backoff
        self._scope: anyio.CancelScope | None = None
        self._stop_deadline: float | None = None
        self._stopping = anyio.Event()
        self._lost: ServiceError | None = None
        self._abandoned = anyio.Event()
        #: Seconds of lease the last answer granting it left (the claim's, then each renewal's): for how long
        #: a report is sent again. A claim that took long on its way leaves a short lease its first renewal
        #: makes whole; a report given up after the claim's few seconds would throw a result away. Counted
        #: from the report's start, it may outlast the lease by up to a third of it: until the sweeper takes
        #: the job back, the server still takes the report (then 409, which ends the retries).
        self._lease_seconds = claim.lease_seconds

    def stop(self, grace_seconds: float) -> None:
        """The agent is stopping: the handler may run ``grace_seconds`` more.

        With no grace at all (a second signal) a report that is failing gives up at its next
        retry rather than keep trying for the rest of the lease: the lease's expiry requeues the job.
        """
        if grace_seconds <= 0:
            self._abandoned.set()
        self._stopping.set()
        deadline = anyio.current_time() + grace_seconds
        self._stop_deadline = deadline if self._stop_deadline is None else min(self._stop_deadline, deadline)
        if self._scope is not None:
            self._scope.deadline = min(self._scope.deadline, deadline)

    async def run(self) -> Outcome:
        claim = self.claim
        result: Any = None
        failure: Exception | None = None
        runtime_deadline: float | None = None
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                self._scope = scope
                max_runtime = (claim.job.get("requires") or {}).get("max_runtime_s")
                if isinstance(max_runtime, (int, float)) and max_runtime > 0:
                    runtime_deadline = scope.deadline = anyio.current_time() + max_runtime
                if self._stop_deadline is not None:
                    scope.deadline = min(scope.deadline, self._stop_deadline)
                tg.start_soon(self._renew_loop)
                try:
                    result = deliverable(await self.registry.run(claim))
                except (Exception, SystemExit) as exc:  # the handler's failure (even sys.exit) is the job's, not the agent's
                    failure = exc
            self._scope = None
            tg.cancel_scope.cancel()
        if self._lost is not None:
            return Outcome(claim.job_id, claim.kind, "lost", self._lost.code)
        if scope.cancelled_caught:
            # Whichever deadline came first ended it: the runtime limit's, or the stop's.
            if runtime_deadline is not None and runtime_deadline <= scope.deadline:
                return await self._fail(RUNTIME_MESSAGE, retry=False)
            return await self._give_back()
        if isinstance(failure, Interrupted):
            # A service manager stopping the service signals the agent and the program at once, in no set
            # order: the agent's stop is waited for a moment before the job is taken for interrupted alone.
            with anyio.move_on_after(INTERRUPTED_STOP_SECONDS):
                await self._stopping.wait()
            if self._stopping.is_set():
                return await self._give_back()
        if failure is not None:
            return await self._fail(str(failure) or type(failure).__name__, retry=is_retryable(failure))
        if isinstance(result, _Children):
            return await self._undeliverable_fails(
                await self._report("decomposed", self.client.add_children, claim.job_id, claim.attempt, result.json), "children")
        if not self._claim_next():
            return await self._undeliverable_fails(
                await self._report("complete", self.client.complete, claim.job_id, claim.attempt, result), "result")

        async def complete_and_claim() -> tuple[dict[str, Any], Claim | None]:
            """Every attempt asks for the next job while the agent is not stopping.

            A repeat of a completion whose answer was lost is answered with the claim the first made;
            once the agent is stopping a retry asks for none, and the server gives back a claim the lost
            answer named.
            """
            if self._claim_next():
                asked_for_next.set()
                return await self.client.complete_and_claim(claim.job_id, claim.attempt, result, kinds=self._kinds,
                                                            request_id=request_id)  # fmt: skip
            return await self.client.complete(claim.job_id, claim.attempt, result), None

        request_id = uuid.uuid4().hex  # one for every attempt: the claim it made is named by it
        asked_for_next = anyio.Event()
        outcome = await self._undeliverable_fails(await self._report("complete", complete_and_claim), "result")
        if outcome.status == "unreported" and asked_for_next.is_set():
            # Had an attempt claimed the node's next job, no answer naming it was read: give it back rather
            # than leave it to wait out a lease no agent renews (and, on its last attempt, fail unrun).
            await give_back_unread(self.client, request_id)
        if outcome.status != "complete":
            return outcome
        job, following = outcome.detail
        if following is not None and not self._claim_next():
            # The agent began stopping while the completion was on its way: the job it claimed next is given
            # back unstarted (answer_unread, not charged) rather than started only to be cut off by the grace.
            await give_back_unread(self.client, request_id)
            following = None
        return Outcome(claim.job_id, claim.kind, "complete", job, following)

    async def _fail(self, message: str, *, retry: bool) -> Outcome:
        claim = self.claim
        status = "retrying" if retry else "failed"
        # Made storable: a message the server could not take would make the report itself fail, and the job
        # wait out its lease.
        message = storable_text(message, MAX_ERROR_CHARS)
        return await self._report(status, self.client.fail, claim.job_id, claim.attempt, message, retry=retry)

    async def _give_back(self) -> Outcome:
        """Past a stop's grace: give the job back. A server of an earlier release answers 404 ``not_found``
        (no such route): the job is failed as retryable instead, as that server expects."""
        claim = self.claim
        outcome = await self._report("released", self.client.give_back, claim.job_id, claim.attempt)
        if outcome.status == "lost" and outcome.detail == "not_found":
            return await self._fail(STOPPED_ERROR, retry=True)
        return outcome

    async def _undeliverable_fails(self, outcome: Outcome, what: str) -> Outcome:
        """A result or children the server refused as invalid or too large: fail the job for good, saying why."""
        if outcome.status != "unreported" or outcome.detail not in UNDELIVERABLE_CODES:
            return outcome
        return await self._fail(f"The server refused the job's {what} ({outcome.detail}); it was not stored.", retry=False)

    async def _report(self, status: str, call, *args, **kwargs) -> Outcome:
        """Deliver an outcome, retrying transport errors and passing refusals while the lease could still hold.

        A refusal for good (:func:`refused_for_good`) ends it at once: "lost" when the job is no
        longer this node's, else "unreported". A passing one (a proxy's page, a 429) is sent again,
        no sooner than its ``Retry-After``: thrown away, a computed result would be computed again.
        """
        claim = self.claim
        deadline = anyio.current_time() + max(self._lease_seconds, 1.0)
        failures = 0
        while True:
            try:
                return Outcome(claim.job_id, claim.kind, status, await call(*args, **kwargs))
            except ServiceError as exc:
                if exc.status == 401:
                    self._on_rejected(exc)
                if exc.status == 401 or refused_for_good(exc):
                    log.warning("outcome refused", extra={"action": "report_refused", "job_id": claim.job_id, "code": exc.code})
                    return Outcome(claim.job_id, claim.kind, "lost" if exc.code in LOST_CODES else "unreported", exc.code)
                error: Exception = exc
            except httpx.HTTPError as exc:
                error = exc
            failures += 1
            delay = retry_delay(error, failures, *self._backoff)
            if anyio.current_time() + delay > deadline or self._abandoned.is_set():
                log.error("outcome not delivered", extra={"action": "report_failed", "job_id": claim.job_id, "error": describe(error)})
                return Outcome(claim.job_id, claim.kind, "unreported", describe(error))
            with anyio.move_on_after(delay):
                await self._abandoned.wait()  # a second signal ends the wait: the next failure gives up

    async def _renew_loop(self) -> None:
        """Renew the lease every third of it, or sooner to carry what the handler said of its progress
        (:meth:`_until_renewal`); end the handler only when the server refuses for good.

        A renewal that fails in passing (unreachable, a proxy's page, a 429, an answer that cannot be
        read) is sent again sooner, no sooner than its ``Retry-After`` (nor its back-off, whatever the
        handler says meanwhile): cancelling the handler on it would throw away the work and leave the job
        to run again with an attempt spent. Progress the server refuses (422: a value it will not take, a
        server that takes none) is dropped and the lease renewed at once without any: a handler reporting
        at every step would otherwise have each renewal refused for what it said since, and the lease run
        out. After :data:`PROGRESS_REFUSALS` refusals in a row, no more is sent for this run.
        """
        claim = self.claim
        interval = claim.lease_seconds / 3
        failures = refusals = 0
        renew_bare = False  # the renewal after a refusal carries nothing of progress
        while True:
            if failures or renew_bare or refusals >= PROGRESS_REFUSALS:
                await anyio.sleep(max(0.2, interval))
            else:
                await self._until_renewal(max(0.2, interval))
            progress = None if renew_bare or refusals >= PROGRESS_REFUSALS else claim.progress_note.unsent()
            try:
                self._lease_seconds = await self.client.renew(claim.job_id, claim.attempt, progress=progress)
                interval = self._lease_seconds / 3
                if progress is not None:
                    claim.progress_note.sent = progress
                    refusals = 0
                failures, renew_bare = 0, False
                continue
            except ServiceError as exc:
                if progress is not None and exc.status == 422:
                    # What it said of its progress was refused, not the lease (a server that takes none, a value
                    # it will not take): dropped, and the lease renewed without it at once. It never costs the run.
                    log.warning("progress refused; renewing without it", extra={"action": "progress_refused",
                                "job_id": claim.job_id, "code": exc.code})  # fmt: skip
                    claim.progress_note.sent = progress
                    refusals += 1
                    renew_bare, interval = True, 0
                    continue
                if exc.status == 401:
                    self._on_rejected(exc)
                if exc.status == 401 or refused_for_good(exc):
                    log.warning("lease lost", extra={"action": "lease_lost", "job_id": claim.job_id, "code": exc.code})
                    self._lost = exc
                    if self._scope is not None:
                        self._scope.cancel()
                    return
                error: Exception = exc
            except httpx.HTTPError as exc:
                error = exc
            failures += 1
            interval = retry_delay(error, failures, 0.2, self._lease_seconds / 6)  # the last lease granted
            log.warning("renewal failed; sending it again", extra={"action": "renew_failed", "job_id": claim.job_id,
                                                                   "error": describe(error), "delay_s": round(interval, 2)})


    async def _until_renewal(self, seconds: float) -> None:
        """Wait ``seconds``, the renewal's pace, or less: every ``progress_seconds`` a look at whether the handler
        said something of its progress the server has not heard, which then goes at once. Carried by the
        renewal alone (a third of the lease, 20 s by default), a dashboard showed it that late; now within
        ``progress_seconds``, and a handler that reports at every step renews no more often than that."""
        deadline = anyio.current_time() + seconds
        while (left := deadline - anyio.current_time()) > 0:
            await anyio.sleep(min(left, self._progress_seconds))
            if self.claim.progress_note.unsent() is not None:
                return


def describe(error: Exception) -> str:
    return error.code if isinstance(error, ServiceError) else type(error).__name__
