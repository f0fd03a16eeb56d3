"""The public path of `register`: put the console on an admin site of the host's own
(`dispatch.console.site`)."""

from dispatch.console.site import APP_LABELS, register

__all__ = ["APP_LABELS", "register"]
