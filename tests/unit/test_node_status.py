from datetime import datetime, timedelta, timezone

import pytest

from umbra.domain.node_status import effective_status

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    "stored,age,expected",
    [
        ("online", 0, "online"),
        ("online", 45, "online"),
        ("online", 46, "offline"),
        ("online", None, "offline"),
        ("provisioning", None, "provisioning"),
        ("draining", 3600, "draining"),
        ("retired", 3600, "retired"),
        ("offline", 0, "offline"),
    ],
)
def test_only_online_is_derived_away(stored, age, expected):
    seen = None if age is None else NOW - timedelta(seconds=age)
    assert effective_status(stored, seen, NOW) == expected


def test_threshold_is_configurable():
    assert effective_status("online", NOW - timedelta(seconds=10), NOW, stale_seconds=5) == "offline"
