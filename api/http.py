"""Request/response plumbing shared by every route: bodies, auth, JSON."""

from __future__ import annotations

import ipaddress
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence, TypeVar
from uuid import UUID

import anyio
import msgspec
import psycopg
from starlette.requests import Request
from starlette.responses import Response

from umbra.compute.auth import Principal, authenticate, authenticated_connection, credential_is_live, revoked
from umbra.db import DATABASE_AWAY
from umbra.compute.jobs import DOCUMENT_FIELD, MAX_JSON_DEPTH, NOT_BLANK, TOO_DEEP
from umbra.errors import InvalidRequest, NotFound, UmbraError
from umbra.events import documents

from .items import item_at
from .params import integer

#: Request bodies above this are refused with 413 before they are parsed.
MAX_BODY_BYTES = 1024 * 1024

T = TypeVar("T")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network



class PayloadTooLarge(UmbraError):
    status = 413

    def __init__(self) -> None:
        super().__init__("payload_too_large", f"Request bodies are limited to {MAX_BODY_BYTES} bytes.")


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(documents.encode(content), status_code=status, media_type="application/json", headers=headers)


def request_id(request: Request) -> str | None:
    """The request's id (``X-Request-ID``, see :mod:`umbra.api.middleware`), recorded with the events it causes."""
    return getattr(request.state, "request_id", None)


def received_at(request: Request) -> float | None:
    """When the request reached this process (``time.monotonic()``, see :mod:`umbra.api.middleware`)."""
    return getattr(request.state, "received_at", None)


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (length := integer(declared)) is not None and length > MAX_BODY_BYTES:
        raise PayloadTooLarge()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise PayloadTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


#: A JSON ``\u0000`` escape (preceded by an even number of backslashes).
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


#: The refusal of a body holding U+0000.
NUL_REFUSED = "Strings may not contain the NUL character (\\u0000); PostgreSQL cannot store it."
#: How deep an item of a list (a batch's job, a child, a result) may nest: its own object, then a
#: free-form field (payload, result) of at most MAX_JSON_DEPTH levels.
_ITEM_DEPTH = MAX_JSON_DEPTH + 1
#: The fields a body may nest freely, which a nesting too deep for the decoder is in.
_FREE_FORM = "payload or result"


async def read_json(request: Request, type_: type[T], *, empty_ok: bool = False, items: str | None = None) -> T:
    """Decode the body strictly into ``type_`` or raise ``invalid_request`` naming the field.

    PostgreSQL's text and jsonb cannot hold U+0000, so a body carrying it is
    refused here, before anything is written, rather than failing mid-command.

    ``items`` names the body's list whose items are numbered (``jobs`` of a
    batch): a refusal within one of them also names its ``index``, since one
    bad item refuses them all.
    """
    body = await read_body(request)
    nul = _nul_offset(body)
    if nul is not None:
        raise _item_refusal(NUL_REFUSED, items, item_at(body, items, offset=nul) if items else None)
    if not body.strip():
        if empty_ok:
            body = b"{}"
        else:
            raise InvalidRequest("A JSON request body is required.")
    try:
        decoded = documents.decoder(type_).decode(body)
    except msgspec.ValidationError as exc:
        field = _field_of(str(exc))
        if document := DOCUMENT_FIELD.match(str(exc)):  # raised by the struct (field names it), about one of its fields
            field = f"{field}.{document.group(1)}" if field else document.group(1)
        item = _ITEM.match(field or "") if items else None
        extra = {"index": int(item.group(2))} if item and item.group(1) == items else {}
        message = str(exc).replace(_BLANK_NAME, "a `str` that is not blank (whitespace only)")
        raise InvalidRequest(f"Invalid request: {message}", field=field, **extra) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Malformed JSON: {exc}") from None
    except RecursionError:  # deeper than the free-form fields' own check could look
        raise _item_refusal(f"{TOO_DEEP} (in {_FREE_FORM})", items,
                            item_at(body, items, deeper_than=_ITEM_DEPTH) if items else None) from None
    return decoded


def _nul_offset(body: bytes) -> int | None:
    """Where ``body`` first holds U+0000, raw or as a JSON escape; None if nowhere."""
    # The substring tests first: the regex is tried at every byte, the tests are fast scans.
    raw = body.find(b"\x00")
    escaped = _NUL_ESCAPE.search(body) if b"\\u0000" in body else None
    if escaped is not None and (raw < 0 or escaped.end() <= raw):
        return escaped.end() - 1
    return raw if raw >= 0 else None


_ITEM = re.compile(r"^(\w+)\[(\d+)\]")
#: How msgspec words a blank name's refusal (:data:`umbra.compute.jobs.NOT_BLANK`), said plainly instead.
_BLANK_NAME = f"`str` matching regex {NOT_BLANK!r}"


def _item_refusal(message: str, items: str | None, index: int | None) -> InvalidRequest:
    """The refusal, naming the item of ``items`` it is about when one was found (as the decoder's own do)."""
    if index is None:
        return InvalidRequest(message)
    field = f"{items}[{index}]"
    return InvalidRequest(f"{message} - at `$.{field}`", field=field, index=index)


def _field_of(message: str) -> str | None:
    # msgspec messages end with "- at `$.requires.vram_min_mb`"
    marker = "at `$"
    if marker in message:
        return message.split(marker, 1)[1].rstrip("`").lstrip(".") or None
    if "missing required field `" in message:
        return message.split("missing required field `", 1)[1].split("`", 1)[0]
    return None


def path_uuid(request: Request, name: str = "id", *, code: str = "not_found") -> UUID:
    """A UUID path parameter; an unparseable one is simply not found."""
    try:
        return UUID(request.path_params[name])
    except ValueError:
        raise NotFound(code, f"No such {name.replace('_id', '')}.") from None


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@asynccontextmanager
async def authenticated(request: Request, *any_of_scopes: str) -> AsyncIterator[tuple[Principal, psycopg.AsyncConnection]]:
    """Authenticate the request, check one of the scopes (403 otherwise), and lend a pooled connection
    for the route's queries: ``async with authenticated(request, "jobs:read") as (who, conn):``.

    No connection is held while a token not yet cached is verified (argon2id, ~70 ms): one held
    meanwhile is one the agents' batches and every other request wait for. A cached token's
    revocation is checked on the connection the route then uses (see
    :func:`umbra.compute.auth.authenticated_connection`). Both come before the route looks at its
    path, query or body, so an unknown or revoked credential is 401 and a missing scope 403 whatever
    they hold.
    """
    services = request.app.state.services
    async with authenticated_connection(services.pool, bearer_token(request), services.token_cache) as (who, conn):
        yield _admitted(request, who, any_of_scopes), conn


async def authorized(request: Request, *any_of_scopes: str) -> Principal:
    """:func:`authenticated` on connections borrowed for its queries alone, none lent to the route.

    For routes that read a body next: the client may send it slowly, and a
    connection held meanwhile is one the agents' batches and every other
    request wait for.
    """
    services = request.app.state.services
    who = await authenticate(services.pool, bearer_token(request), services.token_cache)
    request.state.revocation_deferred = True  # a refusal of the body is 401 if the credential was revoked meanwhile
    return _admitted(request, who, any_of_scopes)


@asynccontextmanager
async def acting_as(request: Request, who: Principal) -> AsyncIterator[psycopg.AsyncConnection]:
    """A pooled connection in a transaction for the command of a route admitted by :func:`authorized`, its
    credential checked in that transaction before the command and again after it (401 if revoked, and
    nothing written).

    Such a route reads its body with no connection held, however slowly the
    client sends it, and its command may wait on locks (an idempotency key,
    the capacity lock): a credential revoked meanwhile must not act. The
    command's own transaction runs inside this one, so its writes commit
    only if the credential was still live once it was done.
    """
    async with request.app.state.services.pool.connection() as conn, conn.transaction():
        await _still_live(request, conn, who)
        yield conn
        await _still_live(request, conn, who)


async def _still_live(request: Request, conn: psycopg.AsyncConnection, who: Principal) -> None:
    if not await credential_is_live(conn, who):
        request.app.state.services.token_cache.forget_credential(who.credential_id)
        raise revoked()


async def batch_principal(request: Request, *any_of_scopes: str) -> Principal:
    """:func:`authorized` for a route whose command goes through the group commit.

    The batch re-checks the credential's revocation in its own transaction
    (pass ``who.credential_id`` to the command), so a cached token costs no
    connection and no query here.
    """
    services = request.app.state.services
    who = await authenticate(services.pool, bearer_token(request), services.token_cache, revocation_deferred=True)
    request.state.revocation_deferred = True  # see refusal_after_deferred_revocation
    return _admitted(request, who, any_of_scopes)


async def refusal_after_deferred_revocation(request: Request, refusal: UmbraError) -> UmbraError:
    """The refusal to answer a request admitted by :func:`batch_principal` or :func:`authorized`: 401 if its
    credential has been revoked meanwhile, else ``refusal``.

    Such a request's revocation is checked by its batch (or :func:`acting_as`), but a refusal of its
    path, query or body comes before that: without this, a revoked credential would learn which of its ids and
    values the route would take, when the credential must come first. Only refusals pay the query. A
    401 (the batch found the credential revoked, perhaps by another process) forgets its cached token.
    """
    who = getattr(request.state, "principal", None)
    if who is None or refusal.status >= 500:
        return refusal
    if refusal.status == 401:  # its batch found the credential revoked: the cached token verifies no more
        request.app.state.services.token_cache.forget_credential(who.credential_id)
        return refusal
    try:
        async with request.app.state.services.pool.connection() as conn:
            live = await credential_is_live(conn, who)
    except DATABASE_AWAY:
        return refusal
    return refusal if live else revoked()


def _admitted(request: Request, who: Principal, any_of_scopes: tuple[str, ...]) -> Principal:
    """``who``, once one of the scopes is checked (403 otherwise) and recorded for the access log."""
    request.state.principal = who  # first: a refusal, 403 included, may still be answered 401 if it was revoked
    if any_of_scopes:
        who.require(*any_of_scopes)
    return who


def client_address(request: Request) -> str:
    """The TCP peer, or X-Forwarded-For's client when the peer is a trusted proxy."""
    peer = request.client.host if request.client else "unknown"
    trusted = request.app.state.services.settings.trusted_proxies
    return forwarded_client(peer, request.headers.getlist("x-forwarded-for"), trusted)


def rate_limit_source(request: Request) -> str:
    """What a rate limit counts the client by: :func:`client_address`, an IPv6 one widened to its network
    (:func:`address_block`)."""
    return address_block(client_address(request), request.app.state.services.settings.rate_limit_ipv6_prefix)


def address_block(address: str, ipv6_prefix: int) -> str:
    """The block of addresses one client holds around ``address``: an IPv6 address's network of
    ``ipv6_prefix`` bits (``2001:db8:1:2::/64``), an IPv4 one itself.

    An IPv6 client is given a /64 at least, and takes a fresh address in it at
    will: counted by its address, it had a budget per request. An IPv4-mapped
    address is its IPv4 one (widened, it would share ``::ffff:0:0/64`` with every
    other). ``address`` that is none (``unknown``) is itself.
    """
    ip = _address(address)
    if ip is None:
        return address
    ip = getattr(ip, "ipv4_mapped", None) or ip
    if ip.version == 4 or ipv6_prefix >= 128:
        return str(ip)
    return str(ipaddress.IPv6Network((ip.packed, ipv6_prefix), strict=False))


def forwarded_client(peer: str, forwarded: Sequence[str], trusted: Sequence[IPNetwork]) -> str:
    """The client behind ``peer``: the nearest untrusted hop of ``X-Forwarded-For`` when ``peer`` is trusted.

    ``forwarded`` is every line of the header, in order: a proxy may add its
    own line rather than extend the client's, and the first line alone is the
    client's own word. A hop is read as an address with or without its port
    (``203.0.113.7:40001``, ``[2001:db8::7]:443``: some proxies write it) and
    named in one spelling (an IPv4-mapped IPv6 address as the IPv4 one), the
    peer too: the pairing rate limit counts attempts by this name (an IPv6
    one widened to its network, :func:`address_block`), and a port that
    changes with each connection made each attempt a source of its own.
    """
    if not _trusted(peer, trusted):
        return _spelled(peer)
    hops = [h.strip() for line in forwarded for h in line.split(",") if h.strip()]
    # Walk from the nearest hop back; the first untrusted one is the client.
    for hop in reversed(hops):
        if not _trusted(hop, trusted):
            return _spelled(hop)
    return _spelled(hops[0]) if hops else _spelled(peer)


#: A hop's address and port: ``[v6]:port``, ``[v6]`` or ``v4:port`` (a bare IPv6 address has more than one colon).
_WITH_PORT = re.compile(r"\[(?P<bracketed>[^\]]+)\](?::[0-9]+)?|(?P<v4>[^:]+):[0-9]+")


def _address(hop: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``hop`` names, without its port; None if it names none."""
    with_port = _WITH_PORT.fullmatch(hop)
    try:
        return ipaddress.ip_address((with_port.group("bracketed") or with_port.group("v4")) if with_port else hop)
    except ValueError:
        return None


def _spelled(hop: str) -> str:
    """``hop``'s address as Python writes it, an IPv4-mapped IPv6 one as IPv4 (one spelling per address), or
    ``hop`` itself when it is none."""
    ip = _address(hop)
    return hop if ip is None else str(getattr(ip, "ipv4_mapped", None) or ip)


def _trusted(address: str, trusted: Sequence[IPNetwork]) -> bool:
    """Whether ``address`` is one of the trusted proxies (an unreadable address is not); an IPv4-mapped IPv6
    address is also its IPv4 one."""
    ip = _address(address)
    if ip is None:
        return False
    forms = (ip, mapped) if (mapped := getattr(ip, "ipv4_mapped", None)) is not None else (ip,)
    return any(form in net for form in forms for net in trusted)


async def watch_disconnect(request: Request, gone: anyio.Event, scope: anyio.CancelScope) -> None:
    """Set ``gone`` and cancel ``scope`` once the client hangs up: a parked request (a long-poll) ends then,
    not at its timeout."""
    # The body was read before the handler ran (a route declared without one: umbra.api.routing),
    # so all that can arrive now is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            scope.cancel()
            return
