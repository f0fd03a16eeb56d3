"""System checks for a host site: the database is PostgreSQL (new enough), the connector
paths import, and, before a worker starts, the migrations are applied.

Stable ids (docs/settings.md lists them):

- dispatch.E010: a database the apps use is not PostgreSQL (SQLite, MySQL, ...).
- dispatch.E011: the PostgreSQL server is older than MIN_POSTGRES (a database check:
  `check --database default`, `migrate` and `runworker` run it).
- dispatch.E012: a DISPATCH_CONNECTORS entry does not import or is not a Connector.
- dispatch.E013: the dispatch/scheduling migrations are not all applied (`runworker`
  refuses to start; never part of `migrate`'s own checks, which would block migrating).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.db import DatabaseError, connections

# Django 5.2 itself needs PostgreSQL 14; the SQL functions need nothing newer.
MIN_POSTGRES = (14, 0)
APPS = ("dispatch", "scheduling")


@register(Tags.database)
def check_postgresql_version(app_configs: Any = None, databases: Any = None, **kwargs: Any):  # type: ignore[no-untyped-def]
    errors: list[Error] = []
    for alias in databases or []:
        conn = connections[alias]
        if conn.vendor != "postgresql":
            continue  # E010 says so
        try:
            version = conn.pg_version  # type: ignore[attr-defined]
        except DatabaseError:
            continue  # unreachable: the command that needs it reports that itself
        major, minor = divmod(int(version), 10000)
        if (major, minor) < MIN_POSTGRES:
            errors.append(
                Error(
                    f"Database {alias!r} is PostgreSQL {major}.{minor}; dispatch needs "
                    f"{MIN_POSTGRES[0]} or newer.",
                    id="dispatch.E011",
                )
            )
    return errors


@register()
def check_database_engine(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    engine = settings.DATABASES.get("default", {}).get("ENGINE", "")
    if engine.endswith("postgresql") or engine.endswith("postgis"):
        return []
    return [
        Error(
            f"dispatch needs PostgreSQL; DATABASES['default'] uses {engine or 'no engine'!r}.",
            hint="Set ENGINE to 'django.db.backends.postgresql' (PostgreSQL "
            f"{MIN_POSTGRES[0]} or newer): leases, fencing and wake-ups are PostgreSQL "
            "functions, LISTEN/NOTIFY and row locks.",
            id="dispatch.E010",
        )
    ]


@register()
def check_connector_paths(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    from django.utils.module_loading import import_string

    from dispatch import conf
    from dispatch.connectors.base import Connector

    errors = []
    for path in conf.extra_connectors():
        try:
            cls = import_string(path)
        except ImportError as exc:
            errors.append(
                Error(
                    f"DISPATCH_CONNECTORS entry {path!r} cannot be imported: {exc}",
                    hint="Use the dotted path of a dispatch.connectors.base.Connector "
                    "subclass, e.g. 'mysite.connectors.S3Connector'.",
                    id="dispatch.E012",
                )
            )
            continue
        if not (isinstance(cls, type) and issubclass(cls, Connector)):
            errors.append(
                Error(
                    f"DISPATCH_CONNECTORS entry {path!r} is not a "
                    "dispatch.connectors.base.Connector subclass.",
                    id="dispatch.E012",
                )
            )
    return errors


def unapplied_migrations(alias: str = "default") -> list[str]:
    """The dispatch/scheduling migrations not applied on `alias` ("app.name" each)."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[alias])
    targets = [key for key in executor.loader.graph.leaf_nodes() if key[0] in APPS]
    plan = executor.migration_plan(targets)
    return [f"{m.app_label}.{m.name}" for m, _ in plan if m.app_label in APPS]


def migrations_error(alias: str = "default") -> Error | None:
    """dispatch.E013 when migrations are missing (None when all are applied)."""
    missing = unapplied_migrations(alias)
    if not missing:
        return None
    shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
    return Error(
        f"The database is not migrated: {len(missing)} migration(s) not applied ({shown}).",
        hint="Run `manage.py migrate` first, then start the worker again.",
        id="dispatch.E013",
    )
