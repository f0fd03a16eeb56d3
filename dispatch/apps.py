from __future__ import annotations

from django.apps import AppConfig


class DispatchConfig(AppConfig):
    name = "dispatch"
    verbose_name = "Dispatch"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the system checks; no database access here (migrate must work on an
        # empty database).
        from dispatch import checks  # noqa: F401
