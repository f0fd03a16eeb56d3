"""Source queries (arbitrary SQL on the source) need a permission of their own."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from dispatch.models import Job, JobBinding
from tests.support.factories import BindingFactory, DatasourceFactory, JobFactory

pytestmark = pytest.mark.django_db

QUERY = "select pg_terminate_backend(pid) from pg_stat_activity"


def login(client: Client, *codenames: str) -> None:
    user = User.objects.create_user(f"u-{uuid.uuid4().hex[:8]}", password="x", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client.force_login(user)


def job_data(job: Job | None, source_spec: str) -> dict[str, Any]:
    return {
        "name": job.name if job else "new-job",
        "description": "",
        "enabled": "on",
        "source_spec": source_spec,
        "sink_spec": "{}",
        "max_attempts": 3,
        "backoff_seconds": 0,
        "backoff_max_seconds": 0,
        "lease_seconds": 30,
        "bindings-TOTAL_FORMS": "0",
        "bindings-INITIAL_FORMS": "0",
    }


def test_job__writing_a_query_needs_the_permission(client: Client):
    job = JobFactory(source_spec={"table": "orders"})
    url = reverse("admin:dispatch_job_change", args=[job.pk])
    spec = f'{{"query": "{QUERY}"}}'
    login(client, "change_job", "view_job")
    response = client.post(url, job_data(job, spec))
    assert response.status_code == 200
    assert "Can write SQL queries that sources run" in response.content.decode()
    assert Job.objects.get(pk=job.pk).source_spec == {"table": "orders"}
    # Other changes to a job without a query stay open to change_job alone.
    assert client.post(url, job_data(job, '{"table": "customers"}')).status_code == 302
    login(client, "change_job", "view_job", "write_source_query")
    assert client.post(url, job_data(job, spec)).status_code == 302
    assert Job.objects.get(pk=job.pk).source_spec == {"query": QUERY}
    # An unchanged query needs nothing more.
    login(client, "change_job", "view_job")
    data = {**job_data(job, spec), "description": "edited"}
    assert client.post(url, data).status_code == 302


def test_binding__pointing_a_query_job_at_a_source_needs_the_permission(client: Client):
    job = JobFactory(source_spec={"query": QUERY})
    pg = {"kind": "postgresql", "config": {"host": "db.example.com", "dbname": "x"}}
    binding = BindingFactory(job=job, source=DatasourceFactory(**pg))
    other = DatasourceFactory(**pg)
    url = reverse("admin:dispatch_jobbinding_change", args=[binding.pk])
    data = {
        "name": binding.name,
        "job": str(job.pk),
        "source": str(other.pk),
        "sink": str(binding.sink_id),
        "enabled": "on",
        "max_concurrency": 1,
    }
    login(client, "change_jobbinding", "view_jobbinding")
    response = client.post(url, data)
    assert response.status_code == 200
    assert "Can write SQL queries that sources run" in response.content.decode()
    assert JobBinding.objects.get(pk=binding.pk).source_id == binding.source_id
    login(client, "change_jobbinding", "view_jobbinding", "write_source_query")
    assert client.post(url, data).status_code == 302
    assert JobBinding.objects.get(pk=binding.pk).source_id == other.pk


@pytest.mark.django_db(transaction=True)
def test_query_source__a_privileged_role_is_refused_a_plain_reader_is_not():
    from django.test import override_settings

    from dispatch.connectors.base import PermanentError
    from dispatch.connectors.postgresql import PostgreSQLConnector as PG
    from tests.support.connectors import Ctx, connect, scratch_db, server_config

    for db in scratch_db("lp"):
        role = f"lp_reader_{db.name}"[:63]
        with connect(db.name) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')
            conn.execute(f'CREATE ROLE "{role}" LOGIN NOSUPERUSER')
            conn.execute("CREATE TABLE t (a int)")
            conn.execute(f'GRANT SELECT ON t TO "{role}"')
        try:
            spec = {"query": "select a from t"}
            with override_settings(DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE=True):
                with (
                    pytest.raises(PermanentError, match="superuser"),
                    PG.open_reader(server_config(db.name), spec, Ctx()),
                ):
                    pass
                with PG.open_reader(server_config(db.name, user=role), spec, Ctx()) as r:
                    assert [c.name for c in r.columns] == ["a"]
                # A table source needs no such check.
                with PG.open_reader(server_config(db.name), {"table": "t"}, Ctx()):
                    pass
        finally:
            with connect(db.name) as conn:
                conn.execute("DROP TABLE t")
                conn.execute(f'DROP ROLE "{role}"')
