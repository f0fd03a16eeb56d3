"""Start-up key check: do the configured keys open what is stored?

A well-formed but wrong key passes the format check (dispatch.E002); this one decrypts a
sample of stored datasource configs (the most recently changed ones, which are the most
likely to be under the newest key). Only the decryption is tried: the identity of the
envelope is checked where a config is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.fernet import InvalidToken
from django.db import DatabaseError, connection

from dispatch.security import crypto

SAMPLE_ROWS = 5


@dataclass(frozen=True)
class KeyReport:
    sampled: int
    unreadable: int

    @property
    def none_open(self) -> bool:
        return self.sampled > 0 and self.unreadable == self.sampled


def sample(limit: int = SAMPLE_ROWS) -> KeyReport | None:
    """Try the keys on up to `limit` stored configs; None when the table cannot be read
    (not migrated yet, no database): nothing to judge then."""
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT config_ciphertext FROM dispatch_datasource "
                "ORDER BY updated_at DESC, id LIMIT %s",
                [limit],
            )
            tokens = [row[0] for row in cursor.fetchall()]
    except DatabaseError:
        return None
    try:
        fernet = crypto.fernet()
    except (crypto.SnapshotUnreadable, ValueError, TypeError):
        return KeyReport(len(tokens), len(tokens))
    unreadable = 0
    for token in tokens:
        try:
            fernet.decrypt(token.encode("ascii"))
        except (InvalidToken, ValueError, TypeError, UnicodeError):
            unreadable += 1
    return KeyReport(len(tokens), unreadable)
