"""Secrets: generation, argon2id hashing, and constant-time checks.

One hashing profile for every stored secret (API keys, node credentials,
pairing codes): changing the cost is one edit here. Tokens have the shape
``<kind>_<prefix>_<secret>``; the prefix is stored in clear to narrow the
lookup, the whole token is verified against the argon2id hash, so two keys that
happen to share a prefix can never authenticate as each other.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from argon2 import PasswordHasher, Type, low_level
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from .settings import cheap_hashing

#: The argon2id profile for every stored secret. RFC 9106's second recommended
#: option (64 MiB would make every pairing attempt cost more than the rate limit
#: needs): 3 passes over 19 MiB, one lane — OWASP's argon2id minimum.
PROFILE = PasswordHasher(time_cost=3, memory_cost=19 * 1024, parallelism=1, hash_len=32, salt_len=16, type=Type.ID)

#: argon2id at its smallest cost (one pass over 8 KiB), for a test suite: the same code paths, only the
#: parameters written into each hash differ (``umbra.settings.CHEAP_HASHING_VARIABLE`` says when).
CHEAP_TEST_PROFILE = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1, hash_len=32, salt_len=16, type=Type.ID)

#: The profile this process hashes with.
PASSWORD_HASHER = CHEAP_TEST_PROFILE if cheap_hashing() else PROFILE

PREFIX_LENGTH = 10
_HEX = re.compile("[0-9a-f]+")


def hash_secret(secret: str) -> str:
    return PASSWORD_HASHER.hash(secret)


def hash_secret_salted(secret: str, salt: bytes) -> str:
    """The one profile's argon2id hash of ``secret`` under a given ``salt``: the same inputs, the same hash.

    For a secret that must be *found* by its hash rather than checked against
    a hash found by other means (a pairing code carries no prefix to look it
    up by): the caller supplies a salt kept per database, so hashing the
    candidate once and looking the result up replaces verifying it against
    every stored hash in turn. The result verifies with :func:`verify_secret`.
    """
    if len(salt) != PASSWORD_HASHER.salt_len:
        raise ValueError(f"the salt must be {PASSWORD_HASHER.salt_len} bytes")
    return low_level.hash_secret(
        secret.encode(), salt, time_cost=PASSWORD_HASHER.time_cost, memory_cost=PASSWORD_HASHER.memory_cost,
        parallelism=PASSWORD_HASHER.parallelism, hash_len=PASSWORD_HASHER.hash_len, type=PASSWORD_HASHER.type,
    ).decode()


def verify_secret(stored_hash: str, secret: str) -> bool:
    """True when ``secret`` matches; argon2's comparison is constant-time."""
    try:
        return PASSWORD_HASHER.verify(stored_hash, secret)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def new_token(kind: str) -> tuple[str, str]:
    """Return ``(token, prefix)`` for a fresh bearer token of ``kind`` (e.g. ``uk``)."""
    prefix = secrets.token_hex(PREFIX_LENGTH // 2)
    return f"{kind}_{prefix}_{secrets.token_urlsafe(32)}", prefix


def token_prefix(token: str, kind: str) -> str | None:
    """The stored-prefix part of ``token``, or None when it is not of ``kind``."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != kind or not is_prefix(parts[1]):
        return None  # what new_token never makes (a NUL, say) is refused here, before any query
    return parts[1]


def is_prefix(text: str) -> bool:
    """Whether ``text`` has the shape of a stored prefix (:func:`new_token`'s hex digits). Only such text is
    quoted back as a prefix: anything else given where a prefix was expected may be a secret."""
    return len(text) == PREFIX_LENGTH and _HEX.fullmatch(text) is not None


def token_fingerprint(token: str) -> bytes:
    """A fast digest used only as an in-memory cache key for verified tokens."""
    return hashlib.sha256(token.encode()).digest()


def constant_time_equal(a: bytes | str, b: bytes | str) -> bool:
    if isinstance(a, str):
        a = a.encode()
    if isinstance(b, str):
        b = b.encode()
    return hmac.compare_digest(a, b)
