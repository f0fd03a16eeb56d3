"""The console on a custom AdminSite under a URL prefix: every page renders and every link
it builds stays in that site (never the default `/admin/`)."""

from __future__ import annotations

import re

import pytest
from django.test import Client, override_settings
from django.urls import reverse

from dispatch.admin_site import register
from dispatch.models import Worker
from tests.support.custom_admin_urls import ops
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import claim_one


def ops_urls() -> list[str]:
    urls = [
        reverse("ops:index"),
        reverse("ops:dispatch_overview"),
        reverse("ops:app_list", args=["dispatch"]),
        reverse("ops:app_list", args=["scheduling"]),
    ]
    for model, model_admin in ops._registry.items():
        info = model._meta.app_label, model._meta.model_name
        urls.append(reverse("ops:{}_{}_changelist".format(*info)))
        urls.append(reverse("ops:{}_{}_add".format(*info)))
        for row in model._default_manager.all()[:2]:
            urls.append(reverse("ops:{}_{}_change".format(*info), args=[row.pk]))
            urls.append(reverse("ops:{}_{}_history".format(*info), args=[row.pk]))
            for spec in getattr(model_admin, "object_actions", ()):
                if spec.destructive:
                    urls.append(
                        reverse("ops:{}_{}_object_action".format(*info), args=[row.pk, spec.name])
                    )
    return urls


def test_register_puts_both_apps_on_the_site():
    labels = register(ops)  # idempotent
    assert "dispatch.Run" in labels and "dispatch.Overview" in labels
    assert "scheduling.Schedule" in labels


@pytest.mark.django_db
@override_settings(ROOT_URLCONF="tests.support.custom_admin_urls")
def test_every_page_of_the_custom_site_links_only_into_it(admin_client: Client) -> None:
    binding = BindingFactory()
    trigger(binding)
    running = trigger(binding)
    claim_one("w-ops", run_id=running.id)
    Worker.objects.create(id="w-ops", host="h1", pid=1, concurrency=1)
    from scheduling.models import Schedule

    Schedule.objects.create(binding=binding, cron="0 * * * *", timezone="UTC", enabled=False)

    index = admin_client.get(reverse("ops:index"))
    assert reverse("ops:dispatch_overview_changelist") in index.content.decode()
    redirect = admin_client.get(reverse("ops:dispatch_overview_changelist"))
    assert redirect.status_code == 302 and redirect["Location"] == reverse("ops:dispatch_overview")

    for url in ops_urls():
        assert url.startswith("/ops/console/")
        response = admin_client.get(url)
        if url.endswith("/add/") and response.status_code == 403:
            continue  # history (runs, attempts, workers) is never added by hand
        assert response.status_code in (200, 302), url
        if response.status_code == 302:
            assert response["Location"].startswith("/ops/console/"), url
            continue
        hrefs = re.findall(r'(?:href|action)="(/[^"]*)"', response.content.decode())
        wrong = [h for h in hrefs if h.startswith("/admin/")]
        assert not wrong, f"{url} links into the default admin: {wrong[:5]}"
