"""Re-pointing a datasource that a query binding reads is re-pointing the query: it needs
the query permission like changing the binding's source does (issue 30, finding 11)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.exceptions import PermissionDenied
from django.test import Client, RequestFactory
from django.urls import reverse

from dispatch.console import querypermission
from dispatch.models import Datasource
from dispatch.security.sqlperm import target_changes
from tests.support.factories import BindingFactory, JobFactory

pytestmark = pytest.mark.django_db

QUERY = "select id, note from customers"
PERMISSION_NAME = "Can write SQL queries that sources run"


def user(*codenames: str) -> User:
    found = User.objects.create_user(f"u-{uuid.uuid4().hex[:8]}", password="x", is_staff=True)
    found.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return found


def datasource(name: str) -> Datasource:
    # No stored password: nothing asks for one again when the target moves.
    ds = Datasource(
        name=name,
        kind="postgresql",
        config={"host": "127.0.0.1", "port": 5432, "dbname": "warehouse", "user": "reader"},
    )
    ds.full_clean()
    ds.save()
    return ds


def form(ds: Datasource, **changes: Any) -> dict[str, Any]:
    """The change form as stored now (every value, the password typed again), changed."""
    ds = Datasource.objects.get(pk=ds.pk)
    data: dict[str, Any] = {"name": ds.name, "enabled": "on"}
    data.update({f"config__{k}": v for k, v in ds.config.items()})
    data.update({f"config__{k}": v for k, v in changes.items()})
    return data


def read_by(ds: Datasource, source_spec: dict[str, Any]) -> None:
    BindingFactory(job=JobFactory(source_spec=source_spec), source=ds)


def dbname(ds: Datasource) -> str:
    return str(Datasource.objects.get(pk=ds.pk).config["dbname"])


def test_datasource__moving_one_a_query_reads_needs_the_query_permission(client: Client):
    ds = datasource("warehouse")
    read_by(ds, {"query": QUERY})
    url = reverse("admin:dispatch_datasource_change", args=[ds.pk])
    client.force_login(user("change_datasource", "view_datasource"))
    for field, value in (("dbname", "elsewhere"), ("port", 5433), ("user", "postgres")):
        response = client.post(url, form(ds, **{field: value}))
        assert response.status_code == 200, field
        page = response.content.decode()
        assert PERMISSION_NAME in page and f"connects ({field})" in page
        assert Datasource.objects.get(pk=ds.pk).version == 1
    # Changes that move nothing stay open to change_datasource alone.
    assert client.post(url, {**form(ds), "name": "renamed"}).status_code == 302
    assert client.post(url, form(ds, password="rotated")).status_code == 302
    assert Datasource.objects.get(pk=ds.pk).config["password"] == "rotated"
    client.force_login(user("change_datasource", "view_datasource", "write_source_query"))
    assert client.post(url, form(ds, dbname="elsewhere")).status_code == 302
    assert dbname(ds) == "elsewhere"


def test_datasource__one_no_query_reads_moves_without_the_permission(client: Client):
    ds = datasource("tables-only")
    read_by(ds, {"table": "customers"})
    url = reverse("admin:dispatch_datasource_change", args=[ds.pk])
    client.force_login(user("change_datasource", "view_datasource"))
    assert client.post(url, form(ds, dbname="elsewhere")).status_code == 302
    assert dbname(ds) == "elsewhere"


def test_datasource__the_save_guard_refuses_a_move_on_any_path():
    ds = datasource("guarded")
    read_by(ds, {"query": QUERY})
    request = RequestFactory().post("/")
    request.user = user("change_datasource")
    ds.config = {**ds.config, "host": "127.0.0.2"}
    with pytest.raises(PermissionDenied, match=r"connects \(host\)"):
        querypermission.guard_datasource_save(request, ds, True)
    request.user = user("change_datasource", "write_source_query")
    querypermission.guard_datasource_save(request, ds, True)


def test_target_changes__every_key_but_the_password_counts():
    old = {"url": "postgresql://u:p@db-a/x"}
    assert target_changes({"url": "postgresql://u:p@db-b/x"}, old) == ["url"]
    assert target_changes({**old, "password": "new"}, old) == []
    assert target_changes({"host": "h", "sslmode": ""}, {"host": "h"}) == []
    assert target_changes({"host": "h", "sslmode": "disable"}, {"host": "h"}) == ["sslmode"]
