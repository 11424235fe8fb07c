"""Request decoding under random input: a refusal is always a clean decode error.

Every request struct the API declares (``EndpointInfo.body`` over the route
table) is fed random bytes, random JSON, and random objects shaped like the
struct (its own field names, nested, with values of every JSON type). The only
acceptable failures are ``msgspec.DecodeError`` and ``msgspec.ValidationError``
(which ``read_json`` turns into 422 ``invalid_request``); a decoded value must
convert to the stored types (requirements, devices) without any other error,
so a request that passes decoding cannot become a 500 later for its shape.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbra.api.app import all_routes
from umbra.api.http import _field_of
from umbra.api.nodes import to_devices
from umbra.errors import InvalidRequest

REQUEST_STRUCTS = sorted(
    {info.body for route in all_routes() if (info := getattr(route, "endpoint_info", None)) and info.body},
    key=lambda t: t.__name__,
)


def field_names(struct: type, seen: set | None = None) -> list[str]:
    """The struct's JSON field names, and those of every struct nested in it."""
    seen = set() if seen is None else seen
    if struct in seen:
        return []
    seen.add(struct)
    names: list[str] = []
    for f in msgspec.structs.fields(struct):
        names.append(f.encode_name)
        for inner in _structs_in(f.type):
            names += field_names(inner, seen)
    return sorted(set(names))


def _structs_in(annotation) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return [annotation]
    found = []
    for arg in getattr(annotation, "__args__", ()) or ():
        found += _structs_in(arg)
    origin = getattr(annotation, "__origin__", None)
    if origin is not None and origin is not annotation:
        found += _structs_in(origin)
    if hasattr(annotation, "__metadata__"):  # Annotated[T, Meta]
        found += _structs_in(annotation.__origin__)
    return found


SCALARS = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30)
    | st.sampled_from(["", "\x00", "cpu", "gpu_discrete", "echo", "0" * 6, "00000000-0000-0000-0000-000000000000",
                       "1e309", "-1", "2147483648"])
)  # fmt: skip


def shaped(struct: type):
    """Objects using the struct's own field names at every level, with random values."""
    keys = st.sampled_from(field_names(struct)) | st.text(max_size=8)
    return st.recursive(
        SCALARS,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=8),
        max_leaves=25,
    ).filter(lambda v: isinstance(v, dict)) | st.dictionaries(keys, SCALARS, max_size=8)


def decode_cleanly(struct: type, raw: bytes) -> None:
    try:
        value = msgspec.json.decode(raw, type=struct)
    except msgspec.ValidationError as exc:
        _field_of(str(exc))  # the 422's field name is derived from the message: must not raise either
        return
    except msgspec.DecodeError:
        return
    msgspec.json.encode(value)
    _to_stored(value)


def _to_stored(value) -> None:
    """What the handlers do next with a decoded body, minus the database."""
    requires = getattr(value, "requires", None)
    if requires is not None and hasattr(requires, "to_requirements"):
        requires.to_requirements()
    for item in getattr(value, "jobs", None) or getattr(value, "children", None) or []:
        _to_stored(item)
    devices = getattr(value, "devices", None)
    if isinstance(devices, list):
        try:
            to_devices(devices)
        except InvalidRequest:
            pass


def test_the_route_table_declares_request_structs():
    names = {t.__name__ for t in REQUEST_STRUCTS}
    assert {"JobRequest", "BatchRequest", "HeartbeatRequest", "RedeemRequest", "CompleteRequest"} <= names


@pytest.mark.parametrize("struct", REQUEST_STRUCTS, ids=lambda t: t.__name__)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_random_input_decodes_or_is_refused_cleanly(struct, data):
    kind = data.draw(st.sampled_from(["bytes", "json", "shaped"]))
    if kind == "bytes":
        raw = data.draw(st.binary(max_size=300))
    elif kind == "json":
        raw = msgspec.json.encode(data.draw(st.recursive(SCALARS, lambda i: st.lists(i) | st.dictionaries(st.text(), i))))
    else:
        raw = msgspec.json.encode(data.draw(shaped(struct)))
    decode_cleanly(struct, raw)


def test_field_names_reach_nested_structs():
    from umbra.api.jobs import BatchRequest

    assert {"jobs", "kind", "requires", "vram_min_mb"} <= set(field_names(BatchRequest))
