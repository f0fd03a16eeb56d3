"""Encryption of datasource configs and attempt snapshots.

Fernet binds no context, so the plaintext is an envelope that names the datasource and
its config version; `decrypt_config` checks both against the row the ciphertext was read
from, so a ciphertext copied onto another datasource (or onto an attempt that
snapshotted another datasource) is refused. `InvalidToken` fails closed.
"""

from __future__ import annotations

import json
import uuid
from functools import lru_cache
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from dispatch.core import conf

ENVELOPE_VERSION = 1


class SnapshotUnreadable(Exception):
    """A ciphertext could not be decrypted, or names another datasource or version."""


class KeyUnavailable(SnapshotUnreadable):
    """None of the configured keys opens the ciphertext: the reader's keys are wrong (or
    incomplete), which says nothing about the row itself."""


@lru_cache(maxsize=8)
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    if not keys:
        raise SnapshotUnreadable("no encryption key is configured (DISPATCH_ENCRYPTION_KEYS)")
    return MultiFernet([Fernet(k) for k in keys])


def fernet() -> MultiFernet:
    return _fernet(tuple(conf.encryption_keys()))


def encrypt_config(datasource_id: uuid.UUID, version: int, config: dict[str, Any]) -> str:
    envelope = {
        "v": ENVELOPE_VERSION,
        "datasource_id": str(datasource_id),
        "version": version,
        "config": config,
    }
    plaintext = json.dumps(envelope, separators=(",", ":"), sort_keys=True).encode()
    return fernet().encrypt(plaintext).decode("ascii")


def decrypt_config(
    token: str, *, expected_id: uuid.UUID, expected_version: int | None = None
) -> dict[str, Any]:
    """Decrypt a config or snapshot and check that it belongs where it was read from.

    The error messages name what failed, never the plaintext.
    """
    try:
        plaintext = fernet().decrypt(token.encode("ascii"))
    except (InvalidToken, ValueError, TypeError, UnicodeError):
        raise KeyUnavailable("ciphertext cannot be decrypted with any configured key") from None
    try:
        envelope = json.loads(plaintext)
    except ValueError:
        raise SnapshotUnreadable("decrypted envelope is not JSON") from None
    if not isinstance(envelope, dict) or envelope.get("v") != ENVELOPE_VERSION:
        raise SnapshotUnreadable("decrypted envelope has an unknown format")
    if envelope.get("datasource_id") != str(expected_id):
        raise SnapshotUnreadable(
            f"ciphertext belongs to another datasource (expected {expected_id})"
        )
    if expected_version is not None and envelope.get("version") != expected_version:
        raise SnapshotUnreadable(
            f"ciphertext is of config version {envelope.get('version')}, expected {expected_version}"
        )
    config = envelope.get("config")
    if not isinstance(config, dict):
        raise SnapshotUnreadable("decrypted envelope holds no config")
    return config


def encrypt_binding_secret(binding_id: uuid.UUID, name: str, value: str) -> str:
    """A binding's secret (its hash key), in an envelope that names the binding and the
    secret, so a ciphertext copied onto another binding or field does not open there."""
    envelope = {"v": ENVELOPE_VERSION, "binding_id": str(binding_id), name: value}
    plaintext = json.dumps(envelope, separators=(",", ":"), sort_keys=True).encode()
    return fernet().encrypt(plaintext).decode("ascii")


def decrypt_binding_secret(token: str, *, expected_id: uuid.UUID, name: str) -> str:
    """The secret `encrypt_binding_secret` stored; the errors name what failed, never the
    plaintext."""
    try:
        plaintext = fernet().decrypt(token.encode("ascii"))
    except (InvalidToken, ValueError, TypeError, UnicodeError):
        raise KeyUnavailable("ciphertext cannot be decrypted with any configured key") from None
    try:
        envelope = json.loads(plaintext)
    except ValueError:
        raise SnapshotUnreadable("decrypted envelope is not JSON") from None
    if not isinstance(envelope, dict) or envelope.get("v") != ENVELOPE_VERSION:
        raise SnapshotUnreadable("decrypted envelope has an unknown format")
    if envelope.get("binding_id") != str(expected_id):
        raise SnapshotUnreadable(f"ciphertext belongs to another binding (expected {expected_id})")
    value = envelope.get(name)
    if not isinstance(value, str):
        raise SnapshotUnreadable(f"decrypted envelope holds no {name}")
    return value


def rotate(token: str) -> str:
    """Re-encrypt a ciphertext under the newest key (plaintext unchanged)."""
    return fernet().rotate(token.encode("ascii")).decode("ascii")
