"""NOTIFY payloads: coalesced per organization, packed under PostgreSQL's 8000-byte limit, read back whole."""

from __future__ import annotations

import uuid

from umbra.events.store import MAX_HINT_PAYLOAD, hint_payloads, parse_hints

A, B = uuid.UUID(int=1), uuid.UUID(int=2)


def test_hints_are_merged_per_organization_into_one_payload():
    [payload] = hint_payloads([(A, 5, 1), (B, 7, 0), (A, 9, 2), (A, 3, 0)])
    assert parse_hints(payload) == [(A, 9, 3), (B, 7, 0)]


def test_many_organizations_are_packed_into_as_few_payloads_as_fit():
    hints = [(uuid.UUID(int=n), 10**12 + n, n % 3) for n in range(1, 501)]
    payloads = hint_payloads(hints)
    assert all(len(p.encode()) <= MAX_HINT_PAYLOAD < 8000 for p in payloads)
    assert len(payloads) == -(-sum(len(f"{o.hex} {p} {c}") + 1 for o, p, c in hints) // MAX_HINT_PAYLOAD)
    assert [hint for p in payloads for hint in parse_hints(p)] == hints


def test_nothing_to_send_is_no_payload_and_a_malformed_one_is_refused_whole():
    assert hint_payloads([]) == []
    assert parse_hints(f"{A.hex} 5 1;not a hint") is None
    assert parse_hints("") is None
