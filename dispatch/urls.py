"""URLs a site may include for orchestrators: `path("", include("dispatch.urls"))`."""

from __future__ import annotations

from django.urls import path

from dispatch import conf
from dispatch.ops import health, metrics

urlpatterns = [
    path("healthz", health.healthz, name="dispatch_healthz"),
    path("readyz", health.readyz, name="dispatch_readyz"),
]

if conf.metrics_path():
    urlpatterns.append(
        path(conf.metrics_path().strip("/"), metrics.metrics_view, name="dispatch_metrics")
    )
