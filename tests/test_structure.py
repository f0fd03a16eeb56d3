"""The SQL files, named statements, state tables and migrations stay in step."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import InternalError, connection, transaction

from dispatch.core import sqlfiles, states

ROOT = Path(__file__).resolve().parent.parent


def test_every_sql_function_file_is_installed_by_a_migration():
    """Every file of `sql/functions/` is in the latest frozen snapshot, as it is now (a
    changed function needs a new snapshot and migration: docs/sql.md), and every frozen
    snapshot is installed by a migration."""
    installs = {
        path.name: re.findall(r'install\("([^"]+)"\)', path.read_text())
        for path in (ROOT / "dispatch" / "migrations").glob("0*.py")
    }
    installed = {name for names in installs.values() for name in names}
    snapshots = {p.name for p in sqlfiles.MIGRATIONS_DIR.glob("*.sql")}
    assert installed == snapshots, "a snapshot without a migration, or an install of nothing"

    functions = {p.name for p in sqlfiles.FUNCTIONS_DIR.glob("*.sql")}
    assert functions and functions == set(sqlfiles.FUNCTION_FILES)
    latest_migration = max(name for name, names in installs.items() if names)
    latest = installs[latest_migration][-1]
    assert sqlfiles.snapshot() == sqlfiles.migration_file(latest), (
        f"sql/functions/ differs from {latest}: freeze it as a new snapshot "
        "installed by a new migration"
    )


@pytest.mark.django_db
def test_every_named_statement_is_valid_sql_against_the_schema():
    names = sqlfiles.query_names()
    assert {"claim", "settle", "recover", "heartbeat", "notify"} <= set(names)
    with connection.cursor() as cursor:
        for name in names:
            # EXPLAIN plans without executing: syntax, tables, columns and functions exist.
            statement = re.sub(r"%\((\w+)\)s", "NULL", sqlfiles.query(name))
            if re.search(r"^CALL ", statement, re.MULTILINE):
                # A procedure cannot be EXPLAINed. Called here inside the test's
                # transaction, it runs (name and argument types resolved, its first part
                # executed) up to its COMMIT, which PostgreSQL refuses inside a block.
                with (
                    pytest.raises(InternalError, match="invalid transaction termination"),
                    transaction.atomic(),
                ):
                    cursor.execute(statement)
                continue
            cursor.execute(f"EXPLAIN {statement}")
    with pytest.raises(KeyError, match="no statement named"):
        sqlfiles.query("nope")


def test_transition_table_covers_every_status():
    assert set(states.TRANSITIONS) == set(states.Status.values)
    for targets in states.TRANSITIONS.values():
        assert targets <= set(states.Status.values)


@pytest.mark.django_db
def test_models_and_migrations_are_in_step():
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_every_added_column_keeps_a_database_default_for_rolling_upgrades() -> None:
    """While a rolling upgrade runs, workers of the previous release insert rows without
    the new columns (docs/deployment.md, "Upgrades"): an added NOT NULL column needs a
    default in the database, not only in Django."""
    from django.db.migrations.loader import MigrationLoader
    from django.db.migrations.operations import AddField
    from django.db.models import NOT_PROVIDED

    loader = MigrationLoader(None, ignore_no_migrations=True)
    missing = [
        f"{app}.{name}: {op.model_name}.{op.name}"
        for (app, name), migration in loader.disk_migrations.items()
        if app in ("dispatch", "scheduling")
        for op in migration.operations
        if isinstance(op, AddField)
        and not (op.field.null or op.field.db_default is not NOT_PROVIDED)
    ]
    assert loader.disk_migrations and not missing, missing


@pytest.mark.parametrize("app", ["dispatch", "scheduling"])
def test_every_check_id_is_in_the_table_the_code_and_the_settings_page(app: str) -> None:
    """One table of check ids per app (`dispatch.checks.CHECK_IDS`,
    `scheduling.checks.CHECK_IDS`): every id the app's code raises is in it, every row is
    raised by a check, and docs/settings.md lists each one."""
    checks = importlib.import_module(f"{app}.checks")

    raised: set[str] = set()
    for path in (ROOT / app).rglob("*.py"):
        raised |= set(re.findall(rf'id="({app}\.[EW]\d{{3}})"', path.read_text()))
    settings_page = (ROOT / "docs" / "settings.md").read_text()
    documented = set(re.findall(rf"`({app}\.[EW]\d{{3}})`", settings_page))
    assert raised, "no check ids found in the code"
    assert raised == set(checks.CHECK_IDS), raised ^ set(checks.CHECK_IDS)
    assert set(checks.CHECK_IDS) <= documented, set(checks.CHECK_IDS) - documented


def test_every_silenced_broad_except_says_why() -> None:
    """ruff's BLE001 lets a broad `except` through only when it re-raises or logs its
    traceback; one silenced with `noqa: BLE001` names its reason on the same line."""
    bare = [
        f"{path.relative_to(ROOT)}:{number}"
        for top in ("dispatch", "scheduling", "tools", "project")
        for path in (ROOT / top).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"noqa: [A-Z0-9, ]*BLE001", line)
        and not re.search(r"BLE001[A-Z0-9, ]* - \w+", line)
    ]
    assert not bare, bare


def _module_constants(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(name, value) of each module-level literal tuple, list or set of three or more items
    in `path`, the value as its items' sorted reprs."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        try:
            literal = ast.literal_eval(value)
        except ValueError:  # not a literal: a call, a comprehension, a name
            continue
        if isinstance(literal, tuple | list | set | frozenset) and len(literal) >= 3:
            items = tuple(sorted(repr(item) for item in literal))
            found += [(t.id, items) for t in targets if isinstance(t, ast.Name)]
    return found


def test_no_constant_is_defined_again_in_another_module() -> None:
    """A list of values the apps share (libpq's sslmodes, the system's trees, ...) has one
    module that owns it; a copy elsewhere drifts from it."""
    owners: dict[tuple[str, ...], list[str]] = {}
    for app in ("dispatch", "scheduling"):
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" in path.parts:  # frozen snapshots repeat by design
                continue
            for name, items in _module_constants(path):
                owners.setdefault(items, []).append(f"{path.relative_to(ROOT)}:{name}")
    again = [places for places in owners.values() if len(places) > 1]
    assert not again, again


# The paths host code and Django name; every other module lives in the folder of its role
# (docs/architecture.md, "Where the code is").
TOP_LEVEL_MODULES = {
    "__init__",
    "admin",
    "admin_site",
    "api",
    "apps",
    "checks",
    "client",
    "models",
    "services",
    "signals",
    "urls",
}


def test_the_top_of_dispatch_holds_only_its_public_paths() -> None:
    top = {path.stem for path in (ROOT / "dispatch").glob("*.py")}
    assert top <= TOP_LEVEL_MODULES, (
        f"move into the folder of its role: {sorted(top - TOP_LEVEL_MODULES)}"
    )
