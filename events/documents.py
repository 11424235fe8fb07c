"""JSON documents as their writers wrote them: every number kept exactly.

A job's payload and result, and an event's metadata, are the submitter's and
the agent's own documents, and the log is the auditor's record of what they
said. Python reads a JSON number with a fraction or an exponent as a double,
which holds about 17 significant digits: ``0.10000000000000000000000001``
would be recorded as ``0.1``, and ``1e400`` refused as out of range.
PostgreSQL's ``jsonb`` holds numbers as ``numeric``, exactly. So every JSON
the service reads or writes goes through here: a number with a fraction or
an exponent is read as a :class:`~decimal.Decimal` (integers are Python's
exact ``int`` already) and written back as the same JSON number.

Typed fields (a requirement's megabytes, a device's utilisation) are not
affected: only numbers of free-form values (``Any``) are read this way.
"""

from __future__ import annotations

import functools
import re
from decimal import Decimal
from typing import Any

import msgspec

#: Writes :class:`~decimal.Decimal` as a JSON number (msgspec's default writes a string).
encoder = msgspec.json.Encoder(decimal_format="number")
encode = encoder.encode
#: The same, with object keys sorted: one text per value, to compare two documents by.
canonical_encoder = msgspec.json.Encoder(decimal_format="number", order="sorted")


@functools.lru_cache(maxsize=None)
def decoder(type_: Any = Any) -> msgspec.json.Decoder:
    """A decoder of ``type_`` reading free-form numbers exactly (one per type, made once)."""
    return msgspec.json.Decoder(type_, float_hook=Decimal)


#: The digits ``numeric`` (what ``jsonb`` keeps a number as) holds before and after the decimal point.
NUMERIC_WHOLE_DIGITS, NUMERIC_FRACTION_DIGITS = 131_072, 16_383


def storable_number(number: Decimal) -> bool:
    """Whether ``jsonb`` can hold ``number``: ``1e131072`` and ``1.5e-16383`` are read here, exactly, but
    PostgreSQL refuses them ("value overflows numeric format"), which writes nothing of the command."""
    _, digits, exponent = number.as_tuple()
    return isinstance(exponent, int) and -exponent <= NUMERIC_FRACTION_DIGITS and len(digits) + exponent <= NUMERIC_WHOLE_DIGITS


#: The longest JSON integer the decoder reads, a minus sign counted: msgspec refuses a longer one as out of
#: range (as Python's ``int`` does past 4,300 digits).
INTEGER_CHARACTERS = 4_300


def readable_number(number: Decimal) -> bool:
    """Whether ``number``, once ``jsonb`` holds it, reads back: ``jsonb`` writes a number with no digits after
    the point in full (``1e5000`` as a 1 and 5,000 zeros), and past :data:`INTEGER_CHARACTERS` the decoder
    refuses it, so every read of the document holding it fails. A body's own integers are held to that as
    it is read; a number written with an exponent is not, and was stored, after which no read of its job
    (nor of its organization's job list or log) and no verification succeeded."""
    sign, digits, exponent = number.as_tuple()
    return not isinstance(exponent, int) or exponent < 0 or number.is_zero() or sign + len(digits) + exponent <= INTEGER_CHARACTERS


#: A JSON string (skipped whole, so that digits inside one are left alone), or an integer token (not the fraction
#: or exponent of a number) of at least :data:`INTEGER_CHARACTERS` digits.
_LONG_INTEGER = r'"(?:[^"\\]|\\.)*"|(?<![0-9.eE+-])(-?[0-9]{%d,})(?![0-9.eE])' % INTEGER_CHARACTERS
_LONG_INTEGERS = {str: re.compile(_LONG_INTEGER), bytes: re.compile(_LONG_INTEGER.encode())}
_AS_DECIMAL = {str: "e0", bytes: b"e0"}


def long_integers_as_decimals(data: bytes | str) -> bytes | str | None:
    """``data`` with each integer longer than the decoder reads written with an exponent (``e0``: the same
    number), so that it is read as a :class:`~decimal.Decimal` and written back as it was; None when it holds none.

    :func:`readable_number` keeps such numbers out of what is written now, but releases before it stored them
    (``1e5000`` in a payload or a result, which ``jsonb`` gives back written out): the log and the views keep
    them for ever, and every read that met one failed. For a read that failed (``msgspec.ValidationError``)."""
    pattern, suffix = _LONG_INTEGERS[type(data)], _AS_DECIMAL[type(data)]
    found = False

    def rewrite(match: re.Match) -> Any:
        nonlocal found
        token = match[1]
        if token is None or len(token) <= INTEGER_CHARACTERS:
            return match[0]
        found = True
        return token + suffix

    rewritten = pattern.sub(rewrite, data)
    return rewritten if found else None


def decode_stored(decoder: msgspec.json.Decoder, data: bytes | str) -> Any:
    """``decoder.decode(data)``, reading integers longer than it reads as decimals (:func:`long_integers_as_decimals`)."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError:
        readable = long_integers_as_decimals(data)
        if readable is None:
            raise
        return decoder.decode(readable)


_ANY = decoder()


def decode(data: bytes | str) -> Any:
    """A JSON document, its numbers kept exactly."""
    return decode_stored(_ANY, data)


def to_builtins(value: Any) -> Any:
    """``msgspec.to_builtins`` keeping a :class:`~decimal.Decimal` as it is, for :data:`encoder` to write as a number."""
    return msgspec.to_builtins(value, builtin_types=(Decimal,))
