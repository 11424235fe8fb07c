"""NOTIFY payloads: coalesced per organization, packed under PostgreSQL's 8000-byte limit, read back whole."""

from __future__ import annotations

import uuid

from umbra.events.store import MAX_HINT_PAYLOAD, first_hint_payload, merge_hints, parse_hints

A, B = uuid.UUID(int=1), uuid.UUID(int=2)


def test_hints_are_merged_per_organization_into_one_payload():
    payload, rest = first_hint_payload(merge_hints({}, [(A, 5, 1), (B, 7, 0), (A, 9, 2), (A, 3, 0)]))
    assert parse_hints(payload) == [(A, 9, 3), (B, 7, 0)] and rest == {}


def test_one_payload_carries_the_organizations_that_fit_and_leaves_the_rest_whole():
    hints = [(uuid.UUID(int=n), 10**12 + n, n % 3) for n in range(1, 501)]
    merged = merge_hints({}, hints)
    sent = []
    while (fitted := first_hint_payload(merged)) is not None:
        payload, merged = fitted
        assert len(payload.encode()) <= MAX_HINT_PAYLOAD < 8000
        sent.append(parse_hints(payload))
    assert len(sent) == -(-sum(len(f"{o.hex} {p} {c}") + 1 for o, p, c in hints) // MAX_HINT_PAYLOAD)
    assert [hint for payload in sent for hint in payload] == hints


def test_nothing_to_send_is_no_payload_and_a_malformed_one_is_refused_whole():
    assert first_hint_payload({}) is None
    assert parse_hints(f"{A.hex} 5 1;not a hint") is None
    assert parse_hints("") is None
