"""Stored secrets are bound to their destination: an edit that points a datasource
elsewhere needs the secret again, a URL never mixes with separate fields, and the client
never sends a password in clear text (require_auth). A local listener records what
reaches it."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse

from dispatch.connectors.base import ConnectorError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.connectors.postgresql import connect
from dispatch.models import Datasource
from tests.support.listener import RecordingServer

pytestmark = pytest.mark.django_db

SECRET = "Stored-Secret-4b1e9"


def stored(**config: object) -> Datasource:
    ds = Datasource(
        name="warehouse",
        kind="postgresql",
        config={"host": "127.0.0.1", "port": 5432, "dbname": "x", "user": "u", **config},
    )
    ds.save()
    return ds


def form(ds: Datasource, **changes: object) -> dict[str, object]:
    data = {"name": ds.name, "enabled": "on"}
    data.update({f"config__{k}": v for k, v in ds.redacted_config.items() if k != "password"})
    data.update({f"config__{k}": v for k, v in changes.items()})
    return data


def test_connect__a_server_asking_for_a_clear_text_password_never_gets_it():
    with RecordingServer() as server:
        config = {"host": "127.0.0.1", "port": server.port, "dbname": "x", "user": "u"}
        with pytest.raises(ConnectorError) as exc:
            connect({**config, "password": SECRET})
        assert server.connections >= 1 and server.received  # it was reached
        assert not server.got(SECRET)
        assert SECRET not in str(exc.value)
        with pytest.raises(ConnectorError):
            connect({"url": f"postgresql://u:{SECRET}@127.0.0.1:{server.port}/x"})
        assert not server.got(SECRET)


@pytest.mark.parametrize("field", ["host", "port", "dbname", "user", "sslmode", "require_auth"])
def test_admin_change__moving_the_destination_needs_the_secret_again(
    admin_client: Client, field: str
):
    ds = stored(password=SECRET)
    with RecordingServer() as server:
        new = {
            "host": "localhost",
            "port": server.port,
            "dbname": "other",
            "user": "postgres",
            "sslmode": "disable",
            "require_auth": "password",
        }[field]
        url = reverse("admin:dispatch_datasource_change", args=[ds.pk])
        response = admin_client.post(url, form(ds, **{field: new}))
        assert response.status_code == 200
        page = response.content.decode()
        assert f"{field} changed: enter the password again" in page
        assert SECRET not in page
        again = Datasource.objects.get(pk=ds.pk)
        assert (again.version, again.config["password"]) == (1, SECRET)
        # The same edit with the password typed again is saved.
        assert admin_client.post(url, form(ds, **{field: new}, password="typed")).status_code == 302
        assert Datasource.objects.get(pk=ds.pk).config["password"] == "typed"
        assert not server.got(SECRET)


def test_admin_change__other_edits_keep_the_stored_secret(admin_client: Client):
    ds = stored(password=SECRET)
    url = reverse("admin:dispatch_datasource_change", args=[ds.pk])
    assert admin_client.post(url, {**form(ds), "name": "renamed"}).status_code == 302
    assert Datasource.objects.get(pk=ds.pk).config["password"] == SECRET


def test_config__url_and_separate_fields_are_never_mixed():
    with pytest.raises(ValidationError) as exc:
        PG.validate_config({"url": "postgresql://u:p@db:5432/d", "host": "elsewhere"})
    assert "not both (host set as well)" in " ".join(exc.value.message_dict["url"])
    with pytest.raises(ValidationError, match="require_auth"):
        PG.validate_config({"host": "h", "dbname": "d", "require_auth": "scram-sha-256,!md5"})
    PG.validate_config({"host": "h", "dbname": "d", "require_auth": "scram-sha-256"})
