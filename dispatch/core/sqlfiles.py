"""Load the SQL that carries dispatch's concurrency (docs/sql.md).

- `sql/functions/<concern>.sql`: the current PL/pgSQL functions and triggers, one file
  per concern. Never installed from here: `snapshot()` concatenates them in
  `FUNCTION_FILES` order, and that text is frozen as a new file of `sql/migrations/`.
- `sql/migrations/NNNN_*.sql`: frozen snapshots, named after the migration that first
  installs each, never edited (a test holds their checksums); migrations install them
  with `install(name)`, so a fresh `migrate` installs what every database got.
- `sql/queries.sql`, `sql/ops.sql`: named statements, each under a `-- name: NAME`
  header, fetched with `query(NAME)` and `ops_query(NAME)`.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
FUNCTIONS_DIR = SQL_DIR / "functions"
MIGRATIONS_DIR = SQL_DIR / "migrations"
_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)

# The order in which the files are executed: helpers before their callers (a LANGUAGE sql
# function is checked against what exists when it is created), the claim's row type
# before the functions that return it, and the triggers last (CREATE TRIGGER needs its
# function).
FUNCTION_FILES = (
    "binding.sql",
    "capacity.sql",
    "marks.sql",
    "claim.sql",
    "events.sql",
    "settle.sql",
    "slices.sql",
    "chains.sql",
    "recover.sql",
    "heartbeat.sql",
    "queue.sql",
    "trigger.sql",
    "triggers.sql",
)


_SNAPSHOT_HEADER = """\
-- A frozen snapshot of dispatch/sql/functions/ (docs/sql.md): installed by a migration,
-- never edited. A change to a function is a new snapshot and a new migration.
"""


def snapshot() -> str:
    """The current functions as one script: every file of `sql/functions/`, in
    `FUNCTION_FILES` order, each under a header naming it. Frozen into
    `sql/migrations/` by hand when a function changes (docs/sql.md)."""
    files = "\n".join(
        f"-- sql/functions/{name}\n\n{(FUNCTIONS_DIR / name).read_text()}"
        for name in FUNCTION_FILES
    )
    return f"{_SNAPSHOT_HEADER}\n{files}"


def migration_file(name: str) -> str:
    """A frozen snapshot of `sql/migrations/`."""
    return (MIGRATIONS_DIR / name).read_text()


def install(name: str) -> Any:
    """A `RunSQL` operation that installs one frozen snapshot of `sql/migrations/` (for
    migrations). Not reversible: functions of a later snapshot replace those of an
    earlier one in place, so there is nothing to restore."""
    from django.db import migrations

    return migrations.RunSQL(migration_file(name), reverse_sql=migrations.RunSQL.noop)


class NamedQueries:
    """The statements of one `.sql` file, each under a `-- name: NAME` header."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @cached_property
    def _statements(self) -> dict[str, str]:
        parts = _NAME.split(self.path.read_text())
        return {
            name: body.strip().rstrip(";")
            for name, body in zip(parts[1::2], parts[2::2], strict=True)
        }

    def query(self, name: str) -> str:
        try:
            return self._statements[name]
        except KeyError:
            raise KeyError(f"no statement named {name!r} in {self.path.name}") from None

    def names(self) -> list[str]:
        return sorted(self._statements)


_DISPATCH = NamedQueries(SQL_DIR / "queries.sql")


def query(name: str) -> str:
    """A named statement of `dispatch/sql/queries.sql`."""
    return _DISPATCH.query(name)


def query_names() -> list[str]:
    return _DISPATCH.names()


_OPS = NamedQueries(SQL_DIR / "ops.sql")


def ops_query(name: str) -> str:
    """A named statement of `dispatch/sql/ops.sql` (retention, health, alerts, metrics)."""
    return _OPS.query(name)


def ops_query_names() -> list[str]:
    return _OPS.names()
