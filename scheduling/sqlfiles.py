"""Named statements of the scheduling app (`scheduling/sql/queries.sql`), in the same
format as dispatch's: each under a `-- name: NAME` header, `%(param)s` placeholders."""

from __future__ import annotations

from pathlib import Path

from dispatch.core.sqlfiles import NamedQueries

SQL_DIR = Path(__file__).resolve().parent / "sql"
_QUERIES = NamedQueries(SQL_DIR / "queries.sql")


def query(name: str) -> str:
    return _QUERIES.query(name)


def query_names() -> list[str]:
    return _QUERIES.names()
