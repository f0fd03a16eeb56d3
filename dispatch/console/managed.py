"""Objects that definition files manage (docs/as-code.md), as the console shows them: a
badge in the lists, a filter, and a warning on the change page. The next apply of the
files overwrites a console edit of such an object."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from dispatch.models import MANAGED_BY_FILES

WARNING = (
    "Managed by files: this {what} is defined in definition files, and their next apply "
    "(manage.py dispatch apply) overwrites edits made here. Change the files instead."
)


def managed_badge(managed_by: str) -> SafeString:
    if managed_by != MANAGED_BY_FILES:
        return format_html("{}", "")
    return format_html(
        '<span class="dsp-badge dsp-warn" title="{}">{}</span>',
        "defined in definition files: the next apply overwrites console edits",
        "files",
    )


class ManagedByFilesAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """For models with a `managed_by` field; put it first among the admin's bases."""

    def get_list_display(self, request: HttpRequest) -> Any:
        return [*super().get_list_display(request), "managed"]

    def get_list_filter(self, request: HttpRequest) -> Any:
        return [*super().get_list_filter(request), "managed_by"]

    @admin.display(description="managed by", ordering="managed_by")
    def managed(self, obj: Any) -> SafeString:
        return managed_badge(obj.managed_by)

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        # Rendered on the page being built (a GET, or a POST with errors): the admin's
        # template shows and consumes the message.
        if obj is not None and obj.managed_by == MANAGED_BY_FILES:
            what = obj._meta.verbose_name
            messages.warning(request, WARNING.format(what=what))
        return super().render_change_form(request, context, add, change, form_url, obj)
