"""Template filters of the operator console (badges and progress bars)."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils.safestring import SafeString

from dispatch.console import badges
from dispatch.core.progress import Progress

register = template.Library()


@register.filter
def status_tone(status: str) -> str:
    return badges.STATUS_TONE.get(status, "off")


@register.filter
def status_badge(status: str) -> SafeString:
    return badges.status_badge(status)


@register.filter
def reason_badge(reason: str) -> SafeString:
    return badges.reason_badge(reason)


@register.filter
def blocked_badge(blocked: str) -> SafeString:
    return badges.blocked_badge(blocked)


@register.filter
def event_label(kind: str) -> str:
    """An event's kind as a reader says it (`lock_wait` -> `lock wait`)."""
    return kind.replace("_", " ")


@register.filter
def origin_label(origin: str) -> str:
    return f"{origin.lower()}: {badges.ORIGIN_LABEL.get(origin, '')}"


@register.simple_tag
def progress(attempt: Any, detail: bool = False) -> SafeString:
    """An attempt's progress bar (`detail`: with rows written, rate and time left)."""
    return badges.progress_bar(Progress.of(attempt), detail=detail)
