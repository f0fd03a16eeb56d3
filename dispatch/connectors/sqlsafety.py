"""What a source database says may reach the sink's SQL text only through these checks.

A source role controls its own `search_path` and may define functions that shadow the
catalog's (`public.format_type`), so every connector session gets a safe `search_path`
(the role's own schemas for resolving table names, but never ahead of `pg_catalog`, and
`pg_temp` last), and a type name read from a source is accepted for the sink's
`CREATE TABLE` only if it is a plain type name by a strict grammar (identifiers, quoted
identifiers, numbers and `( ) , . [ ]`: no comment, no statement separator, no string) and
the sink itself resolves it to a type (`::pg_catalog.regtype`, which parses exactly one type
name and nothing else).

Being behind `pg_catalog` does not protect a function call: lookup takes the closest
signature from any schema on the path, so `its_schema.pg_has_role(name, regrole, text)`
beats the catalog's `(name, oid, text)`. So every catalog function, operator and type the
connectors send is schema-qualified (`pg_catalog.set_config`, `OPERATOR(pg_catalog.||)`),
and the checks that read the catalog run under `catalog_only()` as well.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

from dispatch.connectors.base import PermanentError

_TOKEN = re.compile(r'\s+|[A-Za-z_][A-Za-z0-9_$]*|"(?:[^"]|"")+"|[0-9]+|[(),.\[\]]')


def split_search_path(value: str) -> list[str]:
    """The entries of a `search_path` setting, unquoted ("$user" kept as written)."""
    entries: list[str] = []
    for part in re.findall(r'\s*("(?:[^"]|"")*"|[^,]+)\s*(?:,|$)', value):
        part = part.strip()
        if not part:
            continue
        if part.startswith('"') and part.endswith('"') and part != '"$user"':
            part = part[1:-1].replace('""', '"')
        entries.append(part)
    return entries


def _quote(entry: str) -> str:
    if entry == '"$user"' or entry == "$user":
        return '"$user"'
    return '"' + entry.replace('"', '""') + '"'


def set_safe_search_path(conn: psycopg.Connection[Any]) -> None:
    """Keep the session's schemas for table names, drop any explicit `pg_catalog` (so it is
    searched first, implicitly) and any `pg_temp`, and put `pg_temp` last. Only
    schema-qualified functions are called to read and set it, with no operator."""
    row = conn.execute(CURRENT_SEARCH_PATH_SQL).fetchone()
    conn.execute(SET_SEARCH_PATH_SQL, [safe_search_path(str(row[0]) if row else "")])
    conn.commit()


CURRENT_SEARCH_PATH_SQL = "SELECT pg_catalog.current_setting('search_path')"
SET_SEARCH_PATH_SQL = "SELECT pg_catalog.set_config('search_path', %s, false)"


def safe_search_path(current: str) -> str:
    """The search_path `set_safe_search_path` sets, from the session's `current` one."""
    kept = [
        e
        for e in split_search_path(current)
        if e.lower() != "pg_catalog" and not e.lower().startswith("pg_temp")
    ]
    return ", ".join([*(_quote(e) for e in kept), "pg_temp"])


# Function and operator lookup takes the closest signature from every schema on the path
# (the order only breaks ties); pg_temp is never searched for either, so this path leaves
# the catalog alone.
CATALOG_ONLY_SQL = "SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true)"


def catalog_only(conn: psycopg.Connection[Any]) -> None:
    """`SET LOCAL search_path = pg_catalog, pg_temp` for the rest of the current
    transaction (begun here if none is open): a check of the catalog that a name left
    unqualified by mistake still resolves in the catalog, never in the role's schemas."""
    conn.execute(CATALOG_ONLY_SQL)


def check_type_name(conn: psycopg.Connection[Any], column: str, type_text: str) -> str:
    """`type_text` if it is one type name the sink knows; a permanent error naming the
    column otherwise."""
    pos = 0
    while pos < len(type_text):
        m = _TOKEN.match(type_text, pos)
        if m is None:
            raise PermanentError(
                f"column {column}: the source's type {type_text[:80]!r} is not a plain type name"
            )
        pos = m.end()
    if not type_text.strip():
        raise PermanentError(f"column {column}: the source gave no type")
    try:
        with conn.transaction():
            conn.execute("SELECT %s::pg_catalog.regtype", [type_text])
    except psycopg.Error as exc:
        raise PermanentError(
            f"column {column}: type {type_text[:80]!r} is not a type on the sink "
            f"({exc.diag.message_primary or type(exc).__name__})"
        ) from None
    return type_text


def create_once(conn: psycopg.Connection[Any], name: str, schema: str, statement: Any) -> None:
    """Run a first-use `CREATE ... IF NOT EXISTS` of the table `name` in `schema`, in a
    transaction of its own. CREATE ... IF NOT EXISTS is not atomic against a concurrent
    creation (the loser fails with a duplicate table, a duplicate type or a unique
    violation on the catalog), so creators serialise on a transaction lock for the name;
    under it the second creator sees the first one's committed table. A creator that does
    not take the lock (an older worker) is caught, and the second pass sees its table."""
    for tries in range(2):
        try:
            with conn.transaction():
                conn.execute(
                    "SELECT pg_catalog.pg_advisory_xact_lock("
                    "pg_catalog.hashtext(%s), pg_catalog.hashtext(%s))",
                    [name, schema],
                )
                conn.execute(statement)
            return
        except (
            psycopg.errors.UniqueViolation,
            psycopg.errors.DuplicateTable,
            psycopg.errors.DuplicateObject,
        ):
            if tries:
                raise
