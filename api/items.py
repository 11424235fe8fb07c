"""Which item of a request body's list a refusal is about, found in the raw bytes.

A batch names the item that refuses it (``index``). The decoder says so itself
for most refusals (its error ends in ``$.jobs[3]...``), but not for two that
come from the bytes rather than the decoded values: a NUL anywhere in the body
(refused before decoding, since PostgreSQL cannot store it) and nesting too
deep for the decoder's recursion. For those, :func:`item_at` scans the bytes.

It runs only once the refusal is certain, on bodies the decoder could not take:
so it does not decode (a value nested thousands of levels deep would exhaust
the recursion again), keeps no stack, skips strings and other bytes in C (one
possessive pattern, never backtracking), and stops at the offending byte.
"""

from __future__ import annotations

import re

import msgspec

#: Everything up to the next bracket or comma outside a string: other bytes, and whole strings. Possessive,
#: and only ever matched at a position: one pass over the bytes it skips, whatever they hold.
_SKIP = re.compile(rb'(?:[^"\[\]{},]++|"(?:[^"\\]++|\\.)*+")*+', re.DOTALL)
_OPEN, _CLOSE, _COMMA, _QUOTE = frozenset(b"[{"), frozenset(b"]}"), ord(","), ord('"')


def item_at(body: bytes, items: str, *, offset: int | None = None, deeper_than: int | None = None) -> int | None:
    """The index of the item of the body's top-level list ``items`` that holds byte ``offset``,
    or that first nests more than ``deeper_than`` levels (the item's own object is one); None if none does.
    """
    end = len(body) if offset is None else offset
    depth = 0
    index: int | None = None  # the item being read, while inside the list
    previous = -1  # the bracket or comma before this one
    at = 0
    while (at := _SKIP.match(body, at, end).end()) < end:
        char = body[at]
        if char == _QUOTE:
            break  # a string still open at ``end``: the offset is in it
        if char in _OPEN:
            depth += 1
            if depth == 2 and char == ord("[") and _key(body[previous + 1 : at]) == items:
                index = 0
            elif index is not None and deeper_than is not None and depth - 2 > deeper_than:
                return index
        elif char in _CLOSE:
            if depth == 2:
                index = None  # the list (or another top-level value) ends
            depth -= 1
        elif char == _COMMA and depth == 2 and index is not None:
            index += 1
        previous = at
        at += 1
    if offset is not None and index is not None and depth >= 2:
        return index
    return None


def _key(between: bytes) -> str | None:
    """The key in ``"name":``, the bytes between a top-level ``{`` or ``,`` and the value's bracket."""
    text = between.strip()
    if not text.endswith(b":"):
        return None
    try:
        return msgspec.json.decode(text[:-1], type=str)
    except msgspec.DecodeError:
        return None
