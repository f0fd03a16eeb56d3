"""The cleanup after each transactional test, without truncating what the test never wrote.

Django's (`TransactionTestCase._fixture_teardown`) runs `flush`: a TRUNCATE of every model
table and its indexes, then `post_migrate` again to recreate the content types and
permissions it has just emptied. A test writes a handful of tables, so most of that work
replaces empty files by empty files, several hundred times a suite.

Here a table is truncated when it has changed on disk since it was last truncated: its
total size (heap, indexes, TOAST) differs from the size recorded right after. Any row ever
written since (committed, deleted or rolled back) grows the heap from zero pages and its
primary key's index past its metapage, and an index never shrinks, so an unchanged size
means an unwritten table; what is truncated ends in the same state as with Django's flush.
When the content types or permissions changed (their size or their rows), or the first time
on a database, Django's own flush runs (with `post_migrate`), and the sizes are recorded
after it. A VACUUM (its free-space and visibility maps) changes a size too: such a table is
truncated although empty, as Django's flush would.
"""

from __future__ import annotations

from django.core.management import call_command
from django.db import connections
from django.test import TransactionTestCase
from psycopg import sql

# Emptied by Django's flush and refilled by post_migrate: never truncated here.
REFILLED = frozenset({"django_content_type", "auth_permission"})

_django_teardown = TransactionTestCase._fixture_teardown
# Per database alias: each model table's state (`_table_states`) right after the last cleanup.
_states: dict[str, dict[str, str]] = {}


def _table_states(alias: str) -> dict[str, str]:
    """Each model table's total size in bytes; for the two refilled tables, a digest of
    their rows too (a row updated or deleted in place leaves the size as it was)."""
    connection = connections[alias]
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT t, pg_total_relation_size(quote_ident(t)::regclass) FROM unnest(%s::text[]) t",
            [sorted(tables)],
        )
        states = {name: str(size) for name, size in cursor.fetchall()}
        cursor.execute(
            "SELECT (SELECT md5(string_agg(c::text, ',' ORDER BY c.id)) FROM django_content_type c),"
            " (SELECT md5(string_agg(p::text, ',' ORDER BY p.id)) FROM auth_permission p)"
        )
        contents, permissions = cursor.fetchone()
    states["django_content_type"] += f" {contents}"
    states["auth_permission"] += f" {permissions}"
    return states


def _flush(test_case: TransactionTestCase, alias: str) -> None:
    states = _table_states(alias)
    recorded = _states.get(alias)
    written = None if recorded is None else [t for t, st in states.items() if recorded.get(t) != st]
    if written is None or REFILLED.intersection(written):
        # Django's flush, as TransactionTestCase runs it (no narrowed apps here).
        call_command(
            "flush",
            verbosity=0,
            interactive=False,
            database=alias,
            reset_sequences=False,
            allow_cascade=False,
            inhibit_post_migrate=False,
        )
    elif written:
        # CASCADE: an unwritten (empty) table that references a written one goes too.
        statement = sql.SQL("TRUNCATE {} CASCADE").format(
            sql.SQL(", ").join(sql.Identifier(t) for t in sorted(written))
        )
        with connections[alias].cursor() as cursor:
            cursor.execute(statement)
    else:
        return
    _states[alias] = _table_states(alias)


def fixture_teardown(self: TransactionTestCase) -> None:
    """`TransactionTestCase._fixture_teardown` truncating only what changed (above);
    Django's own where a test narrows the apps or restores serialized data."""
    if self.available_apps is not None or self.serialized_rollback:
        _states.clear()
        _django_teardown(self)
        return
    for alias in self._databases_names(include_mirrors=False):
        _flush(self, alias)


def install() -> None:
    TransactionTestCase._fixture_teardown = fixture_teardown  # type: ignore[method-assign]
