"""DISPATCH_LISTEN_URL: the LISTEN connection inherits the site's TLS settings unless its
URL sets them, and a malformed URL is refused at start-up (dispatch.E015) and in the
workers' logs without ever quoting the URL or its password."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from django.core import checks as django_checks
from django.db import connection
from django.test import override_settings

from dispatch import checks
from dispatch.worker import listen
from scheduling import reconciler
from tests.support.processes import test_database_url

SECRET = "s3cr3t-Pw"

# The site's database settings: verified TLS, SCRAM only, a client certificate.
SITE = {
    "host": "pgbouncer.internal",
    "port": "6432",
    "dbname": "dispatch",
    "user": "site",
    "password": "site-password",
    "sslmode": "verify-full",
    "sslrootcert": "/etc/dispatch/ca.pem",
    "sslcert": "/etc/dispatch/client.pem",
    "sslkey": "/etc/dispatch/client.key",
    "require_auth": "scram-sha-256",
    "connect_timeout": 7,
    "cursor_factory": object(),
}

MALFORMED = {
    "bad scheme": f"mysql://listener:{SECRET}@db.internal:5432/dispatch",
    "bad percent-escape": f"postgres://listener:{SECRET}%zz@db.internal:5432/dispatch",
    "no host": f"postgres://listener:{SECRET}@/dispatch",
    "bad port": f"postgres://listener:{SECRET}@db.internal:99999/dispatch",
    "bad sslmode": f"postgres://listener:{SECRET}@db.internal/dispatch?sslmode=sometimes",
    "unknown parameter": f"postgres://listener:{SECRET}@db.internal/dispatch?sslmod=require",
}


@override_settings(DISPATCH_LISTEN_URL=f"postgres://listener:{SECRET}@db.internal:5432/dispatch")
def test_listen_params__inherit_the_site_tls_when_the_url_sets_none():
    params = listen.connection_params("dispatch-listen w1", SITE)

    # Identity from the URL alone...
    assert (params["host"], params["port"], params["dbname"]) == ("db.internal", "5432", "dispatch")
    assert (params["user"], params["password"]) == ("listener", SECRET)
    # ...TLS and authentication from the site...
    assert params["sslmode"] == "verify-full"
    assert params["sslrootcert"] == "/etc/dispatch/ca.pem"
    assert params["sslcert"] == "/etc/dispatch/client.pem"
    assert params["sslkey"] == "/etc/dispatch/client.key"
    assert params["require_auth"] == "scram-sha-256"
    # ...and the transport options as before.
    assert params["connect_timeout"] == 7
    assert params["application_name"] == "dispatch-listen w1"
    assert "cursor_factory" not in params


@override_settings(
    DISPATCH_LISTEN_URL=(
        f"postgres://listener:{SECRET}@db.internal/dispatch"
        "?sslmode=verify-ca&sslrootcert=/etc/listen/ca.pem&require_auth=password"
    )
)
def test_listen_params__keep_what_the_url_sets():
    params = listen.connection_params("dispatch-listen w1", SITE)

    assert params["sslmode"] == "verify-ca"
    assert params["sslrootcert"] == "/etc/listen/ca.pem"
    assert params["require_auth"] == "password"
    assert params["sslcert"] == "/etc/dispatch/client.pem"  # not in the URL: inherited


@override_settings(DISPATCH_LISTEN_URL="")
def test_listen_params__without_a_url_are_the_sites():
    params = listen.connection_params("dispatch-listen w1", SITE)

    assert params["host"] == "pgbouncer.internal"
    assert params["password"] == "site-password"
    assert params["sslmode"] == "verify-full"


@pytest.fixture
def site_options(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The default database's OPTIONS, changed for one test (the open connection of the
    test keeps its own; a LISTEN connection reads them when it opens)."""
    options = dict(connection.settings_dict.get("OPTIONS") or {})
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    return options


@pytest.mark.django_db
def test_listen_connect__an_inherited_require_refuses_a_server_without_tls(site_options):
    # The test server has no TLS: a LISTEN URL without sslmode must not fall back to
    # plaintext when the site requires TLS (before, it connected in the clear).
    site_options["sslmode"] = "require"
    with (
        override_settings(DISPATCH_LISTEN_URL=test_database_url()),
        pytest.raises(psycopg.OperationalError, match="SSL"),
    ):
        listen.connect("dispatch-listen tls-test").close()


@pytest.mark.django_db
def test_listen_connect__an_inherited_disable_is_what_the_connection_used(site_options):
    site_options["sslmode"] = "disable"
    with override_settings(DISPATCH_LISTEN_URL=test_database_url()):
        conn = listen.connect("dispatch-listen tls-test")
    try:
        used = {opt.keyword: opt.val for opt in conn.pgconn.info}
        assert used[b"sslmode"] == b"disable"
        row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
        assert row == (False,)
    finally:
        conn.close()

    # The URL's own sslmode wins over the site's.
    site_options["sslmode"] = "require"
    with override_settings(DISPATCH_LISTEN_URL=test_database_url() + "?sslmode=disable"):
        conn = listen.connect("dispatch-listen tls-test")
    try:
        used = {opt.keyword: opt.val for opt in conn.pgconn.info}
        assert used[b"sslmode"] == b"disable"
    finally:
        conn.close()


@pytest.mark.django_db
@pytest.mark.parametrize("problem", sorted(MALFORMED))
def test_listen_url_check__flags_a_malformed_url_without_quoting_it(problem):
    url = MALFORMED[problem]
    with override_settings(DISPATCH_LISTEN_URL=url):
        errors = checks.check_listen_url()
        everything = django_checks.run_checks()

    assert [e.id for e in errors] == ["dispatch.E015"]
    assert "dispatch.E015" in [e.id for e in everything]
    for error in everything:
        text = f"{error.msg} {error.hint}"
        assert SECRET not in text and "listener" not in text and "db.internal" not in text


@pytest.mark.parametrize(
    "url",
    [
        f"postgres://listener:{SECRET}@db.internal:5432/dispatch?sslmode=verify-full",
        f"postgresql://listener:{SECRET.replace('-', '%2D')}@db.internal/dispatch",
        "postgres://listener@h1:5432,h2:5433/dispatch",
        "postgres:///dispatch?host=/var/run/postgresql",
    ],
)
def test_listen_url_check__accepts_usable_urls(url):
    with override_settings(DISPATCH_LISTEN_URL=url):
        assert checks.check_listen_url() == []


@override_settings(DISPATCH_LISTEN_URL=MALFORMED["bad percent-escape"])
def test_listen_connect__a_malformed_url_fails_without_quoting_it():
    with pytest.raises(psycopg.ProgrammingError) as failed:
        listen.connect("dispatch-listen w1")

    assert "DISPATCH_LISTEN_URL" in str(failed.value)
    assert SECRET not in str(failed.value)


@override_settings(DISPATCH_LISTEN_URL=MALFORMED["bad percent-escape"])
def test_schedule_listener__logs_a_malformed_url_without_quoting_it(caplog):
    listener = reconciler._Listener()
    with caplog.at_level(logging.WARNING, logger="scheduling"):
        listener.ensure()

    assert listener.conn is None
    assert "schedule LISTEN connection unavailable" in caplog.text
    assert "DISPATCH_LISTEN_URL" in caplog.text
    assert SECRET not in caplog.text
