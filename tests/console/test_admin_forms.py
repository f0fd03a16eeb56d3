"""The datasource form: fields from the kind's config_fields, secrets masked and kept."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from dispatch.core.conf import SSLMODES
from dispatch.models import Datasource
from tests.console.test_admin import PASSWORD, TOKEN, vault, vault_kind  # noqa: F401 - fixture

pytestmark = pytest.mark.django_db

ADD = "admin:dispatch_datasource_add"


def change_url(ds: Datasource) -> str:
    return reverse("admin:dispatch_datasource_change", args=[ds.pk])


def test_add__renders_the_kinds_fields_with_a_password_input(admin_client: Client) -> None:
    page = admin_client.get(reverse(ADD) + "?kind=vaulttest").content.decode()
    assert 'name="config__host"' in page and 'name="config__port"' in page
    assert 'type="password" name="config__password"' in page


def test_add__saves_encrypted_and_never_echoes_the_secret(admin_client: Client) -> None:
    data = {
        "name": "v",
        "kind": "vaulttest",
        "config_kind": "vaulttest",
        "enabled": "on",
        "config__host": "db",
        "config__port": "5432",
        "config__password": PASSWORD,
    }
    bad = admin_client.post(reverse(ADD), {**data, "config__port": "not-a-number"})
    assert bad.status_code == 200 and PASSWORD not in bad.content.decode()
    response = admin_client.post(reverse(ADD), data)
    assert response.status_code == 302, response.content.decode()[:2000]
    ds = Datasource.objects.get(name="v")
    assert ds.config == {"host": "db", "port": 5432, "password": PASSWORD}
    assert PASSWORD not in ds.config_ciphertext
    page = admin_client.get(change_url(ds)).content.decode()
    assert PASSWORD not in page and "A value is stored; leave blank to keep it." in page


def test_add__missing_required_secret_names_the_field(admin_client: Client) -> None:
    response = admin_client.post(
        reverse(ADD),
        {"name": "v", "kind": "vaulttest", "config_kind": "vaulttest", "config__host": "db"},
    )
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["config__password"] == [
        "this field is required"
    ]


def test_add__switching_kind_redisplays_instead_of_saving(admin_client: Client) -> None:
    response = admin_client.post(
        reverse(ADD), {"name": "v", "kind": "vaulttest", "config_kind": "generate"}
    )
    assert response.status_code == 200
    assert "fill in its settings" in response.content.decode()
    assert 'name="config__host"' in response.content.decode()
    assert not Datasource.objects.exists()


def test_change__blank_secret_keeps_it_new_value_replaces_clear_removes(
    admin_client: Client,
) -> None:
    ds = vault(token=TOKEN)
    base = {"name": ds.name, "enabled": "on", "config__host": "db2", "config__port": "6432"}
    assert admin_client.post(change_url(ds), base).status_code == 302
    ds = Datasource.objects.get(pk=ds.pk)
    assert ds.config == {"host": "db2", "port": 6432, "password": PASSWORD, "token": TOKEN}
    assert ds.version == 2
    admin_client.post(change_url(ds), {**base, "config__password": "another-one"})
    assert Datasource.objects.get(pk=ds.pk).config["password"] == "another-one"
    admin_client.post(change_url(ds), {**base, "config__token__clear": "on"})
    assert "token" not in Datasource.objects.get(pk=ds.pk).config


def test_change__nothing_changed_keeps_the_version(admin_client: Client) -> None:
    ds = vault()
    admin_client.post(
        change_url(ds),
        {"name": ds.name, "enabled": "on", "config__host": "db.internal", "config__port": "5432"},
    )
    assert Datasource.objects.get(pk=ds.pk).version == 1


def test_json_fallback__for_kinds_without_fields(admin_client: Client) -> None:
    page = admin_client.get(reverse(ADD) + "?kind=generate").content.decode()
    assert 'name="config_json"' in page
    bad = admin_client.post(
        reverse(ADD),
        {"name": "g", "kind": "generate", "config_kind": "generate", "config_json": '{"nope": 1}'},
    )
    assert "nope: unknown field for a generate datasource" in bad.content.decode()
    bad = admin_client.post(
        reverse(ADD),
        {"name": "g", "kind": "generate", "config_kind": "generate", "config_json": "[1"},
    )
    assert "not valid JSON" in bad.content.decode()
    ok = admin_client.post(
        reverse(ADD),
        {"name": "g", "kind": "generate", "config_kind": "generate", "config_json": "{}"},
    )
    assert ok.status_code == 302
    assert Datasource.objects.get(name="g").config == {}


def _json(value: Any) -> str:
    return json.dumps(value)


def test_postgresql_sslmode__a_choice_of_libpqs_values(admin_client: Client) -> None:
    page = admin_client.get(reverse(ADD) + "?kind=postgresql").content.decode()
    select = re.search(r'<select name="config__sslmode".*?</select>', page, re.S)
    assert select, "sslmode is not a select"
    assert re.findall(r'<option value="([^"]*)"', select.group(0)) == ["", *SSLMODES]
    data = {
        "name": "warehouse",
        "kind": "postgresql",
        "config_kind": "postgresql",
        "enabled": "on",
        "config__host": "db.internal",
        "config__dbname": "dw",
    }
    response = admin_client.post(reverse(ADD), {**data, "config__sslmode": "sometimes"})
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["config__sslmode"] == [
        "must be one of disable, allow, prefer, require, verify-ca, verify-full (not sometimes)"
    ]
    response = admin_client.post(reverse(ADD), {**data, "config__sslmode": "verify-full"})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Datasource.objects.get(name="warehouse").config["sslmode"] == "verify-full"


def test_mysql_kind__its_fields_and_help_in_the_datasource_form(admin_client: Client) -> None:
    page = admin_client.get(reverse(ADD) + "?kind=mysql").content.decode()
    for field in ("host", "port", "database", "user", "password", "tls"):
        assert f'name="config__{field}"' in page, field
    assert "Default database (tables without a database. prefix are in it)." in page
    select = re.search(r'<select name="config__tls".*?</select>', page, re.S)
    assert select, "tls is not a select"
    assert re.findall(r'<option value="([^"]*)"', select.group(0)) == [
        "", "preferred", "required", "verify_identity", "disabled"
    ]  # fmt: skip
    data = {
        "name": "shop",
        "kind": "mysql",
        "config_kind": "mysql",
        "enabled": "on",
        "config__host": "mariadb.internal",
        "config__port": "3307",
        "config__user": "reader",
        "config__password": "shop-secret-pw",
    }
    response = admin_client.post(reverse(ADD), {**data, "config__port": "70000"})
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["config__port"] == [
        "must be between 1 and 65535"
    ]
    response = admin_client.post(reverse(ADD), data)
    assert response.status_code == 302, response.content.decode()[:2000]
    saved = Datasource.objects.get(name="shop")
    assert saved.config == {"host": "mariadb.internal", "port": 3307, "user": "reader",
                            "password": "shop-secret-pw"}  # fmt: skip
    page = admin_client.get(
        reverse("admin:dispatch_datasource_change", args=[saved.pk])
    ).content.decode()
    assert 'name="config__password"' in page and "shop-secret-pw" not in page
