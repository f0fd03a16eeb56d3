"""The test settings with an app listed before dispatch that has its own `runworker`."""

from __future__ import annotations

from tests.settings import *  # noqa: F403

INSTALLED_APPS = ["tests.support.shadow_commands", *INSTALLED_APPS]  # noqa: F405
