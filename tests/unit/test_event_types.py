"""Event decoding: permanent tags, tolerance of newer writers, garbage refused."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbra.events.types import EVENT_TYPES, JobSubmitted, decode_event, encode_event

#: The tags ever written. A tag here must never disappear or change meaning.
PERMANENT_TAGS = {
    "job.submitted", "job.claimed", "job.lease_renewed", "job.completed", "job.failed", "job.requeued",
    "job.lease_expired", "job.released", "job.blocked", "job.unblocked", "job.decomposed", "job.settled",
    "job.cancelled", "job.retried", "job.reprioritized", "node.created", "node.paired", "node.heartbeat", "node.went_offline", "node.draining",
    "node.retired", "node.revoked", "node.device_cordoned", "node.device_uncordoned",
}


def test_every_permanent_tag_still_decodes_to_a_type():
    assert PERMANENT_TAGS <= set(EVENT_TYPES)


def test_round_trip():
    event = JobSubmitted(kind="echo", priority=0, max_attempts=3, payload={"a": 1})
    assert decode_event(encode_event(event)) == event
    assert b'"type":"job.submitted"' in encode_event(event)


def test_unknown_fields_from_a_newer_writer_are_tolerated():
    raw = b'{"type":"job.cancelled","by":"x","added_in_v9":{"nested":true}}'
    assert decode_event(raw).by == "x"


def test_an_unknown_type_or_value_from_a_newer_writer_is_read_as_stored():
    from umbra.events.types import UnknownEvent

    assert decode_event(b'{"type":"job.teleported","to":"mars"}') == UnknownEvent(
        type="job.teleported", data={"type": "job.teleported", "to": "mars"})
    preempted = decode_event(b'{"type":"job.failed","attempt":1,"error":"x","reason":"preempted"}')
    assert isinstance(preempted, UnknownEvent) and preempted.type == "job.failed"
    with pytest.raises(msgspec.DecodeError):
        decode_event(b'{"type": "job.failed"')  # not JSON: refused, never passed off as an event
    with pytest.raises(msgspec.ValidationError):
        decode_event(b'["job.failed"]')  # JSON, but not an event object


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        decode_event(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=10), st.none() | st.integers() | st.text(max_size=10), max_size=6),
       st.sampled_from(sorted(PERMANENT_TAGS)))
def test_random_json_objects_decode_or_fail_cleanly(fields, tag):
    raw = msgspec.json.encode({**fields, "type": tag})
    try:
        decode_event(raw)
    except msgspec.ValidationError:
        pass


def test_a_tag_names_its_schema_version():
    from umbra.events.types import event_version

    assert [event_version(t) for t in ("job.failed", "job.failed.v2", "job.failed.v12", "job.failed.v1", "job.v")] == [1, 2, 12, 1, 1]
    assert {event_version(tag) for tag in EVENT_TYPES} == {1}  # every type is at its first version


def test_a_superseded_version_is_upcast_as_it_is_read(monkeypatch):
    """How a type changes incompatibly: its version 1 rows are upcast to version 2 as they are read, never rewritten."""
    from datetime import datetime, timezone
    from typing import Union

    from umbra.events import types
    from umbra.events.types import Event, JobRequeued, UnknownEvent

    # Say job.requeued one day records the delay instead of the time: version 2, tag job.requeued.v2.
    class JobRequeuedV2(types._Event, tag="job.requeued.v2"):
        attempt: int
        error: str
        delay_s: float

    def upcast(v1: dict) -> dict:
        recorded = datetime(2026, 1, 1, tzinfo=timezone.utc)  # (a real upcast would be given the row's recorded_at)
        delay = datetime.fromisoformat(v1["not_before"]) - recorded
        return {"type": "job.requeued.v2", "attempt": v1["attempt"], "error": v1["error"], "delay_s": delay.total_seconds()}

    current = tuple(t for t in Event.__args__ if t is not JobRequeued) + (JobRequeuedV2,)
    monkeypatch.setattr(types, "_decoder", msgspec.json.Decoder(Union[current]))
    stored = encode_event(JobRequeued(attempt=2, error="oom", not_before=datetime(2026, 1, 1, 0, 0, 5, tzinfo=timezone.utc)))
    assert isinstance(decode_event(stored), UnknownEvent)  # before its upcast is registered: shown as stored, not refused
    monkeypatch.setitem(types.UPCASTS, "job.requeued", upcast)
    assert decode_event(stored) == JobRequeuedV2(attempt=2, error="oom", delay_s=5.0)
    assert types.event_version("job.requeued.v2") == 2
    monkeypatch.setitem(types.UPCASTS, "job.requeued", lambda v1: {**v1, "type": "job.requeued.v2"})  # a wrong upcast
    assert decode_event(stored) == UnknownEvent(type="job.requeued", data=msgspec.json.decode(stored))


def test_an_integer_longer_than_the_decoder_reads_is_read_as_a_decimal_and_nothing_else_is_touched():
    """Releases before ``documents.readable_number`` stored numbers like ``1e5000``, which jsonb gives back
    written out; the event still decodes as its type, the number as the same value, strings and the fractions
    and exponents of other numbers as they were."""
    from decimal import Decimal

    from umbra.events.documents import long_integers_as_decimals

    long, digits = "1" + "0" * 5000, "9" * 5000
    stored = ('{"type":"job.submitted","kind":"k","priority":1,"max_attempts":1,"payload":{"n":-%s,"s":"%s",'
              '"f":1.%s,"e":1.5e-%s,"ok":%s}}') % (long, digits, digits, "3" * 4, "1" * 4300)  # fmt: skip
    event = decode_event(stored)
    assert isinstance(event, JobSubmitted)
    assert event.payload == {"n": -Decimal(long), "s": digits, "f": Decimal("1." + digits), "e": Decimal("1.5e-3333"),
                             "ok": int("1" * 4300)}  # fmt: skip
    assert long_integers_as_decimals(b'{"a": [1, 2.5e10, "' + digits.encode() + b'"]}') is None
