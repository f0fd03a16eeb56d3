"""A host site that includes dispatch's URLs under a prefix (tests/http/test_prefix.py)."""

from __future__ import annotations

from django.urls import include, path

urlpatterns = [path("dispatch/", include("dispatch.urls"))]
