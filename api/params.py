"""Query-string parameters, validated the same way as bodies (422 naming the field)."""

from __future__ import annotations

from starlette.requests import Request

from umbra.errors import InvalidRequest


def query_int(request: Request, name: str, *, default: int, minimum: int, maximum: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    return bounded_int(raw, name, minimum=minimum, maximum=maximum)


_TRUE, _FALSE = ("true", "1"), ("false", "0")


def query_bool(request: Request, name: str, *, default: bool) -> bool:
    """``true``/``1`` or ``false``/``0``; anything else is refused, naming the parameter."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    word = raw.strip().lower()
    if word not in _TRUE + _FALSE:
        raise InvalidRequest(f"{name} must be true or false, got {raw[:40]!r}.", field=name)
    return word in _TRUE


def bounded_int(raw: str, name: str, *, minimum: int, maximum: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer between {minimum} and {maximum}.", field=name) from None
    if not minimum <= value <= maximum:
        raise InvalidRequest(f"{name} must be between {minimum} and {maximum}, got {value}.", field=name)
    return value


def query_list(request: Request, name: str, *, allowed: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated list of known words; an unknown word is refused, naming it."""
    raw = request.query_params.get(name)
    if raw is None or not raw.strip():
        return default
    words = tuple(dict.fromkeys(w.strip() for w in raw.split(",") if w.strip()))
    unknown = [w for w in words if w not in allowed]
    if unknown or not words:
        raise InvalidRequest(f"{name} accepts {', '.join(allowed)}; unknown: {', '.join(unknown) or 'none'}.", field=name)
    return words
