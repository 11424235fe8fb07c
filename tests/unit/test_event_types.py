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
    "job.cancelled", "node.created", "node.paired", "node.heartbeat", "node.went_offline", "node.draining",
    "node.retired", "node.revoked",
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
