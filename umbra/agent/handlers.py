"""Job handlers: the code an agent runs for each job kind.

A handler is a callable taking the :class:`~umbra.agent.client.Claim` and
returning the job's result (any JSON value), or :class:`Decompose` to split the
job into children. It may be ``async`` or plain; a plain one runs in a worker
thread so it never stalls heartbeats or lease renewal.

Progress: a long handler may say how far it is with
``claim.report_progress(fraction, message)`` (from its task or its worker
thread); the lease's next renewal carries it to the server, where the Job and
the dashboard show it and the renewal's event keeps it.

Failures: a handler that raises fails the job with the exception's message.
Whether the server should retry is the handler's call: raise
:class:`RetryableError` (or any exception with ``retryable = True``) for a
transient failure; anything else is final.

The agent claims only the kinds it has handlers for (``?kind=`` on every
claim), so a job of another kind waits for an agent that has one. A job whose
kind no handler takes (a server that ignored the filter) fails non-retryably:
another attempt on the same agent would fail the same way.

Handlers are found in the ``umbra.handlers`` entry-point group (entry point
name = job kind), so a package adds kinds without touching this code; the
built-ins ``echo`` and ``sleep`` exist for demos and tests.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Awaitable, Callable, Union

import anyio
from anyio import to_thread

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "umbra.handlers"

Handler = Callable[[Any], Union[Any, Awaitable[Any]]]


class RetryableError(Exception):
    """A transient failure: the server requeues the job with back-off."""

    retryable = True


class Interrupted(RetryableError):
    """The run was stopped from outside, not by its own fault: a program ended by a signal someone else sent
    it (``SIGTERM``, ``SIGINT``, ``SIGHUP``). A service manager stopping the agent signals every process of
    the service at once: while the agent is stopping such a job is given back, as one past the stop's grace
    is; otherwise it is retried."""


class PermanentError(Exception):
    """A failure another attempt cannot fix (bad payload, unsupported input)."""

    retryable = False


class UnknownKind(PermanentError):
    def __init__(self, kind: str, known: list[str]) -> None:
        super().__init__(
            f"No handler for job kind {kind!r} on this agent (it handles: {', '.join(known) or 'nothing'})."
        )
        self.kind = kind


@dataclass(frozen=True)
class Child:
    """One child job, as ``POST /v1/agent/jobs/{id}/children`` takes it."""

    kind: str
    payload: dict[str, Any] = field(default_factory=dict)
    requires: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    idempotency_key: str | None = None
    #: Earlier children of the same decomposition this one runs after, by their place in the list (``0``: the
    #: first): a merge after its shards.
    depends_on: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": self.kind, "payload": self.payload, "requires": self.requires}
        if self.priority is not None:
            body["priority"] = self.priority
        if self.idempotency_key is not None:
            body["idempotency_key"] = self.idempotency_key
        if self.depends_on:
            body["depends_on"] = list(self.depends_on)
        return body


@dataclass(frozen=True)
class Decompose:
    """Returned by a handler to turn its job into a parent of ``children``."""

    children: list[Child]


def is_retryable(exc: BaseException) -> bool:
    return bool(getattr(exc, "retryable", False))


async def echo(claim) -> Any:
    """Returns the payload unchanged."""
    return claim.payload


async def sleep(claim) -> dict[str, float]:
    """Sleeps ``payload["seconds"]`` (0..86400) and reports how long."""
    payload = claim.payload if isinstance(claim.payload, dict) else {}
    seconds = payload.get("seconds", 1)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise PermanentError("sleep needs payload {\"seconds\": number}.")
    if not 0 <= seconds <= 86_400:
        raise PermanentError("sleep's seconds must be between 0 and 86400.")
    await anyio.sleep(seconds)
    return {"slept": seconds}


BUILTINS: dict[str, Handler] = {"echo": echo, "sleep": sleep}


def load_object(spec: str) -> Handler:
    """Resolve ``module:attribute`` (the entry-point syntax) to a callable."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"handler {spec!r} must look like package.module:function")
    # A module beside the operator is found, whatever script started the agent; last, so a file there
    # never shadows a library the handler imports.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"handler {spec!r} is not callable")
    return target


class HandlerRegistry:
    """Job kind → handler."""

    def __init__(self, handlers: dict[str, Handler] | None = None) -> None:
        self._handlers: dict[str, Handler] = dict(handlers or {})
        #: Plain handlers cancelled while their thread still runs, by claim: set when it returns.
        self._abandoned: dict[int, anyio.Event] = {}

    @classmethod
    def default(cls) -> "HandlerRegistry":
        """The built-ins, then every installed ``umbra.handlers`` entry point."""
        registry = cls(BUILTINS)
        registry.load_entry_points()
        return registry

    def register(self, kind: str, handler: Handler) -> None:
        self._handlers[kind] = handler

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        for point in entry_points(group=group):
            try:
                self.register(point.name, point.load())
            except Exception:
                log.exception("handler entry point failed to load", extra={"action": "handler_load_failed", "kind": point.name})

    @property
    def kinds(self) -> list[str]:
        return sorted(self._handlers)

    async def run(self, claim) -> Any:
        """Run the handler for ``claim.kind``; raises what the handler raises."""
        handler = self._handlers.get(claim.kind)
        if handler is None:
            raise UnknownKind(claim.kind, self.kinds)
        if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None)):
            return await handler(claim)
        returned = anyio.Event()

        def call() -> Any:
            try:
                return handler(claim)
            finally:
                with contextlib.suppress(RuntimeError):  # the event loop is gone: the agent exited
                    anyio.from_thread.run_sync(returned.set)

        # A thread cannot be cancelled: the job's cancellation (lost, stopped, out of time)
        # is answered at once, and the thread is left to finish; see :meth:`returned`.
        self._abandoned[id(claim)] = returned
        try:
            # A limiter of its own: the agent's slots bound its handler threads (--concurrency, up to 64), not
            # anyio's default limiter of 40, which the heartbeat's device discovery shares; with every slot
            # busy, a job past the 40th waited leased and unstarted, and the heartbeat behind it.
            result = await to_thread.run_sync(call, abandon_on_cancel=True, limiter=anyio.CapacityLimiter(1))
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException:
            self._abandoned.pop(id(claim), None)
            raise
        self._abandoned.pop(id(claim), None)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def returned(self, claim) -> bool:
        """Wait until the handler of ``claim`` has returned; True if it was still running.

        A plain handler cancelled with its job keeps its thread (and whatever
        device it drives) until it returns. The agent's slot waits for it
        before it takes other work, so it never runs more jobs at once than
        its concurrency, nor offers a device that is still in use.
        """
        running = self._abandoned.pop(id(claim), None)
        if running is None or running.is_set():
            return False
        await running.wait()
        return True
