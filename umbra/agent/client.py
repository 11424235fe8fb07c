"""The agent protocol over HTTP (API.md, "Pairing" and "Agent protocol").

One method per endpoint, nothing else: retries, back-off and scheduling are the
runner's business. A refusal from the server is raised as :class:`ServiceError`
carrying the contract's stable ``error`` code, so callers branch on codes, never
on message text; so is an answer the agent protocol's methods cannot read (see
:func:`_read`). Transport failures (refused connection, timeout) surface as
``httpx.TransportError``.
"""

from __future__ import annotations

import email.utils
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Sequence
from urllib.parse import quote

import httpx
import msgspec

from umbra.errors import UmbraError
from umbra.events import documents
from umbra.events.types import Device

#: Extra seconds the HTTP client waits beyond a long-poll's ``wait``: the
#: server answers 204 at ``wait`` seconds, so only a dead server takes longer.
LONG_POLL_SLACK_SECONDS = 15.0
#: Timeout for every other request.
REQUEST_TIMEOUT_SECONDS = 20.0


class ServiceError(UmbraError):
    """The server refused a request with a contract error code."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(code, message)
        self.status = status
        self.retry_after = retry_after


#: The longest progress message the server takes; a longer one is cut to it.
PROGRESS_MESSAGE_MAX = 500


def storable_text(text: str, limit: int) -> str:
    """``text`` as the server can take it: PostgreSQL cannot store NUL (U+FFFD instead), nor JSON carry a lone
    surrogate (a file name ``os.fsdecode`` made of bytes that are not UTF-8; escaped), and a field has its
    length (cut, ending with an ellipsis). Either would have made the request itself fail."""
    text = text.replace("\x00", "\ufffd").encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ProgressNote:
    """What a handler last said of its job's progress, and what the renewals have carried to the server.

    A handler running in a worker thread writes :attr:`said` while the renewal task reads it: each is one
    object, replaced whole, never changed in place."""

    __slots__ = ("said", "sent")

    def __init__(self) -> None:
        self.said: dict[str, Any] | None = None
        self.sent: dict[str, Any] | None = None

    def unsent(self) -> dict[str, Any] | None:
        """What the next renewal should carry: what was said since the last one that arrived, else None."""
        said = self.said
        return said if said is not None and said != self.sent else None


@dataclass(frozen=True, slots=True)
class Claim:
    """A claimed job: the Job object, its placement and when the lease ends."""

    job: dict[str, Any]
    placement: dict[str, Any]
    lease_expires_at: datetime
    #: Seconds of lease left when the answer came (see :func:`lease_left`).
    lease_seconds: float
    progress_note: ProgressNote = field(default_factory=ProgressNote, compare=False, repr=False)
    #: The payload with its numbers exact (a fraction or an exponent as a ``Decimal``,
    #: :mod:`umbra.events.documents`), which a program run for the job reads as the submitter wrote them;
    #: :attr:`payload` has Python's floats, which keep about 17 digits, for handlers written in Python.
    exact_payload: Any = field(default=None, compare=False, repr=False)

    def report_progress(self, fraction: float | None = None, message: str | None = None) -> None:
        """Say how far the job is: ``fraction`` done (0 to 1) and a line for people ("epoch 4 of 10").

        For a handler, from its task or its worker thread; it never waits on the network. The lease's
        next renewal (every third of the lease) carries what was said last; the Job object shows it
        (``progress``) and the renewal's event keeps it in the job's history. The message is made
        storable (:func:`storable_text`; cut to :data:`PROGRESS_MESSAGE_MAX` characters).
        """
        if fraction is None and message is None:
            raise ValueError("say a fraction done, a message, or both")
        if fraction is not None and (isinstance(fraction, bool) or not 0 <= float(fraction) <= 1):
            raise ValueError(f"progress fraction must be between 0 and 1, not {fraction!r}")
        said: dict[str, Any] = {}
        if fraction is not None:
            said["fraction"] = float(fraction)
        if message is not None:
            said["message"] = storable_text(str(message), PROGRESS_MESSAGE_MAX)
        self.progress_note.said = said

    @property
    def job_id(self) -> str:
        return self.job["id"]

    @property
    def kind(self) -> str:
        return self.job["kind"]

    @property
    def attempt(self) -> int:
        return int(self.job["attempt"])

    @property
    def payload(self) -> Any:
        return self.job.get("payload")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _server_now(response: httpx.Response) -> datetime:
    header = response.headers.get("date")
    if header:
        try:
            return email.utils.parsedate_to_datetime(header)
        except (TypeError, ValueError):
            pass
    return datetime.now(timezone.utc)


def _claim(body: dict[str, Any], response: httpx.Response, exact: dict[str, Any]) -> Claim:
    """A claim as the server answers it (the long-poll's body, or a completion's ``next_claim``);
    ``exact``: the same claim read with :func:`umbra.events.documents.decode`, for its payload.

    Raises ``KeyError``, ``TypeError`` or ``ValueError`` for one without what running and reporting
    the job need (its id, kind and attempt), here rather than halfway through running it.
    """
    expires = parse_time(body["lease_expires_at"])
    claim = Claim(
        job=body["job"],
        placement=body.get("placement") or {},
        lease_expires_at=expires,
        lease_seconds=lease_left(body, response),
        exact_payload=exact["job"].get("payload"),
    )
    if not (isinstance(claim.job_id, str) and isinstance(claim.kind, str) and claim.attempt >= 0):
        raise TypeError("the claimed job has no id, kind or attempt")
    return claim


#: The header in which the server says how many seconds of lease a claim's or a renewal's answer leaves
#: (``umbra.api.agent.LEASE_LEFT_HEADER``; the agent imports nothing of the server's).
LEASE_LEFT_HEADER = "Umbra-Lease-Seconds"


#: Beside it: the seconds the server held the request before measuring that lease (``umbra.api.agent.HELD_HEADER``).
HELD_HEADER = "Umbra-Held-Seconds"


def lease_left(body: dict[str, Any], response: httpx.Response) -> float:
    """Seconds of lease left when a claim's or a renewal's answer arrived, at least.

    The server says how much was left when it answered (:data:`LEASE_LEFT_HEADER`), measured on
    its own clock from before the lease was granted: no clock is read against another. The
    lease ends by the database's clock, which neither this machine's clock nor the app server's
    need agree with; read against the answer's ``Date`` (the app server's clock), an agent whose
    server ran 10 s behind the database believed it had 13 s of a 3 s lease, and renewed too
    late. A server that does not say gets that reading, never this machine's clock.

    What the answer spent on its way is taken off too: the round trip measured here less the
    time the server says it held the request (:data:`HELD_HEADER`, a long-poll's wait
    included). Both are durations, each on one clock. An answer a proxy held for two thirds of
    a 60 s lease otherwise left its agent renewing after the lease had ended.
    """
    try:
        said = float(response.headers.get(LEASE_LEFT_HEADER, "nan"))
    except ValueError:
        said = math.nan
    if not (math.isfinite(said) and said >= 0):
        return max(0.0, (parse_time(body["lease_expires_at"]) - _server_now(response)).total_seconds())
    return max(0.0, said - _time_on_the_way(response))


def _time_on_the_way(response: httpx.Response) -> float:
    """The most a request and its answer spent between here and the server: the round trip less what the
    server says it held the request. 0 when either is unknown (a server that does not say)."""
    try:
        held = float(response.headers.get(HELD_HEADER, "nan"))
        round_trip = response.elapsed.total_seconds()
    except (ValueError, RuntimeError):  # RuntimeError: an answer not yet read has no round trip
        return 0.0
    if not (math.isfinite(held) and held >= 0):
        return 0.0
    return max(0.0, round_trip - held)


#: The code of a 4xx/5xx answer without the server's error body (a proxy's page, say).
HTTP_ERROR = "http_error"


def raise_for_error(response: httpx.Response) -> None:
    """Raise :class:`ServiceError` for a 4xx/5xx answer, with its contract error code (:data:`HTTP_ERROR` if none)."""
    if response.status_code < 400:
        return
    code, message = HTTP_ERROR, response.reason_phrase or f"HTTP {response.status_code}"
    try:
        body = response.json()
        code = str(body.get("error") or code)
        message = str(body.get("message") or message)
    except (ValueError, AttributeError):
        pass
    retry_after = response.headers.get("retry-after")
    raise ServiceError(
        response.status_code,
        code,
        message,
        retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
    )


def _read(response: httpx.Response, parse: Callable[[dict[str, Any]], Any] = lambda body: body) -> Any:
    """``parse`` of a successful answer's JSON object; an answer it cannot read raises a passing :class:`ServiceError`.

    A 200 with a load balancer's maintenance page, or a body without the keys
    the contract names, says nothing about the request: raised as a 502
    :data:`HTTP_ERROR` (a proxy's answer), the runner waits it out with
    back-off, as it does a proxy's error page, instead of a JSON or key error
    ending the agent.
    """
    try:
        body = response.json()
        if not isinstance(body, dict):
            raise TypeError("not a JSON object")
        return parse(body)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        message = f"The server's answer (HTTP {response.status_code}) could not be read: {type(exc).__name__}."
        raise ServiceError(502, HTTP_ERROR, message) from exc


def _devices_json(devices: Sequence[Device]) -> list[Any]:
    return msgspec.to_builtins(list(devices))


#: What the server takes as the kinds a claim or a heartbeat names (docs/API.md): at most 100 kinds of 1
#: to 200 characters, not all whitespace, and a request line of 16 KiB at most in all (the HTTP server's limit).
MAX_NAMED_KINDS, MAX_KIND_LENGTH, MAX_KINDS_QUERY = 100, 200, 8_000


def claim_kinds(handler_kinds: Sequence[str]) -> list[str]:
    """The kinds this agent names when it claims: its handlers' kinds, as the server takes them.

    A handler registered under a name no job can have (over 200 characters,
    or blank) is left out. When the rest are too many to name (over 100, or too long for
    a request line), the agent names none: it claims every kind, and a job it
    has no handler for fails, as an agent that names no kinds does.
    """
    kinds = [kind for kind in handler_kinds if 1 <= len(kind) <= MAX_KIND_LENGTH and not kind.isspace()]
    if len(kinds) > MAX_NAMED_KINDS or sum(len(quote(kind, safe="")) + 6 for kind in kinds) > MAX_KINDS_QUERY:
        return []
    return kinds


#: How long a stopping agent waits to say so (or to give back a claim it never read): it is leaving either way.
SIGN_OFF_TIMEOUT_SECONDS = 3.0


class AgentClient:
    """An async HTTP client for one server, optionally holding a node credential."""

    def __init__(self, server: str, credential: str | None = None, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"User-Agent": "umbra-agent"}
        if credential:
            headers["Authorization"] = f"Bearer {credential}"
        self._http = httpx.AsyncClient(
            base_url=server.rstrip("/"), headers=headers, timeout=REQUEST_TIMEOUT_SECONDS, transport=transport
        )

    async def __aenter__(self) -> "AgentClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: Any = None, *, timeout: float | None = None, params=None,
                    headers: dict[str, str] | None = None) -> httpx.Response:  # fmt: skip
        kwargs: dict[str, Any] = {"params": params, "headers": dict(headers or {})}
        if body is not None:
            # Numbers as the handler has them: a program's result read exactly (Decimal) is sent as the number
            # it wrote, not as the string msgspec's default makes of a Decimal.
            kwargs["content"] = documents.encode(body)
            kwargs["headers"]["Content-Type"] = "application/json"
        if timeout is not None:
            kwargs["timeout"] = timeout
        response = await self._http.post(path, **kwargs)
        raise_for_error(response)
        return response

    async def redeem(self, *, code: str, name: str, agent_version: str, devices: Sequence[Device]) -> dict[str, Any]:
        """``POST /v1/pairings/redeem`` → ``{"node_id", "credential", "scopes"}``."""
        body = {"code": code, "name": name, "agent_version": agent_version, "devices": _devices_json(devices)}
        return (await self._post("/v1/pairings/redeem", body)).json()

    async def heartbeat(
        self, *, devices: Sequence[Device], agent_version: str, agent_started_at: datetime, kinds: Sequence[str] = ()
    ) -> dict[str, Any]:
        """``POST /v1/agent/heartbeat``; the answer carries the node's status. ``kinds``: the job kinds
        this agent takes (its claims name them), so ``explain`` can say when no agent takes a job's."""
        body = {
            "devices": _devices_json(devices),
            "agent_version": agent_version,
            "agent_started_at": agent_started_at.isoformat(),
            "kinds": list(kinds),  # always: an empty list says "every kind", replacing kinds reported before
        }
        return _read(await self._post("/v1/agent/heartbeat", body))

    async def sign_off(self) -> dict[str, Any]:
        """``POST /v1/agent/offline``: this agent is stopping; the node reads offline until its next heartbeat."""
        return _read(await self._post("/v1/agent/offline", timeout=SIGN_OFF_TIMEOUT_SECONDS))

    async def claim(self, wait: float, *, kinds: Sequence[str] = (), request_id: str | None = None) -> Claim | None:
        """Long-poll ``POST /v1/agent/claim?wait=S``: a :class:`Claim`, or None on 204.

        With ``kinds``, only a job of one of them (``&kind=a&kind=b``). ``request_id`` is sent as
        ``X-Request-ID``: the server records it with the claim, and :meth:`release_unread` names it."""
        response = await self._post(
            "/v1/agent/claim", params={"wait": int(wait), "kind": list(kinds)}, timeout=wait + LONG_POLL_SLACK_SECONDS,
            headers={"X-Request-ID": request_id} if request_id else None,
        )
        if response.status_code == 204:
            return None
        return _read(response, lambda body: _claim(body, response, documents.decode(response.content)))

    async def release_unread(self, request_id: str) -> list[str]:
        """``POST /v1/agent/claim/release``: the answer of the claim request sent as ``request_id`` was never
        read; the server gives back what it took. Returns the ids of the jobs given back."""
        answer = _read(await self._post("/v1/agent/claim/release", {"request_id": request_id},
                                        timeout=SIGN_OFF_TIMEOUT_SECONDS))  # fmt: skip
        released = answer.get("released") if isinstance(answer, dict) else None
        return [str(job_id) for job_id in released] if isinstance(released, list) else []

    async def renew(self, job_id: str, attempt: int, *, progress: dict[str, Any] | None = None) -> float:
        """Extend the lease, saying how far the job is if ``progress`` is given; returns the seconds of the
        lease left (see :func:`lease_left`)."""
        body: dict[str, Any] = {"attempt": attempt} if progress is None else {"attempt": attempt, "progress": progress}
        response = await self._post(f"/v1/agent/jobs/{job_id}/renew", body)
        return _read(response, lambda body: lease_left(body, response))

    async def complete(self, job_id: str, attempt: int, result: Any) -> dict[str, Any]:
        return _read(await self._post(f"/v1/agent/jobs/{job_id}/complete", {"attempt": attempt, "result": result}))

    async def complete_and_claim(self, job_id: str, attempt: int, result: Any, *, kinds: Sequence[str] = (),
                                 request_id: str | None = None) -> tuple[dict[str, Any], Claim | None]:  # fmt: skip
        """Report a result and claim this node's next job in the same request (``complete?claim_next=true``).

        Returns the completed Job and the next :class:`Claim` (of one of
        ``kinds``, if given), or None when nothing this node may take is queued
        (the server does not wait for one). ``request_id`` is sent as
        ``X-Request-ID`` (the same on every retry): :meth:`release_unread` names
        it to give back the next job if no answer is ever read.
        """
        response = await self._post(f"/v1/agent/jobs/{job_id}/complete", {"attempt": attempt, "result": result},
                                    params={"claim_next": "true", "kind": list(kinds)},
                                    headers={"X-Request-ID": request_id} if request_id else None)  # fmt: skip

        def completed(job: dict[str, Any]) -> tuple[dict[str, Any], Claim | None]:
            following = job.pop("next_claim", None)
            return job, (_claim(following, response, documents.decode(response.content)["next_claim"]) if following else None)

        return _read(response, completed)

    async def fail(self, job_id: str, attempt: int, error: str, *, retry: bool) -> dict[str, Any]:
        body = {"attempt": attempt, "error": error, "retry": retry}
        return _read(await self._post(f"/v1/agent/jobs/{job_id}/fail", body))

    async def give_back(self, job_id: str, attempt: int) -> dict[str, Any]:
        """``POST /v1/agent/jobs/{id}/release``: this agent is stopping before the job finished."""
        return _read(await self._post(f"/v1/agent/jobs/{job_id}/release", {"attempt": attempt}))

    async def add_children(self, job_id: str, attempt: int, children: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {"attempt": attempt, "children": list(children)}
        return _read(await self._post(f"/v1/agent/jobs/{job_id}/children", body), lambda answer: list(answer["children"]))
