"""Deeply nested JSON: a clear error on every way in, never a 500 on the pages."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.test import Client
from django.urls import reverse

from dispatch.models import Datasource, Job
from dispatch.security import jsondepth
from tests.support.factories import BindingFactory, DatasourceFactory

pytestmark = pytest.mark.django_db


def nested(levels: int) -> Any:
    """A value whose innermost part sits at `levels`."""
    value: Any = 1
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def job_form(job: Job, **changes: str) -> dict[str, Any]:
    return {
        "name": job.name,
        "description": "",
        "enabled": "on",
        "source_spec": '{"rows": 1}',
        "sink_spec": "{}",
        "max_attempts": 3,
        "backoff_seconds": 0,
        "backoff_max_seconds": 0,
        "lease_seconds": 30,
        **changes,
    }


def test_depth__python_and_the_database_agree_on_the_limit():
    limit = jsondepth.MAX_JSON_DEPTH
    assert not jsondepth.value_too_deep(nested(limit))
    assert jsondepth.value_too_deep(nested(limit + 1))
    job = BindingFactory().job
    Job.objects.filter(pk=job.pk).update(source_spec=nested(limit))
    with (
        pytest.raises(IntegrityError, match="dispatch_job_source_spec_depth"),
        transaction.atomic(),
    ):
        Job.objects.filter(pk=job.pk).update(source_spec=nested(limit + 1))
    with pytest.raises(IntegrityError, match="dispatch_job_sink_spec_depth"), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(sink_spec=nested(900))


def test_model__deep_spec_and_config_are_field_errors():
    job = BindingFactory().job
    job.source_spec = nested(900)
    with pytest.raises(ValidationError) as exc:
        job.full_clean()
    assert "nested more than 32 levels" in str(exc.value.message_dict["source_spec"])
    ds = Datasource(name="deep", kind="generate", config={"x": nested(900)})
    with pytest.raises(ValidationError, match="nested more than 32 levels"):
        ds.full_clean()


@pytest.mark.parametrize("levels", [900, 50_000])
def test_job_admin__deep_spec_post_is_a_form_error(admin_client: Client, levels: int):
    job = BindingFactory().job
    body = "[" * levels + "]" * levels
    response = admin_client.post(
        reverse("admin:dispatch_job_change", args=[job.pk]), job_form(job, source_spec=body)
    )
    assert response.status_code == 200
    assert "nested more than 32 levels" in response.content.decode()
    assert Job.objects.get(pk=job.pk).source_spec != []


def test_datasource_admin__deep_json_config_post_is_a_form_error(admin_client: Client):
    body = '{"a": ' + "[" * 50_000 + "]" * 50_000 + "}"
    response = admin_client.post(
        reverse("admin:dispatch_datasource_add"),
        {
            "name": "deep",
            "kind": "generate",
            "config_kind": "generate",
            "enabled": "on",
            "config_json": body,
        },
    )
    assert response.status_code == 200
    assert "nested more than 32 levels" in response.content.decode()
    assert not Datasource.objects.filter(name="deep").exists()


def test_binding_pages__render_with_the_deepest_allowed_spec(admin_client: Client):
    binding = BindingFactory(source=DatasourceFactory())
    Job.objects.filter(pk=binding.job_id).update(source_spec=nested(jsondepth.MAX_JSON_DEPTH))
    for url in (
        reverse("admin:dispatch_jobbinding_changelist"),
        reverse("admin:dispatch_jobbinding_change", args=[binding.pk]),
        reverse("admin:dispatch_job_change", args=[binding.job_id]),
    ):
        assert admin_client.get(url).status_code == 200, url
