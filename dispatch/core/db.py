"""Small things every part of dispatch needs around the database: the errors a database
call may raise (Django's wrappers and psycopg's own, for raw connections), an error text
fit to be stored, an exception as one log line (a connection's error without what
identifies the server), and the database's clock (contract section
4: ages and deadlines are never computed from a web server's or a worker's clock)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime

import psycopg
from django.db import Error as DjangoDBError
from django.db import connection

DB_ERRORS: tuple[type[BaseException], ...] = (DjangoDBError, psycopg.Error)


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


# What `storable` keeps that a log line may not hold as such: a tab, and the line breaks
# (a quoted text with a newline would start a line of its own: a forged record).
_LINE_BREAKS = str.maketrans({"\t": "\\t", "\n": "\\n", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def loggable(text: str) -> str:
    """`text` fit to be quoted in a log line: `storable`'s escapes, and tab and the line
    breaks written as `\\t`, `\\n`, so a quoted text can neither start a line of its own
    nor reach a terminal as a control sequence."""
    return storable(text).translate(_LINE_BREAKS)


def one_line(exc: BaseException | str) -> str:
    """An exception's text (or a text) for a log line (`loggable`, outer whitespace
    trimmed), at most 300 characters (an exception's type when its text is empty)."""
    if isinstance(exc, str):
        return loggable(exc.strip())[:300]
    return loggable(str(exc).strip())[:300] or type(exc).__name__


# libpq and psycopg quote what identifies a connection when it fails (`connection to
# server at "10.0.0.5"`, `role "app" does not exist`, `host: 'db', port: '5432'`) and the
# piece of a connection string they could not parse (which may be the password).
_QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'")
REDACTED = "***"


def connection_error(
    exc: BaseException, identity: Iterable[str] = (), secrets: Iterable[str] = ()
) -> str:
    """A database error for a log line, without what identifies the server or the role:
    its class and SQLSTATE, and its message with every quoted part, each of `identity`
    (the connection's host, user, database; as whole words) and each of `secrets`
    (wherever it appears) written as `***`. One line (`loggable`), at most 300 characters."""
    # Django wraps psycopg's error: the class and SQLSTATE that say what happened are
    # the cause's.
    cause = exc.__cause__ if isinstance(exc.__cause__, psycopg.Error) else exc
    sqlstate = getattr(cause, "sqlstate", None)
    text = _QUOTED.sub(lambda m: f"{m.group()[0]}{REDACTED}{m.group()[0]}", str(exc))
    for value in sorted((v for v in secrets if v), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    for value in sorted((v for v in identity if v), key=len, reverse=True):
        # Whole words only: a user named `db` must not eat every `db` of the message.
        text = re.sub(rf"(?<![\w.-]){re.escape(value)}(?![\w.-])", REDACTED, text)
    label = type(cause).__name__ + (f" sqlstate={sqlstate}" if sqlstate else "")
    message = loggable(text.strip())[:300]
    return f"{label}: {message}" if message else label


def db_now() -> datetime:
    """The database's `now()` on Django's connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    return now  # type: ignore[no-any-return]
