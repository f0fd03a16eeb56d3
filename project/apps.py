from __future__ import annotations

from django.apps import AppConfig


class ProjectConfig(AppConfig):
    """The repository's runnable site as an app: its demo and fault-injection commands."""

    name = "project"
    verbose_name = "dispatch repository site"
