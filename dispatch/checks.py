"""System checks: a worker or site never starts without a usable encryption key."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, register

from dispatch import conf


@register()
def check_encryption_keys(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    from cryptography.fernet import Fernet

    keys = conf.encryption_keys()
    if not keys:
        return [
            Error(
                "DISPATCH_ENCRYPTION_KEYS is empty: datasource credentials cannot be encrypted.",
                hint="Set DISPATCH_ENCRYPTION_KEYS to one or more comma-separated Fernet keys "
                "(newest first). Generate one with: python -c "
                "'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'",
                id="dispatch.E001",
            )
        ]
    errors = []
    for position, key in enumerate(keys, start=1):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            errors.append(
                Error(
                    f"DISPATCH_ENCRYPTION_KEYS entry {position} is not a valid Fernet key.",
                    hint="A Fernet key is 32 url-safe base64-encoded bytes (44 characters).",
                    id="dispatch.E002",
                )
            )
    return errors
