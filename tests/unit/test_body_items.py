"""Finding the item of a body's list that a byte-level refusal is about (``umbra.api.items``).

The scan must agree with the decoder's own numbering wherever the decoder can
number (so a hypothesis test compares them on random batches), find the item
in bodies the decoder cannot take at all, and stay one pass over the bytes
whatever they hold.
"""

from __future__ import annotations

import time

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from umbra.api.items import item_at

DEEP = b"[" * 5000 + b"]" * 5000


def nul_at(body: bytes) -> int:
    return body.index(b"\\u0000")


def test_the_item_holding_an_offset():
    body = b'{"jobs":[{"kind":"a"},{"kind":"b","payload":{"t":"x\\u0000y"}}]}'
    assert item_at(body, "jobs", offset=nul_at(body)) == 1
    # Brackets, commas and escaped quotes inside strings are text; the key may be escaped and spaced.
    body = b'{"attempt": 1, "chi\\u006cdren" :\n [ {"kind":"],[\\"{"} , {"kind":"b","payload":{"\\u0000":1}}]}'
    assert item_at(body, "children", offset=nul_at(body)) == 1
    # Outside the list, or in another list: no item.
    assert item_at(b'{"other":["\\u0000"],"jobs":[{}]}', "jobs", offset=13) is None
    body = b'{"jobs":[{"kind":"a"}],"x":"\\u0000"}'
    assert item_at(body, "jobs", offset=nul_at(body)) is None


def test_the_first_item_nested_deeper_than_a_bound():
    body = b'{"jobs":[{"kind":"a","payload":{"t":[[1]]}},{"kind":"b","payload":{"t":' + DEEP + b"}},{}]}"
    assert item_at(body, "jobs", deeper_than=3) == 0  # item 0: its object, the payload, two lists
    assert item_at(body, "jobs", deeper_than=4) == 1
    assert item_at(b'{"attempt":' + DEEP + b',"jobs":[{}]}', "jobs", deeper_than=4) is None


TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x01"), max_size=8)  # U+0001 marks the item


@settings(max_examples=200, deadline=None)
@given(st.lists(st.dictionaries(TEXT, TEXT | st.integers(), max_size=3), min_size=1, max_size=8), st.data())
def test_it_numbers_items_as_the_decoder_does(items, data):
    index = data.draw(st.integers(0, len(items) - 1))
    marked = [dict(item) for item in items]
    marked[index]["\x01mark"] = "\x01"
    body = msgspec.json.encode({"before": ["x,]", {"y": "["}], "jobs": marked, "after": [1]})
    offset = body.index(b"\\u0001")
    assert item_at(body, "jobs", offset=offset) == index


def test_one_pass_whatever_the_bytes_hold():
    """Long runs of escapes, an unterminated string, 130,000 tiny items: each well under a second."""
    cases = [
        (b'{"jobs":[{"kind":"' + b'\\"' * 500_000 + b'\\u0000', "nul"),
        (b'{"jobs":[{}, {"kind":"' + b"\\" * 1_000_000, "end"),
        (b'{"jobs":[' + b'{"a":1},' * 130_000 + b'{"p":"\\u0000"}]}', "nul"),
        (b'{"jobs":[' + b'{"a":1},' * 130_000 + b'{"p":' + DEEP + b"}]}", "deep"),
    ]
    for body, kind in cases:
        started = time.perf_counter()
        if kind == "deep":
            item_at(body, "jobs", deeper_than=101)
        else:
            item_at(body, "jobs", offset=nul_at(body) if kind == "nul" else len(body))
        assert time.perf_counter() - started < 1.5, kind
