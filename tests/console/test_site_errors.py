"""Clear errors in a host site: a database that is not PostgreSQL, an unmigrated database,
a connector path that does not import, no encryption key. Each names what is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db import connection
from django.test import override_settings
from psycopg import sql

from dispatch import checks
from tests.conftest import test_database_url, worker_env

ROOT = Path(__file__).resolve().parents[2]
KEY = "7tLtvrDaR4N3B7yWAnMGz7CVGRHhKK0mFmGiZ1cxjbs="


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_sqlite_is_refused_by_the_checks_with_its_id():
    sqlite = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    with override_settings(DATABASES=sqlite):
        errors = checks.check_database_engine()
    assert [e.id for e in errors] == ["dispatch.E010"]
    assert "PostgreSQL" in errors[0].msg and "sqlite3" in errors[0].msg
    assert checks.check_database_engine() == []  # the real settings pass


@pytest.mark.django_db
def test_a_connector_path_that_does_not_import_fails_check():
    missing = r"dispatch\.E012.*mysite\.connectors\.Missing"
    with (
        override_settings(DISPATCH_CONNECTORS=["mysite.connectors.Missing"]),
        pytest.raises(SystemCheckError, match=missing),
    ):
        call_command("check")
    with override_settings(DISPATCH_CONNECTORS=["dispatch.models.Run"]):
        errors = checks.check_connector_paths()
    assert [e.id for e in errors] == ["dispatch.E012"]
    assert "not a dispatch.connectors.base.Connector" in errors[0].msg


@pytest.mark.django_db
def test_no_encryption_key_fails_check():
    with (
        override_settings(DISPATCH_ENCRYPTION_KEYS=[]),
        pytest.raises(SystemCheckError, match=r"dispatch\.E001.*DISPATCH_ENCRYPTION_KEYS"),
    ):
        call_command("check")


@pytest.mark.django_db
def test_postgresql_version_check_passes_on_this_server():
    assert checks.check_postgresql_version(databases=["default"]) == []
    assert connection.pg_version >= checks.MIN_POSTGRES[0] * 10000  # type: ignore[attr-defined]


@pytest.fixture
def empty_database_url() -> str:
    """A scratch database named after the test database, with no tables at all."""
    name = f"{connection.settings_dict['NAME']}_unmigrated"
    admin_url = test_database_url().rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield test_database_url().rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.mark.django_db
def test_worker_on_an_unmigrated_database_exits_naming_migrate(empty_database_url):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "runworker", "--burst"],
        env=worker_env(DATABASE_URL=empty_database_url, DISPATCH_ENCRYPTION_KEYS=KEY),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "dispatch.E013" in proc.stderr
    assert "manage.py migrate" in proc.stderr
    assert "retrying" not in proc.stderr  # no retry loop on a missing table


@pytest.mark.django_db
def test_trigger_wait_says_when_no_worker_is_live():
    import io

    from dispatch.models import Worker
    from tests.support.factories import BindingFactory

    binding = BindingFactory()
    # A worker that stopped, and one that stopped heartbeating long ago: neither is live.
    Worker.objects.create(
        id="gone", host="h", pid=1, concurrency=1, stopped_at="2026-01-01T00:00:00+00:00"
    )
    stale = Worker.objects.create(id="stale", host="h", pid=2, concurrency=1)
    Worker.objects.filter(pk=stale.pk).update(heartbeat_at="2026-01-01T00:00:00+00:00")
    err = io.StringIO()
    with pytest.raises(CommandError, match="still PENDING"):
        call_command(
            "trigger", binding.name, "--wait", "--timeout", "0.3", stdout=io.StringIO(), stderr=err
        )
    assert "No live worker" in err.getvalue() and "runworker" in err.getvalue()

    Worker.objects.create(id="live", host="h", pid=3, concurrency=1)  # heartbeat now
    err = io.StringIO()
    with pytest.raises(CommandError, match="still PENDING"):
        call_command(
            "trigger", binding.name, "--wait", "--timeout", "0.3", stdout=io.StringIO(), stderr=err
        )
    assert "No live worker" not in err.getvalue()


def test_a_bad_connector_path_at_run_time_is_a_configuration_error_naming_it():
    from django.core.exceptions import ImproperlyConfigured

    from dispatch.connectors import registry

    with (
        override_settings(DISPATCH_CONNECTORS=["mysite.connectors.Missing"]),
        pytest.raises(ImproperlyConfigured, match=r"mysite\.connectors\.Missing.*dispatch\.E012"),
    ):
        registry.kinds()
    with (
        override_settings(DISPATCH_CONNECTORS=["dispatch.models.Run"]),
        pytest.raises(ImproperlyConfigured, match="not a dispatch Connector"),
    ):
        registry.kinds()
