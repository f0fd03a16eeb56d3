"""Every JSON the console parses is depth-checked first: deep nesting is a clear refusal,
never a 500 (json recurses once per level)."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse

from dispatch.models import JobBinding
from tests.support.factories import BindingFactory, JobFactory

pytestmark = pytest.mark.django_db


def incremental_binding() -> JobBinding:
    job = JobFactory(source_spec={"rows": 10, "incremental": {"cursor": ["updated_at", "id"]}})
    return BindingFactory(job=job)


@pytest.mark.parametrize("levels", [34, 50_000])
def test_set_cursor__deeply_nested_json_is_refused_not_a_500(
    admin_client: Client, levels: int
) -> None:
    binding = incremental_binding()
    url = reverse("admin:dispatch_jobbinding_object_action", args=[binding.pk, "set_cursor"])
    response = admin_client.post(
        url, {"post": "yes", "value": "[" * levels + "]" * levels}, follow=True
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert "nested more than 32 levels" in page
    entry = LogEntry.objects.get(object_id=str(binding.pk))
    assert "refused (BAD_CURSOR)" in entry.get_change_message()
