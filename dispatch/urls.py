"""URLs a site may include for orchestrators: `path("", include("dispatch.urls"))`."""

from __future__ import annotations

from django.urls import path

from dispatch import health

urlpatterns = [
    path("healthz", health.healthz, name="dispatch_healthz"),
    path("readyz", health.readyz, name="dispatch_readyz"),
]
