"""Query-string parameters, validated the same way as bodies (422 naming the field)."""

from __future__ import annotations

import re
from typing import Collection

from starlette.requests import Request

from umbra.compute.jobs import MAX_NAMED_KINDS, NAME_LENGTH, NOT_BLANK
from umbra.errors import InvalidRequest

_NAMED = re.compile(NOT_BLANK)


def query_value(request: Request, name: str) -> str | None:
    """The one value of a single-valued parameter (``None``: absent); given twice, it is refused naming it.

    Starlette's ``get`` answers the last of repeated values: ``?limit=5&limit=500`` read as 500, and a
    client that meant a list (``?status=queued&status=running``, what HTTP libraries send for a list)
    was answered for its last item alone, with no error.
    """
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise InvalidRequest(f"{name} may be given once, got {len(values)} values.", field=name)
    return values[0] if values else None


def parse_statuses(raw: str | None, known: Collection[str]) -> list[str] | None:
    """A ``status`` filter among ``known``: absent or blank is no filter; a list with an empty item is refused.

    Dropping empty items would turn ``status=,`` into a filter that matches nothing.
    """
    if raw is None or not raw.strip():
        return None
    statuses = [s.strip() for s in raw.split(",")]
    if "" in statuses:
        raise InvalidRequest(f"status must be comma-separated statuses with no empty item; got {raw[:100]!r}.", field="status")
    unknown = [s for s in statuses if s not in known]
    if unknown:
        raise InvalidRequest(f"status must be among {', '.join(known)}; unknown: {', '.join(unknown)}.", field="status")
    return statuses


def query_statuses(request: Request, known: Collection[str]) -> list[str] | None:
    """``?status=``, comma-separated or repeated (``?status=queued&status=running``, as HTTP libraries send a
    list), among ``known`` (:func:`parse_statuses`)."""
    return parse_statuses(",".join(request.query_params.getlist("status")) or None, known)


def query_int(request: Request, name: str, *, default: int, minimum: int, maximum: int) -> int:
    raw = query_value(request, name)
    if raw is None or raw == "":
        return default
    return bounded_int(raw, name, minimum=minimum, maximum=maximum)


_TRUE, _FALSE = ("true", "1"), ("false", "0")


def query_bool(request: Request, name: str, *, default: bool) -> bool:
    """``true``/``1`` or ``false``/``0``; anything else is refused, naming the parameter."""
    raw = query_value(request, name)
    if raw is None or raw == "":
        return default
    word = raw.strip().lower()
    if word not in _TRUE + _FALSE:
        raise InvalidRequest(f"{name} must be true or false, got {raw[:40]!r}.", field=name)
    return word in _TRUE


_INTEGER = re.compile(r"[+-]?[0-9]+")


def integer(text: str) -> int | None:
    """The integer ``text`` spells in at most 20 ASCII digits (with an optional sign, around spaces), else ``None``.

    Python's ``int`` also reads ``1_000`` and the digits of every script
    (``٣``): no client sending such a value means that number, and a refusal
    says so where a silent reading would page from the wrong place.
    """
    text = text.strip()
    # No value here needs more than 20 digits; Python refuses to read over 4,300 (ValueError).
    return int(text) if len(text) <= 21 and _INTEGER.fullmatch(text) else None


def bounded_int(raw: str, name: str, *, minimum: int, maximum: int) -> int:
    value = integer(raw)
    if value is None:
        raise InvalidRequest(f"{name} must be an integer between {minimum} and {maximum}.", field=name)
    if not minimum <= value <= maximum:
        raise InvalidRequest(f"{name} must be between {minimum} and {maximum}, got {value}.", field=name)
    return value


def query_list(request: Request, name: str, *, allowed: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated list of known words, the parameter repeated or not; an unknown word is refused, naming it."""
    raw = ",".join(request.query_params.getlist(name)) or None
    if raw is None or not raw.strip():
        return default
    words = tuple(dict.fromkeys(w.strip() for w in raw.split(",") if w.strip()))
    unknown = [w for w in words if w not in allowed]
    if unknown or not words:
        raise InvalidRequest(f"{name} accepts {', '.join(allowed)}; unknown: {', '.join(unknown) or 'none'}.", field=name)
    return words


def query_kinds(request: Request) -> frozenset[str] | None:
    """The job kinds a claim names (``?kind=a&kind=b``), or ``None`` when it names none (every kind).

    Repeated rather than comma-separated, so any kind (1 to 200 characters of
    any text) can be named. Limited as a heartbeat's ``kinds`` are
    (:data:`umbra.compute.jobs.Kinds`): an empty, blank or over-long value, one
    holding a NUL, or more than 100 of them, is refused naming the parameter.
    """
    values = request.query_params.getlist("kind")
    if not values:
        return None
    if len(values) > MAX_NAMED_KINDS:
        raise InvalidRequest(f"kind may be given at most {MAX_NAMED_KINDS} times, got {len(values)}.", field="kind")
    bad = next((v for v in values if not 1 <= len(v) <= NAME_LENGTH), None)
    if bad is not None:
        raise InvalidRequest(f"each kind must be 1 to {NAME_LENGTH} characters, got {len(bad)}.", field="kind")
    if not all(_NAMED.search(v) for v in values):
        raise InvalidRequest("a kind may not be blank (whitespace only).", field="kind")
    if any("\x00" in v for v in values):  # no job's kind holds one: PostgreSQL's text cannot
        raise InvalidRequest("a kind may not contain the NUL character (%00).", field="kind")
    return frozenset(values)


#: The ``kind`` parameter of every claim, as the route tables declare it (``/openapi.json``).
KIND_QUERY = (list[str], False, f"Repeatable: claim only a job of one of these kinds (at most {MAX_NAMED_KINDS}, "
                                f"each 1 to {NAME_LENGTH} characters); without it, a job of any kind.")
