"""A host site's URLs with the console on an admin site of its own under a prefix (and
the default admin beside it, so that a link into the wrong site would still resolve)."""

from django.contrib import admin
from django.contrib.admin import AdminSite
from django.urls import path

from dispatch.admin_site import register

ops = AdminSite(name="ops")
register(ops)

urlpatterns = [
    path("ops/console/", ops.urls),
    path("admin/", admin.site.urls),
]
