"""Which of a caller's credentials a route admits, from the route table's auth and scopes (for tests that walk it)."""

from __future__ import annotations

from typing import Any, Mapping

from umbra.compute.auth import API_KEY_SCOPES


def holding_the_scopes(info: Any, key: str, node: str, *, prefix: str = "") -> list[tuple[str, str]]:
    """The organization's full API key and node credential, those of the route's kinds."""
    out = []
    if "api_key" in info.auth:
        out.append((f"{prefix}key", key))
    if "node" in info.auth:
        out.append((f"{prefix}node", node))
    return out


def lacking_the_scopes(info: Any, key: str, node: str, scoped: Mapping[str, str], *, prefix: str = "") -> list[tuple[str, str]]:
    """Credentials holding none of the scopes the route accepts: single-scope keys, then the node's and the key's."""
    out = [(f"{prefix}key[{scope}]", token) for scope, token in scoped.items() if scope not in info.scopes]
    if not any(scope.startswith("compute:") for scope in info.scopes):
        out.append((f"{prefix}node", node))
    if not any(scope in API_KEY_SCOPES for scope in info.scopes):
        out.append((f"{prefix}key", key))
    return out
