"""Put the console on an admin site of the host's own.

The apps register their admin pages on Django's default site (`admin.site`). A site with
a custom `AdminSite` (another URL prefix, its own name, several sites) adds them with::

    from django.contrib.admin import AdminSite
    from dispatch.admin_site import register

    ops = AdminSite(name="ops")
    register(ops)                      # dispatch and, when installed, scheduling
    urlpatterns = [path("ops/", ops.urls)]

Every link the console builds is reversed in the namespace of the site it is shown on.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.apps import apps
from django.contrib import admin

APP_LABELS = ("dispatch", "scheduling")


def register(
    site: admin.AdminSite,
    app_labels: Iterable[str] = APP_LABELS,
    *,
    unregister_default: bool = False,
) -> list[str]:
    """Register the ModelAdmins of `app_labels` (those installed) on `site`, the same
    classes as on the default site; optionally remove them from the default site.
    Returns the registered models' labels."""
    admin.autodiscover()  # idempotent: imports each installed app's admin module
    wanted = {label for label in app_labels if apps.is_installed(label)}
    done = []
    for model, model_admin in list(admin.site._registry.items()):
        if model._meta.app_label not in wanted:
            continue
        if not site.is_registered(model):
            site.register(model, type(model_admin))
        if unregister_default and site is not admin.site:
            admin.site.unregister(model)
        done.append(model._meta.label)
    return sorted(done)
