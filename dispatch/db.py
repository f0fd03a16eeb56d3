"""Three small things every part of dispatch needs around the database: the errors a
database call may raise (Django's wrappers and psycopg's own, for raw connections), an
exception as one log line, and the database's clock (contract section 4: ages and
deadlines are never computed from a web server's or a worker's clock)."""

from __future__ import annotations

from datetime import datetime

import psycopg
from django.db import Error as DjangoDBError
from django.db import connection

DB_ERRORS: tuple[type[BaseException], ...] = (DjangoDBError, psycopg.Error)


def one_line(exc: BaseException) -> str:
    """An exception's text on one line, at most 300 characters (its type when empty)."""
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def db_now() -> datetime:
    """The database's `now()` on Django's connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    return now  # type: ignore[no-any-return]
