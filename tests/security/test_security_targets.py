"""The site's target policy: allowed hosts, networks and socket directories; the site's
own database refused; no libpq option that reads local files."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import override_settings

from dispatch.connectors.base import PermanentError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.connectors.postgresql import connect
from dispatch.core.states import Reason, Status
from dispatch.worker import claims
from dispatch.worker.runner import ExecutionControl, Runner
from tests.support.factories import BindingFactory, DatasourceFactory, trigger
from tests.support.helpers import attempts_of


def site_config() -> dict[str, Any]:
    s = connection.settings_dict
    config: dict[str, Any] = {
        "host": s["HOST"] or "127.0.0.1",
        "port": int(s["PORT"] or 5432),
        "dbname": s["NAME"],
        "user": s["USER"],
    }
    if s.get("PASSWORD"):
        config["password"] = s["PASSWORD"]
    return config


def alias_url() -> str:
    """The site's database under a host name the settings do not use: only the server's
    own answer (the fingerprint) can tell."""
    c = site_config()
    return (
        f"postgresql://{c['user']}@site-alias.invalid:{c['port']}/{c['dbname']}"
        f"?hostaddr={c['host']}"
    )


@pytest.mark.django_db
def test_site_database__refused_at_validation_and_when_reached_under_another_name():
    with pytest.raises(ValidationError, match="site's own database"):
        PG.validate_config(site_config())
    with pytest.raises(PermanentError, match="site's own database"):
        connect({"url": alias_url()})
    with override_settings(DISPATCH_ALLOW_SITE_DATABASE=True):
        connect({"url": alias_url()}).close()


@pytest.mark.django_db(transaction=True)
def test_site_database__a_sink_upsert_into_auth_user_fails_permanently():
    staff = User.objects.create_user("staff", password="x", is_staff=True)
    sink = DatasourceFactory(kind="postgresql", config={"url": alias_url()})
    binding = BindingFactory(
        sink=sink,
        job__max_attempts=3,
        job__source_spec={"rows": 1, "batch": 1},
        job__sink_spec={"table": "public.auth_user", "mode": "append"},
    )
    run = trigger(binding)
    [claimed] = claims.claim("policy", run_id=run.id, limit=1, generic=False)
    assert Runner(claimed, ExecutionControl(claimed)).execute() == Status.FAILED
    [attempt] = attempts_of(run)
    assert attempt.reason == Reason.PERMANENT_ERROR
    assert "site's own database" in attempt.error
    staff.refresh_from_db()
    assert not staff.is_superuser and User.objects.count() == 1


@pytest.mark.django_db
def test_unix_sockets__refused_unless_their_directory_is_listed():
    config = {"host": "/var/run/postgresql", "dbname": "x", "user": "u"}
    with pytest.raises(ValidationError, match="Unix-socket directory"):
        PG.validate_config(config)
    with pytest.raises(ValidationError, match="Unix-socket directory"):
        PG.validate_config({"url": "postgresql:///x?host=/tmp"})
    with pytest.raises(ValidationError, match="Unix-socket directory"):
        PG.validate_config({"url": "postgresql://u@/x"})  # libpq's default socket
    with override_settings(DISPATCH_DATASOURCE_HOSTS=["*", "/var/run/postgresql"]):
        PG.validate_config(config)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "option",
    [
        "passfile=/root/.pgpass",
        "sslkey=/etc/ssl/private/k.pem",
        "sslcert=/x",
        "service=prod",
        "sslrootcert=/x",
        "sslcrl=/x",
        "options=-csearch_path%3Dx",
    ],
)
def test_url__options_that_read_local_files_are_refused(option: str):
    with pytest.raises(ValidationError) as exc:
        PG.validate_config({"url": f"postgresql://u@db.example.com/x?{option}"})
    assert "not allowed" in " ".join(exc.value.message_dict["url"])
    with pytest.raises(PermanentError, match="target policy"):
        connect({"url": f"postgresql://u@db.example.com/x?{option}"})


@pytest.mark.django_db
def test_allow_list__names_wildcards_and_networks():
    with override_settings(
        DISPATCH_DATASOURCE_HOSTS=["10.0.0.0/8", "*.example.com", "db.internal"]
    ):
        for host in ("10.1.2.3", "warehouse.example.com", "db.internal"):
            PG.validate_config({"host": host, "dbname": "x"})
        for host in ("127.0.0.1", "example.org", "10.0.0.1,192.168.1.1"):
            with pytest.raises(ValidationError, match="not a host the site allows"):
                PG.validate_config({"host": host, "dbname": "x"})
        # Checked again when connecting (the setting may change after saving).
        with pytest.raises(PermanentError, match="not a host the site allows"):
            connect({"host": "127.0.0.1", "dbname": "x"})
