"""The two roads to dispatch's schema end in the same place: a database that went through
0001-0019 and then migrates to the head (0020), and an empty one migrated to the head
(the squash). And both hold exactly what executing `dispatch/sql/functions/` installs.

Each road runs on a scratch database of its own on the test server, named after the test
database, with Django's migration executor on a connection to it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

from dispatch.core import sqlfiles
from tests.support.connectors import connect, drop_database, recreate_database

# The test database is set up (the scratch databases are named after it); the tests run on
# the scratch databases.
pytestmark = pytest.mark.django_db

SQUASH = "0001_squashed_0020_sql_functions_by_concern"
LAST_OF_THE_OLD_CHAIN = "0019_binding_metrics_and_webhook"

# What a schema is made of, each as a set of rows (so column order, which differs
# between the roads, does not count). Only dispatch's objects: tables, sequences and
# the claim's row type whose names start with `dispatch_`, and what hangs off them.
RELATIONS = r"""
SELECT c.relname, c.relkind::text, coalesce(array_to_string(c.reloptions, ','), '')
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'public' AND c.relname LIKE 'dispatch\_%' AND c.relkind IN ('r', 'S', 'c')
"""
COLUMNS = r"""
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       coalesce(pg_get_expr(d.adbin, d.adrelid), '')
  FROM pg_attribute a
  JOIN pg_class c ON c.oid = a.attrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE n.nspname = 'public' AND c.relname LIKE 'dispatch\_%' AND c.relkind IN ('r', 'c')
   AND a.attnum > 0 AND NOT a.attisdropped
"""
INDEXES = r"""
SELECT tablename, indexname, indexdef FROM pg_indexes
 WHERE schemaname = 'public' AND tablename LIKE 'dispatch\_%'
"""
# The order the planner meets a table's indexes in (by OID): of two equally cheap paths
# it keeps the index created last, so the order is part of the schema.
INDEX_ORDER = r"""
SELECT c.relname, string_agg(i.indexrelid::regclass::text, ' ' ORDER BY i.indexrelid)
  FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
 WHERE c.relname LIKE 'dispatch\_%'
 GROUP BY c.relname
"""
CONSTRAINTS = r"""
SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid)
  FROM pg_constraint k
  JOIN pg_class c ON c.oid = k.conrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'public' AND c.relname LIKE 'dispatch\_%'
"""
SEQUENCES = r"""
SELECT sequencename, data_type::text, start_value, increment_by, min_value, max_value, cycle
  FROM pg_sequences WHERE schemaname = 'public' AND sequencename LIKE 'dispatch\_%'
"""
FUNCTIONS = r"""
SELECT p.proname, p.oid::regprocedure::text, pg_get_functiondef(p.oid)
  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
 WHERE n.nspname = 'public' AND p.proname LIKE 'dispatch\_%'
"""
TRIGGERS = r"""
SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
  FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
 WHERE NOT t.tgisinternal AND c.relname LIKE 'dispatch\_%'
"""
DROP_EVERY_FUNCTION = r"""
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
               JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'public' AND p.proname LIKE 'dispatch\_%' LOOP
        EXECUTE format('DROP ROUTINE %s CASCADE', f);
    END LOOP;
END
$$
"""
PARTS = {
    "relations": RELATIONS,
    "columns": COLUMNS,
    "indexes": INDEXES,
    "index order": INDEX_ORDER,
    "constraints": CONSTRAINTS,
    "sequences": SEQUENCES,
    "functions": FUNCTIONS,
    "triggers": TRIGGERS,
}


def schema(conn: psycopg.Connection[Any]) -> dict[str, set[tuple[Any, ...]]]:
    return {part: set(conn.execute(query).fetchall()) for part, query in PARTS.items()}


@contextmanager
def django_connection(dbname: str) -> Iterator[BaseDatabaseWrapper]:
    """A Django connection to another database of the test server: the test database's
    settings with another name, under an alias of its own for as long as it is used
    (the migration executor's transactions look their connection up by alias)."""
    default = connections[DEFAULT_DB_ALIAS]
    wrapper = type(default)({**default.settings_dict, "NAME": dbname}, alias=dbname)
    connections[dbname] = wrapper
    try:
        yield wrapper
    finally:
        wrapper.close()
        del connections[dbname]


def migrate(
    wrapper: BaseDatabaseWrapper, target: str | None = None, *, squashes: bool = True
) -> list[str]:
    """Migrate dispatch to `target` (default: its head) and return the names of dispatch's
    migrations applied (those of the apps it depends on, auth for API tokens, run too).
    `squashes=False` reads the migration files as they are, without the squash, the way
    the loader sees them once any replaced migration has been applied."""
    executor = MigrationExecutor(wrapper)
    if not squashes:
        executor.loader = MigrationLoader(wrapper, replace_migrations=False)
    if target is None:
        [(_, target)] = executor.loader.graph.leaf_nodes("dispatch")
    plan = executor.migration_plan([("dispatch", target)])
    executor.migrate([("dispatch", target)], plan=plan)
    return [migration.name for migration, _ in plan if migration.app_label == "dispatch"]


@dataclass
class Roads:
    chain: str  # went through 0001-0019, then to the head
    squash: str  # empty, then to the head
    chain_plan: list[str]
    squash_plan: list[str]
    chain_applied: set[str]


@pytest.fixture(scope="module")
def roads(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Roads]:
    with django_db_blocker.unblock():
        test_db = connection.settings_dict["NAME"]
        chain, squash = (f"dispatch_{road}_{test_db}"[:63] for road in ("chain", "squash"))
        for name in (chain, squash):
            recreate_database(name)
        try:
            with django_connection(chain) as wrapper:
                migrate(wrapper, LAST_OF_THE_OLD_CHAIN, squashes=False)
                chain_plan = migrate(wrapper)
                applied = {name for app, name in MigrationLoader(wrapper).applied_migrations}
            with django_connection(squash) as wrapper:
                squash_plan = migrate(wrapper)
            yield Roads(chain, squash, chain_plan, squash_plan, applied)
        finally:
            for name in (chain, squash):
                drop_database(name)


def test_migrate__a_fresh_database_takes_the_squash_and_a_migrated_one_the_chain(
    roads: Roads,
) -> None:
    # The migrations written after the squash follow it on both roads.
    import dispatch.migrations

    folder = Path(dispatch.migrations.__file__).parent
    later = sorted(p.stem for p in folder.glob("0*.py") if int(p.stem[:4]) > 20)
    assert roads.squash_plan == [SQUASH, *later]
    assert roads.chain_plan == ["0020_sql_functions_by_concern", *later]
    # Once the chain reached the head, the squash counts as applied too.
    assert SQUASH in roads.chain_applied


def test_migrate__both_roads_end_in_the_same_schema(roads: Roads) -> None:
    with connect(roads.chain) as chain, connect(roads.squash) as squash:
        by_chain, by_squash = schema(chain), schema(squash)
    for part in PARTS:
        assert by_chain[part], f"no {part} found"
        only_chain = sorted(by_chain[part] - by_squash[part])
        only_squash = sorted(by_squash[part] - by_chain[part])
        assert (only_chain, only_squash) == ([], []), f"{part} differ"
    # What 0012 and 0013 added outside the models is there on both roads.
    relations = {name: options for name, kind, options in by_squash["relations"]}
    assert "fillfactor=50" in relations["dispatch_worker"]
    assert ("dispatch_attempt", "binding_id", "uuid", False, "") in by_squash["columns"]
    assert ("dispatch_lease_token_seq", "S", "") in by_squash["relations"]


def test_migrate__functions_and_triggers_are_what_the_function_files_install(
    roads: Roads,
) -> None:
    # All in one transaction, rolled back: DDL is transactional in PostgreSQL.
    with connect(roads.squash, autocommit=False) as conn:
        migrated = schema(conn)
        conn.execute(DROP_EVERY_FUNCTION)
        assert schema(conn)["functions"] == set()
        assert schema(conn)["triggers"] == set()
        for name in sqlfiles.FUNCTION_FILES:
            conn.execute((sqlfiles.FUNCTIONS_DIR / name).read_text())
        from_files = schema(conn)
        conn.rollback()
    assert migrated["functions"] == from_files["functions"]
    assert migrated["triggers"] == from_files["triggers"]
    # And nothing more or less than the files define, by name (no overloads either).
    defined = {
        name
        for path in sqlfiles.FUNCTIONS_DIR.glob("*.sql")
        for name in re.findall(
            r"^CREATE OR REPLACE (?:FUNCTION|PROCEDURE) (\w+)\(", path.read_text(), re.M
        )
    }
    installed = [name for name, _, _ in migrated["functions"]]
    assert sorted(installed) == sorted(defined)


def test_migrate__no_function_of_an_old_snapshot_is_left_installed(roads: Roads) -> None:
    with connect(roads.chain) as conn:
        installed = {name for name, _, _ in schema(conn)["functions"]}
    old = {
        name
        for path in sqlfiles.MIGRATIONS_DIR.glob("00*_dispatch_v*.sql")
        for name in re.findall(r"(?:FUNCTION|PROCEDURE) (\w+)\(", path.read_text())
    }
    entry_points = {
        "dispatch_claim_v5",
        "dispatch_recover_v2",
        "dispatch_queue_view_v4",
        "dispatch_refresh_blocked_v4",
        "dispatch_trigger_v4",
        "dispatch_trigger_notify_v4",
    }
    assert len(old) == 39
    # Of the old snapshots' functions only the entry points Python calls remain; every
    # helper and trigger function is installed without a version, once.
    assert installed & old == entry_points
    # Entry points first installed by a snapshot of sql/functions/ (0026: slices; 0031:
    # the settlement and the heartbeat that carry the attempts' events).
    newer = {
        "dispatch_slices_plan_v1",
        "dispatch_slices_start_v1",
        "dispatch_settle_v3",
        "dispatch_settle_claim_v6",
        "dispatch_heartbeat_v2",
    }
    assert newer <= installed
    assert not any(re.search(r"_v\d+$", name) for name in installed - entry_points - newer)
