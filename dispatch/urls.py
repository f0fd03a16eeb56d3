"""URLs a site includes for orchestrators and monitoring: `path("", include("dispatch.urls"))`
(or under a prefix: `path("dispatch/", include("dispatch.urls"))`). The HTTP API is under
`api/v1/`, its OpenAPI document at `api/openapi.json`."""

from __future__ import annotations

from django.urls import path

from dispatch.core import conf
from dispatch.http.api import api, openapi_json
from dispatch.ops import health, metrics

urlpatterns = [
    path("healthz", health.healthz, name="dispatch_healthz"),
    path("readyz", health.readyz, name="dispatch_readyz"),
    path("api/openapi.json", openapi_json, name="dispatch_openapi"),
    path("api/v1/", api.urls),
]

if conf.metrics_path():
    urlpatterns.append(
        path(conf.metrics_path().strip("/"), metrics.metrics_view, name="dispatch_metrics")
    )
