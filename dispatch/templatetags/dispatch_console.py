"""Template filters of the operator console (badges and progress bars)."""

from __future__ import annotations

from django import template
from django.utils.safestring import SafeString

from dispatch.console import views as admin_views

register = template.Library()


@register.filter
def status_tone(status: str) -> str:
    return admin_views.STATUS_TONE.get(status, "off")


@register.filter
def status_badge(status: str) -> SafeString:
    return admin_views.status_badge(status)


@register.filter
def reason_badge(reason: str) -> SafeString:
    return admin_views.reason_badge(reason)


@register.filter
def blocked_badge(blocked: str) -> SafeString:
    return admin_views.blocked_badge(blocked)


@register.filter
def origin_label(origin: str) -> str:
    return f"{origin.lower()}: {admin_views.ORIGIN_LABEL.get(origin, '')}"


@register.simple_tag
def progress(rows_read: int, rows_written: int) -> SafeString:
    return admin_views.progress_bar(rows_read, rows_written)
