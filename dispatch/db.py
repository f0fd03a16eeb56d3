"""Small things every part of dispatch needs around the database: the errors a database
call may raise (Django's wrappers and psycopg's own, for raw connections), an exception as
one log line, an error text fit to be stored, and the database's clock (contract section
4: ages and deadlines are never computed from a web server's or a worker's clock)."""

from __future__ import annotations

import re
from datetime import datetime

import psycopg
from django.db import Error as DjangoDBError
from django.db import connection

DB_ERRORS: tuple[type[BaseException], ...] = (DjangoDBError, psycopg.Error)


def one_line(exc: BaseException | str) -> str:
    """An exception's text (or a text) on one line, at most 300 characters (an
    exception's type when its text is empty)."""
    if isinstance(exc, str):
        return " ".join(exc.split())[:300]
    return " ".join(str(exc).split())[:300] or type(exc).__name__


# What a stored error text may not hold as such: control characters (C0, DEL, C1) but tab
# and newline, and lone surrogates (from undecodable bytes), which UTF-8 cannot carry.
# PostgreSQL refuses NUL in text outright; the others would reach pages, mails and logs.
_UNSTORABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def storable(text: str) -> str:
    """`text` with every control character but tab and newline, and every lone surrogate,
    written as its escape (`\\x00`, `\\udc80`): what any error text goes through before
    it is stored, so that storing it cannot fail. Idempotent; backslashes are kept as they
    are (the escapes are for a reader, not for decoding)."""
    return _UNSTORABLE.sub(_escape, text)


def db_now() -> datetime:
    """The database's `now()` on Django's connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    return now  # type: ignore[no-any-return]
