from pathlib import Path

import pytest

from umbra.settings import SettingsError, load_settings


def test_defaults():
    s = load_settings({})
    assert s.database_url is None and s.lease_seconds == 60 and s.heartbeat_stale_seconds == 45


@pytest.mark.parametrize(
    "name,value",
    [("UMBRA_PORT", "eighty"), ("UMBRA_LEASE_SECONDS", "0"), ("UMBRA_TRUSTED_PROXIES", "10.0.0.0/33"),
     ("UMBRA_LOG_LEVEL", "chatty"), ("UMBRA_POLL_FALLBACK_SECONDS", "-1")],
)
def test_invalid_values_fail_naming_the_variable(name, value):
    with pytest.raises(SettingsError, match=name):
        load_settings({name: value})


def test_values_are_read(tmp_path: Path):
    s = load_settings({"UMBRA_DATA_DIR": str(tmp_path), "UMBRA_TRUSTED_PROXIES": "10.0.0.0/8, ::1", "UMBRA_PORT": "9000"})
    assert s.pgdata == tmp_path / "pg" and s.port == 9000 and len(s.trusted_proxies) == 2
    with pytest.raises(Exception):
        s.port = 1  # frozen
